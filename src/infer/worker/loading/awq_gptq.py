"""AWQ and GPTQ int4 checkpoints loaded as they are (torch): each quantized linear's packed tensors become one lazy
tensor, `Int4Tensor`, that the loader takes in place of a dense `<prefix>.weight` [out, in].

The formats (4 bits, int32 words of 8 nibbles; nibble i of a word is bits 4i .. 4i + 3):

- AWQ "gemm" (AutoAWQ's WQLinear_GEMM; transformers' AwqConfig version "gemm"): qweight int32 [in, out / 8] packs 8
  output columns per word, nibble i holding column 8c + AWQ_ORDER[i]; qzeros int32 [groups, out / 8] packed the
  same way; scales fp16 [groups, out]. Zeros are stored as they are (0..15).
- GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq" or "gptq_v2"): qweight int32 [in / 8, out] packs 8 input
  rows per word in plain order (nibble i is input 8r + i); qzeros int32 [groups, out / 8] packs 8 output columns
  in plain order; scales fp16 [groups, out]; g_idx int32 [in] (the group of each input, i // group_size unless
  the checkpoint was quantized with desc_act, which we refuse). The classic "gptq" format stores zero - 1 in each
  nibble (read back as nibble + 1, so 1..16); "gptq_v2" stores the zero itself.

Element (out o, in i) of group g = i // group_size (group_size -1: one group per row) is s[g, o] * (q - z[g, o]).
Our q4 blocks (kernels/quant.py) hold 32 consecutive inputs with an fp16 scale and min, element = scale * q + min;
a group size that is a multiple of 32 puts every block inside one group, which gives it scale = s and
min = -s * z. s * z is exact in fp32 (11-bit mantissa times z <= 16), so rounding it to fp16 is the only rounding:
|min - (-s z)| <= 2^-11 |s z| <= s / 128 (a 128th of a quantization step; 2^-25 absolute below fp16's normal
range). q and s are kept exactly. `read()` gives the exact dense values s * (q - z) in float32.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from infer.kernels.quant import BLOCK, QuantWeight, pack_q4

PACK = 8  # 4-bit values per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ: nibble i of a word holds output column 8c + AWQ_ORDER[i]
PARTS = ("qweight", "qzeros", "scales", "g_idx")
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what is added to each stored zero


class Part(Protocol):
    """A checkpoint tensor not read yet (the loader's FileTensor) or a torch.Tensor: `shape` and a narrowing read."""

    shape: Any

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class Int4Scheme:
    """How a checkpoint's int4 linears are stored, from config.json's `quantization_config`."""

    method: str  # "awq" or "gptq"
    group_size: int  # inputs per (scale, zero); -1: one group per row
    zero_offset: int  # added to every stored zero: 1 for GPTQ's classic "gptq" format, else 0

    def __post_init__(self) -> None:
        if self.method not in ("awq", "gptq"):
            raise ValueError(f"quantization_config.quant_method must be 'awq' or 'gptq', got {self.method!r}")
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % BLOCK):
            raise ValueError(
                f"quantization_config.group_size must be -1 or a positive multiple of {BLOCK} (our "
                f"blocks of {BLOCK} lie inside one group), got {self.group_size}"
            )
        if self.zero_offset not in (0, 1):
            raise ValueError(f"zero_offset must be 0 or 1, got {self.zero_offset}")


# ---------------------------------------------------------------------------------------------------------
# The config


