"""A decode step of 1-8 sequences through a dense Llama-family model in bf16 on a CPU, in one native call.

At batch 1 a token is a walk through every weight (SmolLM2-135M: 269 MB), which the native GEMV streams near
the machine's read bandwidth. What was left was the Python around the ~10 kernel calls of each layer (module
calls, argument checks, ctypes conversions): about 5 of the 13-15 ms a token took on the 2-core dev VM
(2026-11-26). `NativeDecoder` hands the embedding rows, the weights' and pools' addresses and the step's
positions, slots and block tables to kernels/cpu/decode_layers.c, which calls the same kernels in the same order as
the layers do one by one (the linears send 1-8 rows to the same GEMV), so the tokens are the eager path's, bit for
bit (tests/worker/test_native_decode.py).

It serves a step whose batch is 1-8 decoding sequences (GEMV_MAX_ROWS), outside step graphs, when every layer
is the dense Llama layer without q/k norms (biases are fine: Qwen2), on one rank, with bf16 weights the GEMV
takes: the avx512 build (bf16 products by pairs with AVX512-BF16, else the fp32 core) and the avx2 build (bf16
weights widened to fp32 in registers); the generic build has no GEMV. Anything else runs the layers one by one.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from infer.kernels.cpu_kernels import (
    GEMV_MAX_ROWS, MAX_BLOCK, MAX_GROUP, MAX_HEAD_DIM, MAX_HIDDEN, decode_layers, gemv_takes, native_ready
)
from infer.worker.forward_batch import ForwardBatch, KVCache

if TYPE_CHECKING:
    from torch import nn

    from infer.worker.models.layers import PackedLinear
    from infer.worker.models.llama import LlamaModel


def _linears(layer: nn.Module) -> tuple[PackedLinear, PackedLinear, PackedLinear, PackedLinear]:
    """A decoder layer's four linears, in decode_layers.c's order."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


