"""Phi-3 / Phi-4 (Phi3ForCausalLM): the Llama layers with what Phi-3 changes.

- The checkpoint stores qkv_proj and gate_up_proj fused (q | k | v, gate | up rows), which our fused layers take
  whole (`MergedColumnLinear.load_shard` with no shard: each rank cuts its heads out of each part).
- Partial rotary (`partial_rotary_factor`, Phi-4-mini's 0.75): the first rotary_dim dims of each head rotate, the
  rest pass. Our kernels rotate whole heads, so the q and k rows of each head are stored in `partial_rotary_order`
  (rotated pairs at (i, i + head_dim / 2), the passing dims after them in each half) with cos 1, sin 0 in the
  passing columns of the rope cache: q . k is the same sum in another order, the cached K is in that order too.
- LongRoPE ("longrope", older "su"): short factors for sequences up to original_max_position_embeddings, long
  ones past it, scaled by the attention factor (`RotaryEmbedding`; prefix caching is off for such a model).
- The sliding window (`sliding_window`) applies to every layer, as in transformers.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch

from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.models.layers import MergedColumnLinear, _rank_slice, partial_rotary_order
from infer.worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, MLPFactory


class PartialRotaryQKV(MergedColumnLinear):
    """The fused qkv projection with each q and k head's rows in `order` (partial_rotary_order): the rotation the
    kernels apply to whole heads is then transformers' partial one."""

    def __init__(
        self,
        like: MergedColumnLinear,
        in_features: int,
        bias: bool,
        head_dim: int,
        order: torch.Tensor,
        dtype: torch.dtype,
        tp: TensorParallel,
    ) -> None:
        full = {name: size * like.shard_parts[name][0] for name, size in like.shard_sizes.items()}
        super().__init__(in_features, full, bias, dtype, tp, shard_parts=like.shard_parts)
        self.head_dim, self.order = head_dim, order

    def load_shard(self, param_name: str, tensor: Any, shard: str | None = None) -> None:
        if shard not in ("q", "k"):
            super().load_shard(param_name, tensor, shard)
            return
        num_parts, index = self.shard_parts[shard]
        part = _rank_slice(tensor, 0, index, num_parts, f"{param_name}[{shard}]")
        part = part if isinstance(part, torch.Tensor) else part.read()
        heads = part.reshape(-1, self.head_dim, *part.shape[1:])[:, self.order].reshape(part.shape)
        self.load_rows(param_name, self.shard_offsets[shard], self.shard_sizes[shard], heads, f"{param_name}[{shard}]")


class Phi3Model(LlamaModel):
    """LlamaModel whose q / k heads follow partial_rotary_order when the rotary is partial."""

    partial_rotary: ClassVar[bool] = True

    def __init__(
        self,
        config: Any,
        head_dim: int,
        dtype: torch.dtype,
        mlp_factory: MLPFactory | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__(config, head_dim, dtype, mlp_factory, tp)
        rotary_dim = self.rotary_emb.rotary_dim
        if rotary_dim == head_dim:
            return
        order = partial_rotary_order(head_dim, rotary_dim)
        tp = TensorParallel.single() if tp is None else tp
        for layer in self.layers:
            attn = cast(LlamaAttention, layer.self_attn)  # LlamaModel builds LlamaDecoderLayers: a LlamaAttention each
            attn.qkv_proj = PartialRotaryQKV(
                attn.qkv_proj, config.hidden_size, attn.qkv_proj.bias is not None, head_dim, order, dtype, tp
            )


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4 (model_type "phi3"); see the module docstring for what it changes."""

    base_model_class: ClassVar[Any] = Phi3Model
