"""Paged attention over the head-major KV pool [Hkv, num_blocks, block_size, D] (see kv_append.py).

Two operations, each a Triton kernel plus a PyTorch twin of the same signature:

- `paged_decode_attention`: one query token per sequence over its block table. The Triton kernel is
  grouped-query aware (one program loads each K/V tile once for all H / Hkv query heads sharing it) and
  split along the sequence (flash-decoding): NUM_SPLITS programs per (sequence, KV head) each reduce a
  slice of the context to a partial output and its log-sum-exp, which a second kernel merges. One long
  sequence therefore still fills the device.
- `paged_prefill_attention`: variable-length query chunks, sequence i's queries being its last
  q_len_i = query_start_loc[i + 1] - query_start_loc[i] positions, attending causally to their cached
  prefix and themselves (all read from the pool, so K/V must be appended first). A query length of 1 is a
  decode, so this one kernel serves mixed prefill + decode batches.

Every operation takes `window`: 0 for full causal attention, W > 0 for a sliding window, where the query at
position p attends to keys in (p - W, p] only (transformers' `sliding_window`, Mistral's and Gemma's layers);
and `softcap`: 0 for none, c > 0 for Gemma 2's attention logit soft-capping, each score s (already scaled)
becoming c * tanh(s / c) before the mask and the softmax (the native CPU kernels and Triton compute it too).

And `sinks`: None, or attention sinks (GPT-OSS), one learned logit per query head [H] float32 that joins each
softmax's denominator and attends to nothing: p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink_h)). The twins and the
native CPU kernels compute sinks, Triton does not: the dispatchers send a call with sinks on CUDA to the twins.

Sequence i's token j lives at slot block_tables[i, j // block_size] * block_size + j % block_size.
Scores and the softmax run in float32 (fp32 inputs use IEEE fp32 dot products, not TF32); outputs are in
q's dtype.

Pool invariant the twins rely on: every element of the pool is finite. The twins read whole blocks and
mask the positions past a sequence's length, and a masked NaN still poisons the product with V
(0 * NaN = NaN); KVCache.allocate zero-fills the pool for that reason. The Triton kernels never read
past a sequence's length.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from infer.kernels._triton import tl, triton
from infer.kernels.cpu_kernels import (
    paged_decode_attention_native,
    paged_decode_takes,
    paged_prefill_attention_native,
    paged_prefill_takes,
)

# The decode twin works in tiles of sequences whose gathered K + V take about this many bytes: big enough
# that the per-tile Python overhead is small next to the tile's work, small enough to stay in the CPU's
# cache between the gather and the attention (measured on the 2-core dev VM: 2-3x faster at batch 64,
# context 1024-2048, than one gather of the whole batch).
_TILE_BYTES = 2 << 20
# A tile's sequences are padded to the tile's longest; a tile holds lengths within this factor.
_TILE_SPREAD = 1.25


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(
            f"caches must both be [Hkv, num_blocks, block_size, D], got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [*, H, {head_dim}] with H a multiple of {num_kv_heads}, got {tuple(q.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(
            f"block_tables [{num_seqs}, max_blocks] and seq_lens [{num_seqs}] expected, got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )


# ---------------------------------------------------------------------------------------------------------
# Twins


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [Hkv, NB, bs, D], tables [n, nblk] -> [Hkv, n, nblk * bs, D], one row copy per (head, block)."""
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    index = _pool_rows(tables, num_kv_heads, num_blocks)
    return _gather_rows(cache, index).view(num_kv_heads, tables.shape[0], tables.shape[1] * block_size, head_dim)


