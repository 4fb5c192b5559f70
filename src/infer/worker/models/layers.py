"""Building blocks of the Llama-family models: norms, rotary embedding, linear layers, embedding, LM head.

Linear layers store W as [out_features, in_features] (the checkpoint layout) and are written for tensor
parallelism: `ColumnLinear` shards output rows across `tp_size` ranks, `RowLinear` shards input columns and
sums partial results across ranks (see `infer.worker.distributed.tensor_parallel`). Each takes full checkpoint tensors
through `load_shard`, which slices out this rank's part, so the loader never needs to know how a layer is
split. A checkpoint tensor may be a lazy view of a safetensors file (the loader's `FileTensor`): narrowing it
reads only this rank's part, so no rank ever holds a full copy of a sharded weight.

Parameters are created with `torch.empty` on the current default device (the loader scopes it); weights
always come from a checkpoint.

Quantized weights (kernels/quant.py). Built inside `deferred_weights()`, the linear and embedding weights are
shape-only (meta) until `materialize(fmt, device)` gives each its storage: dense (fmt None), or kept quantized
("q4", "q8", "q8+min"): then `weight` holds the blocks' values (uint8 / int8), `weight_scales` and `weight_mins`
their fp16 scales and mins, and `load_shard` turns whatever the checkpoint holds (a GGUF tensor's own blocks, or
dense values, quantized by kernels/quant.quantize) into this layout. A refit of a quantized layer quantizes the
dense tensors it brings the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from infer.kernels.cpu_kernels import GEMV_MAX_ROWS, amx_bf16, gemv, gemv_takes
from infer.kernels.dispatch import Kernels, kernels_here
from infer.kernels.quant import BLOCK, QuantWeight, dequantize, quant_source
from infer.kernels.rotary import build_cos_sin_cache
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.forward_batch import ForwardBatch

_SINGLE = TensorParallel.single()


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


# Quantized storage formats a layer can be given (`materialize`): "q8+min" is q8 with per-block mins.
QUANT_FORMATS = ("q4", "q8", "q8+min")
_DEFER_WEIGHTS: ContextVar[bool] = ContextVar("infer_defer_weights", default=False)


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Linear and embedding weights built inside are shape-only (meta) until each layer's `materialize` gives
    them storage (the loader's plan: dense or quantized). Does not nest."""
    if _DEFER_WEIGHTS.get():
        raise RuntimeError("deferred_weights() does not nest")
    token = _DEFER_WEIGHTS.set(True)
    try:
        yield
    finally:
        _DEFER_WEIGHTS.reset(token)


