"""Paged decode and prefill/mixed attention: Triton and twin against a float64 reference, and each other."""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_checks import DEVICE, KERNEL_DTYPES, assert_close, poisoned, requires_triton
from paged_cases import make_batch, random_pool, random_tables, reference_attention

from infer.kernels.paged_attention import (
    decode_split_tokens,
    paged_decode_attention_compiled,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
    plan_decode,
)

# (query heads, KV heads): MHA, GQA 4:1, an odd group of 5
HEAD_RATIOS = [(4, 4), (8, 2), (5, 1)]

DECODE_IMPLS = {
    "twin": paged_decode_attention_torch,
    "triton": pytest.param(paged_decode_attention_triton, marks=requires_triton),
}
PREFILL_IMPLS = {
    "twin": paged_prefill_attention_torch,
    "triton": pytest.param(paged_prefill_attention_triton, marks=requires_triton),
}


def _seed(*parts: object) -> int:
    """A per-case seed that is the same in every process (str hashes are salted per process)."""
    return zlib.crc32(repr(parts).encode())


@pytest.mark.parametrize("impl", list(DECODE_IMPLS.values()), ids=list(DECODE_IMPLS))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEAD_RATIOS, ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_reference(impl, dtype, heads, head_dim):
    num_heads, num_kv_heads = heads
    generator = torch.Generator().manual_seed(_seed("decode", dtype, heads, head_dim))
    # mixed lengths: a 1-token context, block-aligned and ragged ones, one spanning many blocks
    seq_lens = [1, 16, 37, 130] + torch.randint(2, 100, (2,), generator=generator).tolist()
    batch = make_batch(
        seq_lens,
        [1] * len(seq_lens),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size=16,
        dtype=dtype,
        seed=_seed("decode-batch", dtype, heads, head_dim),
    )
    scale = head_dim**-0.5
    out = impl(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        scale,
        out=poisoned(batch.q.shape, dtype),
    )
    assert_close(out, reference_attention(batch, scale), dtype, "decode vs float64")


def test_decode_plan_tiles_cover_each_sequence_once_and_is_reusable(monkeypatch):
    """The twin's plan (made once per step by the engine, reused by every layer): small tiles force
    several tiles, lengths spread beyond _TILE_SPREAD split tiles, every row lands in exactly one tile, and
    the planned call gives the unplanned answer. A plan for another batch or pool is refused."""
    import infer.kernels.paged_attention as module

    monkeypatch.setattr(module, "_TILE_BYTES", 4 * 2 * 2 * 64 * 4 * 16)  # about four 16-token sequences
    seq_lens = [130, 1, 16, 37, 33, 35, 129, 16, 16, 2]
    batch = make_batch(seq_lens, [1] * len(seq_lens), 8, 2, 64, block_size=16, dtype=torch.float32, seed=_seed("plan"))
    plan = plan_decode(batch.block_tables, batch.seq_lens, batch.k_cache)
    rows = [range(len(seq_lens))[t.rows] if isinstance(t.rows, slice) else t.rows.tolist() for t in plan.tiles]
    covered = sorted(r for tile_rows in rows for r in tile_rows)
    assert covered == list(range(len(seq_lens))) and len(plan.tiles) >= 4
    for tile in plan.tiles:
        lens = batch.seq_lens[tile.rows]
        assert int(lens.max()) <= tile.padded_len < int(lens.max()) + 16
        assert int(lens.max()) <= module._TILE_SPREAD * max(int(lens.min()), 1)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    planned = paged_decode_attention_torch(*args, out=poisoned(batch.q.shape, torch.float32), plan=plan)
    assert_close(planned, reference_attention(batch, 0.125), torch.float32, "planned decode vs float64")
    assert torch.equal(planned, paged_decode_attention_torch(*args))
    with pytest.raises(ValueError, match="decode plan is for 10 sequences"):
        paged_decode_attention_torch(
            batch.q[:3], *args[1:3], batch.block_tables[:3], batch.seq_lens[:3], 0.125, plan=plan
        )


@requires_triton
@pytest.mark.parametrize("num_splits", [1, 2, 8])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_decode_splits_merge_to_the_twin(num_splits, dtype):
    """Flash-decoding: any split count gives the twin's answer, including splits that get no tokens
    (8 splits of a 5-token context)."""
    seq_lens = [5, 200, 64, 129]
    batch = make_batch(seq_lens, [1] * 4, 8, 2, 64, block_size=16, dtype=dtype, seed=_seed("splits", num_splits, dtype))
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    triton_out = paged_decode_attention_triton(*args, out=poisoned(batch.q.shape, dtype), num_splits=num_splits)
    twin_out = paged_decode_attention_torch(*args, out=poisoned(batch.q.shape, dtype))
    assert_close(triton_out, twin_out, dtype, f"{num_splits} splits vs twin")
    assert_close(triton_out, reference_attention(batch, 0.125), dtype, f"{num_splits} splits vs float64")


