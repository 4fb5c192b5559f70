"""FP8 checkpoints (`quantization_config.quant_method` "fp8": DeepSeek-V3 / R1, Qwen3-*-FP8 and other releases in
transformers' FineGrainedFP8Config format) read dense (torch): each FP8 linear's weight and scale become one lazy
tensor, `Fp8Tensor`, that the loader takes in place of the dense `<prefix>.weight` [out, in].

The format:

- `<prefix>.weight`: float8_e4m3fn [out, in] (`fmt` "e4m3", the default; "e5m2" stores float8_e5m2).
- `<prefix>.weight_scale_inv`: [ceil(out / bo), ceil(in / bi)] for `weight_block_size` [bo, bi] (float32 as DeepSeek
  ships it; bf16, fp16 and float8_e8m0fnu, or e8m0 bytes with `scale_fmt` "ue8m0", read exactly), or one value: a
  scale for the whole tensor (so without `weight_block_size`; older per-tensor checkpoints name it `weight_scale`).
  Despite its name the scale multiplies: element (o, i) is weight[o, i] * scale[o // bo, i // bi].
- Which linears are FP8 is read from the tensors (FP8 dtype, or a scale beside the weight), so
  `modules_to_not_convert` / `ignored_layers` (a dense lm_head, routers) need no reading.
- Activation scales (`input_scale`, `activation_scale`: `activation_scheme` "static") and KV cache scales (`k_scale`,
  `v_scale`, `kv_scale`) are skipped: we compute activations and keep the KV cache in --dtype, not in FP8.

`read()` gives the dense values in float32: an FP8 value to float32 is exact and its product with a float32 scale is
one rounding (an e4m3 significand of 4 bits times one of 24 bits needs 28). The loader then casts them to --dtype
like any dense weight (one more rounding), or quantizes them (--quantization int8 / int4, kernels/quant.py's
`quantize`, from the float32 values as from a float32 dense checkpoint). Memory stays that of one tensor: each weight
is read and dequantized when the loader reaches it, over the rows or columns its tensor-parallel shard needs.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # quantization_config.fmt -> weight dtype
SCALE_FORMATS = ("float", "ue8m0")  # quantization_config.scale_fmt
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)  # exact in float32
SCALE_NAMES = ("weight_scale_inv", "weight_scale")  # the scale of `<prefix>.weight`, by preference
# activation and KV cache scales: skipped (activations and the KV cache stay in --dtype)
SKIPPED_SCALES = ("input_scale", "activation_scale", "k_scale", "v_scale", "kv_scale")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 linears are stored, from config.json's `quantization_config`."""

    block: tuple[int, int] | None  # weight_block_size [out, in]; None: one scale per tensor
    fmt: str = "e4m3"  # the weights' FP8 format (FP8_FORMATS)
    scale_fmt: str = "float"  # "ue8m0": scales may also be stored as e8m0 bytes (uint8)

    def __post_init__(self) -> None:
        if self.block is not None and (len(self.block) != 2 or min(self.block) <= 0):
            raise ValueError(f"quantization_config.weight_block_size must be two positive integers, got {self.block}")
        if self.fmt not in FP8_FORMATS:
            raise ValueError(
                f"quantization_config.fmt {self.fmt!r} is not supported (supported: {', '.join(FP8_FORMATS)})"
            )
        if self.scale_fmt not in SCALE_FORMATS:
            raise ValueError(
                f"quantization_config.scale_fmt {self.scale_fmt!r} is not supported "
                f"(supported: {', '.join(SCALE_FORMATS)})"
            )

    @property
    def weight_dtype(self) -> torch.dtype:
        return FP8_FORMATS[self.fmt]


# ---------------------------------------------------------------------------------------------------------
# The config


