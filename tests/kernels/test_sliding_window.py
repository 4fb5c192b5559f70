"""Sliding-window attention (`window` W > 0: the query at position p sees keys in (p - W, p]) in every attention
path: the native CPU kernels (each build this CPU runs), the twins, the compiled decode formulation, the per-sequence
reference and the Triton kernels (CUDA, or TRITON_INTERPRET=1 on a CPU), against the float64 definition."""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_checks import DEVICE, KERNEL_DTYPES, assert_close, poisoned, requires_triton
from paged_cases import make_batch, reference_attention

from infer.kernels.cpu_kernels import (
    paged_decode_attention_native,
    paged_decode_takes,
    paged_prefill_attention_native,
    paged_prefill_takes,
)
from infer.kernels.paged_attention import (
    paged_decode_attention_compiled,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
    plan_decode,
)
from infer.kernels.reference import paged_attention_reference

CPU = torch.device("cpu")
NATIVE_DTYPES = [torch.float32, torch.bfloat16]
# windows: a single key, shorter than a 16-position chunk, one chunk, ragged, longer than every context here
WINDOWS = [1, 5, 16, 37, 1000]
# contexts: shorter than the windows, on and off chunk and block edges, long
SEQ_LENS = [1, 15, 16, 17, 40, 130, 300]
# a mixed batch: decodes, whole prompts, chunks behind a cached prefix, a chunk longer than a task's tile
MIXED_LENS = [40, 1, 23, 50, 77, 9, 300, 16, 96]
MIXED_QUERIES = [1, 1, 23, 17, 70, 9, 130, 16, 40]


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def _decode_batch(dtype, heads, head_dim, block_size, device=DEVICE):
    return make_batch(
        SEQ_LENS,
        [1] * len(SEQ_LENS),
        *heads,
        head_dim,
        block_size,
        dtype,
        seed=_seed("swa-decode", dtype, heads, head_dim, block_size),
        device=device,
    )


def _mixed_batch(dtype, heads, head_dim, block_size, device=DEVICE):
    return make_batch(
        MIXED_LENS,
        MIXED_QUERIES,
        *heads,
        head_dim,
        block_size,
        dtype,
        seed=_seed("swa-mixed", dtype, heads, head_dim, block_size),
        device=device,
    )


