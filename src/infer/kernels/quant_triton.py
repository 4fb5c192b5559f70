"""Weight-only quantized matmul on CUDA: x [M, K] (fp16 / bf16; fp32 for the interpreter tests) times a
QuantWeight [N, K] (kernels/quant.py: q4 nibbles or q8 int8, blocks of 32 along K with an fp16 scale and
optional fp16 min) -> [M, N] in x's dtype, the weight dequantized in registers and never materialized.

    quant_matmul_triton(x, weight)  the kernels below
    quant_matmul_torch(x, weight)   the twin and test oracle: dequantize in fp32, fp32 matmul, cast

Two kernels, both accumulating in fp32:
- `_gemv_kernel` (M <= GEMV_MAX_M, decode): one program streams a [BLOCK_N, BLOCKS_K * 32] weight tile per
  iteration as a [BLOCK_N, BLOCKS_K, 32-or-16] tensor (one quant block per middle index), so a block's scale
  and min broadcast over its last axis and are applied after the in-block sum:
      out[m, n] += scale[n, b] * sum_j q[n, b, j] * x[m, b, j]  +  min[n, b] * sum_j x[m, b, j]
  The products are broadcast-multiply-sums on the CUDA cores (no tensor cores at one row); each of up to
  BLOCK_M rows reuses the dequantized tile.
- `_dot_kernel` (larger M): dequantizes the tile to x's dtype (scale * q + min in fp32, then cast, the
  rounding the twin does not have) and multiplies on the tensor cores with tl.dot, BLOCK_M 16 or 64.

q4 never interleaves nibbles: byte j of block b holds elements 32b + j (low nibble) and 32b + 16 + j (high),
so the low and high nibble tiles each meet their own half of x (x_lo at 32b + j, x_hi at 32b + 16 + j).

Split-K: when the N (and M) tiles alone would leave the GPU's SMs idle (decode shapes such as 2048 x 2048),
the K blocks are split over SPLIT programs that atomically add fp32 partial sums into a zeroed fp32 buffer,
cast to x's dtype afterwards (two more small kernels; the order of the additions is not fixed).

Block sizes (no autotuning; chosen for an H100's 132 SMs, with register counts from compiling for sm_90 so
that none spills, see `_plan`):
  gemv   BLOCK_N 16; BLOCKS_K (quant blocks of 32 per iteration) 16 at one row (a 4 KiB q4 / 8 KiB q8 tile,
         ~170 registers), 8 for 2-4 rows, 4 for 5-16 rows; 4 warps
  dot    M <= 16: BLOCK_M 16, BLOCK_N 64, BLOCKS_K 4, 8 warps, 2 stages (150 / 210 registers, q4 / q8)
         M >  16: BLOCK_M 64, BLOCK_N 64, BLOCKS_K 2, 8 warps (200 / 210 registers)
  split  enough K splits for ~4 programs per SM, each split a whole number of iterations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from infer.kernels._triton import tl, triton
from infer.kernels.quant import BLOCK, QuantWeight, dequantize

GEMV_MAX_M = 4  # rows up to which the broadcast-multiply-sum kernel runs; the tl.dot kernel above
_PROGRAMS_PER_SM = 4  # split-K aims for this many programs per SM
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(x: torch.Tensor, weight: QuantWeight) -> None:
    if not isinstance(weight, QuantWeight):
        raise ValueError(f"weight must be a QuantWeight, got {type(weight).__name__}")
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] for a weight of shape [{n}, {k}], got {list(x.shape)}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be one of {_X_DTYPES}, got {x.dtype}")
    for name, tensor in weight.tensors().items():
        if tensor.device != x.device:
            raise ValueError(f"weight {name} is on {tensor.device}, x on {x.device}")


# ---------------------------------------------------------------------------------------------------------
# The twin


def quant_matmul_torch(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    weight: QuantWeight,  # [N, K]
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ dequantize(weight).T: the weight dequantized in fp32 (scale * q + min), an fp32 matmul, one cast."""
    _check(x, weight)
    return (x.float() @ dequantize(weight, torch.float32).t()).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _load_tile(qs_ptr, stride_qn, cols, col_mask, blocks, block_mask, Q4: tl.constexpr, HALF: tl.constexpr):
    """The quantized values of rows `cols` [BLOCK_N], quant blocks `blocks` [BLOCKS_K], as fp32
    [BLOCK_N, BLOCKS_K, HALF] tiles: q4 the low and the high nibbles (HALF 16); q8 the values twice (HALF 32,
    the second copy unused)."""
    j = tl.arange(0, HALF).to(tl.int64)
    mask = col_mask[:, None, None] & block_mask[None, :, None]
    row_ptrs = qs_ptr + cols[:, None, None] * stride_qn
    if Q4:
        packed = tl.load(row_ptrs + blocks[None, :, None] * 16 + j[None, None, :], mask=mask, other=0)
        low = (packed & 15).to(tl.float32)
        high = (packed >> 4).to(tl.float32)
    else:
        low = tl.load(row_ptrs + blocks[None, :, None] * 32 + j[None, None, :], mask=mask, other=0).to(tl.float32)
        high = low
    return low, high