def scheme_of(config: Mapping[str, Any]) -> Int4Scheme | None:
    """The int4 scheme of a config.json dict: None when it has no `quantization_config` (or an FP8 / MXFP4 one, read
    elsewhere). ValueError naming the field for what we do not load: another quant_method, bits other than 4, AWQ
    other than "gemm" with zero points, a GPTQ format other than gptq / gptq_v2 or other than int32 words, per-module
    overrides."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise ValueError(f"config.json's quantization_config must be an object, got {type(quant).__name__}")
    method = str(quant.get("quant_method", "")).lower()
    if method == "awq":
        return _awq_scheme(quant)
    if method == "gptq":
        return _gptq_scheme(quant)
    if method == "mxfp4":  # GPT-OSS's experts: its model dequantizes them at load (worker/models/gpt_oss.py)
        return None
    if method == "fp8":  # read dense at load (worker/loading/fp8.py)
        return None
    raise ValueError(
        f"quantization_config.quant_method {quant.get('quant_method')!r} is not supported: AWQ and "
        "GPTQ int4 checkpoints load as they are, FP8 ones dense, others need a dense or GGUF checkpoint"
    )


def _field(quant: Mapping[str, Any], names: tuple[str, ...], default: Any = None) -> Any:
    """The first of `names` present (AutoAWQ's own quant_config.json spells bits w_bit, group_size q_group_size)."""
    return next((quant[name] for name in names if name in quant), default)


def _check_bits(quant: Mapping[str, Any], method: str) -> int:
    bits = _field(quant, ("bits", "w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config.bits must be 4 for a {method} checkpoint, got {bits!r}")
    group_size = _field(quant, ("group_size", "q_group_size"), -1)
    if not isinstance(group_size, int):
        raise ValueError(f"quantization_config.group_size must be an integer, got {group_size!r}")
    return group_size


def _awq_scheme(quant: Mapping[str, Any]) -> Int4Scheme:
    group_size = _check_bits(quant, "AWQ")
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(
            f"quantization_config.version {quant.get('version')!r} is not supported: AWQ checkpoints "
            "load in the GEMM layout (version 'gemm'); GEMV and other layouts pack differently"
        )
    if not quant.get("zero_point", True):
        raise ValueError("quantization_config.zero_point false is not supported: AWQ GEMM checkpoints carry zeros")
    return Int4Scheme("awq", group_size, 0)


def _gptq_scheme(quant: Mapping[str, Any]) -> Int4Scheme:
    group_size = _check_bits(quant, "GPTQ")
    fmt = str(_field(quant, ("checkpoint_format", "format"), "gptq")).lower()
    if fmt not in GPTQ_FORMATS:
        raise ValueError(
            f"quantization_config.checkpoint_format {fmt!r} is not supported (supported: "
            f"{', '.join(GPTQ_FORMATS)}); marlin and other repacked formats need their own reader"
        )
    pack_dtype = str(quant.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise ValueError(f"quantization_config.pack_dtype must be int32, got {quant.get('pack_dtype')!r}")
    dynamic = quant.get("dynamic") or {}
    if any(not str(pattern).startswith("-:") for pattern in dynamic):
        raise ValueError(
            "quantization_config.dynamic: per-module quantization overrides are not supported "
            f"(only '-:' exclusions), got {sorted(dynamic)}"
        )
    return Int4Scheme("gptq", group_size, GPTQ_FORMATS[fmt])


def directory_scheme(path: Path) -> Int4Scheme | None:
    """The int4 scheme of the checkpoint in directory `path` (its config.json), None for a dense one or no config."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return scheme_of(json.loads(config.read_text()))


# ---------------------------------------------------------------------------------------------------------
# One quantized weight


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i of every word (bits 4i .. 4i + 3), i = 0 .. 7."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _columns_of_words(words: torch.Tensor, method: str) -> torch.Tensor:
    """Words packing 8 output columns each (AWQ's qweight and qzeros, GPTQ's qzeros), int32 [R, W] -> uint8 [R, 8W]
    with column j at index j."""
    nibbles = unpack_words(words)  # [R, W, 8]: nibble i
    if method == "awq":  # nibble i is column AWQ_ORDER[i]: invert
        inverse = torch.tensor([AWQ_ORDER.index(j) for j in range(PACK)])
        nibbles = nibbles[..., inverse]
    return nibbles.reshape(words.shape[0], -1)


def _read(part: Part, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """The window [rows) x [cols) of a 2-D checkpoint tensor, reading only `rows` (a narrowing) from the file."""
    return part.narrow(0, rows[0], rows[1] - rows[0])[:, cols[0] : cols[1]]


class Int4Tensor:
    """One AWQ / GPTQ linear weight as the loader sees a checkpoint tensor: shape [out, in] (transformers'
    orientation), `narrow` (a lazy view), `read()` (dense float32, exact) and `quantized()` (our q4 blocks).

    Invariants: the view is rows [r0, r1) of the outputs times columns [c0, c1) of the inputs of the full weight
    [N, K]; columns narrow in whole blocks of 32 (so every block stays inside one group). The packed parts are
    read only over the view's rows and groups, when asked.
    """

    def __init__(self, name: str, scheme: Int4Scheme, parts: Mapping[str, Part]) -> None:
        missing = [p for p in PARTS[:3] if p not in parts]
        if missing:
            lacking = ", ".join(f"{name}.{part}" for part in missing)
            raise ValueError(f"{scheme.method.upper()} layer {name!r} lacks {lacking}")
        self.name, self.scheme = name, scheme
        self._qweight, self._qzeros, self._scales = parts["qweight"], parts["qzeros"], parts["scales"]
        words_in, words_out = (int(d) for d in self._qweight.shape)
        n, k = (words_out * PACK, words_in) if scheme.method == "awq" else (words_out, words_in * PACK)
        self.full_shape = (n, k)
        self.group_size = k if scheme.group_size == -1 else scheme.group_size
        self._check_shapes()
        if "g_idx" in parts:
            self._check_group_index(parts["g_idx"])
        self._rows, self._cols = (0, n), (0, k)

    # -- what it is

    @property
    def shape(self) -> tuple[int, int]:
        return self._rows[1] - self._rows[0], self._cols[1] - self._cols[0]

    def __repr__(self) -> str:
        return f"Int4Tensor({self.name!r}, {self.scheme.method}, g={self.scheme.group_size}, {list(self.shape)})"

    def _check_shapes(self) -> None:
        n, k = self.full_shape
        groups = -(-k // self.group_size)
        expected = {"qzeros": (groups, n // PACK), "scales": (groups, n)}
        for part, shape in expected.items():
            found = tuple(int(d) for d in getattr(self, f"_{part}").shape)
            if found != shape:
                raise ValueError(
                    f"{self.name}.{part} has shape {list(found)}; a {self.scheme.method.upper()} int4 "
                    f"weight [{n}, {k}] with group_size {self.scheme.group_size} needs {list(shape)}"
                )

    def _check_group_index(self, g_idx: Part) -> None:
        """GPTQ's g_idx must be i // group_size: a shuffled one (desc_act / act-order) regroups the inputs."""
        k = self.full_shape[1]
        if tuple(g_idx.shape) != (k,):
            raise ValueError(f"{self.name}.g_idx has shape {list(g_idx.shape)}, expected [{k}]")
        found = g_idx.narrow(0, 0, k)
        if not torch.equal(found.to(torch.int64), torch.arange(k) // self.group_size):
            raise ValueError(
                f"{self.name}.g_idx is not i // group_size: quantization_config.desc_act (act-order) "
                "checkpoints with a shuffled g_idx are not supported; requantize without desc_act"
            )

    # -- views

    def narrow(self, dim: int, start: int, length: int) -> Int4Tensor:
        """A lazy view of `length` rows (dim 0: outputs) or columns (dim 1: inputs, in whole blocks of 32) from
        `start`: a tensor-parallel rank's shard. ValueError outside the tensor or off the blocks."""
        dim = dim + 2 if dim < 0 else dim
        if dim not in (0, 1) or start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"{self!r}: cannot narrow dim {dim} to [{start}, {start + length})")
        if dim == 1 and (start % BLOCK or length % BLOCK):
            raise ValueError(f"{self!r}: columns narrow in whole blocks of {BLOCK}, not [{start}, {start + length})")
        view = copy.copy(self)
        first = (self._rows if dim == 0 else self._cols)[0] + start
        if dim == 0:
            view._rows = (first, first + length)
        else:
            view._cols = (first, first + length)
        return view

    # -- reading

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The view's integer codes and its groups: (q uint8 [rows, cols] in 0..15, zeros int16 [rows, G] with the
        format's offset applied, scales float16 [rows, G]), G the groups the view's columns touch, first group
        self._cols[0] // group_size."""
        (r0, r1), (c0, c1) = self._rows, self._cols
        g0, g1 = c0 // self.group_size, (c1 - 1) // self.group_size + 1
        w0, w1 = r0 // PACK, -(-r1 // PACK)  # the words holding the view's output columns
        mine = slice(r0 - w0 * PACK, r1 - w0 * PACK)  # the view's columns among theirs
        if self.scheme.method == "awq":  # [in, out / 8] -> [in, out] -> [out, in]
            q = _columns_of_words(_read(self._qweight, (c0, c1), (w0, w1)), "awq")[:, mine].t()
        else:  # [in / 8, out] -> [out, in / 8, 8] -> [out, in]
            words = _read(self._qweight, (c0 // PACK, c1 // PACK), (r0, r1))
            q = unpack_words(words.t()).reshape(r1 - r0, c1 - c0)
        zeros = _columns_of_words(_read(self._qzeros, (g0, g1), (w0, w1)), self.scheme.method)
        zeros = zeros[:, mine].t().to(torch.int16) + self.scheme.zero_offset
        scales = _read(self._scales, (g0, g1), (r0, r1)).t()
        if scales.dtype != torch.float16:
            raise ValueError(f"{self.name}.scales must be float16, got {scales.dtype}")
        return q.contiguous(), zeros.contiguous(), scales.contiguous()

    def _group_of(self, columns: torch.Tensor) -> torch.Tensor:
        """Index into codes()' groups of each of the view's columns (given relative to the view)."""
        c0 = self._cols[0]
        return (c0 + columns) // self.group_size - c0 // self.group_size

    def read(self) -> torch.Tensor:
        """The view dense, float32 [rows, cols]: s * (q - z), exact (an fp16 s times an integer in -16..15)."""
        q, zeros, scales = self.codes()
        group = self._group_of(torch.arange(q.shape[1]))
        return scales[:, group].float() * (q.to(torch.int16) - zeros[:, group]).float()

    def quantized(self) -> QuantWeight:
        """The view in our q4 blocks: q as stored, scale = s, min = -s * z rounded to fp16 (the only rounding; see
        the module docstring for its bound). ValueError when the columns are no whole blocks of 32 (group_size -1
        with an input width that is not a multiple of 32: such a layer is kept dense through `read()`)."""
        q, zeros, scales = self.codes()
        if q.shape[1] % BLOCK:
            raise ValueError(f"{self!r}: {q.shape[1]} inputs are no whole blocks of {BLOCK}; load it dense")
        group = self._group_of(torch.arange(0, q.shape[1], BLOCK))
        block_scales = scales[:, group]
        mins = (-(block_scales.float() * zeros[:, group].float())).to(torch.float16)
        if not (torch.isfinite(block_scales).all() and torch.isfinite(mins).all()):
            raise ValueError(f"{self.name}: a scale or -scale * zero is not finite in fp16")
        return QuantWeight("q4", pack_q4(q), block_scales.contiguous(), mins.contiguous())


# ---------------------------------------------------------------------------------------------------------
# A checkpoint's tensors


def group_tensors(scheme: Int4Scheme, tensors: Mapping[str, Part]) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(name, reader) for a checkpoint's tensors by name, a reader being a function of no arguments that gives the
    tensor: every `<prefix>.qweight` with its `.qzeros`, `.scales` and optional `.g_idx` becomes one Int4Tensor
    named `<prefix>.weight` (built, and its g_idx checked, when read); every other tensor (embeddings, norms, an
    unquantized lm_head, biases) passes through as it is."""
    prefixes = {name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight")}
    grouped: set[str] = set()
    for prefix in sorted(prefixes):
        parts = {part: tensors[f"{prefix}.{part}"] for part in PARTS if f"{prefix}.{part}" in tensors}
        grouped.update(f"{prefix}.{part}" for part in parts)
        yield f"{prefix}.weight", functools.partial(Int4Tensor, prefix, scheme, parts)
    for name, tensor in tensors.items():
        if name not in grouped:
            yield name, functools.partial(_given, tensor)


def _given(tensor: Part) -> Part:
    return tensor