# ---- native CPU kernels, once per build ----------------------------------------------------------------------


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads, head_dim, block_size",
    [((4, 4), 64, 16), ((9, 3), 128, 16), ((5, 1), 64, 4), ((6, 2), 80, 32), ((4, 2), 72, 16)],
    ids=["1x64", "3x128", "5x64-bs4", "3x80-bs32", "2x72"],
)
def test_native_decode_window_matches_float64(window, dtype, heads, head_dim, block_size):
    """Head dims on the vector paths (64, 128, 80) and off them (72: the portable loops), blocks smaller and
    larger than the 16- or 8-position chunks."""
    batch = _decode_batch(dtype, heads, head_dim, block_size, CPU)
    scale = head_dim**-0.5
    assert paged_decode_takes(batch.q, batch.k_cache, batch.block_tables, batch.seq_lens)
    out = paged_decode_attention_native(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        scale,
        poisoned(batch.q.shape, dtype, CPU),
        window,
    )
    assert_close(out, reference_attention(batch, scale, window), dtype, f"native decode, window {window}")


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads, head_dim, block_size",
    [((4, 4), 64, 16), ((9, 3), 128, 16), ((6, 2), 80, 32), ((32, 2), 64, 8)],
    ids=["1x64", "3x128", "3x80", "16x64"],
)
def test_native_prefill_window_matches_float64(window, dtype, heads, head_dim, block_size):
    batch = _mixed_batch(dtype, heads, head_dim, block_size, CPU)
    scale = head_dim**-0.5
    assert paged_prefill_takes(batch.q, batch.k_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    out = paged_prefill_attention_native(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        poisoned(batch.q.shape, dtype, CPU),
        window=window,
    )
    assert_close(out, reference_attention(batch, scale, window), dtype, f"native prefill, window {window}")


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("window", [3, 16, 21])
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize("heads, head_dim", [((9, 3), 64), ((8, 1), 128), ((6, 2), 80)], ids=["3x64", "8x128", "3x80"])
def test_a_windowed_prefill_row_has_the_bits_of_the_decode_of_its_position(window, dtype, heads, head_dim):
    """With a window every row, bf16 on AVX512-BF16 included, takes the decode arithmetic: a prefilled row equals
    the decode of its position bit for bit (a resumed stream goes on as the one it continues)."""
    seq_lens, query_lens = [37, 16, 90, 17], [37, 16, 41, 5]
    batch = make_batch(seq_lens, query_lens, *heads, head_dim, 16, dtype, seed=_seed("swa-bits", heads), device=CPU)
    prefilled = paged_prefill_attention_native(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        0.125,
        poisoned(batch.q.shape, dtype, CPU),
        window=window,
    )
    row = 0
    for b, (length, chunk) in enumerate(zip(seq_lens, query_lens)):
        for t in range(chunk):
            one = torch.empty(1, heads[0], head_dim, dtype=dtype)
            paged_decode_attention_native(
                batch.q[row : row + 1],
                batch.k_cache,
                batch.v_cache,
                batch.block_tables[b : b + 1],
                torch.tensor([length - chunk + t + 1], dtype=torch.int32),
                0.125,
                one,
                window,
            )
            assert torch.equal(one[0], prefilled[row]), f"sequence {b}, token {t}"
            row += 1


@pytest.mark.usefixtures("isa")
def test_a_negative_window_is_refused():
    batch = _decode_batch(torch.float32, (4, 4), 64, 16, CPU)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention_native(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            0.125,
            torch.empty_like(batch.q),
            -1,
        )


# ---- the twins and the definitions ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (5, 1)], ids=lambda h: f"{h[0]}:{h[1]}")
def test_twins_and_reference_match_float64(window, heads):
    """The decode twin (planned and not), the prefill twin (decodes and chunks), the compiled formulation (run
    eagerly here) and the per-sequence reference, fp32."""
    dtype, head_dim = torch.float32, 64
    scale = head_dim**-0.5
    decodes = _decode_batch(dtype, heads, head_dim, 16, CPU)
    args = (decodes.q, decodes.k_cache, decodes.v_cache, decodes.block_tables, decodes.seq_lens, scale)
    expected = reference_attention(decodes, scale, window)
    assert_close(
        paged_decode_attention_torch(*args, out=poisoned(decodes.q.shape, dtype, CPU), window=window),
        expected,
        dtype,
        "decode twin",
    )
    plan = plan_decode(decodes.block_tables, decodes.seq_lens, decodes.k_cache, window=window)
    assert_close(paged_decode_attention_torch(*args, plan=plan, window=window), expected, dtype, "planned twin")
    assert_close(paged_decode_attention_compiled(*args, window=window), expected, dtype, "compiled formulation")
    if window != 1000:
        with pytest.raises(ValueError, match="window"):  # a plan made for another window
            paged_decode_attention_torch(
                *args, plan=plan_decode(decodes.block_tables, decodes.seq_lens, decodes.k_cache), window=window
            )
    mixed = _mixed_batch(dtype, heads, head_dim, 8, CPU)
    margs = (mixed.q, mixed.k_cache, mixed.v_cache, mixed.block_tables, mixed.seq_lens, mixed.query_start_loc, scale)
    expected = reference_attention(mixed, scale, window)
    assert_close(
        paged_prefill_attention_torch(*margs, out=poisoned(mixed.q.shape, dtype, CPU), window=window),
        expected,
        dtype,
        "prefill twin",
    )
    assert_close(paged_attention_reference(*margs, window=window), expected, dtype, "reference.py")


# ---- Triton (CUDA; TRITON_INTERPRET=1 on a CPU) ----------------------------------------------------------------


TRITON_WINDOWS = [1, 16, 37, 200]


def _triton_window_dtypes() -> list[tuple[int, torch.dtype]]:
    """(window, dtype) cases of the Triton tests: every pair on a GPU; in the interpreter (a CPU, seconds a case) each
    window once, the dtypes in turn. The window enters the kernels as positions only (the bounds of the keys a row
    sees), the same code whatever the dtype, and tests/kernels/test_paged_attention.py runs the kernels in each
    dtype without a window."""
    if DEVICE.type == "cuda":
        return [(w, d) for w in TRITON_WINDOWS for d in KERNEL_DTYPES]
    return [(w, KERNEL_DTYPES[i % len(KERNEL_DTYPES)]) for i, w in enumerate(TRITON_WINDOWS)]


TRITON_CASES = [pytest.param(w, d, id=f"{w}-{d}") for w, d in _triton_window_dtypes()]


@requires_triton
@pytest.mark.parametrize("window, dtype", TRITON_CASES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_decode_window_matches_float64_and_the_twin(window, dtype, num_splits):
    """Splits before the window (empty), holding its start, and after it."""
    batch = _decode_batch(dtype, (8, 2), 64, 16)
    scale = 0.125
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    out = paged_decode_attention_triton(*args, out=poisoned(batch.q.shape, dtype), num_splits=num_splits, window=window)
    assert_close(out, reference_attention(batch, scale, window), dtype, "triton decode vs float64")
    assert_close(out, paged_decode_attention_torch(*args, window=window), dtype, "triton decode vs twin")


@requires_triton
@pytest.mark.parametrize("window, dtype", TRITON_CASES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (5, 1)], ids=lambda h: f"{h[0]}:{h[1]}")
def test_triton_prefill_window_matches_float64_and_the_twin(window, dtype, heads):
    """Query tiles whose rows start seeing keys in different key tiles (rows that see nothing of a tile)."""
    batch = _mixed_batch(dtype, heads, 64, 8)
    scale = 0.125
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, scale)
    out = paged_prefill_attention_triton(
        *args, out=poisoned(batch.q.shape, dtype), max_query_len=max(MIXED_QUERIES), window=window
    )
    assert_close(out, reference_attention(batch, scale, window), dtype, "triton prefill vs float64")
    assert_close(out, paged_prefill_attention_torch(*args, window=window), dtype, "triton prefill vs twin")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="real shapes: a GPU's (the interpreter takes minutes)")
