"""DeepSeek-V2 / V3 on the Llama layers: multi-head latent attention (MLA) here, the MoE layers (shared experts,
grouped top-k routing) in `deepseek_moe.py`.

MLA compresses a token's keys and values into one latent c = kv_a_layernorm(kv_a_proj(x)[:rank]) of kv_lora_rank
dims plus one shared rope key k_pe (qk_rope_head_dim dims, GPT-J-interleaved rope). transformers expands c per head
through kv_b_proj into k_nope and v; here the pool stores the latent itself and attention runs on it (the absorbed
form, as DeepSeek's and vLLM's MLA do):

    score_h = q_nope_h . (W_UK_h c) + q_pe_h . k_pe = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe
    out_h   = W_UV_h (sum_j p_hj c_j)

so each layer's KV pool holds one "head" of kv_lora_rank + qk_rope_head_dim dims per token: K = [c | k_pe] (rotated
before the append), and V the same row (the attention's output past kv_lora_rank is dropped), instead of
num_heads x (qk_nope + qk_rope + v_head) dims per token. The row is stored once: the pool's V tensor of a layer is its
K tensor (`kv_shared`, `KVCache.shared_kv`). The paged attention kernels take it as multi-query attention.
The rope key rotates GPT-J's interleaved pairs (V2; V3 with `rope_interleave`, its default) or the two halves.
The softmax scale is qk_head_dim ** -0.5 times yarn's mscale(factor, mscale_all_dim) ** 2, as in transformers.
With tensor parallelism each rank holds its query heads and their slice of kv_b_proj; the latent (kv_a_proj) is
replicated, so every rank's pool holds the whole latent.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from infer.kernels.dispatch import Kernels, kernels_here
from infer.worker.distributed.expert_parallel import ExpertParallel
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.attention import paged_attention
from infer.worker.engine.forward_batch import ForwardBatch
from infer.worker.models.deepseek_moe import deepseek_mlp_factory
from infer.worker.models.layers import (
    ColumnLinear,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    VocabEmbedding,
    rope_parameters,
)
from infer.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, MLPFactory


def mla_softmax_scale(config: Any) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under yarn scaling with mscale_all_dim."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and all_dim and params["factor"] > 1:
        mscale = 0.1 * all_dim * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class DenseColumnLinear(ColumnLinear):
    """A column-parallel linear whose weight stays dense whatever the loader's quantization plan: MLA reads
    kv_b_proj's weight as per-head matrices."""

    def materialize(self, fmt: str | None, device: torch.device | str) -> None:
        super().materialize(None, device)


