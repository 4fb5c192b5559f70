"""Attention logit soft-capping (Gemma 2: each scaled score s becomes c * tanh(s / c) before the mask and softmax) in
every attention path that computes it: the decode twin (planned and not), the prefill twin over mixed batches, the
compiled decode formulation, the CPU dispatchers (the native kernels; tests/kernels/test_native_softcap_sinks.py
tests those once per build) and the Triton kernels (CUDA, or TRITON_INTERPRET=1 on a CPU), against the float64
definition, with and without a sliding window. A scale of 0.5 makes scores of several units, so that a cap of 2
changes every distribution."""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_checks import DEVICE, KERNEL_DTYPES, assert_close, poisoned, requires_triton
from paged_cases import make_batch, reference_attention

from infer.kernels.paged_attention import (
    paged_decode_attention_compiled,
    paged_decode_attention_cpu,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_prefill_attention_cpu,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
    plan_decode,
)

CPU = torch.device("cpu")
SCALE, CAP = 0.5, 2.0
SEQ_LENS = [1, 15, 16, 40, 130]
MIXED_LENS = [40, 1, 23, 50, 77, 9, 130]
MIXED_QUERIES = [1, 1, 23, 17, 70, 9, 40]


def _batches(dtype, heads, device, head_dim=64):
    seed = zlib.crc32(repr(("softcap", dtype, heads)).encode())
    decodes = make_batch(SEQ_LENS, [1] * len(SEQ_LENS), *heads, head_dim, 16, dtype, seed=seed, device=device)
    mixed = make_batch(MIXED_LENS, MIXED_QUERIES, *heads, head_dim, 8, dtype, seed=seed + 1, device=device)
    return decodes, mixed


def _args(batch, mixed=False):
    tail = (batch.query_start_loc, SCALE) if mixed else (SCALE,)
    return (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, *tail)


@pytest.mark.parametrize("window", [0, 5, 37])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (5, 1)], ids=lambda h: f"{h[0]}:{h[1]}")
def test_twins_and_dispatchers_match_float64(window, heads):
    dtype = torch.float32
    decodes, mixed = _batches(dtype, heads, CPU)
    expected = reference_attention(decodes, SCALE, window, CAP)
    assert (expected - reference_attention(decodes, SCALE, window)).abs().max() > 0.05  # the cap matters
    args = _args(decodes)
    assert_close(
        paged_decode_attention_torch(*args, out=poisoned(decodes.q.shape, dtype, CPU), window=window, softcap=CAP),
        expected,
        dtype,
        "decode twin",
    )
    plan = plan_decode(decodes.block_tables, decodes.seq_lens, decodes.k_cache, window=window)
    assert_close(
        paged_decode_attention_torch(*args, plan=plan, window=window, softcap=CAP), expected, dtype, "planned twin"
    )
    assert_close(paged_decode_attention_compiled(*args, window=window, softcap=CAP), expected, dtype, "compiled")
    assert_close(paged_decode_attention_cpu(*args, window=window, softcap=CAP), expected, dtype, "decode dispatch")
    expected = reference_attention(mixed, SCALE, window, CAP)
    margs = _args(mixed, mixed=True)
    assert_close(
        paged_prefill_attention_torch(*margs, out=poisoned(mixed.q.shape, dtype, CPU), window=window, softcap=CAP),
        expected,
        dtype,
        "prefill twin",
    )
    assert_close(paged_prefill_attention_cpu(*margs, window=window, softcap=CAP), expected, dtype, "prefill dispatch")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_twins_in_half_precision(dtype):
    decodes, mixed = _batches(dtype, (8, 2), CPU)
    assert_close(
        paged_decode_attention_cpu(*_args(decodes), window=16, softcap=CAP),
        reference_attention(decodes, SCALE, 16, CAP),
        dtype,
        "decode dispatch",
    )
    assert_close(
        paged_prefill_attention_cpu(*_args(mixed, mixed=True), window=16, softcap=CAP),
        reference_attention(mixed, SCALE, 16, CAP),
        dtype,
        "prefill dispatch",
    )


@requires_triton
@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_triton_matches_float64_and_the_twin(window, dtype):
    decodes, mixed = _batches(dtype, (8, 2), DEVICE)
    for num_splits in (1, 4):
        out = paged_decode_attention_triton(*_args(decodes), num_splits=num_splits, window=window, softcap=CAP)
        assert_close(out, reference_attention(decodes, SCALE, window, CAP), dtype, "triton decode vs float64")
        assert_close(
            out,
            paged_decode_attention_torch(*_args(decodes), window=window, softcap=CAP),
            dtype,
            "triton decode vs twin",
        )
    margs = _args(mixed, mixed=True)
    out = paged_prefill_attention_triton(*margs, max_query_len=max(MIXED_QUERIES), window=window, softcap=CAP)
    assert_close(out, reference_attention(mixed, SCALE, window, CAP), dtype, "triton prefill vs float64")
    assert_close(
        out, paged_prefill_attention_torch(*margs, window=window, softcap=CAP), dtype, "triton prefill vs twin"
    )


@pytest.mark.skipif(DEVICE.type != "cuda", reason="real shapes: a GPU's (the interpreter takes minutes)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_at_real_shapes_matches_the_twin(dtype):
    """Gemma 2 9B-like heads (16:8, head_dim 256, cap 50, scale 256 ** -0.5), window 4096, contexts to 6000."""
    heads, scale, cap = (16, 8), 256**-0.5, 50.0
    lens = [1, 700, 3000, 6000]
    decodes = make_batch(lens, [1] * len(lens), *heads, 256, 16, dtype, seed=11)
    args = (decodes.q, decodes.k_cache, decodes.v_cache, decodes.block_tables, decodes.seq_lens, scale)
    out = paged_decode_attention_triton(*args, split_tokens=512, window=4096, softcap=cap)
    assert_close(out, paged_decode_attention_torch(*args, window=4096, softcap=cap), dtype, "triton decode vs twin")
    mixed = make_batch([600, 5000, 2100, 1], [600, 1000, 1, 1], *heads, 256, 16, dtype, seed=12)
    margs = (mixed.q, mixed.k_cache, mixed.v_cache, mixed.block_tables, mixed.seq_lens, mixed.query_start_loc, scale)
    out = paged_prefill_attention_triton(*margs, max_query_len=1000, window=4096, softcap=cap)
    assert_close(out, paged_prefill_attention_torch(*margs, window=4096, softcap=cap), dtype, "triton prefill vs twin")
