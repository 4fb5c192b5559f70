"""RMSNorm, optionally fused with the residual add of a pre-norm transformer block.

    rms_norm(x, weight, eps)            -> weight * x / rms(x)
    rms_norm(x, weight, eps, residual)  -> s = x + residual, stored into residual (the new residual stream);
                                           returns weight * s / rms(s)

Numerics follow transformers' LlamaRMSNorm: the statistics and x / rms(x) in float32, that result rounded to
x's dtype, then multiplied by the weight (one more rounding to x's dtype). The residual sum is taken in x's
dtype, exactly as the unfused `hidden = out + hidden` would.

The result goes to `out` when given (x's shape and dtype, unit stride along H; it may be x itself), else to
a fresh contiguous tensor; x is written only when it is `out`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.kernels._triton import tl, triton
from infer.kernels.cpu_kernels import RMS_NORM_MIN_ROWS, rms_norm_native, rms_norm_takes


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match x of shape {tuple(x.shape)}")
    for name, t in (("residual", residual), ("out", out)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype):
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} does not match x {tuple(x.shape)} {x.dtype}")


def rms_norm_torch(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H] like x; updated in place to x + residual
    out: torch.Tensor | None = None,  # [..., H] like x
) -> torch.Tensor:  # [..., H] in x's dtype: out, or a new tensor
    """The twin, in two ATen calls (at decode sizes per-call overhead dominates; a hand-written composite
    measured slower). F.rms_norm without a weight computes in float32 and rounds once to x's dtype, bitwise
    transformers' `(x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`; the weight then multiplies in
    x's dtype, as transformers does. (Handing the weight to F.rms_norm saves ~1-2 us a call in bf16 but
    applies it before the rounding: an ulp off transformers.)
    """
    _check(x, weight, residual, out)
    if residual is not None:
        x = residual.add_(x)
    normed = F.rms_norm(x, (x.shape[-1],), eps=eps)
    return normed.mul_(weight) if out is None else torch.mul(normed, weight, out=out)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, H], rows x_row_stride apart, unit column stride
    x_row_stride,
    residual_ptr,  # [N, H] (read and written when HAS_RESIDUAL)
    residual_row_stride,
    weight_ptr,  # [H]
    out_ptr,  # [N, H], rows out_row_stride apart (may alias x)
    out_row_stride,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # power of two >= hidden_size: one program holds one whole row
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * residual_row_stride + cols
        r = tl.load(residual_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum in x's dtype, as torch's add
        tl.store(residual_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden_size
    normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H] like x; updated in place to x + residual
    out: torch.Tensor | None = None,  # [..., H] like x
) -> torch.Tensor:  # [..., H] in x's dtype: out, or a new tensor
    """One program per row: the residual add, its store and the norm in one pass over the row.

    x may be a row view with any row stride (a copy is made only for a non-unit column stride, or for
    leading dims that do not flatten into rows). `residual` and `out` are written in place, so they must
    have a unit column stride and flatten into rows without a copy.
    """
    _check(x, weight, residual, out)
    hidden_size = x.shape[-1]
    rows = x.reshape(-1, hidden_size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_rows, residual_rows = _rows_in_place(out, "out"), rows  # residual_rows: unused unless HAS_RESIDUAL
    if residual is not None:
        residual_rows = _rows_in_place(residual, "residual")
    if rows.shape[0] == 0:
        return out
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        rows.stride(0),
        residual_rows,
        residual_rows.stride(0),
        weight.contiguous(),
        out_rows,
        out_rows.stride(0),
        hidden_size,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )
    return out


def _rows_in_place(t: torch.Tensor, name: str) -> torch.Tensor:
    """t [..., H] as a [N, H] view that writes through to t."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} is written in place and needs a unit stride along its last dim")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()} does not flatten into rows without a copy"
        ) from None


def rms_norm_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    any_rows: bool = False,
) -> torch.Tensor:
    """A CPU's RMSNorm (kernels/dispatch.py): the native kernel where it takes the arguments (kernels/cpu_kernels.py:
    one pass instead of the twin's pow / mean / rsqrt / mul / mul), else the twin (see `rms_norm_torch` for
    shapes and semantics). fp32 rows take the native kernel from a prefill's rows on (transformers' bits for a
    decode's), or from one row with `any_rows`: the same bits for a row in any batch."""
    if rms_norm_takes(x, weight, residual, out, 1 if any_rows else RMS_NORM_MIN_ROWS):
        _check(x, weight, residual, out)
        return rms_norm_native(x, weight, eps, residual, out)
    return rms_norm_torch(x, weight, eps, residual, out)


__all__ = ["rms_norm_cpu", "rms_norm_torch", "rms_norm_triton"]
