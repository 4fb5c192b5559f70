"""A decode step of 1-8 sequences (speculative verifications' rows included) through a dense Llama-family model on a
CPU, in one native call.

At batch 1 a token is a walk through every weight (SmolLM2-135M: 269 MB), which the native GEMV streams near
the machine's read bandwidth. What was left was the Python around the ~10 kernel calls of each layer (module
calls, argument checks, ctypes conversions): about 5 of the 13-15 ms a token took on the 2-core dev VM
(2026-11-26). `NativeDecoder` hands the embedding rows, the weights' and pools' addresses and the step's
positions, slots and block tables to kernels/cpu/decode_layers.c, which calls the same kernels in the same order as
the layers do one by one (the linears send 1-8 rows to the same GEMV), so the tokens are the eager path's, bit for
bit (tests/worker/test_native_decode.py).

It serves a step whose batch is 1-8 decoding requests (GEMV_MAX_ROWS), each one decode row or the k + 1 rows of a
speculative verification (worker/speculative/verification.py: its last token and k drafts at consecutive positions,
`ForwardBatch.decode_runs`; MAX_ROWS rows in all), outside step graphs, when every layer
is the dense Llama layer without q/k norms (biases are fine: Qwen2), on one rank, in bf16 (decode_layers.c takes
fp32 rows too; `for_model` says why fp32 models keep their layers), with every linear's weight one the native
kernels take: kept quantized (kernels/cpu/quant.c, any build), or dense bf16 in a
bf16 model (the GEMV: the avx512 build's bf16 pairs with AVX512-BF16, else its fp32 core; the avx2 build widens
bf16 to fp32 in registers; the generic build has no GEMV). Anything else runs the layers one by one; so does a
step with rows of a LoRA adapter (worker/engine/lora.py: this call knows no LoRA; LlamaModel.forward checks
`lora_rows_active()`), while steps of base-model rows only keep it.

A verification's rows are computed as the decode at each row's position would be: the linears send all the rows
to the GEMV (each weight row read once for all of them, each row's sum taken alone, however many rows), and
attention reads a request's K and V once for its k + 1 rows, each row seeing the context up to its own position
(kernels/cpu/paged_decode.c's paged_decode_runs, with paged_decode's bits). So greedy output with speculation
equals greedy output without it, token for token, where the steps without it run here too (1-8 sequences).
`steps` and `verification_steps` count the steps this call ran (tests/worker/test_native_decode.py).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, cast

import torch

from infer.kernels.cpu_kernels import (
    GEMV_MAX_ROWS,
    MAX_BLOCK,
    MAX_GROUP,
    MAX_HEAD_DIM,
    MAX_HIDDEN,
    decode_layers,
    native_ready,
)
from infer.kernels.quant import FORMAT_CODES
from infer.worker.engine.forward_batch import ForwardBatch, KVCache
from infer.worker.speculative.config import MAX_SPECULATIVE_TOKENS

if TYPE_CHECKING:
    from infer.worker.models.layers import PackedLinear

# The model's parts are worker/models/llama.py's (LlamaModel and its dense LlamaDecoderLayer, LlamaAttention and
# LlamaMLP): typed Any here, since the model builds its decoder (`for_model`, given its own dense classes) and this
# module imports no model. `for_model` admits only layers of exactly those classes.
Model = Any
Layer = Any


def _attention(layer: Layer) -> Any:
    """A dense layer's attention."""
    return layer.self_attn


def _mlp(layer: Layer) -> Any:
    """A dense layer's MLP."""
    return layer.mlp


def _linears(layer: Layer) -> tuple[PackedLinear, PackedLinear, PackedLinear, PackedLinear]:
    """A decoder layer's four linears, in decode_layers.c's order."""
    attn, mlp = _attention(layer), _mlp(layer)
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


# Rows a step may bring: 1-8 requests, each one decode row or a verification's 1 + k (k <= MAX_SPECULATIVE_TOKENS).
MAX_ROWS = GEMV_MAX_ROWS * (1 + MAX_SPECULATIVE_TOKENS)

# What decode_layers.c takes for a linear's weight (its `formats`): -1 dense bf16 (the GEMV), else the quantized
# format's code (kernels/quant.py FORMAT_CODES).
DENSE_BF16 = -1