def _pool_rows(tables: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """The rows of the pool viewed as [Hkv * NB, bs * D] that hold `tables`' blocks, head-major:
    [Hkv * n * nblk] int64. One flat index makes the gather a single dim-0 index_select, the fast
    contiguous-row copy (about 2x faster on CPUs than index_select along dim 1 of [Hkv, NB, bs * D])."""
    heads = torch.arange(num_kv_heads, dtype=torch.int64, device=tables.device) * num_blocks
    return (heads[:, None] + tables.reshape(1, -1).to(torch.int64)).reshape(-1)


def _gather_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if not cache.is_contiguous():
        raise ValueError("the PyTorch twins need a contiguous KV pool")
    return cache.view(-1, cache.shape[2] * cache.shape[3]).index_select(0, index)


@dataclass(frozen=True)
class DecodeTile:
    """Sequences of similar length attended together: their rows of the batch, the pool rows holding their
    blocks, and the mask of positions past each sequence's length (None when all fill the tile)."""

    rows: slice | torch.Tensor
    num_rows: int
    padded_len: int  # tile length in tokens: whole blocks, to the tile's longest sequence
    pool_rows: torch.Tensor  # [Hkv * num_rows * padded_len / bs] int64, see _pool_rows
    mask: torch.Tensor | None  # [1, num_rows, 1, padded_len] bool: positions seen (past the length, or before
    # the window, hidden)


@dataclass(frozen=True)
class DecodePlan:
    """How the decode twin cuts a batch into tiles. It depends only on the block tables, the sequence
    lengths and the pool's shape, so the engine makes it once per step and every layer reuses it."""

    num_seqs: int
    pool_shape: tuple[int, ...]
    tiles: tuple[DecodeTile, ...]
    window: int = 0


def plan_decode(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_cache: torch.Tensor,
    host_lens: Sequence[int] | None = None,
    window: int = 0,
) -> DecodePlan:
    """The twin's plan for these sequences over a pool shaped like `k_cache`, attending with `window` (0:
    full). `host_lens`, a host copy of `seq_lens`, saves reading them back from the device. Sequences sorted by
    length are cut into tiles whose lengths lie within _TILE_SPREAD and whose gathered K + V take about _TILE_BYTES."""
    num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    lens = list(host_lens) if host_lens is not None else seq_lens.tolist()
    if len(lens) != seq_lens.shape[0]:
        raise ValueError(f"host_lens has {len(lens)} lengths for {seq_lens.shape[0]} sequences")
    bytes_per_token = 2 * num_kv_heads * head_dim * k_cache.element_size()
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    for row in order:
        padded = -(-max(lens[row], 1) // block_size) * block_size
        group = groups[-1] if groups else None
        if (
            group is None
            or lens[row] > _TILE_SPREAD * max(lens[group[0]], 1)
            or (len(group) + 1) * padded * bytes_per_token > _TILE_BYTES
        ):
            groups.append([row])
        else:
            group.append(row)
    tiles = []
    for rows in groups:
        index = _as_index(rows, block_tables.device)
        max_len = max(lens[rows[-1]], 1)
        table_width = -(-max_len // block_size)
        mask = None
        if window or any(lens[r] != table_width * block_size for r in rows):
            positions = torch.arange(table_width * block_size, device=seq_lens.device)
            tile_lens = seq_lens[index][:, None]
            seen = positions[None, :] < tile_lens
            if window:
                seen &= positions[None, :] >= tile_lens - window
            mask = seen[None, :, None, :]
        pool_rows = _pool_rows(block_tables[index, :table_width], num_kv_heads, num_blocks)
        tiles.append(DecodeTile(index, len(rows), table_width * block_size, pool_rows, mask))
    return DecodePlan(len(lens), tuple(k_cache.shape), tuple(tiles), window)


def paged_decode_attention_compiled(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention written for the compiler (CPU step graphs): q [B, H, D] over every row's whole table
    width, positions past each length (and before its window) masked; returns [B, H, D] in q's dtype, float32 inside.

    Scores and outputs are broadcast products reduced over the head dim and over the context, taken from the
    pool through the block tables. Under torch.compile, inductor folds each indexing into the loop of its
    reduction, so K and V are read where they sit in the pool and never copied (the twin copies every block
    it reads, then calls SDPA); run eagerly, this materialises those copies and is slower than the twin.
    Every table entry must name a readable block and every length be >= 1 (step graphs pad their rows so)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    tables = block_tables.to(torch.int64)
    context = tables.shape[1] * block_size
    keys = k_cache[:, tables].view(num_kv_heads, num_seqs, 1, context, head_dim)
    values = v_cache[:, tables].view(num_kv_heads, num_seqs, context, 1, head_dim)
    queries = q.view(num_seqs, num_kv_heads, group, 1, head_dim).transpose(0, 1)  # [Hkv, B, G, 1, D]
    scores = (queries.float() * keys.float()).sum(-1) * scale  # [Hkv, B, G, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(context, device=q.device)[None, :]
    hidden = key_pos >= seq_lens[:, None]  # [B, L]
    if window:
        hidden |= key_pos < seq_lens[:, None] - window
    scores = scores.masked_fill(hidden[None, :, None, :], float("-inf"))
    probs = _softmax_with_sinks(scores, _grouped_sinks(sinks, num_kv_heads))
    out = (probs.transpose(2, 3).unsqueeze(-1) * values.float()).sum(2)  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _as_index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice when rows are consecutive (no copies), else an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64, device=device)


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    plan: DecodePlan | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D]; caches [Hkv, NB, bs, D]; block_tables [B, max_blocks] int32; seq_lens [B] int32 (>= 1).
    Returns out [B, H, D] (written in place when given). `num_splits` only steers the Triton kernel;
    `plan` (from `plan_decode` on the same tables, lengths, pool shape and window) saves re-planning per layer.
    `window` > 0: each sequence attends to its last `window` positions (0: all). `sinks`: see the module docstring.

    Grouped-query attention without repeating K/V: SDPA sees the KV heads as its batch and the sequences as
    its heads, q [Hkv, n, H / Hkv, D] against K, V [Hkv, n, L, D], which is exactly the gathered layout.
    """
    num_seqs, num_heads, head_dim = q.shape
    _check(q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    if plan is None:
        plan = plan_decode(block_tables, seq_lens, k_cache, window=window)
    elif plan.num_seqs != num_seqs or plan.pool_shape != tuple(k_cache.shape) or plan.window != window:
        raise ValueError(
            f"the decode plan is for {plan.num_seqs} sequences over a pool {plan.pool_shape} with window "
            f"{plan.window}, not {num_seqs} over {tuple(k_cache.shape)} with window {window}"
        )
    num_kv_heads = k_cache.shape[0]
    grouped = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    tile_sinks = _grouped_sinks(sinks, num_kv_heads)
    for tile in plan.tiles:
        shape = (num_kv_heads, tile.num_rows, tile.padded_len, head_dim)
        keys = _gather_rows(k_cache, tile.pool_rows).view(shape)
        values = _gather_rows(v_cache, tile.pool_rows).view(shape)
        tile_out = _attend(grouped[:, tile.rows], keys, values, tile.mask, scale, softcap, tile_sinks)
        out[tile.rows] = tile_out.transpose(0, 1).reshape(tile.num_rows, num_heads, head_dim)
    return out


def paged_prefill_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D]; caches [Hkv, NB, bs, D]; block_tables [B, max_blocks]; seq_lens [B] (context after this
    step); query_start_loc [B + 1] int32 (offsets into T). Returns out [T, H, D]; rows of T past
    query_start_loc[B] are left as they are. `max_query_len` only steers the Triton kernel's grid. `window` > 0:
    the query at position p attends to keys in (p - window, p] (0: [0, p]).

    The query-length-1 sequences go, all together, to the decode twin; each longer chunk is one SDPA call.
    """
    num_seqs = block_tables.shape[0]
    _check(q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    out = torch.empty_like(q) if out is None else out
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decodes = [i for i in range(num_seqs) if starts[i + 1] - starts[i] == 1]
    if decodes:
        seqs, tokens = _as_index(decodes, q.device), _as_index([starts[i] for i in decodes], q.device)
        out[tokens] = paged_decode_attention_torch(
            q[tokens],
            k_cache,
            v_cache,
            block_tables[seqs],
            seq_lens[seqs],
            scale,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
    for i in range(num_seqs):
        start, end = starts[i], starts[i + 1]
        if end - start > 1:
            out[start:end] = _chunk_attention(
                q[start:end], k_cache, v_cache, block_tables[i], lens[i], scale, window, softcap, sinks
            )
    return out


def _chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One chunk: q [n, H, D], the last n of `context_len` positions -> [n, H, D], causal (within `window`)."""
    n = q.shape[0]
    if n > context_len:
        raise ValueError(f"a chunk of {n} queries cannot end a context of {context_len} tokens")
    num_blocks = -(-context_len // k_cache.shape[2])
    tables = block_table[None, :num_blocks]
    keys = _gather(k_cache, tables).transpose(0, 1)[:, :, :context_len]  # [1, Hkv, ctx, D]
    values = _gather(v_cache, tables).transpose(0, 1)[:, :, :context_len]
    queries = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if n == context_len and not window and not softcap and sinks is None:
        mask, causal = None, True
    else:  # causal, aligned to the bottom right: query j sits at position context_len - n + j
        key_pos = torch.arange(context_len, device=q.device)
        query_pos = torch.arange(context_len - n, context_len, device=q.device)
        mask, causal = key_pos[None, :] <= query_pos[:, None], False
        if window:
            mask &= key_pos[None, :] > query_pos[:, None] - window
    if causal:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = _attend(queries, keys, values, mask, scale, softcap, None if sinks is None else sinks.view(1, -1, 1, 1))
    return out[0].transpose(0, 1)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale, soft-capped, masked, with sinks) v: q [..., H, n, D], k and v [..., Hkv, L, D] with H a
    multiple of Hkv, mask (True: seen) broadcast to [..., H, n, L], sinks (float32) to [..., H, n, 1]. SDPA without a
    softcap or sinks; written out in float32 with either."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(_softmax_with_sinks(scores, sinks), v.float()).to(q.dtype)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of float32 scores [..., L], each row's denominator also holding exp(sink) (sinks
    broadcast to [..., 1]); a plain softmax without sinks. Max-subtracted with the sink included, as transformers'."""
    if sinks is None:
        return scores.softmax(-1)
    combined = torch.cat((scores, sinks.float().expand(*scores.shape[:-1], 1)), dim=-1)
    return combined.softmax(-1)[..., :-1]


def _grouped_sinks(sinks: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor | None:
    """sinks [H] -> [Hkv, 1, H / Hkv, 1], to broadcast over scores grouped as [Hkv, B, H / Hkv, L]."""
    if sinks is None:
        return None
    if sinks.dim() != 1 or sinks.shape[0] % num_kv_heads:
        raise ValueError(f"sinks must be [H] with H a multiple of {num_kv_heads}, got {tuple(sinks.shape)}")
    return sinks.float().view(num_kv_heads, 1, -1, 1)


# ---------------------------------------------------------------------------------------------------------
# Triton: decode (flash-decoding) and its merge


@triton.jit
def _load_kv_tile(
    k_ptr,
    v_ptr,
    tables_ptr,
    table_base,
    head_base,
    stride_kb,
    stride_ks,
    n0,
    end,
    d,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Context tokens n0 .. n0 + BLOCK_N - 1 (those < end) of one sequence and KV head, through its block
    table: (positions [BLOCK_N], valid [BLOCK_N], K [BLOCK_N, DIM_PAD], V [BLOCK_N, DIM_PAD])."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    block = tl.load(tables_ptr + table_base + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = head_base + block * stride_kb + (pos % BLOCK_SIZE).to(tl.int64) * stride_ks
    tile_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + slot[:, None] + d[None, :], mask=tile_mask, other=0.0)
    v = tl.load(v_ptr + slot[:, None] + d[None, :], mask=tile_mask, other=0.0)
    return pos, valid, k, v


@triton.jit
def _soft_cap(s, softcap):
    """softcap * tanh(s / softcap) where softcap > 0 (tanh as 2 sigmoid(2x) - 1), else s."""
    cap = tl.where(softcap > 0, softcap, 1.0)
    return tl.where(softcap > 0, cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0), s)


@triton.jit
def _online_softmax_step(s, v, m, l_sum, acc):
    """Fold one tile of masked scores s [R, N] (-inf where hidden) and its V [N, DIM_PAD] into the running
    max m [R], normaliser l_sum [R] and unnormalised output acc [R, DIM_PAD]. A row that has seen nothing yet
    (its window starts past this tile) keeps m -inf and adds zeros."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_sum, acc


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qb,
    stride_qh,
    stride_kh,
    stride_kb,
    stride_ks,  # K and V share strides; D is contiguous
    stride_tb,
    stride_ob,
    stride_oh,
    scale,
    split_tokens,
    window,
    softcap,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    # grid: (B, Hkv, NUM_SPLITS). Rows = the GROUP query heads of one KV head (padded to GROUP_PAD >= 16
    # for tl.dot); columns = BLOCK_N context tokens per step, which may span several pool blocks.
    # Split s reduces context tokens [s * per_split, (s + 1) * per_split): `split_tokens` when it is > 0
    # (fixed boundaries: the result does not depend on the batch or the grid), else the length / NUM_SPLITS.
    # With window > 0 only positions >= seq_len - window are seen: tiles before the one holding it are skipped.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    if split_tokens > 0:
        per_split = split_tokens
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    head_base = kv_head * stride_kh
    low = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # one type on every path (no branch)
    for n0 in range(tl.maximum(start, low // BLOCK_N * BLOCK_N), end, BLOCK_N):
        pos, valid, k, v = _load_kv_tile(
            k_ptr,
            v_ptr,
            tables_ptr,
            seq * stride_tb,
            head_base,
            stride_kb,
            stride_ks,
            n0,
            end,
            d,
            BLOCK_SIZE,
            HEAD_DIM,
            BLOCK_N,
        )
        s = _soft_cap(tl.dot(q, tl.trans(k), input_precision="ieee") * scale, softcap)  # [GROUP_PAD, BLOCK_N]
        s = tl.where((valid & (pos >= low))[None, :], s, float("-inf"))
        m, l_sum, acc = _online_softmax_step(s, v, m, l_sum, acc)

    nonempty = l_sum > 0
    result = acc / tl.where(nonempty, l_sum, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )
    else:
        # partials: part_out [B, H, NUM_SPLITS, DIM_PAD] float32, part_lse [B, H, NUM_SPLITS], contiguous
        num_heads = tl.num_programs(1) * GROUP
        part_row = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + part_row[:, None] * DIM_PAD + d[None, :], result, mask=row_mask)
        lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, l_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=g < GROUP)


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    # grid: (B, H). out = sum_s exp(lse_s - max) * out_s / sum_s exp(lse_s - max); empty splits weigh 0.
    # The sums run in split order, one split at a time: empty splits at the end add exact zeros, so the bits
    # do not depend on how many the grid has (a tree reduction's order would change with NUM_SPLITS).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    row = seq * tl.num_programs(1) + head
    d = tl.arange(0, DIM_PAD)
    lse_max = tl.max(tl.load(part_lse_ptr + row * NUM_SPLITS + tl.arange(0, NUM_SPLITS)), 0)
    acc = tl.zeros([DIM_PAD], tl.float32)
    weight_sum = 0.0
    for s in range(NUM_SPLITS):
        weight = tl.exp(tl.load(part_lse_ptr + row * NUM_SPLITS + s) - lse_max)
        acc += weight * tl.load(part_out_ptr + (row * NUM_SPLITS + s) * DIM_PAD + d)
        weight_sum += weight
    result = acc / weight_sum
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, result.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_num_splits(q: torch.Tensor, num_kv_heads: int, max_context: int) -> int:
    """Enough programs to fill the device about twice over, each reducing at least 256 tokens."""
    if not q.is_cuda:
        return 1
    programs = q.shape[0] * num_kv_heads
    wanted = -(-2 * _num_sms(q.device.index or 0) // max(programs, 1))
    return max(1, min(triton.next_power_of_2(wanted), triton.next_power_of_2(-(-max_context // 256)), 64))


DECODE_TILE = 64  # context tokens per inner step of the decode kernel (BLOCK_N)


def decode_split_tokens(max_context: int) -> int:
    """Context tokens per split of the decode kernel in an engine whose sequences reach `max_context`
    tokens: at least 256, and at most 64 splits (a power of two, a multiple of the kernel's tile).

    Fixed per engine, so that the bits of a sequence's attention depend on nothing but the sequence: not on
    the sequences batched with it, the block-table width or the padded rows of a step graph. A CUDA-graph
    step and the eager step of the same batch then give the same tokens."""
    if max_context < 1:
        raise ValueError(f"max_context must be >= 1, got {max_context}")
    return max(256, 1 << (-(-max_context // 64) - 1).bit_length())


def _pads(group: int, head_dim: int) -> tuple[int, int]:
    return max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(head_dim))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    plan: DecodePlan | None = None,
    split_tokens: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Same contract as `paged_decode_attention_torch`. `num_splits` (a power of two) defaults to enough
    programs to fill the device, bounded by the context the block tables can hold; `split_tokens` (from
    `decode_split_tokens`, a multiple of 64) instead fixes each split's span, and the splits then cover
    what the tables can hold. `plan` is the twin's and is ignored here."""
    num_seqs, num_heads, head_dim = q.shape
    _check(q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    if q.stride(2) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("paged_decode_attention_triton needs a contiguous head dim and K/V of equal strides")
    num_kv_heads, _, block_size, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    if split_tokens is not None:
        if num_splits is not None:
            raise ValueError("give num_splits or split_tokens, not both")
        if split_tokens < DECODE_TILE or split_tokens % DECODE_TILE:
            raise ValueError(f"split_tokens must be a positive multiple of {DECODE_TILE}, got {split_tokens}")
        spans = -(-block_tables.shape[1] * block_size // split_tokens)
        num_splits = 1 << (spans - 1).bit_length()  # a power of two for the merge; splits past a length are empty
    elif num_splits is None:
        num_splits = _default_num_splits(q, num_kv_heads, block_tables.shape[1] * block_size)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    group = num_heads // num_kv_heads
    group_pad, dim_pad = _pads(group, head_dim)
    if num_splits == 1:
        part_out = part_lse = out
    else:
        part_out = torch.empty(num_seqs, num_heads, num_splits, dim_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        split_tokens or 0,
        window,
        float(softcap),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=DECODE_TILE,
        NUM_SPLITS=num_splits,
    )
    if num_splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            NUM_SPLITS=num_splits,
        )
    return out


# ---------------------------------------------------------------------------------------------------------
# Triton: prefill / mixed batches


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    starts_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_tb,
    stride_ot,
    stride_oh,
    scale,
    window,
    softcap,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # grid: (query tiles of the longest chunk, B, Hkv). Rows = BLOCK_Q query tokens x GROUP_PAD heads of one
    # KV head (row r: token r // GROUP_PAD, head r % GROUP_PAD), so each K/V tile is loaded once for the
    # whole group; columns = BLOCK_N context tokens per step, up to the tile's causal limit.
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2).to(tl.int64)
    q_start = tl.load(starts_ptr + seq).to(tl.int32)
    q_len = tl.load(starts_ptr + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    prefix = seq_len - q_len

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    local = tile * BLOCK_Q + r // GROUP_PAD  # query index within the chunk
    g = r % GROUP_PAD
    d = tl.arange(0, DIM_PAD)
    row_valid = (local < q_len) & (g < GROUP)
    # Rows that hold no query take the tile's last position, so that no row sees only masked keys.
    end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_Q)  # the tile's last query sees keys < end
    query_pos = tl.where(row_valid, prefix + local, end - 1)
    token = (q_start + local).to(tl.int64)
    heads = kv_head * GROUP + g
    io_mask = row_valid[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)

    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
    head_base = kv_head * stride_kh
    # with window > 0, row r sees keys in (query_pos - window, query_pos]: tiles before the tile's first query's
    # window are skipped
    low = tl.where(window > 0, tl.maximum(prefix + tile * BLOCK_Q - window + 1, 0), 0)
    for n0 in range(low // BLOCK_N * BLOCK_N, end, BLOCK_N):
        pos, valid, k, v = _load_kv_tile(
            k_ptr,
            v_ptr,
            tables_ptr,
            seq * stride_tb,
            head_base,
            stride_kb,
            stride_ks,
            n0,
            end,
            d,
            BLOCK_SIZE,
            HEAD_DIM,
            BLOCK_N,
        )
        s = _soft_cap(tl.dot(q, tl.trans(k), input_precision="ieee") * scale, softcap)
        seen = valid[None, :] & (pos[None, :] <= query_pos[:, None])
        seen = seen & ((window <= 0) | (pos[None, :] > query_pos[:, None] - window))
        s = tl.where(seen, s, float("-inf"))
        m, l_sum, acc = _online_softmax_step(s, v, m, l_sum, acc)
    result = acc / l_sum[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Same contract as `paged_prefill_attention_torch`. `max_query_len` (a host int) sizes the grid; without
    it, the grid covers T query tokens per sequence (correct, with idle programs)."""
    num_seqs = block_tables.shape[0]
    _check(q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    if q.stride(2) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("paged_prefill_attention_triton needs a contiguous head dim and K/V of equal strides")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad, dim_pad = triton.next_power_of_2(group), max(16, triton.next_power_of_2(head_dim))
    block_q = max(1, 64 // group_pad)  # 64 rows per program (>= 16 for tl.dot)
    longest = num_tokens if max_query_len is None else max_query_len
    grid = (triton.cdiv(longest, block_q), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        window,
        float(softcap),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=64,
    )
    return out


# ---------------------------------------------------------------------------------------------------------
# Dispatch


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    plan: DecodePlan | None = None,
    split_tokens: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A CPU's decode attention (kernels/dispatch.py): the native kernel where it takes the arguments
    (kernels/cpu_kernels.py: softcap and sinks included), else the twin (see `paged_decode_attention_torch`). Both
    reduce each sequence in one pass and ignore `num_splits` / `split_tokens` (and the native kernel `plan`)."""
    if paged_decode_takes(q, k_cache, block_tables, seq_lens, sinks) and (out is None or out.is_contiguous()):
        _check(q, k_cache, v_cache, block_tables, seq_lens, q.shape[0])
        out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
        return paged_decode_attention_native(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out, window, softcap=softcap, sinks=sinks
        )
    return paged_decode_attention_torch(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, plan, window, softcap, sinks
    )


def paged_prefill_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    decode_from: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A CPU's prefill / mixed attention (kernels/dispatch.py): the native kernel where it takes the arguments
    (kernels/cpu_kernels.py: softcap and sinks included), else the twin (see `paged_prefill_attention_torch`).
    `decode_from`: the native kernel's (its rows from those positions with the decode kernel's bits); the twin
    ignores it."""
    if paged_prefill_takes(q, k_cache, block_tables, seq_lens, query_start_loc, sinks) and (
        out is None or out.is_contiguous()
    ):
        num_seqs = block_tables.shape[0]
        _check(q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
        if query_start_loc.shape != (num_seqs + 1,):
            raise ValueError(f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
        out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
        return paged_prefill_attention_native(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            out,
            decode_from,
            window,
            softcap,
            sinks,
        )
    return paged_prefill_attention_torch(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, max_query_len, window, softcap, sinks
    )