class MLAttention(nn.Module):
    """Multi-head latent attention over a pool of latents (see the module docstring). Same call as LlamaAttention."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.kernels: Kernels = kernels_here()
        single = TensorParallel.single()
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.num_heads = len(tp.part(config.num_attention_heads, "the number of attention heads"))
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank, self.v_dim = config.kv_lora_rank, config.v_head_dim
        q_size = config.num_attention_heads * (self.nope + self.rope)
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnLinear(hidden, q_size, False, dtype, tp)
        else:
            self.q_a_proj = ColumnLinear(hidden, self.q_lora_rank, bias, dtype, single)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, dtype)
            self.q_b_proj = ColumnLinear(self.q_lora_rank, q_size, False, dtype, tp)
        self.kv_a_proj_with_mqa = ColumnLinear(hidden, self.rank + self.rope, bias, dtype, single)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6, dtype)
        self.kv_b_proj = DenseColumnLinear(
            self.rank, config.num_attention_heads * (self.nope + self.v_dim), False, dtype, tp
        )
        self.o_proj = RowLinear(config.num_attention_heads * self.v_dim, hidden, bias, dtype, tp)
        self.scale = mla_softmax_scale(config)
        self.rotary_emb = rotary_emb

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """positions [T], hidden [T, hidden_size] -> [T, hidden_size]; appends the tokens' latents to the pool
        (k_cache / v_cache [1, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim])."""
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], -1)
        kv = torch.cat((self.kv_a_layernorm(latent.contiguous()), k_pe), -1).view(num_tokens, 1, -1)
        q_pe = q_pe.contiguous()
        self.rotary_emb(positions, q_pe, kv[..., self.rank :])  # both rotated in place
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w_kv.split([self.nope, self.v_dim], dim=1)  # [H, nope, rank], [H, v, rank]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, rank]
        query = torch.cat((q_latent, q_pe), -1)  # [T, H, rank + rope]
        out = paged_attention(self.kernels, query, kv, kv, k_cache, v_cache, batch, self.scale)
        out = torch.einsum("thr,hvr->thv", out[..., : self.rank], w_uv)  # [T, H, v]
        return self.o_proj(out.reshape(num_tokens, -1))


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer with MLA for its attention (same forward)."""

    def __init__(
        self, config: Any, rotary_emb: RotaryEmbedding, dtype: torch.dtype, mlp: nn.Module, tp: TensorParallel
    ) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = MLAttention(config, rotary_emb, dtype, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = mlp


class DeepseekV2Model(LlamaModel):
    """Embedding, MLA decoder layers with `mlp_factory`'s feed-forward sublayers (dense or MoE), final norm
    (LlamaModel's forward; no native decode step)."""

    def __init__(
        self,
        config: Any,
        head_dim: int,
        dtype: torch.dtype,
        mlp_factory: MLPFactory | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        nn.Module.__init__(self)
        tp = TensorParallel.single() if tp is None else tp
        if mlp_factory is None:
            mlp_factory = deepseek_mlp_factory(config, dtype, ExpertParallel.single(), tp)[0]
        interleaved = config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True))
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.rotary_emb = RotaryEmbedding(config, config.qk_rope_head_dim, is_neox=not interleaved)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, self.rotary_emb, dtype, mlp_factory(i), tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.tp_size = tp.size
        self.native_decode = False


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 (model_type "deepseek_v2") and V3 ("deepseek_v3"); see the module docstring and deepseek_moe.py.
    The KV pool holds one latent head of kv_lora_rank + qk_rope_head_dim dims per token and layer (num_kv_heads,
    head_dim), once (`kv_shared`). An EP rank holds `ep.expert_range(n_routed_experts)` of each MoE layer's routed
    experts."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    # per-expert checkpoint module (mlp.experts.{i}.<name>) -> (our fused expert parameter, projection)
    expert_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
        "down_proj": ("down_proj", "down"),
    }
    base_model_class: ClassVar[Any] = DeepseekV2Model
    supports_step_graphs: ClassVar[bool] = False  # expert dispatch is data-dependent; MLA has no graph path yet
    supports_expert_parallel: ClassVar[bool] = True
    kv_shared: ClassVar[bool] = True  # V is K: the latent row, stored once

    def __init__(
        self, config: Any, dtype: torch.dtype, ep: ExpertParallel | None = None, tp: TensorParallel | None = None
    ) -> None:
        ep = ExpertParallel.single() if ep is None else ep
        tp = TensorParallel.single() if tp is None else tp
        mlp_factory, sparse = deepseek_mlp_factory(config, dtype, ep, tp)
        if ep.size > 1 and not sparse:
            raise ValueError(
                f"an EP group of {ep.size} ranks needs MoE layers; this {config.model_type} config has "
                f"none (n_routed_experts={getattr(config, 'n_routed_experts', None)}, "
                f"first_k_dense_replace={getattr(config, 'first_k_dense_replace', None)})"
            )
        super().__init__(config, dtype, mlp_factory, tp)
        self.ep = ep
        self.num_kv_heads = 1
        self.head_dim = config.kv_lora_rank + config.qk_rope_head_dim
        mtp = max(int(getattr(config, name, None) or 0) for name in ("num_mtp_layers", "num_nextn_predict_layers"))
        self.mtp_layers = range(self.num_layers, self.num_layers + mtp)

    def skips_checkpoint_tensor(self, key: str) -> bool:
        """Whether checkpoint tensor `key` belongs to V3's multi-token-prediction layers (model.layers.{n}. past the
        decoder layers, as the released checkpoints store them), which serving does not run (transformers skips
        them too)."""
        parts = key.split(".", 3)
        return (
            len(parts) == 4
            and parts[:2] == ["model", "layers"]
            and parts[2].isdigit()
            and int(parts[2]) in self.mtp_layers
        )
