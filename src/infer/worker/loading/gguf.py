"""GGUF files read as they are: quantized tensors stay in their blocks until someone asks for them.

`GGUFFile(path)` parses the file's header and metadata once (our own reader, GGUFHeader; the tensor data stays a
memory map, nothing of it is read at open) and names every tensor the way a transformers checkpoint of the same
model does, so the loader can treat it like a safetensors file. `GGUFTensor` is one tensor, unread: `shape`
(transformers' orientation, [out, in] for matrices), `ggml_type`, `dequantize(dtype)` (our own vectorized torch
decoding), `quantized()` (the blocks repacked into kernels/quant.py's q4 / q8 formats, read straight from the raw
block bytes), `narrow(dim, start, length)` (a lazy tensor-parallel shard) and `read()` (the loader's FileTensor
interface).

Repacking GGUF blocks into QuantWeight (q = the stored integer, d / dmin / m the block's fp16 fields, sc / mn a
K-quant's 6-bit sub-block scale / min):

    Q4_0 -> q4, scale d, min -8 d                   exact
    Q4_1 -> q4, scale d, min m                      exact
    Q8_0 -> q8 symmetric, scale d                   exact
    Q5_0 -> q8 symmetric, q - 16, scale d           exact
    Q5_1 -> q8 affine, scale d, min m               exact
    Q4_K -> q4 per 32, scale fp16(d sc), min fp16(-dmin mn)
    Q5_K -> q8 affine per 32, the same scale and min
    Q6_K -> q8 symmetric per 32, requantized from the dequantized values by kernels.quant.quantize

Exact means that kernels.quant.dequantize of the repacked weight equals gguf-py's dequantization bit for bit (in
float32). The bounds of the others, per element, in float32 arithmetic:

    Q4_K, Q5_K: |ours - gguf| <= 2^-11 (qmax |d sc| + |dmin mn|) + (qmax + 1) 2^-25 + f32 rounding
                (qmax = 15 for Q4_K, 31 for Q5_K: half an fp16 ulp on the product scale and min, the 2^-25 terms
                where those fall below fp16's normal range; the products d sc, dmin mn are exact in f32)
    Q6_K:       |ours - gguf| <= S / 2 + f32 rounding, with S = fp16(absmax / 127) the new scale of the element's
                block of 32 (so at most absmax / 254 (1 + 2^-11) where absmax / 127 is a normal fp16): Q6_K's
                two 16-element sub-blocks of a 32-block have their own scales, which one int8 grid cannot hold
                in general

A repack (or decode) that overflows fp16 (|8 d| > 65504 for Q4_0, |d sc| for a K-quant) is a ValueError naming
the tensor; real weights are many orders of magnitude below.

llama.cpp's converter permutes the rows of a llama-architecture attn_q / attn_k (each head's rotary halves
interleaved); transformers undoes it on load (`reverse_permute_weights`), and so do we: a GGUFTensor carries the
order of its rows, which moves whole rows (whole blocks along K), so the quantized storage is permuted without
decoding anything.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import mmap
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from infer.kernels.quant import BLOCK, QuantWeight, pack_q4, quantize, unpack_q4

Q = GGMLQuantizationType
# Decoded (and repacked) a chunk of rows at a time: float32 temporaries stay around this many elements (4 MiB).
DECODE_CHUNK_ELEMENTS = 1 << 20
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
NATURAL_DTYPE = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}

# ---------------------------------------------------------------------------------------------------------
# Names: GGUF -> transformers

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Architectures whose attn_q / attn_k rows llama.cpp's converter permuted (transformers' TENSOR_PROCESSORS).
PERMUTED_ARCHITECTURES = ("llama",)
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that are no checkpoint weight: llama 3's rope frequency factors (the config's rope scaling carries them).
SKIPPED_NAMES = frozenset({"rope_freqs.weight"})
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERT_PART = re.compile(r"_exps|_shexp|ffn_gate_inp")


def checkpoint_name(gguf_name: str) -> str | None:
    """The transformers checkpoint name of GGUF tensor `gguf_name` (None for one that is no weight, see
    SKIPPED_NAMES). NotImplementedError for MoE expert / router tensors, ValueError for a name we do not know."""
    if gguf_name in SKIPPED_NAMES:
        return None
    if _EXPERT_PART.search(gguf_name):
        raise NotImplementedError(
            f"GGUF tensor {gguf_name!r} belongs to MoE experts, which are not read from GGUF files yet"
        )
    module, _, kind = gguf_name.rpartition(".")
    if module in GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{GLOBAL_NAMES[module]}.{kind}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in LAYER_NAMES:
        raise ValueError(
            f"GGUF tensor {gguf_name!r} has no transformers name (known: {sorted(GLOBAL_NAMES)}, "
            f"blk.N.{{{', '.join(LAYER_NAMES)}}})"
        )
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"


def unpermute_order(num_rows: int, num_heads: int) -> np.ndarray:
    """int64 [num_rows]: row r of transformers' attn q / k weight is row order[r] of llama.cpp's.

    llama.cpp stored each head's rows (rotary halves [a0..a(h-1), b0..b(h-1)]) interleaved as [a0, b0, a1, b1 ...]
    (`w.reshape(heads, 2, half, ...).swapaxes(1, 2)`); the inverse gathers them back. `num_heads`: query heads for
    attn_q, key-value heads for attn_k."""
    if num_heads <= 0 or num_rows % (2 * num_heads):
        raise ValueError(f"{num_rows} rows do not split into {num_heads} heads of two rotary halves")
    half = num_rows // num_heads // 2
    return np.arange(num_rows, dtype=np.int64).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(-1)


# ---------------------------------------------------------------------------------------------------------
# Decoding GGUF blocks (each function: uint8 [n, type_size] -> float32 [n, block_size], the same float32
# operations in the same order as gguf-py's numpy reference, so the results agree bit for bit)


def _field(blocks: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes start..stop of every block viewed as `dtype`: [n, (stop - start) / itemsize]."""
    return blocks[:, start:stop].contiguous().view(dtype)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, as float32 [n, 1]."""
    return _field(blocks, start, start + 2, torch.float16).float()


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, B] -> uint8 [n, 8 B]: bit i of the little-endian bit string (0 or 1)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(packed.shape[0], -1)


def _q5(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    """A Q5_0 / Q5_1 block's 5-bit values, uint8 [n, 32] (4 low bits in the 16 bytes after qh, 32 high bits in
    qh's 4 bytes)."""
    low = unpack_q4(blocks[:, qh_at + 4 : qh_at + 20])
    return low | (_bits(blocks[:, qh_at : qh_at + 4]) << 4)


