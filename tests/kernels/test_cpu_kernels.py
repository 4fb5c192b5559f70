"""The native CPU attention kernels (kernels/cpu/paged_decode.c, paged_prefill.c) against the float64
definition, the twins, and the inputs they must refuse instead of reading outside the pool; rotary and the KV
append against their twins' bits."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import assert_close, poisoned
from paged_cases import make_batch, random_pool, random_tables, reference_attention

from infer.kernels import cpu_kernels
from infer.kernels.cpu_kernels import (
    paged_decode_attention_native,
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

NATIVE_DTYPES = [torch.float32, torch.bfloat16]
CPU = torch.device("cpu")  # the native kernels' tensors, also on a CUDA machine


def _native(batch, scale, out=None):
    out = poisoned(batch.q.shape, batch.q.dtype, CPU) if out is None else out
    assert paged_decode_takes(batch.q, batch.k_cache, batch.block_tables, batch.seq_lens)
    return paged_decode_attention_native(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale, out
    )


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (5, 1), (32, 2)], ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (128, 16), (64, 4), (80, 32), (72, 16)])
def test_decode_matches_float64(dtype, heads, head_dim, block_size):
    """Group sizes with and without a specialised task (1, 3, 5, 16), head dims on the AVX-512 path (64, 128,
    80) and off it (72), blocks smaller and larger than its 16-position chunks."""
    num_heads, num_kv_heads = heads
    seq_lens = [1, 15, 16, 17, 37, 130, 300]
    batch = make_batch(
        seq_lens,
        [1] * len(seq_lens),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=hash((num_heads, head_dim, block_size)) % 2**31,
        device=CPU,
    )
    scale = head_dim**-0.5
    assert_close(_native(batch, scale), reference_attention(batch, scale), dtype, "native decode vs float64")


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
def test_dispatch_picks_native_and_agrees_with_the_twin(dtype):
    batch = make_batch([5, 64, 200], [1, 1, 1], 8, 2, 64, 16, dtype, seed=3, device=CPU)
    qkv = torch.cat([batch.q.flatten(1), torch.zeros(3, 256, dtype=dtype)], dim=1)  # q as a view, as in a layer
    q = qkv[:, : 8 * 64].view(3, 8, 64)
    native = paged_decode_attention_cpu(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    twin = paged_decode_attention_torch(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    assert_close(native, twin, dtype, "native vs twin")


def test_a_sequences_output_does_not_depend_on_its_batch():
    batch = make_batch([33, 70, 140, 9], [1] * 4, 6, 2, 64, 16, torch.bfloat16, seed=5, device=CPU)
    alone = torch.empty(1, 6, 64, dtype=torch.bfloat16)
    together = _native(batch, 0.125)
    paged_decode_attention_native(
        batch.q[2:3], batch.k_cache, batch.v_cache, batch.block_tables[2:3], batch.seq_lens[2:3], 0.125, alone
    )
    assert torch.equal(alone[0], together[2])


def test_reads_only_the_positions_of_each_sequence():
    """Everything outside the named positions is NaN, even inside a sequence's own last block."""
    generator = torch.Generator().manual_seed(11)
    seq_lens = [3, 21]
    k_cache, v_cache = random_pool(2, 12, 8, 64, torch.float32, generator, CPU)
    tables = random_tables(seq_lens, 12, 8, generator, CPU)
    keep_k, keep_v = k_cache.clone(), v_cache.clone()
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    for i, length in enumerate(seq_lens):
        for pos in range(length):
            block, offset = tables[i, pos // 8], pos % 8
            k_cache[:, block, offset] = keep_k[:, block, offset]
            v_cache[:, block, offset] = keep_v[:, block, offset]
    q = torch.randn(2, 4, 64, generator=generator)
    out = paged_decode_attention_native(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        0.125,
        poisoned(q.shape, torch.float32, CPU),
    )
    assert not torch.isnan(out).any()


def test_sequences_past_the_packing_budget_give_the_same_bits():
    """bf16 keys are packed once per call for the chunks that span several tasks, up to 32 MiB; a chunk past that
    budget packs its own tiles in each task. Two long contexts here need 47 MiB: the second goes past it."""
    batch = make_batch([6000, 6000], [100, 100], 16, 8, 128, 16, torch.bfloat16, seed=8, device=CPU)
    together = _prefill(batch, 128**-0.5)
    for b in range(2):
        alone = torch.empty(100, 16, 128, dtype=torch.bfloat16)
        paged_prefill_attention_native(
            batch.q[100 * b : 100 * (b + 1)],
            batch.k_cache,
            batch.v_cache,
            batch.block_tables[b : b + 1],
            batch.seq_lens[b : b + 1],
            torch.tensor([0, 100], dtype=torch.int32),
            128**-0.5,
            alone,
        )
        assert torch.equal(alone, together[100 * b : 100 * (b + 1)])
    assert_close(together, reference_attention(batch, 128**-0.5), torch.bfloat16, "long contexts vs float64")


@pytest.mark.parametrize("case", ["block past the pool", "negative block", "length past the table", "length 0"])
def test_bad_tables_are_refused_before_anything_is_read(case):
    batch = make_batch([20, 40], [1, 1], 4, 2, 64, 16, torch.float32, seed=9, device=CPU)
    tables, lens = batch.block_tables.clone(), batch.seq_lens.clone()
    if case == "block past the pool":
        tables[1, 2] = batch.k_cache.shape[1]
    elif case == "negative block":
        tables[0, 0] = -1
    elif case == "length past the table":
        lens[1] = tables.shape[1] * 16 + 1
    else:
        lens[0] = 0
    out = poisoned(batch.q.shape, torch.float32, CPU)
    with pytest.raises(ValueError, match="outside the pool|past its block table"):
        paged_decode_attention_native(batch.q, batch.k_cache, batch.v_cache, tables, lens, 0.125, out)
    assert torch.isnan(out).all()


def _verification(
    heads: tuple[int, int], head_dim: int, dtype: torch.dtype, firsts: list[int], runs: list[int], seed: int
):
    """Rows of speculative verifications: run b is runs[b] rows of sequence b at consecutive positions, the first
    seeing firsts[b] positions; each row carries its sequence's table (as the engine's ForwardBatch does).
    (q, k_cache, v_cache, tables per row, lengths per row)."""
    generator = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    k_cache, v_cache = random_pool(num_kv_heads, 40, 16, head_dim, dtype, generator, CPU)
    tables = random_tables([f + r - 1 for f, r in zip(firsts, runs)], 40, 16, generator, CPU)
    row_tables = torch.cat([tables[b : b + 1].expand(r, -1) for b, r in enumerate(runs)]).contiguous()
    lens = torch.tensor([f + t for f, r in zip(firsts, runs) for t in range(r)], dtype=torch.int32)
    q = torch.randn(len(lens), num_heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, row_tables, lens


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads, head_dim",
    [((9, 3), 64), ((8, 1), 128), ((32, 2), 64), ((4, 4), 80)],
    ids=["3x64", "8x128", "16x64", "1x80"],
)
@pytest.mark.parametrize("window", [0, 7])
def test_verification_runs_have_the_bits_of_their_rows_decoded_one_by_one(dtype, heads, head_dim, window):
    """A verification's k + 1 rows read their sequence's K and V once (in pieces of 16 / G tokens where the run
    is longer), each row with the bits of its own decode: runs of 1 (a plain decode beside verifications), 5, 17
    (longer than a piece for every group here), lengths on and off the 16-position chunks."""
    firsts, runs = [20, 45, 3, 16], [5, 1, 17, 2]
    q, k_cache, v_cache, tables, lens = _verification(heads, head_dim, dtype, firsts, runs, seed=21)
    rows = torch.empty(q.shape, dtype=dtype)
    paged_decode_attention_native(q, k_cache, v_cache, tables, lens, 0.125, rows, window)
    together = paged_decode_attention_native(
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        0.125,
        poisoned(q.shape, dtype, CPU),
        window,
        runs=torch.tensor(runs, dtype=torch.int32),
    )
    assert torch.equal(together, rows)


@pytest.mark.parametrize(
    "case", ["runs past the rows", "runs short of the rows", "lengths not one apart", "an empty run"]
)
def test_bad_runs_are_refused_before_anything_is_written(case):
    q, k_cache, v_cache, tables, lens = _verification((4, 2), 64, torch.float32, [10, 30], [3, 4], seed=3)
    runs = {
        "runs past the rows": [3, 5],
        "runs short of the rows": [3, 3],
        "an empty run": [3, 0, 4],
        "lengths not one apart": [4, 3],
    }[case]
    out = poisoned(q.shape, torch.float32, CPU)
    with pytest.raises(ValueError, match="runs that do not add up"):
        paged_decode_attention_native(
            q, k_cache, v_cache, tables, lens, 0.125, out, runs=torch.tensor(runs, dtype=torch.int32)
        )
    assert torch.isnan(out).all()


def test_what_it_does_not_take_goes_to_the_twin():
    batch = make_batch([10, 30], [1, 1], 4, 2, 64, 16, torch.float16, seed=1, device=CPU)
    assert not paged_decode_takes(batch.q, batch.k_cache, batch.block_tables, batch.seq_lens)
    got = paged_decode_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    assert_close(got, reference_attention(batch, 0.125), torch.float16, "fp16 through the twin")
    wide = make_batch([10], [1], 34, 2, 64, 16, torch.float32, seed=2, device=CPU)  # a group of 17: past MAX_GROUP
    assert not paged_decode_takes(wide.q, wide.k_cache, wide.block_tables, wide.seq_lens)


# ---- prefill / mixed steps ----------------------------------------------------------------------------------


def _prefill(batch, scale, out=None):
    out = poisoned(batch.q.shape, batch.q.dtype, CPU) if out is None else out
    assert paged_prefill_takes(batch.q, batch.k_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    return paged_prefill_attention_native(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, scale, out
    )


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (5, 1), (32, 2)], ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (128, 16), (64, 4), (80, 32), (256, 8)])
def test_prefill_matches_float64(dtype, heads, head_dim, block_size):
    """One batch of decodes, whole prompts, chunks behind a cached prefix and chunks longer than a task's tile of
    query tokens (64 rows / group), with contexts that end inside a 16- or 32-key tile and on their edges."""
    num_heads, num_kv_heads = heads
    seq_lens = [40, 1, 23, 50, 77, 9, 300, 16, 96]
    query_lens = [1, 1, 23, 17, 70, 9, 130, 16, 40]
    batch = make_batch(
        seq_lens,
        query_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=hash((num_heads, head_dim, block_size)) % 2**31,
        device=CPU,
    )
    scale = head_dim**-0.5
    assert_close(_prefill(batch, scale), reference_attention(batch, scale), dtype, "native prefill vs float64")


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
def test_prefill_dispatch_picks_native_agrees_with_the_twin_and_leaves_padding_rows(dtype):
    batch = make_batch([33, 12, 1, 200], [33, 5, 1, 64], 6, 2, 64, 16, dtype, seed=4, device=CPU)
    q = torch.cat([batch.q, torch.randn(3, 6, 64).to(dtype)])  # three padding tokens after the last sequence
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.125)
    assert paged_prefill_takes(q, batch.k_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    native = paged_prefill_attention_cpu(*args, out=poisoned(q.shape, dtype, CPU))
    twin = paged_prefill_attention_torch(*args, out=poisoned(q.shape, dtype, CPU))
    assert torch.isnan(native[-3:]).all()
    assert_close(native[:-3], twin[:-3], dtype, "native prefill vs twin")


def test_a_chunks_output_does_not_depend_on_its_batch():
    batch = make_batch([33, 150, 140, 9], [33, 70, 1, 9], 6, 2, 64, 16, torch.bfloat16, seed=6, device=CPU)
    together = _prefill(batch, 0.125)
    alone = torch.empty(70, 6, 64, dtype=torch.bfloat16)
    paged_prefill_attention_native(
        batch.q[33:103],
        batch.k_cache,
        batch.v_cache,
        batch.block_tables[1:2],
        batch.seq_lens[1:2],
        torch.tensor([0, 70], dtype=torch.int32),
        0.125,
        alone,
    )
    assert torch.equal(alone, together[33:103])


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads, head_dim",
    [((9, 3), 64), ((8, 1), 128), ((32, 2), 64), ((6, 2), 80)],
    ids=["3x64", "8x128", "16x64", "3x80"],
)
def test_a_prefill_row_has_the_bits_of_the_decode_of_its_position(dtype, heads, head_dim):
    """A stream resumed elsewhere is its prompt and delivered tokens prefilled, then decoded: each prefill row
    must equal the decode of the same position bit for bit, or the resumed stream drifts from the one it
    continues. Chunks behind a cached prefix and whole prompts, lengths on and off the 16-position chunks. The
    packed bf16 path (AVX512-BF16) rounds its probabilities to bf16 as transformers does, so it is exempt."""
    if dtype == torch.bfloat16 and cpu_kernels.gemv_paths() & cpu_kernels.GEMV_BF16_PAIRS:
        pytest.skip("bf16 prefill on AVX512-BF16 takes the packed path, its own arithmetic")
    num_heads, num_kv_heads = heads
    seq_lens, query_lens = [37, 16, 90, 17], [37, 16, 41, 5]
    batch = make_batch(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, 16, dtype, seed=12, device=CPU)
    prefilled = _prefill(batch, 0.125)
    row = 0
    for b, (length, chunk) in enumerate(zip(seq_lens, query_lens)):
        for t in range(chunk):  # token t of the chunk sees length - chunk + t + 1 positions
            one = torch.empty(1, num_heads, head_dim, dtype=dtype)
            paged_decode_attention_native(
                batch.q[row : row + 1],
                batch.k_cache,
                batch.v_cache,
                batch.block_tables[b : b + 1],
                torch.tensor([length - chunk + t + 1], dtype=torch.int32),
                0.125,
                one,
            )
            assert torch.equal(one[0], prefilled[row]), f"sequence {b}, token {t}"
            row += 1