@requires_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_fixed_split_tokens_give_the_same_bits_in_any_batch(dtype):
    """With split_tokens (what engines pass), a sequence's output does not depend on the rows batched with
    it or on the table width: alone, in a batch, and in a wider table padded as a step graph pads it, the
    bits are equal. Lengths straddle split boundaries (255, 256, 257, 600 at 256 tokens a split)."""
    seq_lens = [600, 5, 257, 256, 255, 64]
    batch = make_batch(
        seq_lens, [1] * len(seq_lens), 8, 2, 64, block_size=16, dtype=dtype, seed=_seed("fixed-splits", dtype)
    )
    split_tokens = decode_split_tokens(700)
    assert split_tokens == 256

    def run(rows: list[int], extra_columns: int) -> torch.Tensor:
        tables = batch.block_tables[rows]
        tables = torch.cat((tables, tables.new_zeros(len(rows), extra_columns)), dim=1)
        return paged_decode_attention_triton(
            batch.q[rows],
            batch.k_cache,
            batch.v_cache,
            tables,
            batch.seq_lens[rows],
            0.125,
            out=poisoned((len(rows), 8, 64), dtype),
            split_tokens=split_tokens,
        )

    whole = run(list(range(len(seq_lens))), 0)
    assert_close(whole, reference_attention(batch, 0.125), dtype, "fixed splits vs float64")
    for row in range(len(seq_lens)):
        for extra in (0, 7, 40):  # 40 more blocks: 2.5x more splits in the grid, all empty for this row
            assert torch.equal(run([row], extra)[0], whole[row]), (row, extra)
    assert torch.equal(run([2, 0, 2], 13)[1], whole[0])
    with pytest.raises(ValueError, match="split_tokens must be a positive multiple of 64"):
        paged_decode_attention_triton(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125, split_tokens=100
        )
    with pytest.raises(ValueError, match="not both"):
        paged_decode_attention_triton(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            0.125,
            num_splits=2,
            split_tokens=256,
        )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_compiled_formulation_matches_reference(compiled):
    """The step graphs' decode attention on CPU, run as written and through torch.compile (what the engine
    runs): float64 reference on rows of mixed lengths over a table padded past every length, GQA 8:2 and an
    odd group 5:1."""
    attend = paged_decode_attention_compiled
    if compiled:
        attend = torch.compile(paged_decode_attention_compiled, dynamic=False, fullgraph=True)
    for num_heads, num_kv_heads in ((8, 2), (5, 1)):
        seq_lens = [1, 16, 37, 130, 64]
        batch = make_batch(
            seq_lens,
            [1] * len(seq_lens),
            num_heads,
            num_kv_heads,
            64,
            block_size=16,
            dtype=torch.float32,
            seed=_seed("compiled-formulation", num_heads),
        )
        q, k_cache, v_cache = batch.q.cpu(), batch.k_cache.cpu(), batch.v_cache.cpu()
        tables = torch.cat((batch.block_tables, batch.block_tables[:, :1].expand(-1, 3)), dim=1).cpu()
        out = attend(q, k_cache, v_cache, tables, batch.seq_lens.cpu(), 0.125)
        assert_close(out, reference_attention(batch, 0.125), torch.float32, f"{num_heads}:{num_kv_heads}")


def test_decode_split_tokens_per_engine():
    """At least 256 tokens a split, at most 64 splits of the longest context, a power of two."""
    assert [decode_split_tokens(n) for n in (1, 2048, 16384, 16385, 32768, 131072)] == [256, 256, 256, 512, 512, 2048]
    with pytest.raises(ValueError, match="max_context must be >= 1"):
        decode_split_tokens(0)


@pytest.mark.parametrize("impl", list(PREFILL_IMPLS.values()), ids=list(PREFILL_IMPLS))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEAD_RATIOS, ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_matches_reference(impl, dtype, heads, head_dim):
    """Decodes, a whole-prompt prefill, chunks continuing a cached prefix (chunked prefill, prefix-cache
    hits) and a chunk longer than one query tile, in one batch."""
    num_heads, num_kv_heads = heads
    seq_lens = [40, 1, 23, 50, 77, 9]
    query_lens = [1, 1, 23, 17, 70, 9]
    batch = make_batch(
        seq_lens,
        query_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size=8,
        dtype=dtype,
        seed=_seed("mixed", dtype, heads, head_dim),
    )
    scale = head_dim**-0.5
    out = impl(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        out=poisoned(batch.q.shape, dtype),
        max_query_len=max(query_lens),
    )
    assert_close(out, reference_attention(batch, scale), dtype, "mixed vs float64")