def _linear_format(linear: PackedLinear, dtype: torch.dtype) -> int | None:
    """The code decode_layers.c multiplies `linear` by, or None where it cannot (a dense fp32 weight: the GEMV
    streams bf16 weights only)."""
    if linear.quant is not None:
        return FORMAT_CODES[linear.quant.format] if linear.quant_native else None
    return DENSE_BF16 if linear.gemv_native and dtype == torch.bfloat16 else None


class NativeDecoder:
    """Runs `LlamaModel`'s layers and final norm for a batch of 1-8 decoding sequences (see the module docstring).
    Build it with `for_model`, which answers None for a model it cannot serve. It holds the addresses of the
    weights as they are when it is built: the loader's `pack_weights`, which runs after every change of the weights
    (load, refit, resume), drops it, and the next step builds a new one."""

    def __init__(self, model: Model, formats: list[int]) -> None:
        layers = list(model.layers)  # dense layers (for_model admits no other)
        attn, mlp = _attention(layers[0]), _mlp(layers[0])
        self.model = model
        self.dtype = model.norm.weight.dtype
        self.num_layers = len(layers)
        self.hidden = model.norm.weight.shape[0]
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate = mlp.down_proj.logical_shape[1]
        self.eps, self.scale = model.norm.eps, attn.scale
        # 18 a layer, in decode_layers.c's order: the norms and linears' weights, the biases (None where there is
        # none), each linear's block scales and mins (None for a dense one); then the final norm's weight
        weights: list[torch.Tensor | None] = []
        for layer in layers:
            qkv, o, gate_up, down = linears = _linears(layer)
            weights += [
                layer.input_layernorm.weight,
                qkv.weight,
                o.weight,
                layer.post_attention_layernorm.weight,
                gate_up.weight,
                down.weight,
                *(linear.bias for linear in linears),
            ]
            weights += [t for linear in linears for t in (linear.weight_scales, linear.weight_mins)]
        weights.append(model.norm.weight)
        self.weights = (ctypes.c_void_p * len(weights))(*[None if t is None else t.data_ptr() for t in weights])
        self.formats = (ctypes.c_int32 * len(formats))(*formats)
        # each layer's sliding window (0: full), as the layers' own attention takes it
        self.windows = (ctypes.c_int32 * len(layers))(*[_attention(layer).window for layer in layers])
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scratch_per_row = 2 * self.hidden + 2 * q_size + 2 * kv_size + 3 * self.intermediate
        self.scratch = torch.empty(GEMV_MAX_ROWS * self.scratch_per_row, dtype=self.dtype)
        self.residual = torch.empty(GEMV_MAX_ROWS, self.hidden, dtype=self.dtype)
        self._pools: tuple[tuple[int, ...], ctypes.Array] | None = None
        self.steps = 0  # steps run here
        self.verification_steps = 0  # of them, steps with a verification's rows

    @classmethod
    def for_model(cls, model: Model, tp_size: int, dense: tuple[Any, Any, Any]) -> NativeDecoder | None:
        """The decoder for `model`, or None where the native step does not apply to it. `dense`: the model's own
        dense (decoder layer, attention, MLP) classes; a layer of any other class (a subclass included) is not
        run here."""
        dense_layer, dense_attention, dense_mlp = dense
        layers: list[Layer] = list(model.layers)
        dtype = model.norm.weight.dtype
        # bf16 only: an fp32 model's layers run torch's RMSNorm and SiLU on a decode's few rows (RMS_NORM_MIN_ROWS:
        # transformers' bits), so its native step (the same C kernels for fp32 rows as for bf16) would give a
        # sequence other bits alone than in a batch of more than 8, and with quantized linears (int8 activations)
        # other tokens now and then: seeded sampling must not depend on the batch.
        if tp_size != 1 or not layers or dtype != torch.bfloat16 or not native_ready():
            return None
        if model.norm.weight.device.type != "cpu" or model.rotary_emb.cos_sin_cache.dtype != torch.float32:
            return None
        if not all(
            type(layer) is dense_layer
            and type(layer.self_attn) is dense_attention
            and type(layer.mlp) is dense_mlp
            and layer.self_attn.q_norm is None
            and not layer.self_attn.softcap
            for layer in layers
        ):
            return None
        attns = [_attention(layer) for layer in layers]
        attn = attns[0]
        norms = [model.norm] + [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        linears = [linear for layer in layers for linear in _linears(layer)]
        shapes_taken = (
            attn.head_dim % 16 == 0
            and attn.head_dim <= MAX_HEAD_DIM
            and attn.num_heads % attn.num_kv_heads == 0
            and attn.num_heads // attn.num_kv_heads <= MAX_GROUP
            and model.norm.weight.shape[0] <= MAX_HIDDEN
        )
        same = (
            all(
                other.num_heads == attn.num_heads
                and other.num_kv_heads == attn.num_kv_heads
                and other.head_dim == attn.head_dim
                and other.scale == attn.scale
                for other in attns
            )
            and len({n.eps for n in norms}) == 1
        )
        formats = [_linear_format(linear, dtype) for linear in linears]
        plain = (
            all(code is not None for code in formats)
            and all(
                lin.bias is None
                or (lin.bias.dtype == dtype and lin.bias.is_contiguous() and lin.bias.shape[0] == lin.logical_shape[0])
                for lin in linears
            )
            and all(n.weight.dtype == dtype and n.weight.is_contiguous() for n in norms)
        )
        # `plain` holds only where no code is None
        return cls(model, cast("list[int]", formats)) if shapes_taken and same and plain else None

    def takes(self, batch: ForwardBatch, kv_cache: KVCache) -> bool:
        """Whether this step is one for the native call: 1-8 decoding requests (verifications' rows included) and
        nothing else, outside a step graph, over pools of the model's type and of the shape the kernels take."""
        rows, runs = batch.input_ids.shape[0], batch.decode_runs
        requests = rows if runs is None else runs.shape[0]
        if (
            batch.step_graph
            or not 0 < rows <= MAX_ROWS
            or not 0 < requests <= GEMV_MAX_ROWS
            or batch.num_decodes != rows
            or len(batch.context_lens) != rows
        ):
            return False
        if runs is not None and not (runs.dtype == torch.int32 and runs.is_contiguous() and runs.device.type == "cpu"):
            return False
        pool, tables, cos_sin = kv_cache.k[0], batch.block_tables, self.model.rotary_emb.cos_sin_cache
        return (
            batch.positions.dtype == batch.slot_mapping.dtype == torch.int64
            and batch.positions.is_contiguous()
            and batch.slot_mapping.is_contiguous()
            and batch.seq_lens.dtype == torch.int32
            and batch.seq_lens.is_contiguous()
            and cos_sin.dtype == torch.float32
            and cos_sin.is_contiguous()
            and pool.dtype == self.dtype
            and pool.dim() == 4
            and pool.is_contiguous()
            and pool.shape[2] <= MAX_BLOCK
            and tables.dtype == torch.int32
            and tables.stride(1) == 1
        )

    def pool_addresses(self, kv_cache: KVCache) -> ctypes.Array:
        """The pools' addresses as decode_layers.c takes them (made again when the pool's tensors change: a
        suspend and resume allocates new ones)."""
        tensors = [pool for pair in zip(kv_cache.k, kv_cache.v, strict=True) for pool in pair]
        key = tuple(id(t) for t in tensors)
        if self._pools is None or self._pools[0] != key:
            self._pools = key, (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
        return self._pools[1]

    def run(self, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """hidden [B, hidden] (the embedding rows, of the model's type; overwritten) -> the final norm's output
        [B, hidden], for a step that `takes` accepts. K and V of the new tokens are stored in every layer's pool."""
        h = hidden if hidden.is_contiguous() else hidden.contiguous()
        rows = h.shape[0]
        if self.residual.shape[0] < rows:  # grown to the most rows a step brought (a verification: 1 + k each)
            self.residual = torch.empty(rows, self.hidden, dtype=self.dtype)
            self.scratch = torch.empty(rows * self.scratch_per_row, dtype=self.dtype)
        rotary = self.model.rotary_emb
        decode_layers(
            h,
            self.residual,
            self.weights,
            self.formats,
            self.pool_addresses(kv_cache),
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate,
            self.eps,
            self.scale,
            batch.positions,
            batch.slot_mapping,
            batch.block_tables,
            batch.seq_lens,
            kv_cache.k[0],
            rotary.cos_sin_cache,
            rotary.is_neox,
            self.scratch,
            self.windows,
            batch.decode_runs,
        )
        self.steps += 1
        self.verification_steps += batch.decode_runs is not None
        return h