@pytest.mark.parametrize("heads, head_dim", [((9, 3), 64), ((8, 1), 128)], ids=["3x64", "8x128"])
def test_rows_from_decode_from_have_the_decode_s_bits_and_the_others_the_prefill_s(heads, head_dim):
    """`decode_from` (the engine passes each sequence's prompt length): rows at those positions and later have
    the decode kernel's bits, in bf16 on the packed path too; rows before them keep the bits the prefill gives
    without it. A prompt then prefilled again with its generated tokens (a resumed stream) has every row as
    when it was first computed. Boundaries before, inside and after each chunk."""
    num_heads, num_kv_heads = heads
    seq_lens, query_lens = [90, 70, 33, 40], [60, 70, 33, 40]
    decode_from = torch.tensor([50, 71, 0, 20], dtype=torch.int32)  # inside, past the end, all, at the start
    batch = make_batch(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, seed=13, device=CPU)
    plain = _prefill(batch, 0.125)
    mixed = paged_prefill_attention_native(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        0.125,
        poisoned(batch.q.shape, torch.bfloat16, CPU),
        decode_from,
    )
    row = 0
    for b, (length, chunk) in enumerate(zip(seq_lens, query_lens)):
        for t in range(chunk):
            position = length - chunk + t
            if position < decode_from[b]:
                assert torch.equal(mixed[row], plain[row]), f"sequence {b}, token {t}"
            else:
                one = torch.empty(1, num_heads, head_dim, dtype=torch.bfloat16)
                paged_decode_attention_native(
                    batch.q[row : row + 1],
                    batch.k_cache,
                    batch.v_cache,
                    batch.block_tables[b : b + 1],
                    torch.tensor([position + 1], dtype=torch.int32),
                    0.125,
                    one,
                )
                assert torch.equal(mixed[row], one[0]), f"sequence {b}, token {t}"
            row += 1
    with pytest.raises(ValueError, match="decode_from must be"):
        paged_prefill_attention_native(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            0.125,
            torch.empty_like(batch.q),
            decode_from[:2],
        )


