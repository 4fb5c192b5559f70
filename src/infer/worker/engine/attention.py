"""The attention step of one layer over the paged KV pool: append this step's K/V, then attend.

Decodes (the first batch.num_decodes sequences, one query each) go to the flash-decoding kernel in one
call; the prefill chunks after them go to the prefill/mixed kernel in one call. Which kernels those are (Triton on
CUDA, the native kernels on a CPU where they take the call, their PyTorch twins elsewhere) is the device's table
(kernels/dispatch.py), which the calling layer holds. The pool of one layer is [Hkv, num_blocks, block_size, D].
"""

from __future__ import annotations

import torch

from infer.kernels.dispatch import Kernels
from infer.kernels.paged_attention import plan_decode
from infer.worker.engine.forward_batch import ForwardBatch


def paged_attention(
    kernels: Kernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    cos_sin_cache: torch.Tensor | None = None,
    is_neox: bool = True,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store k, v [T, Hkv, D] at the batch's slots (rotating k there when `cos_sin_cache` is given), then
    attend q [T, H, D] over each sequence's context (its last `window` positions with a sliding window > 0; scores
    soft-capped with a softcap > 0 (Gemma 2); attention sinks [H] float32 in each softmax's denominator where given
    (GPT-OSS): the native CPU kernels and the twins compute them, Triton not sinks, so on CUDA those go to the twins).
    Returns [T, H, D] in q's dtype; padding rows are 0."""
    if batch.step_graph:
        return _padded_decode(
            kernels, q, k, v, k_cache, v_cache, batch, scale, cos_sin_cache, is_neox, window, softcap, sinks
        )
    kernels.append_kv(k, v, k_cache, v_cache, batch.slot_mapping, batch.positions, cos_sin_cache, is_neox)
    out = torch.empty_like(q)
    num_real, num_decodes = batch.num_real_tokens, batch.num_decodes
    if num_real < q.shape[0]:  # padding tokens after the last sequence: defined output, never attended
        out[num_real:] = 0
    if num_decodes:
        tables, lens = batch.block_tables[:num_decodes], batch.seq_lens[:num_decodes]
        plan = None
        if not kernels.paged_decode_takes(q, k_cache, tables, lens, sinks):
            # the twin's tiling, planned by the first layer of the step with this window
            key = f"decode_plan/{window}"
            plan = batch.per_step.get(key)
            if plan is None:
                plan = batch.per_step[key] = plan_decode(
                    tables, lens, k_cache, batch.context_lens[:num_decodes], window
                )
        kernels.paged_decode_attention(
            q[:num_decodes],
            k_cache,
            v_cache,
            tables,
            lens,
            scale,
            out=out[:num_decodes],
            plan=plan,
            split_tokens=batch.decode_split_tokens,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
    if num_decodes < batch.num_seqs:
        kernels.paged_prefill_attention(
            q[num_decodes:num_real],
            k_cache,
            v_cache,
            batch.block_tables[num_decodes:],
            batch.seq_lens[num_decodes:],
            batch.prefill_query_start_loc,
            scale,
            out=out[num_decodes:num_real],
            max_query_len=batch.max_prefill_len,
            decode_from=batch.prefill_decode_from,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
    if batch.image_spans:
        image_span_attention(q, k_cache, v_cache, batch, scale, window, softcap, sinks, out)
    return out


def image_span_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Rows of `out` [T, H, D] that are image tokens of `batch.image_spans`, recomputed with the image's tokens
    attending to each other both ways (transformers' Gemma 3 mask): the query at p sees the key at k where (k <= p or
    k is a token of the same image) and, with a sliding window, k > p - window. The chunk's K/V are already in the
    pool. Every token of the image must be in the pool or in this chunk (the scheduler keeps an image's remaining
    tokens in one chunk: SchedulerConfig.whole_images); RuntimeError if not. Plain torch, in float32."""
    if sinks is not None:
        raise NotImplementedError("attention sinks with bidirectional image attention are not supported")
    starts = [0]
    for length in batch.query_lens:
        starts.append(starts[-1] + length)
    block_size = k_cache.shape[2]
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    for seq, lo, hi in batch.image_spans or ():
        end = batch.context_lens[seq]
        first = end - batch.query_lens[seq]  # the chunk's first position
        if hi > end:
            raise RuntimeError(
                f"an image's tokens [{lo}, {hi}) end past its chunk [{first}, {end}): split across chunks"
            )
        q_lo = max(lo, first)
        if q_lo >= hi:
            continue
        k_lo = max(0, q_lo - window + 1) if window else 0
        device = q.device
        keys = torch.arange(k_lo, hi, device=device)
        table = batch.block_tables[seq].to(device=device, dtype=torch.int64)
        blocks, offsets = table[keys // block_size], keys % block_size
        k = k_cache[:, blocks, offsets].float()  # [Hkv, L, D]
        v = v_cache[:, blocks, offsets].float()
        rows = slice(starts[seq] + q_lo - first, starts[seq] + hi - first)
        qs = q[rows].float().transpose(0, 1).reshape(kv_heads, heads // kv_heads, hi - q_lo, -1)  # [Hkv, G, n, D]
        scores = torch.einsum("hgnd,hld->hgnl", qs, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        p = torch.arange(q_lo, hi, device=device).unsqueeze(1)
        allowed = (keys <= p) | ((keys >= lo) & (keys < hi))
        if window:
            allowed &= keys > p - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        attended = torch.einsum("hgnl,hld->hgnd", scores.softmax(-1), v)  # [Hkv, G, n, D]
        out[rows] = attended.reshape(heads, hi - q_lo, -1).transpose(0, 1).to(out.dtype)


def _padded_decode(
    kernels: Kernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    cos_sin_cache: torch.Tensor | None,
    is_neox: bool,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """A step graph's attention: every row decodes, padding rows included (they write the scratch slot and
    attend to it), with no host sync and no shape that depends on the lengths' values (the table's
    `step_graph_decode`: Triton in a CUDA graph, the native operator or the version written for the compiler)."""
    kernels.append_kv(
        k, v, k_cache, v_cache, batch.slot_mapping, batch.positions, cos_sin_cache, is_neox, pad_slot=batch.pad_slot
    )
    return kernels.step_graph_decode(
        q,
        k_cache,
        v_cache,
        batch.block_tables,
        batch.seq_lens,
        scale,
        batch.decode_split_tokens,
        window,
        softcap,
        sinks,
    )