@triton.jit
def _dequantized(
    q, scale, mins, HAS_MIN: tl.constexpr, dtype: tl.constexpr, BLOCK_N: tl.constexpr, TILE_K: tl.constexpr
):
    """q [BLOCK_N, BLOCKS_K, HALF] fp32 -> scale * q (+ min) in `dtype`, as [BLOCK_N, TILE_K = BLOCKS_K * HALF]."""
    w = q * scale[:, :, None]
    if HAS_MIN:
        w += mins[:, :, None]
    return tl.reshape(w.to(dtype), (BLOCK_N, TILE_K))


@triton.jit
def _load_scales(scale_ptr, min_ptr, stride_sn, cols, col_mask, blocks, block_mask, HAS_MIN: tl.constexpr):
    """scale and min [BLOCK_N, BLOCKS_K] as fp32 (min 0 without mins)."""
    offs = cols[:, None] * stride_sn + blocks[None, :]
    mask = col_mask[:, None] & block_mask[None, :]
    scale = tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_MIN:
        low = tl.load(min_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        low = tl.zeros_like(scale)
    return scale, low


@triton.jit
def _store(out_ptr, stride_om, acc, rows, row_mask, cols, col_mask, SPLIT: tl.constexpr):
    ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Runtime sizes and the strides whose alignment does not matter are not specialized on: one compilation then
# serves every shape of a model (the qs and x column strides still are, for vectorized loads).
_UNSPECIALIZED = ["stride_xm", "stride_sn", "stride_om", "M", "N", "num_blocks", "blocks_per_split"]


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _gemv_kernel(
    x_ptr,
    stride_xm,
    stride_xk,  # x [M, K]
    qs_ptr,
    stride_qn,  # q4: uint8 [N, K // 2]; q8: int8 [N, K]
    scale_ptr,
    min_ptr,
    stride_sn,  # fp16 [N, K // 32] each (min_ptr unused without HAS_MIN)
    out_ptr,
    stride_om,  # [M, N]: x's dtype, or fp32 accumulated atomically when SPLIT
    M,
    N,
    num_blocks,
    blocks_per_split,
    Q4: tl.constexpr,
    HAS_MIN: tl.constexpr,
    SPLIT: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS_K: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), splits). Program (n, s) covers all M <= BLOCK_M rows, columns
    # [n * BLOCK_N, +BLOCK_N) and the quant blocks [s * blocks_per_split, +blocks_per_split) of K.
    # HALF: the x elements one (low or high) nibble tile meets per block, 16 for q4, 32 for q8.
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    row_mask = rows < M
    first = tl.program_id(1) * blocks_per_split
    end = tl.minimum(first + blocks_per_split, num_blocks)
    j = tl.arange(0, HALF).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(first, end, BLOCKS_K):
        blocks = b0 + tl.arange(0, BLOCKS_K).to(tl.int64)
        block_mask = blocks < end
        low, high = _load_tile(qs_ptr, stride_qn, cols, col_mask, blocks, block_mask, Q4, HALF)
        scale, mins = _load_scales(scale_ptr, min_ptr, stride_sn, cols, col_mask, blocks, block_mask, HAS_MIN)
        # x [BLOCK_M, BLOCKS_K, HALF]: the elements the low (or only) values multiply; x_hi the high nibbles'
        x_offs = rows[:, None, None] * stride_xm + (blocks[None, :, None] * 32 + j[None, None, :]) * stride_xk
        x_mask = row_mask[:, None, None] & block_mask[None, :, None]
        x_lo = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
        if Q4:
            x_hi = tl.load(x_ptr + x_offs + 16 * stride_xk, mask=x_mask, other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            pick = rows[:, None, None] == m
            xm = tl.sum(tl.where(pick, x_lo, 0.0), axis=0)  # [BLOCKS_K, HALF]
            dots = tl.sum(low * xm[None, :, :], axis=2)  # [BLOCK_N, BLOCKS_K]
            x_sums = tl.sum(xm, axis=1)  # [BLOCKS_K]
            if Q4:
                xm_hi = tl.sum(tl.where(pick, x_hi, 0.0), axis=0)
                dots += tl.sum(high * xm_hi[None, :, :], axis=2)
                x_sums += tl.sum(xm_hi, axis=1)
            part = dots * scale
            if HAS_MIN:
                part += mins * x_sums[None, :]
            acc += tl.where(rows[:, None] == m, tl.sum(part, axis=1)[None, :], 0.0)  # row m += [BLOCK_N]
    _store(out_ptr, stride_om, acc, rows, row_mask, cols, col_mask, SPLIT)


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _dot_kernel(
    x_ptr,
    stride_xm,
    stride_xk,  # x [M, K]
    qs_ptr,
    stride_qn,  # q4: uint8 [N, K // 2]; q8: int8 [N, K]
    scale_ptr,
    min_ptr,
    stride_sn,  # fp16 [N, K // 32] each (min_ptr unused without HAS_MIN)
    out_ptr,
    stride_om,  # [M, N]: x's dtype, or fp32 accumulated atomically when SPLIT
    M,
    N,
    num_blocks,
    blocks_per_split,
    Q4: tl.constexpr,
    HAS_MIN: tl.constexpr,
    SPLIT: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS_K: tl.constexpr,
    TILE_K: tl.constexpr,
):
    # grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), splits); the M tiles of one N tile are neighbours, so they
    # share the weight tile through L2. Each iteration: one dot of K = BLOCKS_K * HALF (q8), two for q4
    # (low nibbles with x_lo, high with x_hi); TILE_K = BLOCKS_K * HALF.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    first = tl.program_id(2) * blocks_per_split
    end = tl.minimum(first + blocks_per_split, num_blocks)
    j = tl.arange(0, HALF).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(first, end, BLOCKS_K):
        blocks = b0 + tl.arange(0, BLOCKS_K).to(tl.int64)
        block_mask = blocks < end
        low, high = _load_tile(qs_ptr, stride_qn, cols, col_mask, blocks, block_mask, Q4, HALF)
        scale, mins = _load_scales(scale_ptr, min_ptr, stride_sn, cols, col_mask, blocks, block_mask, HAS_MIN)
        x_offs = rows[:, None, None] * stride_xm + (blocks[None, :, None] * 32 + j[None, None, :]) * stride_xk
        x_mask = row_mask[:, None, None] & block_mask[None, :, None]
        x_lo = tl.reshape(tl.load(x_ptr + x_offs, mask=x_mask, other=0.0), (BLOCK_M, TILE_K))
        w_lo = _dequantized(low, scale, mins, HAS_MIN, dtype, BLOCK_N, TILE_K)  # [BLOCK_N, TILE_K]
        acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision="ieee")
        if Q4:
            x_hi = tl.reshape(tl.load(x_ptr + x_offs + 16 * stride_xk, mask=x_mask, other=0.0), (BLOCK_M, TILE_K))
            w_hi = _dequantized(high, scale, mins, HAS_MIN, dtype, BLOCK_N, TILE_K)
            acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision="ieee")
    _store(out_ptr, stride_om, acc, rows, row_mask, cols, col_mask, SPLIT)


