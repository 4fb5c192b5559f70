"""The engine on the kernels (the PyTorch twins on CPU) produces the same greedy tokens as with the plain
per-sequence attention of kernels/reference.py, through chunked prefill, prefix-cache hits and mixed
prefill + decode steps.

In float32. In bf16 the two differ in rounding (the twin's SDPA keeps bf16 inputs, the reference upcasts
first), and greedy decoding flips at near-ties: on SmolLM2 one prompt in six started with a different token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from prompts import varied_prompts

from infer import LLM, SamplingParams
from infer.kernels.reference import paged_attention_reference


def _reference_decode(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    out=None,
    num_splits=None,
    plan=None,
    split_tokens=None,
    window=0,
    softcap=0.0,
    sinks=None,
):
    assert not softcap and sinks is None, "the plain reference has no soft-capping or sinks (no model here has them)"
    starts = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, starts, scale, out, window)


def _reference_prefill(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    out=None,
    max_query_len=None,
    decode_from=None,
    window=0,
    softcap=0.0,
    sinks=None,
):
    assert not softcap and sinks is None, "the plain reference has no soft-capping or sinks (no model here has them)"
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, window)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "qwen2", "mistral-swa"])
def test_twins_match_plain_attention_greedy(model, smollm2_dir, tiny_model_dir, smollm2_tokenizer, monkeypatch):
    # qwen2: 5 query heads per KV head; mistral-swa: a window of 16 on every layer
    path = smollm2_dir if model == "smollm2" else tiny_model_dir(model)
    texts = varied_prompts(6, longest_words=400)
    prompts = [smollm2_tokenizer(t)["input_ids"] for t in texts + [texts[-1] + " and then some more"]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # dense weights: the int8 activations of quantized linears would turn the kernels' last-bit differences into
    # half a quantization step now and then; this compares attention
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=128,
        block_size=16,
        quantization="none",
    )
    with_kernels = [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.scheduler.stats.prefix_cache_hit_tokens > 0  # the last prompt extends another
    for module in llm.engine.model.modules():  # the attention layers' kernels (kernels/dispatch.py), swapped
        if (kernels := getattr(module, "kernels", None)) is not None:
            plain = dataclasses.replace(
                kernels, paged_decode_attention=_reference_decode, paged_prefill_attention=_reference_prefill
            )
            monkeypatch.setattr(module, "kernels", plain)
    with_plain = [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]
    assert max(len(p) for p in prompts) > 128  # chunked prefill beside running decodes
    for i, (got, want) in enumerate(zip(with_kernels, with_plain, strict=True)):
        assert got == want, f"prompt {i} ({len(prompts[i])} tokens): kernels {got} vs plain {want}"
