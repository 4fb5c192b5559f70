"""Gemma 2's soft-capping (`softcap` c > 0: each scaled score s becomes c * tanh(s / c)) and GPT-OSS's attention sinks
(`sinks` [H] float32: exp(sink_h) joins head h's softmax denominator) in the native CPU attention kernels
(kernels/cpu/paged_decode.c: paged_decode and its runs; paged_prefill.c, packed bf16 path included), once per build
this CPU runs, against the float64 definition and the twins (kernels/paged_attention.py, which define both), with
sliding windows, several heads per KV head, head dims on and off the vector paths and contexts ending inside a block;
the bits each row must share with its decode; the dispatchers sending such calls to the native kernels; and the
arguments they refuse. A scale of 0.5 makes scores of several units, so that a cap of 2 changes every distribution,
and sinks of a few units take a visible share of each softmax."""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_checks import assert_close, poisoned
from paged_cases import make_batch, reference_attention

from infer.kernels import paged_attention
from infer.kernels.cpu_kernels import (
    paged_decode_attention_native,
    paged_decode_cpu_op,
    paged_decode_takes,
    paged_prefill_attention_native,
    paged_prefill_takes,
)
from infer.kernels.paged_attention import (
    paged_decode_attention_cpu,
    paged_decode_attention_torch,
    paged_prefill_attention_cpu,
    paged_prefill_attention_torch,
)

pytestmark = pytest.mark.usefixtures("isa")  # every test once per build this CPU runs (conftest.py)

CPU = torch.device("cpu")
NATIVE_DTYPES = [torch.float32, torch.bfloat16]
SCALE, CAP = 0.5, 2.0
# (softcap, sinks): each alone and both together
EXTRAS = [(CAP, False), (0.0, True), (CAP, True)]
# contexts: one position, on and off 16-position chunks and block edges, long
SEQ_LENS = [1, 15, 16, 17, 40, 130, 300]
# decodes, whole prompts, chunks behind a cached prefix, a chunk longer than a task's tile of query tokens
MIXED_LENS = [40, 1, 23, 50, 77, 9, 300, 16, 96]
MIXED_QUERIES = [1, 1, 23, 17, 70, 9, 130, 16, 40]


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def _sinks(num_heads: int, on: bool, seed: int) -> torch.Tensor | None:
    if not on:
        return None
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2 + 1


def _extras_id(extra: tuple[float, bool]) -> str:
    return "+".join(name for name, on in (("softcap", extra[0]), ("sinks", extra[1])) if on)


def _check_against_definitions(out, batch, window, softcap, sinks, twin, dtype, what):
    expected = reference_attention(batch, SCALE, window, softcap, sinks)
    assert (expected - reference_attention(batch, SCALE, window)).abs().max() > 0.05, "softcap / sinks must matter"
    assert_close(out, expected, dtype, f"{what} vs float64")
    assert_close(out, twin, dtype, f"{what} vs the twin")


@pytest.mark.parametrize("extra", EXTRAS, ids=_extras_id)
@pytest.mark.parametrize("window", [0, 5, 37])
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads, head_dim, block_size",
    [((4, 4), 64, 16), ((9, 3), 128, 16), ((5, 1), 64, 4), ((6, 2), 80, 32), ((4, 2), 72, 16)],
    ids=["1x64", "3x128", "5x64-bs4", "3x80-bs32", "2x72"],
)
def test_native_decode_matches_float64_and_the_twin(extra, window, dtype, heads, head_dim, block_size):
    """Head dims on the vector paths (64, 128, 80) and off them (72: the portable loops), blocks smaller and larger
    than the 16- or 8-position chunks."""
    softcap, with_sinks = extra
    batch = make_batch(
        SEQ_LENS, [1] * len(SEQ_LENS), *heads, head_dim, block_size, dtype, seed=_seed("d", heads, dtype), device=CPU
    )
    sinks = _sinks(heads[0], with_sinks, _seed("sinks", heads))
    assert paged_decode_takes(batch.q, batch.k_cache, batch.block_tables, batch.seq_lens, sinks)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, SCALE)
    out = paged_decode_attention_native(
        *args, poisoned(batch.q.shape, dtype, CPU), window, softcap=softcap, sinks=sinks
    )
    twin = paged_decode_attention_torch(*args, window=window, softcap=softcap, sinks=sinks)
    _check_against_definitions(out, batch, window, softcap, sinks, twin, dtype, "native decode")


