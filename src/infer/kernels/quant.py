"""Weights kept quantized: the two block formats our CPU kernels multiply by, and their PyTorch twins.

Every quantized weight W [N, K] (a linear's [out_features, in_features], or an embedding table [vocab, hidden]) is
held as blocks of BLOCK = 32 consecutive elements along K, each block with an fp16 scale and, in the affine
variant, an fp16 min: element = scale * q + min.

- "q4": q in 0..15, two per byte. qs uint8 [N, K // 2]; block b of a row is bytes 16b .. 16b + 15, and byte j
  of it holds element 32b + j in its low nibble and element 32b + 16 + j in its high nibble (ggml's Q4_0 / Q4_1
  layout within a block). mins always present (a symmetric source such as Q4_0 has min = -8 * scale).
- "q8": q in -128..127. qs int8 [N, K]. mins None (symmetric: Q8_0, Q5_0 as q - 16, int8 at load) or present
  (affine: Q5_1, Q5_K, AWQ / GPTQ zero points).

GGUF's formats map onto these at load (worker/loading/gguf.py): Q4_0, Q4_1 exactly; Q4_K, Q5_K with their sub-block
scales and mins rounded to fp16; Q8_0, Q5_0, Q5_1 exactly; Q6_K requantized to q8 blocks of 32. All three
tensors are row-major with N leading, so a tensor-parallel rank's rows (or its whole blocks of columns) are a
narrowing of each.

y = x W^T with W kept quantized: `quant_matmul` (the native kernel, kernels/cpu/quant.c) and its twin
`quant_matmul_reference`. Both quantize each row of x per block of 32 to int8 (`quantize_activations`) and sum
integer block dots scaled in fp32 (`block_products` states the sum); they differ only in the order of the fp32 sum.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass

import torch

from infer.kernels import cpu_kernels

BLOCK = 32
FORMATS = ("q4", "q8")


@dataclass
class QuantWeight:
    """A weight [N, K] in one of FORMATS (see the module docstring for the layout)."""

    format: str
    qs: torch.Tensor  # q4: uint8 [N, K // 2]; q8: int8 [N, K]
    scales: torch.Tensor  # float16 [N, K // BLOCK]
    mins: torch.Tensor | None = None  # float16 [N, K // BLOCK] or None (q8 only)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"quantized format must be one of {FORMATS}, got {self.format!r}")
        n, blocks = self.scales.shape
        width = blocks * (BLOCK // 2 if self.format == "q4" else BLOCK)
        qs_dtype = torch.uint8 if self.format == "q4" else torch.int8
        if self.qs.dtype != qs_dtype or tuple(self.qs.shape) != (n, width):
            raise ValueError(
                f"{self.format} qs must be {qs_dtype} [{n}, {width}], got {self.qs.dtype} {list(self.qs.shape)}"
            )
        if self.scales.dtype != torch.float16:
            raise ValueError(f"scales must be float16, got {self.scales.dtype}")
        if self.mins is None and self.format == "q4":
            raise ValueError("q4 weights carry mins")
        if self.mins is not None and (self.mins.dtype != torch.float16 or self.mins.shape != self.scales.shape):
            raise ValueError("mins must be float16 shaped like scales")

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.scales.shape[0]), int(self.scales.shape[1]) * BLOCK

    def tensors(self) -> dict[str, torch.Tensor]:
        """The storage by name (qs, scales, mins when present)."""
        out = {"qs": self.qs, "scales": self.scales}
        if self.mins is not None:
            out["mins"] = self.mins
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def unpack_q4(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] in the q4 layout -> uint8 [N, K], one value 0..15 per element, in element order."""
    n = qs.shape[0]
    blocks = qs.reshape(n, -1, BLOCK // 2)
    return torch.cat((blocks & 0x0F, blocks >> 4), dim=2).reshape(n, -1)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of values 0..15 -> the q4 layout [N, K // 2] (unpack_q4's inverse)."""
    blocks = q.to(torch.uint8).reshape(q.shape[0], -1, BLOCK)
    return (blocks[..., : BLOCK // 2] | (blocks[..., BLOCK // 2 :] << 4)).reshape(q.shape[0], -1)


def dequantize(weight: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] as `dtype` (each element computed in float32: scale * q + min, then cast)."""
    q = unpack_q4(weight.qs) if weight.format == "q4" else weight.qs
    n, k = weight.shape
    values = q.reshape(n, -1, BLOCK).float() * weight.scales.float().unsqueeze(-1)
    if weight.mins is not None:
        values = values + weight.mins.float().unsqueeze(-1)
    return values.reshape(n, k).to(dtype)


def quantize(weight: torch.Tensor, fmt: str) -> QuantWeight:
    """Our own weight-only quantizer of a dense [N, K] tensor (K a multiple of BLOCK), per block of 32:
    q8 symmetric (scale = absmax / 127, q = round(w / scale)), q4 affine (min = the block's min, scale =
    (max - min) / 15, q = round((w - min) / scale) in 0..15). The error of an element is at most half a step
    plus the fp16 rounding of its scale and min."""
    if fmt not in FORMATS:
        raise ValueError(f"quantized format must be one of {FORMATS}, got {fmt!r}")
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"a quantized weight is [N, K] with K a multiple of {BLOCK}, got {list(weight.shape)}")
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if fmt == "q8":
        scales = (blocks.abs().amax(dim=-1) / 127).to(torch.float16)
        inverse = torch.where(scales.float() > 0, 1 / scales.float(), torch.zeros(()))
        q = torch.round(blocks * inverse.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return QuantWeight("q8", q.reshape(n, k), scales)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
    mins = low.to(torch.float16)
    scales = ((high - mins.float()) / 15).to(torch.float16)
    inverse = torch.where(scales.float() > 0, 1 / scales.float(), torch.zeros(()))
    q = torch.round((blocks - mins.float().unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp_(0, 15)
    return QuantWeight("q4", pack_q4(q.reshape(n, k)), scales, mins)


def to_format(weight: QuantWeight, fmt: str) -> QuantWeight:
    """`weight` in a storage format of worker/models/layers.py ("q4", "q8", "q8+min"): as it is where it fits,
    q4 -> q8+min exactly (the same scales, mins and values), otherwise requantized from its values."""
    if fmt == "q4":
        return weight if weight.format == "q4" else quantize(dequantize(weight), "q4")
    if fmt == "q8":
        return weight if weight.format == "q8" and weight.mins is None else quantize(dequantize(weight), "q8")
    if fmt != "q8+min":
        raise ValueError(f"unknown quantized storage format {fmt!r}")
    if weight.format == "q4":
        return QuantWeight("q8", unpack_q4(weight.qs).to(torch.int8), weight.scales, weight.mins)
    mins = weight.mins if weight.mins is not None else torch.zeros_like(weight.scales)
    return QuantWeight("q8", weight.qs, weight.scales, mins)


def quant_source(tensor: object, fmt: str) -> QuantWeight:
    """A checkpoint tensor in storage format `fmt`: a GGUF tensor's own blocks (its `quantized()`), else its dense
    values (a torch.Tensor, or a lazy tensor's `read()`) quantized by `quantize`."""
    own = tensor.quantized() if hasattr(tensor, "quantized") else None
    if own is not None:
        return to_format(own, fmt)
    dense = tensor if isinstance(tensor, torch.Tensor) else tensor.read()  # type: ignore[attr-defined]
    return to_format(quantize(dense, "q4" if fmt == "q4" else "q8"), fmt)


# ---- y = x W^T with W quantized: the twin, and the native kernel (kernels/cpu/quant.c) ----

FORMAT_CODES = {"q4": 0, "q8": 1}  # quant_matmul's fmt argument in C
_FLT_MIN = torch.finfo(torch.float32).tiny
_TWIN_ROWS = 16  # rows of x the twin takes at a time (its block dots are [blocks, rows, N] float64)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of BLOCK) -> (q int8 [M, K], d float32 [M, K // BLOCK], s float32 [M, K // BLOCK]), per
    block of 32 as the kernel does it: amax = max |x|, d = amax / 127 in fp32 (d < FLT_MIN taken as 0),
    q = round-half-to-even(x * (1 / d)) (0 where d = 0; |q| <= 127 without a clamp), s = d * sum(q) in fp32.
    Each element's error is at most d / 2 plus the fp32 rounding of x * (1 / d) (|x| * 2^-22 bounds both roundings).
    A block holding a NaN or an infinity has d = NaN (its q unspecified): its row's outputs are NaN, as the kernel's."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)  # NaN where a block holds one
    d = torch.div(amax, torch.full_like(amax, 127.0))
    d = torch.where(d >= _FLT_MIN, d, torch.zeros_like(d))
    d = torch.where(amax.isfinite(), d, torch.full_like(d, math.nan))
    inverse = torch.where(
        d > 0, torch.div(torch.ones_like(d), torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(d)
    )
    q = torch.round(blocks * inverse.unsqueeze(-1))
    s = d * q.sum(dim=-1)
    return q.to(torch.int8).reshape(m, k), d, s


def _check_operands(x: torch.Tensor, weight: QuantWeight) -> None:
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, {weight.shape[1]}] for a weight {list(weight.shape)}, got {list(x.shape)}")
    if x.shape[0] < 1:
        raise ValueError("x needs at least one row")


def block_products(x: torch.Tensor, weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's sum before it is rounded: for x [M, K] and weight [N, K], (total, magnitude), each float64
    [M, N]. Per block b: the integer dot of the int8 activations (`quantize_activations`) with q_w (exact), times
    d_w * d_x (an fp32 product), that product rounded to fp32, plus m_w * s_x rounded to fp32; total is the sum of
    those fp32 terms taken in float64. magnitude is sum_b |d_w d_x| (|q_w| . |q_x|) + |m_w s_x|: it bounds every
    partial sum of any split of the block dots into lanes, so an fp32 sum of the pieces in any order of depth D
    is within about D * 2^-24 * magnitude of total."""
    _check_operands(x, weight)
    qx, dx, sx = quantize_activations(x)
    n, k = weight.shape
    blocks = k // BLOCK
    qw = (unpack_q4(weight.qs) if weight.format == "q4" else weight.qs).reshape(n, blocks, BLOCK)
    qw = qw.double().permute(1, 2, 0)  # [blocks, 32, N]
    dw = weight.scales.float().t()  # [blocks, N]
    mw = None if weight.mins is None else weight.mins.float().t()
    totals, magnitudes = [], []
    for start in range(0, x.shape[0], _TWIN_ROWS):
        rows = slice(start, start + _TWIN_ROWS)
        q = qx[rows].double().reshape(-1, blocks, BLOCK).transpose(0, 1)  # [blocks, rows, 32]
        scale = dx[rows].t().unsqueeze(-1) * dw.unsqueeze(1)  # [blocks, rows, N] fp32
        terms = scale * torch.bmm(q, qw).float()  # the dots [blocks, rows, N] are exact in fp32
        magnitude = scale.double().abs() * torch.bmm(q.abs(), qw.abs())
        if mw is not None:
            terms = torch.cat((terms, sx[rows].t().unsqueeze(-1) * mw.unsqueeze(1)))
            magnitude = torch.cat((magnitude, terms[-blocks:].double().abs()))
        totals.append(terms.double().sum(dim=0))
        magnitudes.append(magnitude.sum(dim=0))
    return torch.cat(totals), torch.cat(magnitudes)


def quant_matmul_reference(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) @ weight [N, K]^T -> [M, N] in x.dtype, with the native kernel's arithmetic:
    `block_products`' total rounded to fp32, then to x.dtype. The kernel sums the same fp32 terms in another
    order (in fp32), so the two differ by at most that sum's rounding."""
    total, _ = block_products(x, weight)
    return total.float().to(x.dtype)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare quant_matmul's C signature (kernels/cpu/kernels.h) on a loaded library (the package's, or a test's
    build of quant.c)."""
    return cpu_kernels.declare(lib, ["quant_matmul"])


@functools.cache
def _bound(lib: ctypes.CDLL) -> ctypes.CDLL:
    return bind(lib)


def _native() -> ctypes.CDLL | None:
    """The package's library as cpu_kernels._library() gives it now (the selected ISA build; tests swap it), with
    quant_matmul declared on it once."""
    lib = cpu_kernels._library()
    return None if lib is None else _bound(lib)


def quant_matmul_takes(weight: QuantWeight) -> bool:
    """Whether the native kernel multiplies by this weight: on a CPU, its tensors contiguous, the native library
    loaded (built on first use). K is a multiple of BLOCK by construction."""
    return (
        weight.qs.device.type == "cpu"
        and all(t.is_contiguous() for t in weight.tensors().values())
        and not torch.compiler.is_compiling()
        and _native() is not None
    )


def quant_matmul(x: torch.Tensor, weight: QuantWeight, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp32 on the CPU, unit column stride, M >= 1) @ weight [N, K]^T -> a new [M, N] tensor in
    x.dtype, by the native kernel (`lib`: a library `bind` has declared; default the package's), for a weight
    `quant_matmul_takes` (checked once per weight by the caller, not here). Equal to `quant_matmul_reference` up to
    the order of an fp32 sum; a row's bits do not depend on the other rows of x or on the thread count."""
    n, k = weight.scales.shape[0], weight.scales.shape[1] * BLOCK
    if (
        x.dim() != 2
        or x.shape[1] != k
        or x.shape[0] < 1
        or x.dtype not in cpu_kernels.NATIVE_DTYPES
        or x.stride(1) != 1
        or not x.is_cpu
    ):
        raise ValueError(
            f"the native quantized matmul takes CPU bf16 / fp32 rows x [M >= 1, {k}] with unit column "
            f"stride, got {x.dtype} {list(x.shape)} with strides {x.stride()} on {x.device}"
        )
    lib = lib or _native()
    if lib is None:
        raise ValueError("the native CPU kernels are not built here (see quant_matmul_takes)")
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    status = lib.quant_matmul(
        x.data_ptr(),
        x.stride(0) if m > 1 else k,
        weight.qs.data_ptr(),
        weight.scales.data_ptr(),
        None if weight.mins is None else weight.mins.data_ptr(),
        FORMAT_CODES[weight.format],
        out.data_ptr(),
        n,
        m,
        n,
        k,
        x.dtype == torch.bfloat16,
    )
    if status == -2:
        raise MemoryError(f"the native quantized matmul could not allocate {m} quantized rows of {k}")
    if status != 0:
        raise ValueError(
            f"the native quantized matmul refused x {list(x.shape)} (row stride {x.stride(0)}) by a "
            f"{weight.format} weight {list(weight.shape)}"
        )
    return out
