"""What only Phi-3 has, on the tiny random checkpoint of tests/family_cases.py (its greedy tokens, whole and in
chunks, logprobs, step graphs and bf16 against transformers, and Phi-4's: tests/worker/test_families.py): partial
rotary (12 of 16 dims) with the q / k heads permuted in the fused qkv_proj, LongRoPE (short factors up to 48
positions, long ones past) and a window of 16 on every layer; the one-call native bf16 decode step over them; pipeline
stages that pick the long factors by the sequence's length."""

from __future__ import annotations

import torch
from family_cases import CASES
from family_models import tiny_llm
from hf_reference import hf_model

from infer import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine
from infer.worker.loading.loader import load_model
from infer.worker.models import native_decode
from infer.worker.models.phi3 import PartialRotaryQKV

PHI3 = CASES["phi3"]
PROMPTS, MAX_NEW = PHI3.prompts, PHI3.max_new
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def test_the_model_is_ours_with_fused_weights_partial_rotary_and_windows(family_dir):
    path = family_dir("phi3")
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


def test_native_bf16_decode_step_equals_the_layers(family_dir, monkeypatch):
    """bf16: the one-call native decode step (decode_layers.c over the permuted heads, the long rows of the rope
    cache, the window) gives the tokens and log-probabilities of the layers run one by one, bit for bit."""
    path = family_dir("phi3")
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


def test_pipeline_stages_take_the_long_factors_past_the_original_length(family_checkpoint):
    """PP 2: each stage picks LongRoPE's rows by the sequence's length as one process does."""
    path, want = family_checkpoint("phi3")
    llm = tiny_llm(path, pipeline_parallel_size=2)
    try:
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    finally:
        llm.close()
