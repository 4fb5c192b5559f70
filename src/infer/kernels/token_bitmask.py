"""Token bitmask: set to -inf the logits of the tokens a grammar does not allow, for many rows in one launch.

The bitmask is xgrammar's layout: [R, W] int32 with W = ceil(V / 32); bit j of word w of row r (LSB first)
allows token 32 * w + j. Row r of the mask applies to row `rows[r]` of the logits; tokens at or past W * 32
(or past the logits' V) are not touched beyond V. A token whose bit is 0 becomes -inf; the others keep
their value. In place; the Triton kernel and the twin agree exactly (only -inf is written).
"""

from __future__ import annotations

import torch

from infer.kernels._triton import tl, triton

BLOCK = 1024  # token ids per Triton program


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(
            f"logits must be [B, V] and bitmask [R, W], got {tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32 or rows.dtype != torch.int64:
        raise ValueError(f"bitmask must be int32 and rows int64, got {bitmask.dtype} and {rows.dtype}")
    if rows.shape != (bitmask.shape[0],):
        raise ValueError(f"rows must be [{bitmask.shape[0]}], got {tuple(rows.shape)}")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"a bitmask of {bitmask.shape[1]} words covers {bitmask.shape[1] * 32} tokens, "
            f"fewer than the vocabulary ({logits.shape[1]})"
        )


# ---------------------------------------------------------------------------------------------------------
# The twin


def apply_token_bitmask_torch(
    logits: torch.Tensor,  # [B, V] float, modified in place
    bitmask: torch.Tensor,  # [R, W] int32
    rows: torch.Tensor,
) -> None:  # [R] int64 rows of logits
    _check(logits, bitmask, rows)
    if rows.numel() == 0:
        return
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]  # [R, V]
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))


# ---------------------------------------------------------------------------------------------------------
# The Triton kernel: one program per (mask row, BLOCK of token ids)


@triton.jit
def _bitmask_kernel(logits_ptr, stride_logits, bitmask_ptr, stride_bitmask, rows_ptr, vocab_size, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    ids = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = ids < vocab_size
    words = tl.load(bitmask_ptr + r.to(tl.int64) * stride_bitmask + ids // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (ids % 32).to(tl.int32)) & 1) != 0
    row = tl.load(rows_ptr + r)
    dst = logits_ptr + row * stride_logits + ids
    tl.store(dst, tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty), mask=in_vocab & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Same contract as `apply_token_bitmask_torch`."""
    _check(logits, bitmask, rows)
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_token_bitmask_triton needs contiguous rows of logits and bitmask")
    if rows.numel() == 0:
        return
    vocab_size = logits.shape[1]
    _bitmask_kernel[(rows.numel(), triton.cdiv(vocab_size, BLOCK))](
        logits, logits.stride(0), bitmask, bitmask.stride(0), rows, vocab_size, BLOCK=BLOCK
    )