def _decode_float(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return blocks.contiguous().view(dtype).float()


def _decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = unpack_q4(blocks[:, 2:18]).to(torch.int8) - 8
    return _f16(blocks, 0) * q.float()


def _decode_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * unpack_q4(blocks[:, 4:20]).float() + _f16(blocks, 2)


def _decode_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * (_q5(blocks, 2).to(torch.int8) - 16).float()


def _decode_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _q5(blocks, 4).float() + _f16(blocks, 2)


def _decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:34].view(torch.int8).float() * _f16(blocks, 0)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 8 sub-block scales and mins (6 bits each, packed in bytes 4..15), uint8 [n, 8] each."""
    packed = blocks[:, 4:16].reshape(-1, 3, 4)
    sc_low, mn_low, high = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = torch.cat((sc_low & 0x3F, (high & 0x0F) | ((sc_low >> 2) & 0x30)), dim=-1)
    mins = torch.cat((mn_low & 0x3F, (high >> 4) | ((mn_low >> 2) & 0x30)), dim=-1)
    return scales, mins


def _k_step_and_offset(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: d sc and dmin mn per sub-block, float32 [n, 8] (exact: an fp16 times a 6-bit integer)."""
    scales, mins = _k_scales(blocks)
    return _f16(blocks, 0) * scales.float(), _f16(blocks, 2) * mins.float()


def _q4_k_values(blocks: torch.Tensor, qs_at: int) -> torch.Tensor:
    """The 4-bit values of a Q4_K / Q5_K super-block, uint8 [n, 8, 32]: 4 chunks of 32 bytes, the low nibbles of
    chunk c are sub-block 2c, the high nibbles sub-block 2c + 1."""
    chunks = blocks[:, qs_at : qs_at + 128].reshape(-1, 4, 1, 32)
    return torch.cat((chunks & 0x0F, chunks >> 4), dim=2).reshape(-1, 8, 32)