@pytest.mark.parametrize(
    "case", ["block past the pool", "chunk longer than its context", "offsets decrease", "offsets past the tokens"]
)
def test_bad_prefill_batches_are_refused_before_anything_is_read(case):
    batch = make_batch([20, 40], [20, 8], 4, 2, 64, 16, torch.float32, seed=10, device=CPU)
    tables, lens, starts = batch.block_tables.clone(), batch.seq_lens.clone(), batch.query_start_loc.clone()
    if case == "block past the pool":
        tables[1, 2] = batch.k_cache.shape[1]
    elif case == "chunk longer than its context":
        lens[0] = 19
    elif case == "offsets decrease":
        starts[1] = 29
    else:
        starts[2] = 29
    out = poisoned(batch.q.shape, torch.float32, CPU)
    with pytest.raises(ValueError, match="longer than its context|outside the pool|not increasing"):
        paged_prefill_attention_native(batch.q, batch.k_cache, batch.v_cache, tables, lens, starts, 0.125, out)
    assert torch.isnan(out).all()


def test_prefill_shapes_it_does_not_take_go_to_the_twin():
    odd = make_batch([10, 30], [10, 4], 4, 2, 72, 16, torch.float32, seed=12, device=CPU)  # head_dim 72: not 16k
    assert not paged_prefill_takes(odd.q, odd.k_cache, odd.block_tables, odd.seq_lens, odd.query_start_loc)
    got = paged_prefill_attention_cpu(
        odd.q, odd.k_cache, odd.v_cache, odd.block_tables, odd.seq_lens, odd.query_start_loc, 0.125
    )
    assert_close(got, reference_attention(odd, 0.125), torch.float32, "head_dim 72 through the twin")
    half = make_batch([10], [10], 4, 2, 64, 16, torch.float16, seed=13, device=CPU)
    assert not paged_prefill_takes(half.q, half.k_cache, half.block_tables, half.seq_lens, half.query_start_loc)


