"""Weights kept quantized: the two block formats our CPU kernels multiply by, and their PyTorch twins.

Every quantized weight W [N, K] (a linear's [out_features, in_features], or an embedding table [vocab, hidden]) is
held as blocks of BLOCK = 32 consecutive elements along K, each block with an fp16 scale and, in the affine
variant, an fp16 min: element = scale * q + min.

- "q4": q in 0..15, two per byte. qs uint8 [N, K // 2]; block b of a row is bytes 16b .. 16b + 15, and byte j
  of it holds element 32b + j in its low nibble and element 32b + 16 + j in its high nibble (ggml's Q4_0 / Q4_1
  layout within a block). mins always present (a symmetric source such as Q4_0 has min = -8 * scale).
- "q8": q in -128..127. qs int8 [N, K]. mins None (symmetric: Q8_0, Q5_0 as q - 16, int8 at load) or present
  (affine: Q5_1, Q5_K, AWQ / GPTQ zero points).

GGUF's formats map onto these at load (worker/gguf.py): Q4_0, Q4_1 exactly; Q4_K, Q5_K with their sub-block
scales and mins rounded to fp16; Q8_0, Q5_0, Q5_1 exactly; Q6_K requantized to q8 blocks of 32. All three
tensors are row-major with N leading, so a tensor-parallel rank's rows (or its whole blocks of columns) are a
narrowing of each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
FORMATS = ("q4", "q8")


@dataclass
class QuantWeight:
    """A weight [N, K] in one of FORMATS (see the module docstring for the layout)."""

    format: str
    qs: torch.Tensor                  # q4: uint8 [N, K // 2]; q8: int8 [N, K]
    scales: torch.Tensor              # float16 [N, K // BLOCK]
    mins: torch.Tensor | None = None  # float16 [N, K // BLOCK] or None (q8 only)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"quantized format must be one of {FORMATS}, got {self.format!r}")
        n, blocks = self.scales.shape
        width = blocks * (BLOCK // 2 if self.format == "q4" else BLOCK)
        qs_dtype = torch.uint8 if self.format == "q4" else torch.int8
        if self.qs.dtype != qs_dtype or tuple(self.qs.shape) != (n, width):
            raise ValueError(f"{self.format} qs must be {qs_dtype} [{n}, {width}], got {self.qs.dtype} "
                             f"{list(self.qs.shape)}")
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
    return (blocks[..., :BLOCK // 2] | (blocks[..., BLOCK // 2:] << 4)).reshape(q.shape[0], -1)


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


def quant_linear_torch(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """x [M, K] @ dequantize(weight)^T -> [M, N] in x's dtype (fp32 products and sums): the plain twin."""
    return (x.float() @ dequantize(weight).to(x.device).T).to(x.dtype)


def quant_linear(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """x [M, K] times a quantized weight [N, K], transposed -> [M, N] in x's dtype, by the fastest path here."""
    return quant_linear_torch(x, weight)
