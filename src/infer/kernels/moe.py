"""The expert MLPs of a mixture-of-experts layer, fused: every row through its own expert.

    fused_experts_torch(x, expert_ids, w13, w2) -> out  (and fused_experts_triton, the same contract)
        out[n] = w2[e] @ (silu(w13[e, :I] @ x[n]) * (w13[e, I:] @ x[n]))  with e = expert_ids[n]

x [N, H] are the rows (one per (token, chosen expert) pair, already routed: the caller weights and sums
them per token); expert_ids [N] int64 are local expert ids in [0, E); w13 [E, 2I, H] holds each expert's
gate rows then its up rows (transformers' `experts.gate_up_proj`), w2 [E, H, I] its down projection
(`experts.down_proj`). Numerics follow transformers' per-expert loop: both matmuls accumulate in float32
(fp32 inputs use IEEE dot products, not TF32), gate and up are rounded to x's dtype, silu(gate) is rounded
again before the product with up, and the intermediate is stored in x's dtype.

Both implementations group rows by expert, so each expert's weights are read once per call:
- the twin sorts rows by expert (stable argsort + bincount) and runs two matmuls per expert that has rows
  (a loop over experts present, never over rows);
- the Triton version is a grouped GEMM in two kernels. `_align_to_tiles` lays the rows out in tiles of
  BLOCK_M slots, each tile belonging to one expert (an expert's last tile padded with slot -1), without a
  host sync: the tile count is bounded by N // BLOCK_M + min(E, N) and surplus tiles carry expert -1 and
  exit at once. `_gate_up_kernel` computes a [BLOCK_M, BLOCK_N] tile of gate and of up together and stores
  silu(gate) * up (the activation fused into the epilogue) in slot order; `_down_kernel` multiplies those
  slots by the expert's w2 and scatters each result to its row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.kernels._triton import tl, triton


def _check(
    x: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor | None
) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"need x [N, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    num_experts, two_i, hidden = w13.shape
    if two_i % 2 or hidden != x.shape[1] or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)} "
            "(w13 [E, 2I, H], w2 [E, H, I])"
        )
    if expert_ids.shape != (x.shape[0],) or expert_ids.dtype != torch.int64:
        raise ValueError(f"expert_ids must be int64 [{x.shape[0]}], got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"weights {w13.dtype}, {w2.dtype} differ from x's dtype {x.dtype}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match x {tuple(x.shape)} {x.dtype}")


# ---------------------------------------------------------------------------------------------------------
# The twin


def fused_experts_torch(
    x: torch.Tensor,  # [N, H]
    expert_ids: torch.Tensor,  # [N] int64, local expert of each row, in [0, E)
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    out: torch.Tensor | None = None,  # [N, H] like x
) -> torch.Tensor:  # [N, H] in x's dtype: out, or a new tensor
    """Rows sorted by expert, two matmuls per expert with rows, results scattered back to their rows.
    Syncs with the device once (the per-expert row counts)."""
    _check(x, expert_ids, w13, w2, out)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if x.shape[0] == 0:
        return out
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=w13.shape[0]).tolist()
    if len(counts) > w13.shape[0]:
        raise ValueError(f"expert id {len(counts) - 1} is outside [0, {w13.shape[0]})")
    rows = x.index_select(0, order)
    results = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate, up = F.linear(rows[start:end], w13[expert]).chunk(2, dim=-1)
        results[start:end] = F.linear(F.silu(gate).mul_(up), w2[expert])
        start = end
    return out.index_copy_(0, order, results)


# ---------------------------------------------------------------------------------------------------------
# Triton: a grouped GEMM over tiles of rows that share an expert


def _align_to_tiles(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by expert into tiles of block_m slots, with no host sync.

    Returns (slot_rows [num_tiles * block_m] int64: the row in each slot, -1 for padding;
    tile_experts [num_tiles] int64: the expert of each tile, -1 for surplus tiles past the last expert's).
    Expert e's rows fill slots [padded_start[e], padded_start[e] + count[e]) in row order; its share of the
    slots is count[e] rounded up to a multiple of block_m.
    """
    num_rows = expert_ids.shape[0]
    device = expert_ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, expert_ids, torch.ones_like(expert_ids))  # bincount would sync for its size
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    row_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(expert_ids, stable=True)
    sorted_experts = expert_ids.index_select(0, order)
    rank_in_expert = torch.arange(num_rows, device=device) - row_start.index_select(0, sorted_experts)
    slots = padded_start.index_select(0, sorted_experts) + rank_in_expert
    num_tiles = num_rows // block_m + min(num_experts, num_rows)  # each expert adds at most one partial tile
    slot_rows = torch.full((num_tiles * block_m,), -1, dtype=torch.int64, device=device)
    slot_rows.index_copy_(0, slots, order)
    tile_starts = torch.arange(num_tiles, device=device, dtype=torch.int64) * block_m
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True)  # first expert ending past it
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1)
    return slot_rows, tile_experts