# ---- rotary and KV append: the twins' bits --------------------------------------------------------------


def _cos_sin(max_positions: int, head_dim: int = 64) -> torch.Tensor:
    from infer.kernels.rotary import build_cos_sin_cache

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return build_cos_sin_cache(inv_freq, 1.0, max_positions)


def _qkv(tokens: int, dtype: torch.dtype, heads=(6, 2), head_dim=64, seed=0):
    """q, k, v as views into one [T, (H + 2 Hkv) D] projection output, as a layer makes them."""
    generator = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    qkv = (torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator) * 3).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return (
        q.view(tokens, num_heads, head_dim),
        k.view(tokens, num_kv_heads, head_dim),
        v.view(tokens, num_kv_heads, head_dim),
    )


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rotary_gives_the_twins_bits(dtype, is_neox):
    from infer.kernels.rotary import rotary_embedding_cpu, rotary_embedding_torch

    cos_sin = _cos_sin(4096)
    positions = torch.tensor([0, 5, 17, 4095, 300, 1], dtype=torch.int64)
    native, twin = _qkv(6, dtype)[0], _qkv(6, dtype)[0]
    rotary_embedding_cpu(positions, native, None, cos_sin, is_neox)
    rotary_embedding_torch(positions, twin, None, cos_sin, is_neox)
    assert torch.equal(native, twin)


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize("rotate", [True, False], ids=["rotated", "plain"])
@pytest.mark.parametrize("pad_slot", [None, 5], ids=["skip-padding", "pad-slot"])
def test_append_gives_the_twins_bits(dtype, rotate, pad_slot):
    from infer.kernels.kv_append import append_kv_cpu, append_kv_torch

    _, k, v = _qkv(7, dtype, seed=1)
    cos_sin = _cos_sin(2048) if rotate else None
    positions = torch.tensor([3, 9, 0, 2047, 64, 65, 7], dtype=torch.int64)
    slots = torch.tensor([40, -1, 3, 127, 16, -1, 0], dtype=torch.int64)
    pools = [torch.zeros(2, 8, 16, 64, dtype=dtype) for _ in range(4)]
    append_kv_cpu(k, v, pools[0], pools[1], slots, positions, cos_sin, True, pad_slot)
    append_kv_torch(k, v, pools[2], pools[3], slots, positions, cos_sin, True, pad_slot)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