@requires_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_prefill_triton_matches_twin_and_leaves_padding_rows(dtype):
    """The two implementations agree, and rows past query_start_loc[B] (padding tokens) are not touched."""
    batch = make_batch([33, 12, 1], [33, 5, 1], 6, 2, 64, block_size=16, dtype=dtype, seed=_seed("pad", dtype))
    q = torch.cat([batch.q, torch.randn(3, 6, 64).to(dtype).to(DEVICE)])  # three padding rows
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.125)
    triton_out = paged_prefill_attention_triton(*args, out=poisoned(q.shape, dtype), max_query_len=33)
    twin_out = paged_prefill_attention_torch(*args, out=poisoned(q.shape, dtype))
    assert torch.isnan(triton_out[-3:]).all() and torch.isnan(twin_out[-3:]).all()
    assert_close(triton_out[:-3], twin_out[:-3], dtype, "prefill triton vs twin")


@pytest.mark.parametrize("impl", list(DECODE_IMPLS.values()), ids=list(DECODE_IMPLS))
def test_decode_block_ids_beyond_32_bit_offsets(impl):
    """A block whose element offset (block * block_size * head_dim) exceeds 2**31: offsets must be int64.

    The pool is 4 GiB of fp16 address space per cache, allocated but never touched except for the blocks the
    table names (the operating system maps untouched pages lazily)."""
    block_size, head_dim, dtype = 16, 64, torch.float16
    num_blocks = (2**31) // (block_size * head_dim) + 4
    k_cache = torch.empty(1, num_blocks, block_size, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    generator = torch.Generator().manual_seed(7)
    tables = torch.tensor(
        [[num_blocks - 1, 3, num_blocks - 3], [num_blocks - 2, 0, 0]], dtype=torch.int32, device=DEVICE
    )
    for block in (num_blocks - 1, 3, num_blocks - 3, num_blocks - 2):
        k_cache[0, block] = torch.randn(block_size, head_dim, generator=generator).to(dtype)
        v_cache[0, block] = torch.randn(block_size, head_dim, generator=generator).to(dtype)
    seq_lens = torch.tensor([40, 16], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 2, head_dim, generator=generator).to(dtype).to(DEVICE)
    out = impl(q, k_cache, v_cache, tables, seq_lens, 0.125, out=poisoned(q.shape, dtype))
    expected = torch.empty(2, 2, head_dim, dtype=torch.float64)
    for i, (table, length) in enumerate(zip(tables.tolist(), seq_lens.tolist())):
        positions = torch.arange(length)
        blocks = torch.tensor(table)[positions // block_size]
        keys = k_cache[0, blocks, positions % block_size].double()
        values = v_cache[0, blocks, positions % block_size].double()
        expected[i] = (q[i].double() @ keys.T * 0.125).softmax(-1) @ values
    assert_close(out, expected, dtype, "decode at a block id past 2**31 elements")


@pytest.mark.parametrize("impl", list(DECODE_IMPLS.values()), ids=list(DECODE_IMPLS))
def test_decode_reads_only_the_named_blocks(impl):
    """Blocks the tables do not name are NaN in the V pool... for the Triton kernel; the twin reads whole
    blocks and relies on the pool holding finite values (KVCache zero-fills), so it gets huge finite junk
    instead: either way a read of a foreign block changes the answer."""
    dtype = torch.float32
    generator = torch.Generator().manual_seed(11)
    seq_lens = [3, 21]
    k_cache, v_cache = random_pool(2, 12, 8, 64, dtype, generator)
    tables = random_tables(seq_lens, 12, 8, generator)
    named = set(tables[0, :1].tolist()) | set(tables[1, :3].tolist())
    junk = float("nan") if impl is not paged_decode_attention_torch else 1e4
    for block in range(12):
        if block not in named:
            v_cache[:, block] = junk
            k_cache[:, block] = junk
    # positions past each sequence's length inside its own last block: finite junk (read but masked)
    v_cache[:, tables[0, 0], 3:] = 1e4
    v_cache[:, tables[1, 2], 5:] = 1e4
    q = torch.randn(2, 4, 64, generator=generator).to(DEVICE)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = impl(q, k_cache, v_cache, tables, seq_lens_t, 0.125, out=poisoned(q.shape, dtype))
    assert out.abs().max() < 10, "a masked position or a foreign block leaked into the output"