@dataclass(frozen=True)
class Plan:
    """How one call is launched: the kernel, its tile sizes and the number of K splits."""

    kernel: str  # "gemv" or "dot"
    block_m: int
    block_n: int
    blocks_k: int  # quant blocks (32 elements of K) per iteration
    num_warps: int
    num_stages: int
    splits: int
    blocks_per_split: int


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so the tests cover the atomic path
    return torch.cuda.get_device_properties(device).multi_processor_count


def _plan(
    m: int, n: int, num_blocks: int, device: torch.device, kernel: str | None = None, splits: int | None = None
) -> Plan:
    """Tile sizes for an [m, K] x [n, K]^T product with K = 32 * num_blocks (module docstring), and enough K
    splits to give every SM _PROGRAMS_PER_SM programs; `kernel` and `splits` override the choice. Under the
    interpreter (CPU tensors) an iteration takes 2 quant blocks, so tiny test shapes loop and split."""
    kernel = kernel or ("gemv" if m <= GEMV_MAX_M else "dot")
    if kernel == "gemv":
        if m > 16:
            raise ValueError(f"the gemv kernel takes at most 16 rows, got {m}")
        block_m = triton.next_power_of_2(m)
        block_n, blocks_k, warps, stages = 16, 16 if block_m == 1 else 8 if block_m <= 4 else 4, 4, 1
    elif m <= 16:
        block_m, block_n, blocks_k, warps, stages = 16, 64, 4, 8, 2
    else:
        block_m, block_n, blocks_k, warps, stages = 64, 64, 2, 8, 1
    if device.type != "cuda":
        blocks_k = 2
    k_steps = triton.cdiv(num_blocks, blocks_k)
    if splits is None:
        tiles = triton.cdiv(n, block_n) * (triton.cdiv(m, block_m) if kernel == "dot" else 1)
        splits = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device), tiles)
    splits = max(1, min(splits, k_steps))
    steps_per_split = triton.cdiv(k_steps, splits)
    splits = triton.cdiv(k_steps, steps_per_split)  # no empty split
    return Plan(kernel, block_m, block_n, blocks_k, warps, stages, splits, steps_per_split * blocks_k)