@pytest.mark.parametrize("extra", EXTRAS, ids=_extras_id)
@pytest.mark.parametrize("window", [0, 5, 37])
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads, head_dim, block_size",
    [((4, 4), 64, 16), ((9, 3), 128, 16), ((6, 2), 80, 32), ((32, 2), 64, 8)],
    ids=["1x64", "3x128", "3x80", "16x64"],
)
def test_native_prefill_matches_float64_and_the_twin(extra, window, dtype, heads, head_dim, block_size):
    """Without a window, bf16 takes the packed path where the CPU has AVX512-BF16 (head dims 64 and 128 here)."""
    softcap, with_sinks = extra
    batch = make_batch(
        MIXED_LENS, MIXED_QUERIES, *heads, head_dim, block_size, dtype, seed=_seed("p", heads, dtype), device=CPU
    )
    sinks = _sinks(heads[0], with_sinks, _seed("sinks", heads))
    starts = batch.query_start_loc
    assert paged_prefill_takes(batch.q, batch.k_cache, batch.block_tables, batch.seq_lens, starts, sinks)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, starts, SCALE)
    out = paged_prefill_attention_native(
        *args, poisoned(batch.q.shape, dtype, CPU), window=window, softcap=softcap, sinks=sinks
    )
    twin = paged_prefill_attention_torch(*args, window=window, softcap=softcap, sinks=sinks)
    _check_against_definitions(out, batch, window, softcap, sinks, twin, dtype, "native prefill")


