"""Paged attention in plain torch: the CPU path and the reference the fused kernels are tested against.

Shapes: T tokens in the batch, H query heads, Hkv key/value heads (H % Hkv == 0), D head dim.
The cache of one layer is [num_blocks, block_size, Hkv, D]; token `j` of a sequence lives at
slot block_table[j // block_size] * block_size + j % block_size.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from infer.worker.forward_batch import ForwardBatch


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, has_padding: bool = True) -> None:
    """Store the new tokens' k, v [T, Hkv, D] at their slots; slot -1 (padding) is skipped.
    `has_padding=False` promises there is no -1 slot and skips the (syncing) mask."""
    k_slots, v_slots = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    if has_padding:
        valid = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    k_slots.index_copy_(0, slot_mapping, k)
    v_slots.index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """cache [num_blocks, bs, Hkv, D], block_tables [B, max_blocks] -> [B, L, Hkv, D], L = max_len rounded
    up to whole blocks.

    Whole blocks are copied (one row of bs * Hkv * D per block), which is several times faster than a
    per-token gather. Positions past a sequence's length hold whatever the pool has there (another
    sequence's K/V or zeros): finite values, since the pool is zero-initialised and only finite K/V are
    written (see KVCache.allocate). Callers mask them.
    """
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks]
    rows = cache.view(cache.shape[0], -1).index_select(0, tables.flatten())
    return rows.view(tables.shape[0], num_blocks * block_size, *cache.shape[2:])


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Write k, v [T, Hkv, D] into the cache, then attend q [T, H, D] over each sequence's context.

    Decodes (the first batch.num_decodes sequences) are batched in one call; each prefill chunk of n tokens
    at positions seq_len - n .. seq_len - 1 attends causally to its cached prefix and itself.
    Returns [T, H, D] in q's dtype; softmax accumulates in float32 (SDPA's CPU kernels do).
    """
    num_real = sum(batch.query_lens)
    write_kv(k, v, k_cache, v_cache, batch.slot_mapping, has_padding=num_real < q.shape[0])
    out = torch.empty_like(q)
    if num_real < q.shape[0]:  # padding tokens after the last sequence: defined output, never attended
        out[num_real:] = 0
    num_decodes = batch.num_decodes
    groups = batch.decode_groups if num_decodes else ()
    if len(groups) == 1:
        out[:num_decodes] = decode_attention(
            q[:num_decodes], k_cache, v_cache, batch.block_tables[:num_decodes], batch.seq_lens[:num_decodes],
            groups[0][1], scale)
    else:  # mixed lengths: one call per group of similar lengths instead of padding all to the longest
        for rows, max_len in groups:
            out.index_copy_(0, rows, decode_attention(
                q.index_select(0, rows), k_cache, v_cache, batch.block_tables.index_select(0, rows),
                batch.seq_lens.index_select(0, rows), max_len, scale))
    starts = (0, *itertools.accumulate(batch.query_lens))  # host copies: no device sync
    for i in range(num_decodes, batch.num_seqs):
        start, end = starts[i], starts[i + 1]
        out[start:end] = prefill_attention(q[start:end], k_cache, v_cache, batch.block_tables[i],
                                           batch.context_lens[i], scale)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                     scale: float) -> torch.Tensor:
    """One query per sequence: q [B, H, D] -> [B, H, D].

    Grouped-query without repeating K/V: the H / Hkv query heads sharing a KV head become that head's
    "query rows", so SDPA sees q [B, Hkv, H/Hkv, D] against K, V [B, Hkv, L, D].
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys = gather_kv(k_cache, block_tables, max_len).transpose(1, 2)  # [B, Hkv, L, D]
    values = gather_kv(v_cache, block_tables, max_len).transpose(1, 2)
    valid = torch.arange(keys.shape[2], device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    grouped = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=valid[:, None, None, :],
                                         scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_table: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """One chunk: q [n, H, D] for the last n of `context_len` positions -> [n, H, D], causal."""
    n = q.shape[0]
    # 4-D, contiguous inputs: what SDPA's fused CPU kernel takes (3-D falls back to the slow math path)
    keys = gather_kv(k_cache, block_table[None], context_len)[:, :context_len]  # [1, ctx, Hkv, D]
    values = gather_kv(v_cache, block_table[None], context_len)[:, :context_len]
    keys, values = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()  # [1, Hkv, ctx, D]
    queries = q.transpose(0, 1).unsqueeze(0).contiguous()                                  # [1, H, n, D]
    if n == context_len:
        mask, causal = None, True
    else:  # causal, aligned to the bottom right: query j sits at position context_len - n + j
        key_pos = torch.arange(context_len, device=q.device)
        query_pos = torch.arange(context_len - n, context_len, device=q.device)
        mask, causal = key_pos[None, :] <= query_pos[:, None], False
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)