def quant_matmul_triton(
    x: torch.Tensor,  # [M, K] fp16 / bf16 (fp32 in the interpreter tests)
    weight: QuantWeight,  # [N, K], each tensor contiguous along K
    *,
    kernel: str | None = None,
    splits: int | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """Same contract as `quant_matmul_torch`; no host sync. `kernel` ("gemv" / "dot") and `splits` override
    the plan (benchmarks and tests); by default M <= GEMV_MAX_M runs the gemv kernel."""
    _check(x, weight)
    for name, tensor in weight.tensors().items():
        if tensor.stride(1) != 1:
            raise ValueError(f"quant_matmul_triton needs weight {name} contiguous along K")
    if kernel not in (None, "gemv", "dot"):
        raise ValueError(f"kernel must be 'gemv' or 'dot', got {kernel!r}")
    m = x.shape[0]
    n, k = weight.shape
    if m == 0 or k == 0:
        return torch.zeros((m, n), dtype=x.dtype, device=x.device)
    num_blocks = k // BLOCK
    plan = _plan(m, n, num_blocks, x.device, kernel, splits)
    split = plan.splits > 1
    out = (
        torch.zeros((m, n), dtype=torch.float32, device=x.device)
        if split
        else torch.empty((m, n), dtype=x.dtype, device=x.device)
    )
    mins = weight.mins if weight.mins is not None else weight.scales
    args = (
        x,
        x.stride(0),
        x.stride(1),
        weight.qs,
        weight.qs.stride(0),
        weight.scales,
        mins,
        weight.scales.stride(0),
        out,
        out.stride(0),
        m,
        n,
        num_blocks,
        plan.blocks_per_split,
    )
    q4 = weight.format == "q4"
    half = 16 if q4 else 32
    meta = dict(
        Q4=q4,
        HAS_MIN=weight.mins is not None,
        SPLIT=split,
        HALF=half,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCKS_K=plan.blocks_k,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    n_tiles = triton.cdiv(n, plan.block_n)
    if plan.kernel == "gemv":
        _gemv_kernel[(n_tiles, plan.splits)](*args, **meta)
    else:
        _dot_kernel[(triton.cdiv(m, plan.block_m), n_tiles, plan.splits)](*args, TILE_K=plan.blocks_k * half, **meta)
    return out.to(x.dtype) if split else out


__all__ = ["GEMV_MAX_M", "Plan", "quant_matmul_torch", "quant_matmul_triton"]
