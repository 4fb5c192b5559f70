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
from infer.worker.forward_batch import ForwardBatch


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
    return out


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