def _weight_param(rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
    return _param(rows, cols, dtype=dtype, device="meta" if _DEFER_WEIGHTS.get() else None)


class QuantStorage(nn.Module):
    """What linear layers and the embedding share: a weight [rows, cols] that is dense (`weight` in `dtype`) or
    kept quantized (`quant_format`; `weight` the values, `weight_scales` / `weight_mins` the fp16 block scales and
    mins; `quant` the QuantWeight view of them, made by `pack_weights`)."""

    weight: nn.Parameter
    weight_scales: nn.Parameter | None
    weight_mins: nn.Parameter | None
    dtype: torch.dtype

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("weight_scales", None)
        self.register_parameter("weight_mins", None)
        self.quant_format: str | None = None
        self.quant: QuantWeight | None = None
        self.quant_native = False  # the native kernel takes self.quant (decided with the view)
        self.kernels: Kernels = kernels_here()

    def materialize(self, fmt: str | None, device: torch.device | str) -> None:
        """Give a deferred (meta) weight its storage on `device`: dense in self.dtype (fmt None) or quantized."""
        rows, cols = self.weight.shape
        if fmt is None:
            self.weight = _param(rows, cols, dtype=self.dtype, device=device)
            return
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"quantized format must be one of {QUANT_FORMATS}, got {fmt!r}")
        if cols % BLOCK:
            raise ValueError(f"a quantized weight needs a multiple of {BLOCK} columns, got {cols}")
        self.quant_format = fmt
        width, values = (cols // 2, torch.uint8) if fmt == "q4" else (cols, torch.int8)
        self.weight = _param(rows, width, dtype=values, device=device)
        self.weight_scales = _param(rows, cols // BLOCK, dtype=torch.float16, device=device)
        if fmt != "q8":
            self.weight_mins = _param(rows, cols // BLOCK, dtype=torch.float16, device=device)

    @property
    def logical_shape(self) -> tuple[int, int]:
        """[rows, cols] of the weight as the checkpoint has it, whatever its storage."""
        if self.weight_scales is None:
            return int(self.weight.shape[0]), int(self.weight.shape[1])
        return int(self.weight_scales.shape[0]), int(self.weight_scales.shape[1]) * BLOCK

    def shards_of(self, param_name: str) -> tuple[str | None, ...]:
        """The shards a checkpoint fills `param_name` with (the loader's completeness check): the block scales and
        mins come with the weight, from no checkpoint tensor of their own."""
        if param_name in ("weight_scales", "weight_mins"):
            return ()
        return tuple(getattr(self, "shard_names", (None,)))

    def share_storage(self, other: QuantStorage) -> None:
        """Use `other`'s weight storage, quantized or not (tied embeddings)."""
        self.weight, self.weight_scales, self.weight_mins = other.weight, other.weight_scales, other.weight_mins
        self.quant_format, self.quant, self.quant_native = other.quant_format, other.quant, other.quant_native

    def refresh_quant(self) -> None:
        """Remake the QuantWeight view after the storage changed (load, refit, restore)."""
        if self.quant_format is None or self.weight.numel() == 0:
            self.quant, self.quant_native = None, False
            return
        # materialize gives a quantized weight its scales with its format (and share_storage copies both)
        scales = cast(torch.Tensor, self.weight_scales)
        self.quant = QuantWeight("q4" if self.quant_format == "q4" else "q8", self.weight, scales, self.weight_mins)
        self.quant_native = self.kernels.quant_matmul_takes(self.quant)

    def copy_weight_rows(self, start: int, length: int, tensor: Any, what: str) -> None:
        """Fill rows [start, start + length) of the weight from a checkpoint tensor of exactly that shape (a
        torch.Tensor, a lazy file tensor, or a GGUF tensor), quantizing or dequantizing as the storage needs."""
        if self.quant_format is None or self.weight_scales is None:  # dense (a format comes with its scales)
            rows = self.weight.narrow(0, start, length)
            if tuple(rows.shape) != tuple(tensor.shape):
                raise ValueError(f"{what}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(rows.shape)}")
            rows.copy_(tensor if isinstance(tensor, torch.Tensor) else tensor.read())
            return
        expected = (length, self.logical_shape[1])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{what}: checkpoint shape {tuple(tensor.shape)} != expected {expected}")
        source = quant_source(tensor, self.quant_format)
        self.weight.narrow(0, start, length).copy_(source.qs)
        self.weight_scales.narrow(0, start, length).copy_(source.scales)
        if self.weight_mins is not None:
            if source.mins is None:
                self.weight_mins.narrow(0, start, length).zero_()
            else:
                self.weight_mins.narrow(0, start, length).copy_(source.mins)

    def dense_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in self.dtype (an embedding lookup of a quantized table)."""
        if self.quant is None:
            raise RuntimeError("the quantized table has no storage (released, or not loaded)")
        picked = QuantWeight(
            self.quant.format,
            self.quant.qs.index_select(0, ids),
            self.quant.scales.index_select(0, ids),
            None if self.quant.mins is None else self.quant.mins.index_select(0, ids),
        )
        return dequantize(picked, self.dtype)


def _copy_checked(param: torch.Tensor, tensor: Any, what: str) -> None:
    """Copy a checkpoint tensor (a torch.Tensor, or a lazy file tensor with `shape` and `read()`) into param."""
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
    param.copy_(tensor if isinstance(tensor, torch.Tensor) else tensor.read())


def _rank_slice(tensor: Any, dim: int, index: int, num_parts: int, what: str) -> Any:
    """Part `index` of `tensor` cut into `num_parts` contiguous equal parts along `dim` (a rank's share)."""
    size = tensor.shape[dim]
    if size % num_parts:
        raise ValueError(f"{what}: dimension {dim} of size {size} does not split across {num_parts} ranks")
    if num_parts == 1:
        return tensor  # whole: a GGUF tensor keeps its blocks
    part = size // num_parts
    return tensor.narrow(dim, index * part, part)


class RMSNorm(nn.Module):
    """y = w * x / rms(x) over the last dim (`infer.kernels.rmsnorm`: float32 statistics, cast back to x's
    dtype before the weight, as transformers).

    `norm(x)` returns y. `norm(x, residual)` is the fused pre-norm of a residual stream: it adds x into
    `residual` in place (the new stream) and returns (norm of that sum, residual).
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=dtype)
        # One kernel for every row count (set by the loader for models with quantized linears: their int8
        # activations turn the native kernel's and the twin's last-bit differences into other tokens now and then,
        # and a row must get the same bits alone as in a batch)
        self.any_rows = False
        self.kernels: Kernels = kernels_here()

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps, any_rows=self.any_rows)
        return self.kernels.rms_norm(x, self.weight, self.eps, residual, any_rows=self.any_rows), residual


class PackedLinear(QuantStorage):
    """Base of the linear layers: `self.weight` [out, in] (+ optional `self.bias`), and the path that multiplies by
    it, chosen once by `pack_weights()` when the checkpoint is loaded.

    A bf16 weight on a CPU whose native build has a bf16 GEMV (AVX512-BF16, or AVX2's fp32 core) is multiplied by
    it at every row count (`infer.kernels.cpu_kernels.gemv`: 1-8 rows stream the weight once; more go through tiles
    with the same sums, so a row's output has the same bits in a prefill, a batch or a decode), reading the weight
    as stored: it is kept once. (Until 2026-12-01 an AVX512-BF16 CPU kept a oneDNN-packed copy beside it for more
    than 8 rows, twice the weights' memory.) A CPU with AMX-BF16 keeps that copy: oneDNN multiplies more than 8
    rows on the AMX tiles, several times what vector instructions reach (not measured here: no such CPU); so does
    any CPU where `prepack` is True (`--cpu-weight-prepack`: prefills and batches past 8 rows at oneDNN's speed,
    1.25x the tiles' on AVX512-BF16, for twice the weights' memory). Other
    dense weights on a CPU (fp32; bf16 without a native build) keep a oneDNN pre-packed copy (1.2-2x F.linear at
    decode shapes) beside the plain weight that checkpoint loading, tied embeddings and tests read. A quantized weight
    (QuantStorage) is multiplied by the device's `quant_matmul` (kernels/dispatch.py) at every row count: the
    native kernel on a CPU (where it takes the weight), Triton on CUDA, the twin elsewhere.
    """

    bias: nn.Parameter | None
    packed: torch.Tensor | None = None
    gemv_native: bool = False  # bf16 rows go to the native GEMV (all, or 1-8 where a packed copy takes more)
    # beside a weight the GEMV takes, a oneDNN-packed copy for more than 8 rows: None = only on AMX-BF16 CPUs
    # (EngineConfig.cpu_weight_prepack; worker/loading/loader.py's set_weight_prepack)
    prepack: bool | None = None
    lora: Any = None  # a worker/engine/lora.py LoraLayer once an adapter targets this layer

    def pack_weights(self) -> None:
        self.refresh_quant()
        if self.quant is not None:
            self.packed, self.gemv_native = None, False
            return
        self.gemv_native = gemv_takes(self.weight)
        twin = amx_bf16() if self.prepack is None else self.prepack
        self.packed = None if self.gemv_native and not twin else _pack_for_cpu(self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [N, in] -> x W^T + bias, [N, out]."""
        if self.quant is not None:
            y = self.kernels.quant_matmul(x.reshape(-1, x.shape[-1]), self.quant, self.quant_native)
            y = y.reshape(*x.shape[:-1], -1)
            return y if bias is None else y.add_(bias)
        rows = x.shape[0] if x.dim() == 2 else 0
        to_gemv = rows <= GEMV_MAX_ROWS or self.packed is None  # (an AMX CPU's packed copy takes more rows)
        if self.gemv_native and 0 < rows and x.dtype == torch.bfloat16 and to_gemv:
            fused = bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
            if torch.compiler.is_compiling():  # an opaque op to the compiler, as packed_linear
                y = native_linear(x, self.weight, bias if fused else None)
            else:
                y = gemv(x if x.stride(1) == 1 else x.contiguous(), self.weight, bias if fused else None)
            return y if fused or bias is None else y.add_(bias)  # the bias fused: one rounding, as oneDNN's
        if x.dim() == 2 and self.packed is not None:
            if torch.compiler.is_compiling():
                return packed_linear(x, self.packed, self.weight, bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")  # (no op overhead)
        return F.linear(x, self.weight, bias)

    def load_rows(self, param_name: str, start: int, length: int, tensor: Any, what: str) -> None:
        """Rows [start, start + length) of `weight` or `bias` from a checkpoint tensor of that many rows."""
        if param_name == "weight":
            self.copy_weight_rows(start, length, tensor, what)
        elif param_name == "bias" and self.bias is not None:
            _copy_checked(self.bias.narrow(0, start, length), tensor, what)
        else:
            raise ValueError(f"{type(self).__name__} has no parameter {param_name!r} in a checkpoint")


@torch.library.custom_op("infer::native_linear", mutates_args=())
def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in] (bf16) @ weight^T (+ bias) through the native GEMV, as an op the compiler does not trace into."""
    return gemv(x if x.stride(1) == 1 else x.contiguous(), weight, bias)


@native_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("infer::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [N, in] @ weight^T (+ bias) through oneDNN's pre-packed `packed` copy of weight [out, in]. An opaque
    op to the compiler (inductor has no lowering for a packed weight it did not pack itself)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def onednn_packs_bf16() -> bool:
    """Whether oneDNN pre-packs bf16 weights on this CPU (it needs avx512bw, avx512vl and avx512dq, or
    avx_ne_convert; elsewhere `_pack_for_cpu` gives None for a bf16 weight)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _pack_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of `weight` for CPU matmuls, or None where that path does not apply."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
    except (RuntimeError, AttributeError):  # a torch build without these ops: plain F.linear
        return None


class ColumnLinear(PackedLinear):
    """y = x W^T + b with W's output rows split across tensor-parallel ranks (no communication)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp: TensorParallel = _SINGLE
    ) -> None:
        super().__init__()
        if out_features % tp.size:
            raise ValueError(f"out_features {out_features} does not split across {tp.size} ranks")
        self.tp, self.dtype = tp, dtype
        self.weight = _weight_param(out_features // tp.size, in_features, dtype)
        self.bias = _param(out_features // tp.size, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)

    def load_shard(self, param_name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """Copy this rank's rows of the full checkpoint tensor into `weight` or `bias`."""
        if shard is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard!r}")
        rows = self.logical_shape[0]
        self.load_rows(param_name, 0, rows, _rank_slice(tensor, 0, self.tp.rank, self.tp.size, param_name), param_name)


class MergedColumnLinear(ColumnLinear):
    """Several column-parallel projections of the same input fused into one matmul (qkv, gate_up).

    `shard_sizes` maps each checkpoint projection (e.g. "q", "k", "v") to its full output size, in the order
    its rows appear in the fused weight. Each rank holds its slice of every shard, concatenated: part
    tp.rank of tp.size, unless `shard_parts` gives a shard's (number of parts, this rank's part) (KV heads
    replicated over ranks: one head of the KV heads on every size / num_kv_heads ranks).
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: Mapping[str, int],
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallel = _SINGLE,
        shard_parts: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        self.shard_parts = {name: (shard_parts or {}).get(name, (tp.size, tp.rank)) for name in shard_sizes}
        for name, size in shard_sizes.items():
            if size % self.shard_parts[name][0]:
                raise ValueError(
                    f"shard {name!r} of size {size} does not split across {self.shard_parts[name][0]} ranks"
                )
        local = {name: size // self.shard_parts[name][0] for name, size in shard_sizes.items()}
        super().__init__(in_features, sum(local.values()) * tp.size, bias, dtype, tp)
        self.shard_sizes = local
        offsets = [0]
        for size in self.shard_sizes.values():
            offsets.append(offsets[-1] + size)
        self.shard_offsets = dict(zip(self.shard_sizes, offsets[:-1], strict=True))

    @property
    def shard_names(self) -> tuple[str, ...]:
        return tuple(self.shard_sizes)

    def load_shard(self, param_name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """This rank's rows of checkpoint tensor `shard`, or with shard None of a checkpoint that stores the fused
        tensor whole (Phi-3's qkv_proj, gate_up_proj: the shards' full rows one after another)."""
        if shard is None:
            full = {name: size * self.shard_parts[name][0] for name, size in self.shard_sizes.items()}
            if tensor.shape[0] != sum(full.values()):
                raise ValueError(f"{param_name}: a fused checkpoint tensor of {tensor.shape[0]} rows for shards {full}")
            start = 0
            for name, rows in full.items():
                self.load_shard(param_name, tensor.narrow(0, start, rows), name)
                start += rows
            return
        if shard not in self.shard_sizes:
            raise ValueError(f"{type(self).__name__} needs one of the shards {self.shard_names}, got {shard!r}")
        num_parts, index = self.shard_parts[shard]
        part = _rank_slice(tensor, 0, index, num_parts, f"{param_name}[{shard}]")
        self.load_rows(param_name, self.shard_offsets[shard], self.shard_sizes[shard], part, f"{param_name}[{shard}]")

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The per-shard views of a forward output, in shard order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)


class RowLinear(PackedLinear):
    """y = x W^T + b with W's input columns split across ranks; x arrives sharded, and the partial sums are
    all-reduced over the TP group unless `reduce_results` is False (the caller reduces).
    The bias is added once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallel = _SINGLE,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"in_features {in_features} does not split across {tp.size} ranks")
        self.tp, self.reduce_results, self.dtype = tp, reduce_results, dtype
        self.weight = _weight_param(out_features, in_features // tp.size, dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, None)
        if self.lora is not None:  # before the reduction: this rank's part of the delta (its x columns through A's)
            y = self.lora.apply(x, y)
        if self.reduce_results:
            self.tp.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)

    def load_shard(self, param_name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        if shard is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard!r}")
        if param_name == "weight":
            tensor = _rank_slice(tensor, 1, self.tp.rank, self.tp.size, param_name)
        self.load_rows(param_name, 0, self.logical_shape[0], tensor, param_name)


class VocabEmbedding(QuantStorage):
    """Token id -> row of the [vocab, hidden] table (dense, or quantized: the rows dequantized). Vocab-parallel:
    each rank holds rows [rank * V / size, (rank + 1) * V / size), looks up the ids that fall there, zeros the
    others, and the rows are all-reduced (exactly one rank contributes each)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallel = _SINGLE) -> None:
        super().__init__()
        self.tp, self.dtype = tp, dtype
        self.rows = tp.part(vocab_size, "the vocabulary size")
        self.weight = _weight_param(len(self.rows), hidden_size, dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_format is None:
            return F.embedding(ids, self.weight)
        return self.dense_rows(ids.reshape(-1)).reshape(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        outside = (input_ids < self.rows.start) | (input_ids >= self.rows.stop)
        local = (input_ids - self.rows.start).masked_fill_(outside, 0)
        out = self.lookup(local).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def pack_weights(self) -> None:
        self.refresh_quant()

    def load_shard(self, param_name: str, tensor: Any, shard: str | None = None) -> None:
        if shard is not None or param_name != "weight":
            raise ValueError(f"{type(self).__name__} has no shard {shard!r} of {param_name!r}")
        self.copy_weight_rows(
            0, len(self.rows), _rank_slice(tensor, 0, self.tp.rank, self.tp.size, param_name), param_name
        )


class LMHead(PackedLinear):
    """hidden [N, hidden] -> logits [N, vocab] in float32. `tie_to` shares the embedding's table.
    Vocab-parallel: each rank computes its vocabulary slice; TP rank 0 gathers the full rows (the other
    ranks get None: only rank 0 samples)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallel = _SINGLE) -> None:
        super().__init__()
        self.tp, self.dtype = tp, dtype
        self.weight = _weight_param(len(tp.part(vocab_size, "the vocabulary size")), hidden_size, dtype)
        self.bias = None

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.share_storage(embedding)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.tp.gather_columns(self.matmul(hidden, None).float())

    def load_shard(self, param_name: str, tensor: Any, shard: str | None = None) -> None:
        if shard is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard!r}")
        self.load_rows(
            param_name,
            0,
            self.logical_shape[0],
            _rank_slice(tensor, 0, self.tp.rank, self.tp.size, param_name),
            param_name,
        )


# ---------------------------------------------------------------------------------------------------------
# Rotary embedding


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of a transformers config as one dict with "rope_type" and "rope_theta".

    transformers >= 5 keeps them in `config.rope_parameters`; older configs have `rope_theta` and an
    optional `rope_scaling` dict (whose type key may be "type").
    """
    params = getattr(config, "rope_parameters", None)
    if params is not None and any(isinstance(value, dict) for value in params.values()):
        raise NotImplementedError(f"per-layer-type rope parameters are not supported: {params}")
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    params["rope_type"] = _ROPE_ALIASES.get(rope_type, rope_type)
    for name, default in (("original_max_position_embeddings", None), ("partial_rotary_factor", 1.0)):
        if params.get(name) is None:
            params[name] = getattr(config, name, None) or default
    return params


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear_inv_freq(p: dict[str, Any], dim: int, config: Any) -> tuple[torch.Tensor, float]:
    return _default_inv_freq(p["rope_theta"], dim) / p["factor"], 1.0


def _llama3_inv_freq(p: dict[str, Any], dim: int, config: Any) -> tuple[torch.Tensor, float]:
    inv_freq = _default_inv_freq(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_inv_freq(p: dict[str, Any], dim: int, config: Any) -> tuple[torch.Tensor, float]:
    base, old_len = p["rope_theta"], p["original_max_position_embeddings"]
    factor = p.get("factor") or config.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _dynamic_inv_freq(p: dict[str, Any], dim: int, config: Any) -> tuple[torch.Tensor, float]:
    # transformers rescales theta only for sequences longer than max_position_embeddings, which the engine never
    # serves: up to there dynamic NTK is the default rope (RotaryEmbedding.reserve refuses to go further)
    return _default_inv_freq(p["rope_theta"], dim), 1.0


def _longrope_factor(p: dict[str, Any], config: Any) -> float:
    factor = p.get("factor")
    return factor if factor is not None else config.max_position_embeddings / p["original_max_position_embeddings"]


def _longrope_inv_freq(
    p: dict[str, Any],
    dim: int,
    config: Any,
    factors: str = "short_factor",
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3's "su"): theta's frequencies divided by one factor per pair, `short_factor` for sequences up
    to original_max_position_embeddings, `long_factor` past it; cos / sin scaled by the attention factor."""
    ext = torch.tensor(p[factors], dtype=torch.float32)
    if ext.shape != (dim // 2,):
        raise ValueError(f"rope {factors} has {ext.numel()} entries for {dim // 2} rotary pairs")
    factor = _longrope_factor(p, config)
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        old_len = p["original_max_position_embeddings"]
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * p["rope_theta"] ** shape), float(attention_factor)


_ROPE_TYPES = {
    "default": lambda p, dim, config: (_default_inv_freq(p["rope_theta"], dim), 1.0),
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
    "yarn": _yarn_inv_freq,
    "dynamic": _dynamic_inv_freq,
    "longrope": _longrope_inv_freq,
}
# Phi-3's older name; Qwen2-VL's older configs name M-RoPE's type "mrope": default frequencies (MRotaryEmbedding)
_ROPE_ALIASES = {"su": "longrope", "mrope": "default"}


# Cache length for configs that state no max_position_embeddings (the engine's context length is then 4096 too).
DEFAULT_MAX_POSITIONS = 4096


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, one instance shared by all layers of a model.

    Holds the cos/sin cache [max_positions, head_dim] float32 (`infer.kernels.rotary`), with the config's
    theta and rope scaling (`inv_freq`, `attention_scaling`). `rotary(positions, q, k)` rotates q and k in
    place. `is_neox` picks the layout of the rotated pairs: the two halves of the head dim (the Llama family,
    the default) or GPT-J's interleaved pairs.

    The cache covers config.max_position_embeddings positions, which the engine's max_model_len never exceeds.
    A caller that goes further (a model driven directly, past its context length) calls `reserve` first; the
    cache then grows to the next power of two. Positions past the cache are not checked per call (that would
    sync a device): the twin raises IndexError, the Triton kernel would read out of bounds.

    Partial rotary (`partial_rotary_factor` < 1, only where the model says it handles it: `partial=True`): the
    first rotary_dim = factor * head_dim dims of a head rotate, the rest pass through. The kernels rotate whole
    heads, so such a model keeps each q / k head in `partial_rotary_order` (its weights' rows permuted at load):
    the rotated pairs first in each half, then the passing dims, whose cache columns are cos 1, sin 0.

    LongRoPE (`length_dependent`): transformers rotates with the short factors while a sequence is at most
    original_max_position_embeddings long and with the long ones past that. The cache holds both: rows
    [0, n) short, [n, 2n) long, and `rope_batch` moves each token of a sequence longer than that to the long
    rows. (A sequence that grows past it while decoding keeps its earlier keys as they were rotated; transformers'
    Phi-3 recomputes them then.)
    """

    inv_freq: torch.Tensor  # buffers (registered in __init__), typed for their readers
    cos_sin_cache: torch.Tensor

    def __init__(self, config: Any, head_dim: int, is_neox: bool = True, partial: bool = False) -> None:
        super().__init__()
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type not in _ROPE_TYPES:
            raise NotImplementedError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(sorted(_ROPE_TYPES))}"
            )
        factor = float(params["partial_rotary_factor"])
        if factor != 1.0 and not partial:
            raise NotImplementedError(f"partial_rotary_factor {factor} is not supported by this model")
        self.rotary_dim = int(head_dim * factor)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim or (self.rotary_dim != head_dim and not is_neox):
            raise ValueError(f"partial_rotary_factor {factor} of head_dim {head_dim}: no even neox rotary dim")
        self.head_dim, self.rope_type, self.is_neox = head_dim, rope_type, is_neox
        inv_freq, self.attention_scaling = _ROPE_TYPES[rope_type](params, self.rotary_dim, config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.long_inv_freq: torch.Tensor | None = None
        self.original_max_positions = 0
        max_positions = int(getattr(config, "max_position_embeddings", 0) or 0) or DEFAULT_MAX_POSITIONS
        if rope_type == "longrope":
            self.original_max_positions = int(params["original_max_position_embeddings"])
            if max_positions > self.original_max_positions:
                self.long_inv_freq = _longrope_inv_freq(params, self.rotary_dim, config, "long_factor")[0]
        self.register_buffer("cos_sin_cache", self._cache(max_positions), persistent=False)
        self.kernels: Kernels = kernels_here()

    @property
    def length_dependent(self) -> bool:
        """Whether a token's rotation depends on its sequence's length, not only its position (LongRoPE with a
        long set): the same prefix then has other keys in a longer sequence (no prefix cache across lengths)."""
        return self.long_inv_freq is not None

    def _cache(self, num_positions: int) -> torch.Tensor:
        cache = self._rows(self.inv_freq, num_positions)
        if self.long_inv_freq is not None:
            cache = torch.cat((cache, self._rows(self.long_inv_freq, num_positions)))
        return cache

    def _rows(self, inv_freq: torch.Tensor, num_positions: int) -> torch.Tensor:
        """[num_positions, head_dim]: cos | sin, each half the rotated pairs then (partial rotary) cos 1, sin 0."""
        rows = build_cos_sin_cache(inv_freq, self.attention_scaling, num_positions)
        passing = (self.head_dim - self.rotary_dim) // 2
        if not passing:
            return rows
        cos, sin = rows.chunk(2, dim=-1)
        ones, zeros = cos.new_ones(num_positions, passing), cos.new_zeros(num_positions, passing)
        return torch.cat((cos, ones, sin, zeros), dim=-1)

    @property
    def max_positions(self) -> int:
        rows = int(self.cos_sin_cache.shape[0])
        return rows // 2 if self.length_dependent else rows

    def reserve(self, num_positions: int) -> None:
        """Make the cache cover positions 0 .. num_positions - 1 (growing it to the next power of two)."""
        if num_positions > self.max_positions:
            if self.rope_type == "dynamic":
                raise NotImplementedError(
                    f"rope_type 'dynamic' past max_position_embeddings {self.max_positions} "
                    f"(transformers rescales it with each step's length): {num_positions}"
                )
            self.cos_sin_cache = self._cache(1 << (num_positions - 1).bit_length())

    def rope_batch(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch with the positions the rotation reads: the same, except with LongRoPE's long set, where the
        tokens of sequences longer than original_max_position_embeddings read the long rows. A sequence's length is
        its context after this step, or its whole prompt's while that is prefilled in chunks (transformers sees the
        prompt at once)."""
        if not self.length_dependent:
            return batch
        lens = batch.seq_lens  # [B]
        if batch.prefill_decode_from is not None:  # the prefill chunks' prompt lengths
            decodes = batch.num_decodes
            lens = torch.cat((lens[:decodes], torch.maximum(lens[decodes:], batch.prefill_decode_from)))
        long = lens > self.original_max_positions
        if not batch.step_graph:  # rows of prefill chunks: their sequence's flag; padding rows keep theirs
            long = torch.repeat_interleave(long, torch.tensor(batch.query_lens, device=long.device))
            long = F.pad(long, (0, batch.positions.shape[0] - long.shape[0]))
        return replace(batch, positions=batch.positions + long.to(torch.int64) * self.max_positions)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, cos_sin: torch.Tensor | None = None
    ) -> None:
        """Rotate q [T, Hq, head_dim] and k [T, Hk, head_dim] (views into the qkv output are fine) in place,
        token i by row positions[i] [T] of `cos_sin` (default: this cache)."""
        cache = self.cos_sin_cache if cos_sin is None else cos_sin
        self.kernels.rotary_embedding(positions, q, k, cache, self.is_neox)


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal rotary embedding (M-RoPE): each token has three positions (temporal, height, width), and
    the rotated pairs are cut into `mrope_section` runs, the first rotated by the temporal position, the next by the
    height, the last by the width (transformers' recomposition of the frequencies). Where a token's three are equal
    (every text token) that is the plain rotation at that position, so a step without image tokens runs on
    `positions` and the shared cache as any model does (decodes, native steps included); a step whose batch carries
    `mrope_positions` gets a cos | sin row per token (`rope_batch`), which its positions then index."""

    column_sections: torch.Tensor  # [head_dim] int64: the position (0 t, 1 h, 2 w) each cache column rotates by

    def __init__(self, config: Any, head_dim: int, is_neox: bool = True, partial: bool = False) -> None:
        super().__init__(config, head_dim, is_neox, partial)
        sections = [int(n) for n in rope_parameters(config).get("mrope_section") or ()]
        if len(sections) != 3 or sum(sections) * 2 != self.rotary_dim or min(sections) < 0:
            raise ValueError(
                f"mrope_section {sections}: three runs of rotated pairs summing to {self.rotary_dim // 2} expected"
            )
        half = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
        self.register_buffer("column_sections", torch.cat((half, half)), persistent=False)

    def rope_batch(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch with one cos | sin row per token where it carries `mrope_positions` (positions 0 .. T-1 index
        them); unchanged otherwise."""
        if batch.mrope_positions is None:
            return batch
        index = batch.mrope_positions[self.column_sections].t()  # [T, head_dim]: each column's position
        rows = self.cos_sin_cache.gather(0, index.contiguous())
        positions = torch.arange(index.shape[0], dtype=torch.int64, device=index.device)
        return replace(batch, positions=positions, rope_cache=rows)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim] int64: for each dim of a head as the kernels see it (RotaryEmbedding, partial rotary), the dim of
    transformers' head it holds. transformers pairs (i, i + r/2) of the first r = rotary_dim dims and passes the
    rest; here pair i < r/2 sits at (i, i + head_dim/2) and the passing dims fill each half's remainder."""
    half, rot_half = head_dim // 2, rotary_dim // 2
    passing = torch.arange(rotary_dim, head_dim)
    return torch.cat(
        (
            torch.arange(rot_half),
            passing[: half - rot_half],
            torch.arange(rot_half, rotary_dim),
            passing[half - rot_half :],
        )
    )
