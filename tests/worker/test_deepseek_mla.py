"""DeepSeek-V2's multi-head latent attention against transformers on tiny random dense checkpoints
(tests/family_models.py: latent 32 + rope key 16 in the pool, yarn scaling with mscale_all_dim, a low-rank q and a
plain q_proj). Greedy tokens equal transformers' `generate` in fp32 on prompts past yarn's original 32 positions;
logprobs within 2e-4; the pool holds one latent head of 48 dims per token (its MoE layers: test_deepseek_moe.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from family_models import DEEPSEEK_V2, tiny_checkpoint, tiny_llm
from hf_reference import assert_bf16_as_close_as_transformers, hf_model, transformers_greedy

from infer import LLM, SamplingParams
from infer.worker.loader import load_model

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
_rng = random.Random(21)
PROMPTS = [[_rng.randrange(3, 250) for _ in range(n)] for n in (7, 33, 60)]
PROMPTS += [PROMPTS[2][:40] + [9, 10, 11]]  # shares 40 tokens with the third: cache hits
VARIANTS = {"q-lora": {}, "q-proj": {"q_lora_rank": None}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer):
    made = {}

    def make(name: str) -> tuple[Path, list[list[int]]]:
        if name not in made:
            path = tiny_checkpoint(
                tmp_path_factory.mktemp(name), smollm2_tokenizer, "deepseek_v2", **{**DEEPSEEK_V2, **VARIANTS[name]}
            )
            made[name] = path, transformers_greedy(path, PROMPTS, MAX_NEW)
        return made[name]

    return make


def _llm(path: Path, **options) -> LLM:
    return tiny_llm(path, **{"kv_cache_memory": 4_000_000, **options})  # a smaller pool than the default


def test_the_pool_holds_the_latent(checkpoints):
    model = load_model(checkpoints("q-lora")[0], torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    assert (model.num_kv_heads, model.head_dim) == (1, 32 + 16)  # transformers caches 4 x (32 + 24) per token


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_tokens_equal_transformers(checkpoints, name):
    path, want = checkpoints(name)
    llm = _llm(path)
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [c.token_ids for c in again] == want
    assert sum(c.num_cached_tokens for c in again) > 0


def test_logprobs_within_tolerance_of_transformers(checkpoints):
    path, _ = checkpoints("q-lora")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    completions = _llm(path).generate(PROMPTS, params, use_tqdm=False)
    hf = hf_model(path)
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1)
        for step, entry in enumerate(completion.logprobs):
            for candidate, logprob in entry.items():
                value = logprob.logprob if hasattr(logprob, "logprob") else logprob
                assert abs(value - expected[step, candidate].item()) <= 2e-4, (step, candidate)


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(checkpoints):
    """bf16 logits over the longest prompt and its fp32 greedy continuation (76 positions): ours drift from
    transformers' fp32 no more than 1.5x transformers' own bf16 forward does, and pick its next token at 80% of the
    positions or more (the figures are printed)."""
    path, want = checkpoints("q-lora")
    ids = PROMPTS[2] + want[2]
    assert_bf16_as_close_as_transformers(path, ids, "deepseek_v2")