class NativeDecoder:
    """Runs `LlamaModel`'s layers and final norm for a batch of 1-8 decoding sequences (see the module docstring).
    Build it with `for_model`, which answers None for a model it cannot serve."""

    def __init__(self, model: LlamaModel) -> None:
        layers = list(model.layers)
        attn, mlp = layers[0].self_attn, layers[0].mlp
        self.model = model
        self.num_layers = len(layers)
        self.hidden = model.norm.weight.shape[0]
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate = mlp.down_proj.weight.shape[1]
        self.eps, self.scale = model.norm.eps, attn.scale
        self.linears: list[PackedLinear] = [linear for layer in layers for linear in _linears(layer)]
        # 10 a layer, in decode_layers.c's order (the four linears' biases last, None where there is none), then
        # the final norm's weight (Parameters keep their identity across reloads and suspend / resume; their
        # storage may move, so the addresses are read each step)
        self.weights: list[torch.Tensor | None] = []
        for layer in layers:
            qkv, o, gate_up, down = linears = _linears(layer)
            self.weights += [layer.input_layernorm.weight, qkv.weight, o.weight, layer.post_attention_layernorm.weight,
                             gate_up.weight, down.weight, *(linear.bias for linear in linears)]
        self.weights.append(model.norm.weight)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scratch = torch.empty(GEMV_MAX_ROWS * (2 * self.hidden + 2 * q_size + 2 * kv_size + 3 * self.intermediate),
                                   dtype=torch.bfloat16)
        self.residual = torch.empty(GEMV_MAX_ROWS, self.hidden, dtype=torch.bfloat16)

    @classmethod
    def for_model(cls, model: LlamaModel, tp_size: int) -> NativeDecoder | None:
        """The decoder for `model`, or None where the native step does not apply to it."""
        from infer.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

        layers = list(model.layers)
        if tp_size != 1 or not layers or model.norm.weight.dtype != torch.bfloat16 or not native_ready():
            return None
        if model.norm.weight.device.type != "cpu" or model.rotary_emb.cos_sin_cache.dtype != torch.float32:
            return None
        if not all(type(layer) is LlamaDecoderLayer and type(layer.self_attn) is LlamaAttention
                   and type(layer.mlp) is LlamaMLP and layer.self_attn.q_norm is None for layer in layers):
            return None
        attn = layers[0].self_attn
        norms = [model.norm] + [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        linears = [linear for layer in layers for linear in _linears(layer)]
        shapes_fit = (attn.head_dim % 16 == 0 and attn.head_dim <= MAX_HEAD_DIM
                      and attn.num_heads % attn.num_kv_heads == 0 and attn.num_heads // attn.num_kv_heads <= MAX_GROUP
                      and model.norm.weight.shape[0] <= MAX_HIDDEN)
        same = all(layer.self_attn.num_heads == attn.num_heads and layer.self_attn.num_kv_heads == attn.num_kv_heads
                   and layer.self_attn.head_dim == attn.head_dim and layer.self_attn.scale == attn.scale
                   for layer in layers) and len({n.eps for n in norms}) == 1
        plain = all(gemv_takes(lin.weight) and (lin.bias is None or (
            lin.bias.dtype == torch.bfloat16 and lin.bias.is_contiguous() and lin.bias.shape == lin.weight.shape[:1]))
            for lin in linears) and all(n.weight.dtype == torch.bfloat16 and n.weight.is_contiguous() for n in norms)
        return cls(model) if shapes_fit and same and plain else None

    def takes(self, batch: ForwardBatch, kv_cache: KVCache) -> bool:
        """Whether this step is one for the native call: 1-8 decoding sequences and nothing else, outside a step
        graph, over bf16 pools of the shape the kernels take, with every linear on the GEMV (pack_weights decides
        that)."""
        rows = batch.input_ids.shape[0]
        if (batch.step_graph or not 0 < rows <= GEMV_MAX_ROWS or batch.num_decodes != rows
                or len(batch.context_lens) != rows):
            return False
        pool, tables, cos_sin = kv_cache.k[0], batch.block_tables, self.model.rotary_emb.cos_sin_cache
        return (batch.positions.dtype == batch.slot_mapping.dtype == torch.int64 and batch.positions.is_contiguous()
                and batch.slot_mapping.is_contiguous()
                and batch.seq_lens.dtype == torch.int32 and batch.seq_lens.is_contiguous()
                and cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and pool.dtype == torch.bfloat16
                and pool.dim() == 4 and pool.is_contiguous()
                and pool.shape[2] <= MAX_BLOCK and tables.dtype == torch.int32 and tables.stride(1) == 1
                and all(linear.gemv_ready for linear in self.linears))

    def addresses(self, kv_cache: KVCache) -> tuple[ctypes.Array, ctypes.Array]:
        """The weights' (NULL for a missing bias) and the pools' addresses as decode_layers.c takes them, now."""
        weights = (ctypes.c_void_p * len(self.weights))(*[None if t is None else t.data_ptr() for t in self.weights])
        pools = (ctypes.c_void_p * (2 * self.num_layers))(
            *[pool.data_ptr() for pair in zip(kv_cache.k, kv_cache.v, strict=True) for pool in pair])
        return weights, pools

    def run(self, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """hidden [B, hidden] bf16 (the embedding rows; overwritten) -> the final norm's output [B, hidden], for a
        step that `takes` accepts. K and V of the new tokens are stored in every layer's pool."""
        weights, pools = self.addresses(kv_cache)
        h = hidden if hidden.is_contiguous() else hidden.contiguous()
        rotary = self.model.rotary_emb
        decode_layers(h, self.residual, weights, pools, self.num_layers, self.num_heads, self.num_kv_heads,
                      self.head_dim, self.intermediate, self.eps, self.scale, batch.positions, batch.slot_mapping,
                      batch.block_tables, batch.seq_lens, kv_cache.k[0], rotary.cos_sin_cache, rotary.is_neox,
                      self.scratch)
        return h