@pytest.mark.parametrize("extra", EXTRAS, ids=_extras_id)
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize("heads, head_dim", [((9, 3), 64), ((8, 1), 128), ((6, 2), 80)], ids=["3x64", "8x128", "3x80"])
def test_rows_have_the_bits_of_their_decode(extra, dtype, heads, head_dim):
    """A prefill with decode_from 0 (every row the decode arithmetic, the packed bf16 path's rows too) and a
    verification's runs (rows of one sequence reading K and V once) give each row the bits of its own decode, with a
    window and without: a resumed stream goes on as the one it continues, speculation keeps greedy output exact."""
    softcap, with_sinks = extra
    sinks = _sinks(heads[0], with_sinks, _seed("sinks", heads))
    seq_lens, query_lens = [37, 16, 90, 17], [37, 16, 41, 5]
    batch = make_batch(seq_lens, query_lens, *heads, head_dim, 16, dtype, seed=_seed("bits", heads), device=CPU)
    for window in (0, 21):
        prefilled = paged_prefill_attention_native(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            SCALE,
            poisoned(batch.q.shape, dtype, CPU),
            torch.zeros(len(seq_lens), dtype=torch.int32),
            window,
            softcap,
            sinks,
        )
        # the same rows as decodes, one by one, then as runs of one sequence's consecutive positions
        row_tables = torch.cat([batch.block_tables[b : b + 1].expand(n, -1) for b, n in enumerate(query_lens)])
        row_lens = torch.tensor(
            [s - n + t + 1 for s, n in zip(seq_lens, query_lens) for t in range(n)], dtype=torch.int32
        )
        args = (batch.q, batch.k_cache, batch.v_cache, row_tables.contiguous(), row_lens, SCALE)
        one_by_one = torch.cat(
            [
                paged_decode_attention_native(
                    batch.q[r : r + 1],
                    batch.k_cache,
                    batch.v_cache,
                    row_tables[r : r + 1].contiguous(),
                    row_lens[r : r + 1],
                    SCALE,
                    torch.empty(1, *batch.q.shape[1:], dtype=dtype),
                    window,
                    softcap=softcap,
                    sinks=sinks,
                )
                for r in range(batch.q.shape[0])
            ]
        )
        runs = paged_decode_attention_native(
            *args,
            poisoned(batch.q.shape, dtype, CPU),
            window,
            runs=torch.tensor(query_lens, dtype=torch.int32),
            softcap=softcap,
            sinks=sinks,
        )
        batched = paged_decode_attention_native(
            *args, poisoned(batch.q.shape, dtype, CPU), window, softcap=softcap, sinks=sinks
        )
        assert torch.equal(prefilled, one_by_one), f"prefill rows vs their decodes, window {window}"
        assert torch.equal(runs, one_by_one), f"verification runs vs their decodes, window {window}"
        assert torch.equal(batched, one_by_one), f"a decode batch vs its rows alone, window {window}"


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
def test_the_dispatchers_and_the_step_graph_operator_take_the_native_kernels(dtype, monkeypatch):
    """On a CPU, soft-capped calls and calls with float32 sinks go to the native kernels (counted) and agree with the
    twins; sinks of another type go to the twins."""
    calls = {"decode": 0, "prefill": 0}

    def counting(name, kernel):
        def call(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        return call

    monkeypatch.setattr(
        paged_attention, "paged_decode_attention_native", counting("decode", paged_decode_attention_native)
    )
    monkeypatch.setattr(
        paged_attention, "paged_prefill_attention_native", counting("prefill", paged_prefill_attention_native)
    )
    decodes = make_batch([5, 64, 200], [1, 1, 1], 8, 2, 64, 16, dtype, seed=3, device=CPU)
    mixed = make_batch([33, 12, 1, 200], [33, 5, 1, 64], 8, 2, 64, 16, dtype, seed=4, device=CPU)
    sinks = _sinks(8, True, 5)
    dargs = (decodes.q, decodes.k_cache, decodes.v_cache, decodes.block_tables, decodes.seq_lens, SCALE)
    margs = (mixed.q, mixed.k_cache, mixed.v_cache, mixed.block_tables, mixed.seq_lens, mixed.query_start_loc, SCALE)
    for softcap, extra_sinks in ((CAP, None), (0.0, sinks), (CAP, sinks)):
        kw = dict(window=7, softcap=softcap, sinks=extra_sinks)
        twin = paged_decode_attention_torch(*dargs, **kw)
        assert_close(paged_decode_attention_cpu(*dargs, **kw), twin, dtype, "decode dispatch")
        op_out = poisoned(decodes.q.shape, dtype, CPU)
        paged_decode_cpu_op(*dargs, op_out, 7, softcap, extra_sinks)
        assert_close(op_out, twin, dtype, "step graph operator")
        assert_close(
            paged_prefill_attention_cpu(*margs, **kw),
            paged_prefill_attention_torch(*margs, **kw),
            dtype,
            "prefill dispatch",
        )
    assert calls == {"decode": 3, "prefill": 3}
    half = sinks.half()
    assert not paged_decode_takes(decodes.q, decodes.k_cache, decodes.block_tables, decodes.seq_lens, half)
    got = paged_decode_attention_cpu(*dargs, softcap=CAP, sinks=half)
    assert_close(got, paged_decode_attention_torch(*dargs, softcap=CAP, sinks=half), dtype, "fp16 sinks, twin")
    assert calls["decode"] == 3


@pytest.mark.parametrize(
    "case, match",
    [
        ("negative softcap", "softcap must be"),
        ("NaN softcap", "softcap must be"),
        ("sinks of another length", "sinks as a contiguous float32"),
        ("bf16 sinks", "sinks as a contiguous float32"),
        ("strided sinks", "sinks as a contiguous float32"),
    ],
)
def test_bad_softcaps_and_sinks_are_refused_before_anything_is_written(case, match):
    batch = make_batch([20, 40], [20, 8], 4, 2, 64, 16, torch.float32, seed=9, device=CPU)
    softcap, sinks = 0.0, torch.zeros(4)
    if case == "negative softcap":
        softcap = -1.0
    elif case == "NaN softcap":
        softcap = float("nan")
    elif case == "sinks of another length":
        sinks = torch.zeros(2)
    elif case == "bf16 sinks":
        sinks = sinks.bfloat16()
    else:
        sinks = torch.zeros(8)[::2]
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    out = poisoned(batch.q.shape, torch.float32, CPU)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention_native(*args, batch.query_start_loc, SCALE, out, softcap=softcap, sinks=sinks)
    decode_out = poisoned((2, 4, 64), torch.float32, CPU)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention_native(batch.q[:2], *args[1:], SCALE, decode_out, softcap=softcap, sinks=sinks)
    assert torch.isnan(out).all() and torch.isnan(decode_out).all()
