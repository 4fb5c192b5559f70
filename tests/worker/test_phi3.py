"""Phi-3 / Phi-4 against transformers on tiny random checkpoints (tests/family_models.py): "phi3" with partial rotary
(12 of 16 dims), LongRoPE (short factors up to 48 positions, long ones past) and a window of 16 on every layer;
"phi4" as Phi-4 is (full rotary, plain rope, no window). Both store qkv_proj and gate_up_proj fused. Greedy tokens
equal transformers' `generate` in fp32 on prompts within the original length and past it (and past the window),
in direct mode and with step graphs; logprobs within 2e-4."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from family_models import PHI3, tiny_checkpoint, tiny_llm
from hf_reference import assert_bf16_as_close_as_transformers, hf_model, transformers_greedy

from infer import SamplingParams
from infer.worker.config import EngineConfig
from infer.worker.engine import Engine
from infer.worker.loader import load_model
from infer.worker.models import native_decode
from infer.worker.models.phi3 import PartialRotaryQKV

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
_rng = random.Random(11)
# 9 + 16 and 30 + 16 stay within the original 48 positions (short factors); 50 and 75 start past it (long factors)
PROMPTS = [[_rng.randrange(3, 250) for _ in range(n)] for n in (9, 30, 50, 75)]
PHI4 = {
    **{
        k: v
        for k, v in PHI3.items()
        if k not in ("rope_scaling", "partial_rotary_factor", "sliding_window", "original_max_position_embeddings")
    },
    "rope_theta": 250000.0,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer):
    """name -> (model directory, transformers' greedy tokens), each made once."""
    made = {}

    def make(name: str) -> tuple[Path, list[list[int]]]:
        if name not in made:
            path = tiny_checkpoint(
                tmp_path_factory.mktemp(name), smollm2_tokenizer, "phi3", **(PHI3 if name == "phi3" else PHI4)
            )
            made[name] = path, transformers_greedy(path, PROMPTS, MAX_NEW)
        return made[name]

    return make


def test_the_model_is_ours_with_fused_weights_partial_rotary_and_windows(checkpoints):
    path, _ = checkpoints("phi3")
    model = load_model(path, torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "Phi3ForCausalLM" and not model.lm_head_tied
    assert model.layer_windows == (16, 16, 16)
    rotary = model.model.rotary_emb
    assert rotary.rotary_dim == 12 and rotary.length_dependent and rotary.original_max_positions == 48
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, PartialRotaryQKV)
    # q's first head as the kernels hold it: transformers' rows in partial_rotary_order; v as it is
    theirs = hf_model(path).model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(attn.qkv_proj.weight[:16], theirs[:16][attn.qkv_proj.order])
    assert torch.equal(attn.qkv_proj.weight[-32:], theirs[-32:])


@pytest.mark.parametrize("name, chunk", [("phi3", None), ("phi3", 16), ("phi4", None)])
def test_greedy_tokens_equal_transformers(checkpoints, name, chunk):
    """Chunks of 16 tokens: a prompt longer than the original length takes the long factors from its first chunk."""
    path, want = checkpoints(name)
    llm = tiny_llm(path, **({"max_num_batched_tokens": chunk} if chunk else {}))
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want


def test_logprobs_within_tolerance_of_transformers(checkpoints):
    path, _ = checkpoints("phi3")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    completions = tiny_llm(path).generate(PROMPTS, params, use_tqdm=False)
    hf = hf_model(path)
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        if len(prompt) <= 48 < len(prompt) + MAX_NEW:
            continue  # crosses the original length while decoding (see the module docstring of models/phi3.py)
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1)
        for step, entry in enumerate(completion.logprobs):
            for candidate, logprob in entry.items():
                value = logprob.logprob if hasattr(logprob, "logprob") else logprob
                assert abs(value - expected[step, candidate].item()) <= 2e-4, (step, candidate)


def test_step_graphs_give_the_tokens(checkpoints):
    path, want = checkpoints("phi3")
    engine = Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            max_model_len=256,
            num_threads=1,
            device="cpu",
            block_size=4,
            enforce_eager=False,
            max_graph_batch_size=4,
            max_num_seqs=4,
        )
    )
    assert engine.runner.step_graphs is not None
    assert not engine.scheduler.block_manager.enable_prefix_caching  # LongRoPE: keys depend on the length
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    assert [out[str(i)] for i in range(len(PROMPTS))] == want


def test_native_bf16_decode_step_equals_the_layers(checkpoints, monkeypatch):
    """bf16: the one-call native decode step (decode_layers.c over the permuted heads, the long rows of the rope
    cache, the window) gives the tokens and log-probabilities of the layers run one by one, bit for bit."""
    path, _ = checkpoints("phi3")
    calls: list[int] = []
    real = native_decode.decode_layers

    def counting(h, *args, **kwargs):
        calls.append(h.shape[0])
        return real(h, *args, **kwargs)

    monkeypatch.setattr(native_decode, "decode_layers", counting)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)

    def run(native: bool) -> list[tuple]:
        engine = Engine(
            EngineConfig(
                model=str(path), dtype="bfloat16", max_model_len=256, num_threads=2, device="cpu", block_size=4
            )
        )
        if not native:
            engine.model.model.native_decode = False
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, params)
        out: dict[str, list] = {str(i): [] for i in range(len(PROMPTS))}
        while engine.has_unfinished():
            for delta in engine.step():
                out[delta.request_id].append((delta.token_ids, delta.logprobs))
        return [out[str(i)] for i in range(len(PROMPTS))]

    fused = run(True)
    native_steps = len(calls)
    assert native_steps >= MAX_NEW - 1
    assert run(False) == fused and len(calls) == native_steps


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(checkpoints):
    """bf16 logits over the longest prompt and its fp32 greedy continuation (91 positions, long factors): ours drift
    from transformers' fp32 no more than 1.5x transformers' own bf16 forward does, and pick its next token at 80% of
    the positions or more (the figures are printed). (Greedy runs in bf16 part ways at the first near-tie and never
    meet again, so they are compared position by position here.)"""
    path, want = checkpoints("phi3")
    ids = PROMPTS[3] + want[3]
    assert_bf16_as_close_as_transformers(path, ids, "phi3")


def test_pipeline_stages_take_the_long_factors_past_the_original_length(checkpoints):
    """PP 2: each stage picks LongRoPE's rows by the sequence's length as one process does."""
    path, want = checkpoints("phi3")
    llm = tiny_llm(path, pipeline_parallel_size=2)
    try:
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    finally:
        llm.close()