@pytest.mark.parametrize("case", ["slot past the pool", "slot below -1", "position past the cache"])
def test_bad_slots_and_positions_are_refused_with_nothing_written(case):
    from infer.kernels.cpu_kernels import append_kv_native, rotary_native

    q, k, v = _qkv(3, torch.float32, seed=2)
    cos_sin = _cos_sin(100)
    positions = torch.tensor([1, 2, 3], dtype=torch.int64)
    slots = torch.tensor([0, 1, 2], dtype=torch.int64)
    if case == "slot past the pool":
        slots[2] = 2 * 8 * 16
    elif case == "slot below -1":
        slots[0] = -2
    else:
        positions[1] = 100
    k_pool, v_pool = torch.zeros(2, 8, 16, 64), torch.zeros(2, 8, 16, 64)
    with pytest.raises(ValueError, match="outside"):
        append_kv_native(k, v, k_pool, v_pool, slots, positions, cos_sin, True, None)
    assert not k_pool.any() and not v_pool.any()
    if case == "position past the cache":
        before = q.clone()
        with pytest.raises(ValueError, match="outside the cos/sin cache"):
            rotary_native(positions, q, cos_sin, True)
        assert torch.equal(q, before)


def _stand_in_compiler(folder, real) -> str:
    """A compiler that answers --version, counts its builds in folder/builds (one line each, its -march), holds each
    for a moment and copies `real` (this level's library, which the real compiler built) to its -o target."""
    import textwrap

    compiler = folder / "cc"
    compiler.write_text(
        textwrap.dedent(f"""\
            #!/bin/sh
            [ "$1" = --version ] && {{ echo stand-in 1.0; exit 0; }}
            for arg; do case "$arg" in -march=*) echo "$arg" >> {folder}/builds;; esac; done
            while [ "$1" != -o ]; do shift; done
            sleep 1
            cp {real} "$2"
            """)
    )
    compiler.chmod(0o755)
    return str(compiler)