def fp8_scheme_of(config: Mapping[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json dict: None unless its quantization_config's quant_method is "fp8". ValueError
    naming the field for what we do not load: an activation_scheme other than dynamic / static, a weight_block_size
    that is no two positive integers, a fmt other than e4m3 / e5m2, a scale_fmt other than float / ue8m0, experts in
    another format (expert_dtype "fp4": DeepSeek-V4)."""
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping) or str(quant.get("quant_method", "")).lower() != "fp8":
        return None
    activations = str(quant.get("activation_scheme", "dynamic")).lower()
    if activations not in ("dynamic", "static"):
        raise ValueError(
            f"quantization_config.activation_scheme {quant.get('activation_scheme')!r} is not supported "
            "(dynamic or static; the activations are computed in --dtype either way)"
        )
    experts = str(quant.get("expert_dtype", "fp8")).lower()
    if experts != "fp8":
        raise ValueError(f"quantization_config.expert_dtype {quant.get('expert_dtype')!r} is not supported (fp8)")
    return Fp8Scheme(
        _block_of(quant.get("weight_block_size")),
        str(quant.get("fmt", "e4m3")).lower(),
        str(quant.get("scale_fmt", "float")).lower(),
    )


def _block_of(value: Any) -> tuple[int, int] | None:
    """weight_block_size as (rows, columns), None when absent (per-tensor scales)."""
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(f"quantization_config.weight_block_size must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


# ---------------------------------------------------------------------------------------------------------
# One FP8 weight


def _read_all(part: Any) -> torch.Tensor:
    """A whole checkpoint tensor: a torch.Tensor as it is, a lazy one (the loader's FileTensor) read."""
    return part if isinstance(part, torch.Tensor) else part.read()


def _window(part: Any, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """The window [rows) x [cols) of a 2-D checkpoint tensor, read by one narrowing of the file: only the columns
    when every row is wanted, else only the rows (their whole width, when both are narrowed)."""
    n, k = (int(d) for d in part.shape)
    if cols == (0, k):
        return part.narrow(0, rows[0], rows[1] - rows[0])
    if rows == (0, n):
        return part.narrow(1, cols[0], cols[1] - cols[0])
    return part.narrow(0, rows[0], rows[1] - rows[0])[:, cols[0] : cols[1]]


class Fp8Tensor:
    """One FP8 linear weight as the loader sees a checkpoint tensor: shape [out, in], `narrow` (a lazy view) and
    `read()` (dense float32: each FP8 value times its block's scale, one rounding).

    Invariants: the view is rows [r0, r1) x columns [c0, c1) of the full weight [N, K]; its scales are blocks
    `self.block` of the full weight (N x K for a scale of one value). Only the view's rows or columns of the weight
    and the scales of the blocks they touch are read, when asked.
    """

    def __init__(self, name: str, scheme: Fp8Scheme, weight: Any, scale: Any, scale_name: str) -> None:
        self.name, self.scheme, self.scale_name = name, scheme, scale_name
        self._weight, self._scale = weight, scale
        dims = tuple(int(d) for d in weight.shape)
        if len(dims) != 2 or 0 in dims:
            raise ValueError(f"FP8 weight {name} has shape {list(dims)}: a linear weight is [out, in], not empty")
        if getattr(weight, "dtype", None) != scheme.weight_dtype:
            raise ValueError(
                f"{name} is {getattr(weight, 'dtype', None)}, but quantization_config.fmt {scheme.fmt!r} stores "
                f"{scheme.weight_dtype} (and {scale_name} scales it)"
            )
        n, k = dims
        self.full_shape = (n, k)
        self.block = self._check_scale()
        self._rows, self._cols = (0, n), (0, k)

    # -- what it is

    @property
    def shape(self) -> tuple[int, int]:
        return self._rows[1] - self._rows[0], self._cols[1] - self._cols[0]

    def __repr__(self) -> str:
        return f"Fp8Tensor({self.name!r}, {self.scheme.fmt}, block {list(self.block)}, {list(self.shape)})"

    def _check_scale(self) -> tuple[int, int]:
        """The block each scale value covers: the scheme's, or the whole weight for a scale of one value."""
        dtype = getattr(self._scale, "dtype", None)
        if dtype not in SCALE_DTYPES and not (dtype == torch.uint8 and self.scheme.scale_fmt == "ue8m0"):
            raise ValueError(
                f"{self.scale_name} is {dtype}: FP8 scales are float32, bfloat16, float16 or float8_e8m0fnu "
                "(uint8 e8m0 bytes with quantization_config.scale_fmt 'ue8m0')"
            )
        n, k = self.full_shape
        found = tuple(int(d) for d in self._scale.shape)
        if len(found) <= 2 and all(d == 1 for d in found):
            return n, k  # one scale for the whole weight
        if self.scheme.block is None:
            raise ValueError(
                f"{self.scale_name} has shape {list(found)}: without quantization_config.weight_block_size an FP8 "
                f"weight's scale is one value (the weight {self.name} is [{n}, {k}])"
            )
        bo, bi = self.scheme.block
        grid = (-(-n // bo), -(-k // bi))
        if found != grid:
            raise ValueError(
                f"{self.scale_name} has shape {list(found)}; the FP8 weight {self.name} [{n}, {k}] in blocks of "
                f"[{bo}, {bi}] (quantization_config.weight_block_size) needs {list(grid)}"
            )
        return bo, bi

    # -- views

    def narrow(self, dim: int, start: int, length: int) -> Fp8Tensor:
        """A lazy view of `length` rows (dim 0: outputs) or columns (dim 1: inputs) from `start`: a tensor-parallel
        rank's shard, anywhere (not only on block boundaries). ValueError outside the tensor."""
        dim = dim + 2 if dim < 0 else dim
        if dim not in (0, 1) or start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"{self!r}: cannot narrow dim {dim} to [{start}, {start + length})")
        view = copy.copy(self)
        first = (self._rows if dim == 0 else self._cols)[0] + start
        if dim == 0:
            view._rows = (first, first + length)
        else:
            view._cols = (first, first + length)
        return view

    # -- reading

    def scales(self) -> torch.Tensor:
        """The scales of the blocks the view touches, float32 [row blocks, column blocks] (exact), the first being
        block (r0 // bo, c0 // bi)."""
        (r0, r1), (c0, c1) = self._rows, self._cols
        bo, bi = self.block
        if self.block == self.full_shape:
            scale = _read_all(self._scale).reshape(1, 1)
        else:
            scale = _window(self._scale, (r0 // bo, -(-r1 // bo)), (c0 // bi, -(-c1 // bi)))
        if scale.dtype == torch.uint8:  # e8m0 bytes (scale_fmt "ue8m0"): 2^(byte - 127)
            scale = scale.view(torch.float8_e8m0fnu)
        scale = scale.float()
        if not torch.isfinite(scale).all():
            raise ValueError(f"{self.scale_name}: a scale is not finite")
        return scale

    def read(self) -> torch.Tensor:
        """The view dense, float32 [rows, cols]: weight * scale of its block, rounded once. ValueError naming the
        weight if a value is not finite (an FP8 NaN, or a product past float32's range)."""
        (r0, r1), (c0, c1) = self._rows, self._cols
        bo, bi = self.block
        dense = _window(self._weight, self._rows, self._cols).float()
        scale = self.scales()
        columns = scale[:, torch.arange(c0, c1) // bi - c0 // bi]  # [row blocks, cols]: each column's block scale
        for j, block in enumerate(range(r0 // bo, -(-r1 // bo))):  # one block row at a time: no second [rows, cols]
            start, stop = max(r0, block * bo) - r0, min(r1, (block + 1) * bo) - r0
            dense[start:stop].mul_(columns[j])
        if not torch.isfinite(dense).all():
            raise ValueError(f"{self.name}: an FP8 value or its product with {self.scale_name} is not finite")
        return dense


# ---------------------------------------------------------------------------------------------------------
# A checkpoint's tensors


def group_fp8_tensors(scheme: Fp8Scheme, tensors: Mapping[str, Any]) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(name, reader) for a checkpoint's tensors by name (each with `shape`, `dtype` and `narrow`), a reader being a
    function of no arguments that gives the tensor: every `<prefix>.weight` that is FP8 or has a scale beside it
    becomes one Fp8Tensor of that name (built, and checked, when read: another expert-parallel rank's experts never
    are); activation and KV cache scales are skipped; every other tensor passes through as it is. ValueError naming
    the tensor for a scale with no weight or an FP8 tensor that is no linear's weight."""
    skipped = sorted(name for name in tensors if name.rpartition(".")[2] in SKIPPED_SCALES)
    if skipped:
        logger.info(
            "FP8 checkpoint: %d activation / KV cache scales skipped (%s, ...): activations and the KV cache are "
            "computed in --dtype",
            len(skipped),
            skipped[0],
        )
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in SKIPPED_SCALES:
            continue
        if leaf in SCALE_NAMES:
            if f"{prefix}.weight" not in tensors:
                raise ValueError(f"checkpoint tensor {name!r} scales a weight the checkpoint lacks ({prefix}.weight)")
            continue
        scale_name = next((f"{prefix}.{s}" for s in SCALE_NAMES if f"{prefix}.{s}" in tensors), None)
        fp8 = getattr(tensor, "dtype", None) in FP8_DTYPES
        if leaf == "weight" and (fp8 or scale_name is not None):
            if scale_name is None:
                raise ValueError(f"FP8 weight {name!r} lacks its scale {prefix}.weight_scale_inv")
            yield name, functools.partial(Fp8Tensor, name, scheme, tensor, tensors[scale_name], scale_name)
        elif fp8:
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}: only linear weights are read as FP8")
        else:
            yield name, functools.partial(_given, tensor)


def _given(tensor: Any) -> Any:
    return tensor