@triton.jit
def _tile_rows(slot_rows_ptr, tile, BLOCK_M: tl.constexpr):
    """The slots of `tile`, the rows they hold (int64) and which of them are real (not padding)."""
    slots = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(slot_rows_ptr + slots)
    return slots, rows, rows >= 0


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [N, H]
    stride_x_row,
    stride_x_col,
    w13_ptr,  # [E, 2I, H]
    stride_w_expert,
    stride_w_out,
    stride_w_in,
    h_ptr,  # [num_tiles * BLOCK_M, I] intermediate, in slot order
    stride_h_slot,
    slot_rows_ptr,  # [num_tiles * BLOCK_M] int64, -1 = padding
    tile_experts_ptr,  # [num_tiles] int64, -1 = no work
    hidden_size,
    inter_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # intermediate columns per program
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:
        return
    slots, rows, row_mask = _tile_rows(slot_rows_ptr, tile, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter_size
    gate_ptrs = w13_ptr + expert * stride_w_expert + cols.to(tl.int64)[None, :] * stride_w_out
    up_ptrs = gate_ptrs + inter_size * stride_w_out
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_size
        a = tl.load(
            x_ptr + rows[:, None] * stride_x_row + ks[None, :] * stride_x_col,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BM, BK]
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = tl.load(gate_ptrs + ks[:, None] * stride_w_in, mask=w_mask, other=0.0)  # [BK, BN]
        w_up = tl.load(up_ptrs + ks[:, None] * stride_w_in, mask=w_mask, other=0.0)
        acc_gate = tl.dot(a, w_gate, acc_gate, input_precision="ieee")
        acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
    dtype = h_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(
        h_ptr + slots[:, None] * stride_h_slot + cols[None, :],
        (act * up).to(dtype),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _down_kernel(
    h_ptr,  # [num_tiles * BLOCK_M, I] intermediate, in slot order
    stride_h_slot,
    w2_ptr,  # [E, H, I]
    stride_w_expert,
    stride_w_out,
    stride_w_in,
    out_ptr,  # [N, H]
    stride_out_row,
    stride_out_col,
    slot_rows_ptr,  # [num_tiles * BLOCK_M] int64, -1 = padding
    tile_experts_ptr,  # [num_tiles] int64, -1 = no work
    hidden_size,
    inter_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output (hidden) columns per program
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:
        return
    slots, rows, row_mask = _tile_rows(slot_rows_ptr, tile, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden_size
    w_ptrs = w2_ptr + expert * stride_w_expert + cols.to(tl.int64)[None, :] * stride_w_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < inter_size
        a = tl.load(
            h_ptr + slots[:, None] * stride_h_slot + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )  # [BM, BK]
        w = tl.load(w_ptrs + ks[:, None] * stride_w_in, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    tl.store(
        out_ptr + rows[:, None] * stride_out_row + cols[None, :] * stride_out_col,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def _block_m(num_rows: int, num_experts: int) -> int:
    """Rows per tile: small when experts get few rows each (decode), larger for prefill batches."""
    rows_per_expert = num_rows / max(num_experts, 1)
    return 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64


def fused_experts_triton(
    x: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract as `fused_experts_torch`; no host sync. Any strides for x, the weights and out."""
    _check(x, expert_ids, w13, w2, out)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    num_rows, hidden_size = x.shape
    num_experts, inter_size = w13.shape[0], w13.shape[1] // 2
    if num_rows == 0:
        return out
    block_m, block_n, block_k = _block_m(num_rows, num_experts), 64, 32
    slot_rows, tile_experts = _align_to_tiles(expert_ids, num_experts, block_m)
    num_tiles = tile_experts.shape[0]
    h = torch.empty((num_tiles * block_m, inter_size), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_tiles, triton.cdiv(inter_size, block_n))](
        x,
        x.stride(0),
        x.stride(1),
        w13,
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        h,
        h.stride(0),
        slot_rows,
        tile_experts,
        hidden_size,
        inter_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    _down_kernel[(num_tiles, triton.cdiv(hidden_size, block_n))](
        h,
        h.stride(0),
        w2,
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        out,
        out.stride(0),
        out.stride(1),
        slot_rows,
        tile_experts,
        hidden_size,
        inter_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


__all__ = ["fused_experts_torch", "fused_experts_triton"]