@pytest.mark.parametrize("window", [512, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_window_at_real_shapes_matches_the_twin(window, dtype):
    """Mistral-like heads (32:8, head_dim 128), blocks of 16, contexts up to 6000 (past both windows), decode with
    fixed split spans (the engine's) and a mixed batch with long chunks."""
    heads, scale = (32, 8), 128**-0.5
    lens = [1, 700, 3000, 6000]
    decodes = make_batch(lens, [1] * len(lens), *heads, 128, 16, dtype, seed=_seed("real-decode", window))
    args = (decodes.q, decodes.k_cache, decodes.v_cache, decodes.block_tables, decodes.seq_lens, scale)
    out = paged_decode_attention_triton(*args, split_tokens=512, window=window)
    assert_close(out, paged_decode_attention_torch(*args, window=window), dtype, "triton decode vs twin")
    mixed = make_batch(
        [600, 5000, 2100, 1], [600, 1000, 1, 1], *heads, 128, 16, dtype, seed=_seed("real-mixed", window)
    )
    margs = (mixed.q, mixed.k_cache, mixed.v_cache, mixed.block_tables, mixed.seq_lens, mixed.query_start_loc, scale)
    out = paged_prefill_attention_triton(*margs, max_query_len=1000, window=window)
    assert_close(out, paged_prefill_attention_torch(*margs, window=window), dtype, "triton prefill vs twin")