def _q5_k_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K's 5-bit values, uint8 [n, 8, 32]: the Q4_K layout plus bit s of qh byte j for element j of sub-block s."""
    high = (blocks[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
    return _q4_k_values(blocks, 48) | (high << 4)


def _decode_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    step, offset = _k_step_and_offset(blocks)
    values = step.unsqueeze(-1) * _q4_k_values(blocks, 16).float() - offset.unsqueeze(-1)
    return values.reshape(-1, 256)


def _decode_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    step, offset = _k_step_and_offset(blocks)
    return (step.unsqueeze(-1) * _q5_k_values(blocks).float() - offset.unsqueeze(-1)).reshape(-1, 256)


def _decode_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 elements), fp16 d."""
    low = blocks[:, :128].reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    q = ((low & 0x0F).reshape(-1, 8, 32) | ((high & 0x03).reshape(-1, 8, 32) << 4)).to(torch.int8) - 32
    step = _f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()
    return (step.unsqueeze(-1) * q.reshape(-1, 16, 16).float()).reshape(-1, 256)


DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: lambda blocks: _decode_float(blocks, torch.float32),
    Q.F16: lambda blocks: _decode_float(blocks, torch.float16),
    Q.BF16: lambda blocks: _decode_float(blocks, torch.bfloat16),
    Q.Q4_0: _decode_q4_0,
    Q.Q4_1: _decode_q4_1,
    Q.Q5_0: _decode_q5_0,
    Q.Q5_1: _decode_q5_1,
    Q.Q8_0: _decode_q8_0,
    Q.Q4_K: _decode_q4_k,
    Q.Q5_K: _decode_q5_k,
    Q.Q6_K: _decode_q6_k,
}

# ---------------------------------------------------------------------------------------------------------
# Repacking GGUF blocks into QuantWeight storage (each function: uint8 [n, type_size] -> (qs, scales, mins) of
# the n blocks' elements, one row per GGUF block: qs [n, q-blocks * bytes per q-block], scales / mins float16
# [n, q-blocks], mins None for a symmetric format)

Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _repack_q4_0(blocks: torch.Tensor) -> Packed:
    scales = _field(blocks, 0, 2, torch.float16)
    return blocks[:, 2:18], scales, (scales.float() * -8).half()  # -8 d: exact unless it overflows


def _repack_q4_1(blocks: torch.Tensor) -> Packed:
    return blocks[:, 4:20], _field(blocks, 0, 2, torch.float16), _field(blocks, 2, 4, torch.float16)


def _repack_q8_0(blocks: torch.Tensor) -> Packed:
    return blocks[:, 2:34].view(torch.int8), _field(blocks, 0, 2, torch.float16), None


def _repack_q5_0(blocks: torch.Tensor) -> Packed:
    return _q5(blocks, 2).to(torch.int8) - 16, _field(blocks, 0, 2, torch.float16), None


def _repack_q5_1(blocks: torch.Tensor) -> Packed:
    return _q5(blocks, 4).to(torch.int8), _field(blocks, 0, 2, torch.float16), _field(blocks, 2, 4, torch.float16)


def _k_fp16_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K sub-block scale d sc and min -dmin mn, each rounded to fp16 once: [n, 8] float16."""
    step, offset = _k_step_and_offset(blocks)
    return step.half(), (-offset).half()


def _repack_q4_k(blocks: torch.Tensor) -> Packed:
    scales, mins = _k_fp16_scales(blocks)
    return pack_q4(_q4_k_values(blocks, 16).reshape(-1, 256)), scales, mins


def _repack_q5_k(blocks: torch.Tensor) -> Packed:
    scales, mins = _k_fp16_scales(blocks)
    return _q5_k_values(blocks).reshape(-1, 256).to(torch.int8), scales, mins


def _repack_q6_k(blocks: torch.Tensor) -> Packed:
    weight = quantize(_decode_q6_k(blocks), "q8")
    return weight.qs, weight.scales, None


REPACKERS: dict[GGMLQuantizationType, tuple[str, bool, Callable[[torch.Tensor], Packed]]] = {
    # GGUF type: (our format, whether it carries mins, the repacker)
    Q.Q4_0: ("q4", True, _repack_q4_0),
    Q.Q4_1: ("q4", True, _repack_q4_1),
    Q.Q4_K: ("q4", True, _repack_q4_k),
    Q.Q8_0: ("q8", False, _repack_q8_0),
    Q.Q5_0: ("q8", False, _repack_q5_0),
    Q.Q5_1: ("q8", True, _repack_q5_1),
    Q.Q5_K: ("q8", True, _repack_q5_k),
    Q.Q6_K: ("q8", False, _repack_q6_k),
}

# ---------------------------------------------------------------------------------------------------------
# One tensor


class GGUFTensor:
    """One tensor of a GGUF file, not read yet: what the loader receives in place of a torch.Tensor.

    Invariants: the raw bytes are [stored rows, bytes per row] (a vector is one stored row), rows are whole GGUF
    blocks along the last axis. A matrix view is an order of stored rows (`rows`: int64 [shape[0]], a
    permutation or a narrowing of them) times a window of columns [start, stop) that is a multiple of 32 for a
    quantized type; a vector view is an order of its elements. Narrowing makes a new view of the same bytes.
    """

    def __init__(
        self,
        name: str,
        ggml_type: GGMLQuantizationType,
        data: np.ndarray,
        shape: tuple[int, ...],
        row_order: np.ndarray | None = None,
        *,
        file_map: np.ndarray | None = None,
    ) -> None:
        """`data`: the tensor's raw bytes as GGUF stores them (any dtype, e.g. a view of the memory map); `shape`:
        transformers' orientation (GGUF's ne reversed), one or two dimensions; `row_order`: which stored row
        each row of a matrix is (a q / k unpermutation), None for the stored order; `file_map`: the whole read-only
        memory map of the file that `data` views, whose pages are given back as they are read (see
        `drop_file_pages`): never other memory."""
        if len(shape) not in (1, 2):
            raise NotImplementedError(
                f"GGUF tensor {name!r} has {len(shape)} dimensions {list(shape)}; only "
                "vectors and matrices are read (MoE expert stacks are not supported yet)"
            )
        self.name = name
        self._type = ggml_type
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        self._block_size, self._type_size = block_size, type_size
        width = shape[-1]
        stored_rows = shape[0] if len(shape) == 2 else 1
        if width % block_size:
            raise ValueError(
                f"GGUF tensor {name!r}: rows of {width} elements are no whole {ggml_type.name} blocks of {block_size}"
            )
        row_bytes = width // block_size * type_size
        raw = data.reshape(-1).view(np.uint8)
        if raw.size != stored_rows * row_bytes:
            raise ValueError(
                f"GGUF tensor {name!r} ({ggml_type.name} {list(shape)}) needs "
                f"{stored_rows * row_bytes} bytes, the file holds {raw.size}"
            )
        self._raw = raw.reshape(stored_rows, row_bytes)
        self._vector = len(shape) == 1
        order = np.arange(shape[0], dtype=np.int64) if row_order is None else np.asarray(row_order, np.int64)
        if order.shape != (shape[0],):
            raise ValueError(f"GGUF tensor {name!r}: a row order of {order.shape[0]} for {shape[0]} rows")
        self._rows = order  # a matrix: stored row of each row; a vector: stored element of each element
        self._columns = (0, width)
        self._file_map = file_map

    # -- what it is

    @property
    def shape(self) -> tuple[int, ...]:
        """transformers' orientation: [out, in] for a matrix (GGUF's ne reversed), [n] for a vector."""
        if self._vector:
            return (len(self._rows),)
        return (len(self._rows), self._columns[1] - self._columns[0])

    @property
    def ggml_type(self) -> str:
        """The GGUF storage type's name: "Q4_1", "F32", ..."""
        return self._type.name

    def __repr__(self) -> str:
        return f"GGUFTensor({self.name!r}, {self.ggml_type}, {list(self.shape)})"

    # -- views

    def narrow(self, dim: int, start: int, length: int) -> GGUFTensor:
        """A lazy view of `length` rows (dim 0) or columns (dim 1) from `start`, nothing read: a tensor-parallel
        rank's shard. Columns of a quantized matrix go in whole blocks of 32 (ValueError otherwise)."""
        dim = dim + len(self.shape) if dim < 0 else dim
        if not 0 <= dim < len(self.shape) or start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"GGUF tensor {self.name!r} {list(self.shape)}: cannot narrow dim {dim} to [{start}, {start + length})"
            )
        view = copy.copy(self)
        if dim == 0:
            view._rows = self._rows[start : start + length]
            return view
        if self._type not in FLOAT_TYPES and (start % BLOCK or length % BLOCK):
            raise ValueError(
                f"GGUF tensor {self.name!r} is {self.ggml_type}: its columns narrow in whole blocks "
                f"of {BLOCK}, not [{start}, {start + length})"
            )
        first = self._columns[0] + start
        view._columns = (first, first + length)
        return view

    # -- reading

    def read(self) -> torch.Tensor:
        """All of it, decoded into its natural dtype (float16 / bfloat16 as stored, else float32)."""
        return self.dequantize(NATURAL_DTYPE.get(self._type, torch.float32))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor as `dtype`, each element decoded in float32 as gguf-py does, then cast. Decodes a chunk of
        rows at a time (temporaries of about DECODE_CHUNK_ELEMENTS). NotImplementedError for a storage type
        without a decoder, naming it and the tensor."""
        decode = self._decoder()
        if self._vector:  # small: decoded whole, then put in order
            values = self._decode_rows(decode, np.zeros(1, np.int64))[0]
            return values[torch.from_numpy(self._rows)].to(dtype)
        out = torch.empty(self.shape, dtype=dtype)
        for first, rows in self._row_chunks():
            out[first : first + len(rows)] = self._decode_rows(decode, rows).to(dtype)
        self._release_map()
        return out

    def quantized(self) -> QuantWeight | None:
        """The matrix repacked into a QuantWeight [shape[0], shape[1]] straight from its blocks (see the module
        docstring for the format each GGUF type becomes and its error bound). None for a tensor stored as floats
        (F32, F16, BF16) and for a vector: those are taken dense (`read()`)."""
        if self._type in FLOAT_TYPES or self._vector:
            return None
        if self._type not in REPACKERS:
            raise NotImplementedError(
                f"GGUF tensor {self.name!r}: storage type {self.ggml_type} cannot be kept "
                f"quantized (supported: {', '.join(t.name for t in REPACKERS)})"
            )
        fmt, has_mins, repack = REPACKERS[self._type]
        n, k = self.shape
        qs = torch.empty((n, k // 2 if fmt == "q4" else k), dtype=torch.uint8 if fmt == "q4" else torch.int8)
        scales = torch.empty((n, k // BLOCK), dtype=torch.float16)
        mins = torch.empty_like(scales) if has_mins else None
        for first, rows in self._row_chunks():
            part_qs, part_scales, part_mins = self._repack_rows(repack, rows)
            qs[first : first + len(rows)] = part_qs
            scales[first : first + len(rows)] = part_scales
            if mins is not None and part_mins is not None:
                mins[first : first + len(rows)] = part_mins
        self._check_finite(scales, mins)
        self._release_map()
        return QuantWeight(fmt, qs, scales, mins)

    # -- internals

    def _release_map(self) -> None:
        """After a whole read: every page of the file's map given back, those a later fault mapped again beside
        the rows read (the kernel maps a page-cache folio whole, which may span other tensors' rows) included."""
        if self._file_map is not None:
            drop_file_pages(self._file_map)

    def _decoder(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if self._type not in DECODERS:
            raise NotImplementedError(
                f"GGUF tensor {self.name!r}: storage type {self.ggml_type} is not supported "
                f"(supported: {', '.join(t.name for t in DECODERS)})"
            )
        return DECODERS[self._type]

    def _row_chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        """(first output row, stored row indices) over the view's rows, DECODE_CHUNK_ELEMENTS at a time."""
        first, last = self._block_span()
        per_chunk = max(1, DECODE_CHUNK_ELEMENTS // max(1, last - first))
        for first in range(0, len(self._rows), per_chunk):
            yield first, self._rows[first : first + per_chunk]

    def _block_span(self) -> tuple[int, int]:
        """The element range [a, b) of the whole GGUF blocks covering the column window."""
        start, stop = self._columns
        size = self._block_size
        return start // size * size, -(-stop // size) * size

    def _blocks(self, rows: np.ndarray) -> torch.Tensor:
        """The GGUF blocks covering the column window of stored `rows`, uint8 [len(rows) * blocks per row,
        type_size] (a copy out of the memory map: fancy indexing copies)."""
        first, last = self._block_span()
        span = slice(first // self._block_size * self._type_size, last // self._block_size * self._type_size)
        blocks = torch.from_numpy(np.asarray(self._raw[rows, span])).reshape(-1, self._type_size)
        if self._file_map is not None and len(rows):
            drop_file_pages(self._raw[int(rows.min()) : int(rows.max()) + 1])
        return blocks

    def _decode_rows(self, decode: Callable[[torch.Tensor], torch.Tensor], rows: np.ndarray) -> torch.Tensor:
        """float32 [len(rows), window width]: the stored rows decoded, cut to the column window."""
        first = self._block_span()[0]
        values = decode(self._blocks(rows)).reshape(len(rows), -1)
        return values[:, self._columns[0] - first : self._columns[1] - first]

    def _repack_rows(self, repack: Callable[[torch.Tensor], Packed], rows: np.ndarray) -> Packed:
        """The stored rows repacked and cut to the column window (whole blocks of 32)."""
        qs, scales, mins = repack(self._blocks(rows))
        first = (self._columns[0] - self._block_span()[0]) // BLOCK
        count = (self._columns[1] - self._columns[0]) // BLOCK
        qs = qs.reshape(len(rows), -1, qs.shape[1] * BLOCK // self._block_size)[:, first : first + count]
        return (
            qs.reshape(len(rows), -1),
            scales.reshape(len(rows), -1)[:, first : first + count],
            None if mins is None else mins.reshape(len(rows), -1)[:, first : first + count],
        )

    def _check_finite(self, scales: torch.Tensor, mins: torch.Tensor | None) -> None:
        for what, values in (("scales", scales), ("mins", mins)):
            if values is not None and not bool(torch.isfinite(values).all()):
                raise ValueError(
                    f"GGUF tensor {self.name!r} ({self.ggml_type}): repacked {what} overflow fp16 "
                    "(or the file holds non-finite ones)"
                )


# ---------------------------------------------------------------------------------------------------------
# One file


class GGUFFile:
    """A GGUF file opened once: `architecture`, `metadata(key)`, and `tensors()` -> (transformers checkpoint
    name, GGUFTensor) in file order. The header and metadata are parsed at open; tensor data stays memory-mapped
    until a tensor is decoded or repacked.

    ValueError naming the file for a file that is not a readable GGUF (garbage, truncated), an architecture we do
    not read (SUPPORTED_ARCHITECTURES) or a tensor with no transformers name; NotImplementedError naming the
    tensor for MoE experts.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        self.architecture = str(self.metadata("general.architecture", ""))
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self.num_layers = int(self._arch_value("block_count"))
        self.num_heads = int(self._arch_value("attention.head_count"))
        self.num_kv_heads = int(self._arch_value("attention.head_count_kv", self.num_heads))
        self._tensors = self._map_tensors()

    def metadata(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` (a number, string, or list), `default` where the file lacks it."""
        return self._reader.fields.get(key, default)

    def tensors(self) -> Iterator[tuple[str, GGUFTensor]]:
        """(transformers checkpoint name, tensor) for every weight of the file, in file order."""
        yield from self._tensors.items()

    def tensor(self, name: str) -> GGUFTensor:
        """The tensor with transformers checkpoint name `name` (KeyError naming the file if there is none)."""
        if name not in self._tensors:
            raise KeyError(f"{self.path} has no tensor named {name!r}")
        return self._tensors[name]

    def _arch_value(self, suffix: str, default: Any = None) -> Any:
        value = self.metadata(f"{self.architecture}.{suffix}", default)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata lacks {self.architecture}.{suffix}")
        if isinstance(value, list):  # per-layer head counts (some hybrid models)
            raise ValueError(f"{self.path}: {self.architecture}.{suffix} varies per layer ({value}); not supported")
        return value

    def _map_tensors(self) -> dict[str, GGUFTensor]:
        mapped: dict[str, GGUFTensor] = {}
        for info in self._reader.tensors:
            try:
                name = checkpoint_name(info.name)
                if name is None:
                    continue
                shape = tuple(int(n) for n in reversed(info.shape.tolist()))
                mapped[name] = GGUFTensor(
                    info.name,
                    info.tensor_type,
                    info.data,
                    shape,
                    self._row_order(info.name, shape),
                    file_map=self._reader.data,
                )
            except (ValueError, NotImplementedError) as error:
                raise type(error)(f"{self.path}: {error}") from None
        return mapped

    def _row_order(self, gguf_name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The unpermutation of a llama attn_q / attn_k (rows of a matrix, elements of a bias), else None."""
        if self.architecture not in PERMUTED_ARCHITECTURES:
            return None
        part = gguf_name.split(".")[-2]
        heads = {"attn_q": self.num_heads, "attn_k": self.num_kv_heads}.get(part)
        return None if heads is None else unpermute_order(shape[0], heads)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a GGUF header: its name, GGUF's dims (ne: fastest-varying first), storage type, and
    its raw bytes (a view of the memory map)."""

    name: str
    shape: np.ndarray
    tensor_type: GGMLQuantizationType
    data: np.ndarray


@dataclass
class GGUFHeader:
    """A GGUF file's metadata (key -> value: numbers, strings, lists) and tensor entries, read once.

    Our own reader of the format (GGUF v2 / v3, little-endian): gguf-py's GGUFReader builds an object per element
    of every metadata array, which took 2-6 s for the embedded model's 49,152-token vocabulary on the 2-core dev VM
    (2026-11-26); this takes a few tens of milliseconds (numeric arrays in one numpy read, strings in a loop)."""

    fields: dict[str, Any]
    tensors: list[TensorInfo]
    data: np.ndarray | None = None  # the whole file, memory-mapped read-only (the tensors' data views it)


_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_STRUCTS = {
    dtype: struct.Struct("<" + code)
    for dtype, code in (("<u1", "B"), ("<i1", "b"), ("<u2", "H"), ("<i2", "h"), ("<u4", "I"), ("<i4", "i"))
    + (("<f4", "f"), ("<u8", "Q"), ("<i8", "q"), ("<f8", "d"))
}


class _Cursor:
    """Reads little-endian GGUF values from a byte buffer; IndexError past its end (a truncated file). Scalars and
    strings go through `struct` on a memoryview (a numpy view per value cost ~25 us: 2-4 s for the embedded model's
    98k vocabulary and merge strings), numeric arrays through one numpy read."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.view, self.at, self.size = buffer.data, 0, len(buffer)

    def _advance(self, size: int) -> int:
        at = self.at
        if at + size > self.size:
            raise IndexError(f"{size} bytes wanted at offset {at} of {self.size}")
        self.at = at + size
        return at

    def take(self, dtype: str, count: int = 1) -> np.ndarray:
        at = self._advance(np.dtype(dtype).itemsize * count)
        return np.frombuffer(self.view, dtype, count, at)

    def scalar(self, dtype: str) -> Any:
        unpacker = _STRUCTS[dtype]
        return unpacker.unpack_from(self.view, self._advance(unpacker.size))[0]

    def string(self) -> str:
        length = self.scalar("<u8")
        at = self._advance(length)
        return str(self.view[at : at + length], "utf-8", "replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary): `string` inlined, the loop being most of a header's reading."""
        view, at, size, unpack, out = self.view, self.at, self.size, _STRUCTS["<u8"].unpack_from, []
        for _ in range(count):
            if at + 8 > size:
                raise IndexError(f"8 bytes wanted at offset {at} of {size}")
            (length,) = unpack(view, at)
            end = at + 8 + length
            if end > size:
                raise IndexError(f"{length} bytes wanted at offset {at + 8} of {size}")
            out.append(str(view[at + 8 : end], "utf-8", "replace"))
            at = end
        self.at = at
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<u4"), self.scalar("<u8")
            if item == _STRING:
                return self.strings(count)
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            values = self.take(_SCALARS[item], count).tolist()
            return [bool(v) for v in values] if item == _BOOL else values
        value = self.scalar(_SCALARS[kind])
        return bool(value) if kind == _BOOL else value


def _read_header(path: Path) -> GGUFHeader:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(np.asarray(data))
    if bytes(cursor.take("<u1", 4)) != b"GGUF":
        raise ValueError("no GGUF magic at the start")
    version = cursor.scalar("<u4")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian, or not a version we read)")
    num_tensors, num_fields = cursor.scalar("<u8"), cursor.scalar("<u8")
    fields = {}
    for _ in range(num_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.scalar("<u4"))
    entries = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = cursor.take("<u8", cursor.scalar("<u4")).astype(np.int64)
        entries.append((name, dims, GGMLQuantizationType(cursor.scalar("<u4")), cursor.scalar("<u8")))
    alignment = int(fields.get("general.alignment", 32))
    start = -(-cursor.at // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in entries:
        block_size, type_size = GGML_QUANT_SIZES[kind]
        size = int(np.prod(dims)) // block_size * type_size
        if start + offset + size > len(data):
            raise IndexError(f"tensor {name!r} ends past the end of the file")
        tensors.append(TensorInfo(name, dims, kind, np.asarray(data[start + offset : start + offset + size])))
    return GGUFHeader(fields, tensors, np.asarray(data))


def _open_reader(path: Path) -> GGUFHeader:
    """The header of `path`; ValueError naming the file for anything that is not a readable GGUF file."""
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    try:
        return _read_header(path)
    except (ValueError, IndexError, KeyError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path}: not a readable GGUF file (truncated or corrupt?): {type(error).__name__}: {error}"
        ) from None


# ---------------------------------------------------------------------------------------------------------
# Config and tokenizer, no weights


def write_model_dir(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Fill `out_dir` with what transformers reads from the GGUF's metadata: config.json, the tokenizer files
    (chat template included), generation_config.json, and a symlink model.gguf -> the source file's absolute
    path. No weights are read or written: the model loads them from model.gguf."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    source = Path(gguf_path).resolve()
    GGUFFile(source)  # a file that is no readable GGUF of an architecture we read: a ValueError naming it, first
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    folder, name = str(source.parent), source.name
    with _one_metadata_read():
        config = AutoConfig.from_pretrained(folder, gguf_file=name)  # metadata only: no tensor is read
        config.save_pretrained(out)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    link = out / "model.gguf"
    link.unlink(missing_ok=True)
    link.symlink_to(source)


@contextlib.contextmanager
def _one_metadata_read() -> Iterator[None]:
    """transformers reads a GGUF's whole metadata (its vocabulary and merges included) once for AutoConfig and again
    for AutoTokenizer, which builds the same config to pick the tokenizer class. Within this block the second call
    takes a copy of the first's result (metadata only, return_tensors=False; anything else goes through as it is),
    and the one read goes through `_HeaderFields`, our header as gguf-py's GGUFReader presents it (gguf-py's reader
    builds a numpy view per element of every array: ~15 s on a 2-core VM for the embedded model's 98k vocabulary
    and merge strings, where ours takes tens of milliseconds). Both calls import the function from its module when
    they run, and it imports GGUFReader from `gguf` when it runs, so the modules' attributes are what they call."""
    import gguf as gguf_module
    from transformers import modeling_gguf_pytorch_utils as utils

    gguf: Any = gguf_module  # its GGUFReader is swapped for a while
    read, reader = utils.load_gguf_checkpoint, gguf.GGUFReader
    done: dict[str, Any] = {}

    def once(path: Any, return_tensors: Any = False, model_to_load: Any = None, torch_dtype: Any = None) -> Any:
        if return_tensors or model_to_load is not None or torch_dtype is not None:
            return read(path, return_tensors, model_to_load, torch_dtype)
        key = str(path)
        if key not in done:
            header = _HeaderFields.of(Path(path))
            gguf.GGUFReader = reader if header is None else lambda *_args, **_options: header
            try:
                done[key] = read(path, False)
            finally:
                gguf.GGUFReader = reader
        return copy.deepcopy(done[key])

    utils.load_gguf_checkpoint = once
    try:
        yield
    finally:
        utils.load_gguf_checkpoint = read


@dataclass(frozen=True)
class _Field:
    """One metadata value as gguf-py's ReaderField holds it for transformers' `_gguf_parse_value`: `types` (the
    GGUF value type, or [array, item type]), `parts` (one entry per element: a string's UTF-8 bytes, or a number
    in a 1-tuple) and `data` (the indices of `parts` that are values: all of them here)."""

    types: list[int]
    parts: list[Any]
    data: list[int]


class _HeaderFields:
    """Our GGUFHeader presented as much of gguf-py's GGUFReader as transformers' metadata read uses: `fields` (name
    -> _Field) and `tensors` (entries with a `name`). `of(path)` is None for a header this cannot present exactly
    (a string that is not valid UTF-8, an array of arrays): the caller keeps gguf-py's reader then."""

    def __init__(self, fields: dict[str, _Field], tensors: list[TensorInfo]) -> None:
        self.fields, self.tensors = fields, tensors

    @classmethod
    def of(cls, path: Path) -> _HeaderFields | None:
        header = _read_header(path)
        with path.open("rb") as file:
            (version,) = struct.unpack("<4xI", file.read(8))  # after the magic, which _read_header checked
        # gguf-py's reader adds the header's own numbers as fields (transformers files them under "ignore")
        given = {"GGUF.version": version, "GGUF.tensor_count": len(header.tensors), "GGUF.kv_count": len(header.fields)}
        fields = {}
        for name, value in {**given, **header.fields}.items():
            field = _as_field(value)
            if field is None:
                return None
            fields[name] = field
        return cls(fields, header.tensors)


def _value_type(value: Any) -> int | None:
    """The GGUF value type that gives `value` back through transformers' parse (any integer type reads as int)."""
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return 4  # uint32
    if isinstance(value, float):
        return 6  # float32
    if isinstance(value, str) and "\ufffd" not in value:  # our reader decodes with "replace"; gguf-py's is strict
        return _STRING
    return None


def _as_field(value: Any) -> _Field | None:
    items = value if isinstance(value, list) else [value]
    kinds = {_value_type(item) for item in items} or {4}  # an empty array: any type reads as []
    kind = kinds.pop() if len(kinds) == 1 else None
    if kind is None:
        return None
    parts = [item.encode() if kind == _STRING else (item,) for item in items]
    return _Field([_ARRAY, kind] if isinstance(value, list) else [kind], parts, list(range(len(parts))))


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """GGUFFile(path), opened once per version of the file while a load runs (the loader reads it for its plan, then
    its tensors); `close_gguf_files` ends that, unmapping the file (its pages would count as the worker's resident
    memory)."""
    stat = Path(path).stat()
    return _open_cached(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


_LIBC = ctypes.CDLL(None, use_errno=True) if hasattr(mmap, "MADV_DONTNEED") else None


def drop_file_pages(view: np.ndarray) -> None:
    """Give back the pages under `view`, a contiguous view of a read-only memory map of a file: they leave the
    process's resident memory and stay in the page cache (a later read maps them again, unchanged). While a
    model loads, the file's pages would otherwise stay resident beside the weights repacked from them until the
    file is closed: 78 MiB more at the peak on the embedded model (2026-11-27). Never for other memory: on
    anonymous memory the same call would zero it. Where the platform has no madvise, nothing."""
    if _LIBC is None or not view.nbytes:
        return
    start = view.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(view.ctypes.data + view.nbytes - start), mmap.MADV_DONTNEED)


def close_gguf_files() -> None:
    """Forget the files `open_gguf` opened (their memory maps go with the last tensor that views them)."""
    _open_cached.cache_clear()