def test_the_library_is_built_again_over_a_damaged_cache_file_and_not_at_all_without_a_compiler(
    tmp_path, isa, monkeypatch
):
    """The rebuild is the stand-in compiler's (a copy of the real build): a real one costs 25-70 s on a loaded 2-core
    machine, and every first load in a fresh cache (a fresh clone's run) builds each level with the real one."""
    assert cpu_kernels.library(isa) is not None
    real = cpu_kernels._library_path(cpu_kernels._compiler(), isa)  # $CC where set (the GPU image sets it)
    monkeypatch.setenv("CC", _stand_in_compiler(tmp_path, real))
    monkeypatch.setenv("INFER_COMPILE_CACHE", str(tmp_path / "cache"))
    path = cpu_kernels._library_path(cpu_kernels._compiler(), isa)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    assert cpu_kernels._load(isa) is not None and path.stat().st_size > 1000
    assert (tmp_path / "builds").read_text().splitlines() == [cpu_kernels._march(isa)]  # built again, once
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    assert cpu_kernels._load(isa) is None


def test_processes_starting_at_once_build_the_library_once_and_all_load_it(tmp_path, isa):
    """The test processes and the daemons they start all look for the library at once: one builds, the others
    wait for it (a stand-in compiler counts its builds, holds each for a moment, and copies the real library)."""
    import os
    import subprocess
    import sys

    built = cpu_kernels.library(isa)
    assert built is not None
    real = cpu_kernels._library_path(cpu_kernels._compiler(), isa)
    env = {**os.environ, "CC": _stand_in_compiler(tmp_path, real), "INFER_COMPILE_CACHE": str(tmp_path / "cache")}
    script = f"from infer.kernels import cpu_kernels; print(cpu_kernels.library({isa!r}) is not None)"
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outputs == ["True"] * 3
    assert (tmp_path / "builds").read_text().splitlines() == [cpu_kernels._march(isa)]


# ---- the greedy step's row max -----------------------------------------------------------------------------


def test_row_max_is_torch_max_over_the_last_dim_ties_nans_and_infinities_included():
    from infer.kernels.cpu_kernels import row_max, row_max_takes

    generator = torch.Generator().manual_seed(21)
    wide = torch.randn(12, 49152 + 40, generator=generator)
    x = wide[:, 3:49155]  # rows of a wider buffer: row stride != V
    x[0, 100], x[0, 50] = float("nan"), float("nan")  # a NaN wins, the first one
    x[1] = float("-inf")  # nothing above -inf: index 0
    x[2, 7] = x[2, 9000] = x[2].max() + 1  # a tie: the first index
    x[3, -1] = float("inf")  # the last element
    x[4] = 1.0  # all equal
    x[5, 63], x[5, 64] = 50.0, 50.0  # a tie across the 64-element blocks
    assert row_max_takes(x)
    top, index = row_max(x)
    want_top, want_index = x.max(dim=-1)
    assert torch.equal(index, want_index)
    assert torch.equal(top.nan_to_num(), want_top.nan_to_num()) and top[0].isnan()
    for odd in (torch.randn(3, 5, generator=generator), torch.randn(2, 1, generator=generator)):
        assert torch.equal(row_max(odd)[1], odd.max(dim=-1).indices)
    assert not row_max_takes(x.to(torch.bfloat16)) and not row_max_takes(x.t())
