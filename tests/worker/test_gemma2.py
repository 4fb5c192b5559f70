"""Gemma 2 against transformers on a tiny random checkpoint (tests/family_models.py: alternating local layers with a
window of 8 and global ones, attention logit soft-capping at 5, final soft-capping at 3, query_pre_attn_scalar 24
for a head_dim of 32, random norm weights). Greedy tokens equal transformers' `generate` in fp32 on prompts past the
window (direct mode, prefix-cache hits, step graphs); logprobs within 2e-4; bf16 as close to fp32 as transformers'
own bf16."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from attention_calls import assert_native_attention, count_attention_kernels
from family_models import GEMMA2, tiny_checkpoint, tiny_llm
from hf_reference import assert_bf16_as_close_as_transformers, hf_model, transformers_greedy

from infer import SamplingParams
from infer.worker.config import EngineConfig
from infer.worker.engine import Engine
from infer.worker.loader import load_model

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
_rng = random.Random(8)
PROMPTS = [[_rng.randrange(3, 250) for _ in range(n)] for n in (5, 30, 61)]
PROMPTS += [PROMPTS[2][:40] + [9, 10, 11]]  # shares 40 tokens with the third: cache hits


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, smollm2_tokenizer) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("gemma2"), smollm2_tokenizer, "gemma2", **GEMMA2)


@pytest.fixture(scope="module")
def want(gemma2) -> list[list[int]]:
    return transformers_greedy(gemma2, PROMPTS, MAX_NEW)


def test_the_model_is_ours_with_soft_capped_windowed_layers(gemma2):
    model = load_model(gemma2, torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "Gemma2ForCausalLM" and model.lm_head_tied
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.window for a in attns] == [8, 0, 8, 0]
    assert all(a.softcap == 5.0 and a.scale == 24**-0.5 and a.q_norm is None for a in attns)
    assert model.final_logit_softcapping == 3.0


def test_greedy_tokens_equal_transformers_past_the_window(gemma2, want, monkeypatch):
    """On a CPU every soft-capped layer's attention (windowed or not) runs on the native kernels."""
    calls = count_attention_kernels(monkeypatch)
    llm = tiny_llm(gemma2)
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [c.token_ids for c in again] == want
    assert sum(c.num_cached_tokens for c in again) > 0
    assert_native_attention(calls)


def test_logprobs_within_tolerance_of_transformers(gemma2):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    completions = tiny_llm(gemma2).generate(PROMPTS, params, use_tqdm=False)
    hf = hf_model(gemma2, attn_implementation="eager")
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1)
        for step, entry in enumerate(completion.logprobs):
            for candidate, logprob in entry.items():
                value = logprob.logprob if hasattr(logprob, "logprob") else logprob
                assert abs(value - expected[step, candidate].item()) <= 2e-4, (step, candidate)


def test_step_graphs_give_the_tokens(gemma2, want):
    """Decode steps in compiled graphs: the native kernel as an operator, soft-capped."""
    engine = Engine(
        EngineConfig(
            model=str(gemma2),
            dtype="float32",
            max_model_len=256,
            num_threads=1,
            device="cpu",
            block_size=4,
            enforce_eager=False,
            max_graph_batch_size=4,
            max_num_seqs=4,
            enable_prefix_caching=False,
        )
    )
    assert engine.runner.step_graphs is not None
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    assert [out[str(i)] for i in range(len(PROMPTS))] == want


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(gemma2, want):
    """bf16 logits over a prompt and its fp32 greedy continuation (81 positions): ours drift from transformers' fp32
    no more than 1.5x transformers' own bf16 forward does, and pick its next token at 80% of the positions or more."""
    ids = PROMPTS[2] + want[2]
    assert_bf16_as_close_as_transformers(gemma2, ids, "gemma2", attn_implementation="eager")
