"""GPT-OSS (transformers' GptOssForCausalLM): the Llama attention with attention sinks, alternating sliding and full
layers, and a mixture of experts with its own router and expert MLP.

- Attention: q / k / v / o with biases, neox rope (yarn in the released configs), and one learned sink logit per
  head in every softmax's denominator (`sinks`, see kernels/paged_attention.py). `layer_types` alternates
  "sliding_attention" (a window of `sliding_window`) and "full_attention" (`layer_windows`).
- RMSNorm: the weight times the normalized row in float32, then cast (transformers keeps the norms in float32).
- Router: logits = x W^T + b [T, E]; the top-k logits, softmaxed among themselves in the model dtype.
- Experts: gate_up = x @ W_gu[e] + b_gu[e] with gate and up interleaved (even / odd columns), the clamped SwiGLU
  (up.clamp(-limit, limit) + 1) * gate * sigmoid(alpha * gate) with gate clamped above at limit, then
  @ W_down[e] + b_down[e]. Weights in the checkpoint's layout: gate_up_proj [E, H, 2I], down_proj [E, I, H].
- MXFP4 checkpoints (`quantization_config.quant_method == "mxfp4"`): the experts' `*_blocks` / `*_scales` are
  dequantized at load (`dequantize_mxfp4`, straight to the model dtype: FP4 values times powers of two are exact in
  bf16), so the model runs dense in its dtype.

Expert parallelism and TP x EP as for Mixtral (`ExpertParallel.run_experts`; each TP rank holds its slice of every
local expert's intermediate size and the block all-reduces). The attention with sinks runs on the native CPU
attention kernels on a CPU and on the kernels' PyTorch twins on CUDA (Triton computes no sinks); no native decode
step or step graph (expert dispatch is data-dependent).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from infer.worker.distributed.expert_parallel import ExpertParallel
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.attention import paged_attention
from infer.worker.engine.forward_batch import ForwardBatch, KVCache
from infer.worker.models.layers import ColumnLinear, RotaryEmbedding, VocabEmbedding, _param, _rank_slice
from infer.worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaVariant, MLPFactory, layer_windows

# The 16 values of an FP4 (e2m1) code, by code (transformers' FP4_VALUES).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 expert weights -> dense, transposed to the in-memory layout: blocks [E, R, G, 16] uint8 (two FP4 codes
    a byte, the low nibble first), scales [E, R, G] uint8 (a power of two, biased by 127, per block of 32) ->
    [E, G * 32, R] in `dtype` (gate_up_proj's [E, H, 2I] from [E, 2I, H / 32, 16], down_proj's [E, I, H])."""
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks [E, R, G, 16] and scales [E, R, G] expected, got {tuple(blocks.shape)} and "
            f"{tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.int64)
    values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1).flatten(-2)  # [E, R, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    num_experts, rows = blocks.shape[:2]
    return values.reshape(num_experts, rows, -1).transpose(1, 2).to(dtype).contiguous()


def _quant_method(config: Any) -> str | None:
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(method)


class GptOssRMSNorm(nn.Module):
    """y = (w * x / rms(x)) in float32, cast back to x's dtype; w kept in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class GptOssAttention(LlamaAttention):
    """LlamaAttention with a sink logit per query head (`sinks` [this rank's heads], loaded from the checkpoint's
    full [H] by `load_shard`)."""

    def __init__(
        self,
        config: Any,
        head_dim: int,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        tp: TensorParallel,
        window: int,
    ) -> None:
        bias = bool(getattr(config, "attention_bias", True))
        variant = LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False)
        super().__init__(config, variant, head_dim, rotary_emb, dtype, tp, window)
        self.tp = tp
        self.sinks = _param(self.num_heads, dtype=dtype)

    def load_shard(self, param_name: str, tensor: Any, shard: object = None) -> None:
        if param_name != "sinks" or shard is not None:
            raise ValueError(f"{type(self).__name__} loads only its sinks whole, not {param_name!r} [{shard}]")
        part = _rank_slice(tensor, 0, self.tp.rank, self.tp.size, "sinks")
        if tuple(part.shape) != tuple(self.sinks.shape):
            raise ValueError(
                f"sinks: checkpoint shape {tuple(tensor.shape)} != expected {(self.num_heads * self.tp.size,)}"
            )
        self.sinks.copy_(part if isinstance(part, torch.Tensor) else part.read())

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """positions [T], hidden [T, hidden_size] -> [T, hidden_size]; writes this layer's new K, V into the cache."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        self.rotary_emb(positions, q, None)  # K is rotated by the KV append as it is stored
        out = paged_attention(
            self.kernels,
            q,
            k,
            v,
            k_cache,
            v_cache,
            batch,
            self.scale,
            self.rotary_emb.cos_sin_cache,
            self.rotary_emb.is_neox,
            self.window,
            sinks=self.sinks.float(),
        )
        return self.o_proj(out.view(num_tokens, -1))


class GptOssExperts(nn.Module):
    """This rank's experts of one layer, in the checkpoint's layout: gate_up_proj [E_local, H, 2I] (gate and up
    interleaved), gate_up_proj_bias [E_local, 2I], down_proj [E_local, I, H], down_proj_bias [E_local, H]; with TP
    each rank holds its slice of I (its gate / up pairs), and rank 0 alone adds the down bias (the block
    all-reduces). `experts(rows, ids)` is the `ExpertsFn` of `ExpertParallel.run_experts`.

    MXFP4 checkpoints fill gate_up_proj / down_proj through `*_blocks` and `*_scales` (size-0 placeholders here,
    dequantized into the dense parameter when both of a projection have arrived)."""

    PROJECTIONS = ("gate_up_proj", "down_proj")

    def __init__(self, config: Any, dtype: torch.dtype, ep: ExpertParallel, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.num_experts = tp, config.num_local_experts
        self.expert_range = ep.expert_range(self.num_experts)
        self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)
        inter = len(tp.part(config.intermediate_size, "the experts' intermediate size"))
        hidden, num_local = config.hidden_size, len(self.expert_range)
        self.gate_up_proj = _param(num_local, hidden, 2 * inter, dtype=dtype)
        self.gate_up_proj_bias = _param(num_local, 2 * inter, dtype=dtype)
        self.down_proj = _param(num_local, inter, hidden, dtype=dtype)
        self.down_proj_bias = _param(num_local, hidden, dtype=dtype)
        self.mxfp4 = _quant_method(config) == "mxfp4"
        self._pending: dict[str, torch.Tensor] = {}
        if self.mxfp4:
            for name in self.PROJECTIONS:
                for part in ("blocks", "scales"):
                    setattr(self, f"{name}_{part}", _param(0, dtype=torch.uint8))

    def forward(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """rows [N, H], ids [N] int64 (this rank's experts, local ids) -> each row through its expert, [N, H]."""
        out = torch.zeros_like(rows)
        for e in ids.unique().tolist():
            picked = (ids == e).nonzero().squeeze(1)
            gate_up = rows[picked] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate = gate_up[:, ::2].clamp(max=self.limit)
            up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
            y = ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[e]
            out[picked] = y + self.down_proj_bias[e] if self.tp.rank == 0 else y
        return out

    def shards_of(self, param_name: str) -> tuple[None, ...]:
        """The loader's completeness check: an MXFP4 checkpoint fills the projections through their blocks."""
        return () if self.mxfp4 and param_name in self.PROJECTIONS else (None,)

    def load_shard(self, param_name: str, tensor: Any, shard: object = None) -> None:
        if shard is not None:
            raise ValueError(f"{param_name} takes the experts' fused tensor, not a shard {shard!r}")
        if tensor.shape[0] != self.num_experts:
            raise ValueError(
                f"{param_name}: {tensor.shape[0]} experts in the checkpoint, the config has {self.num_experts}"
            )
        ours = tensor.narrow(0, self.expert_range.start, len(self.expert_range))
        ours = ours if isinstance(ours, torch.Tensor) else ours.read()
        if param_name.endswith(("_blocks", "_scales")) and self.mxfp4:
            self._pending[param_name] = ours
            projection = param_name.rpartition("_")[0]
            blocks, scales = self._pending.get(f"{projection}_blocks"), self._pending.get(f"{projection}_scales")
            if blocks is not None and scales is not None:
                self._load_dense(projection, dequantize_mxfp4(blocks, scales, getattr(self, projection).dtype))
                del self._pending[f"{projection}_blocks"], self._pending[f"{projection}_scales"]
            return
        self._load_dense(param_name, ours)

    def _load_dense(self, param_name: str, tensor: torch.Tensor) -> None:
        """This rank's slice of I of the local experts' full tensor: the last dim of gate_up_proj(_bias), dim 1 of
        down_proj; down_proj_bias whole."""
        param: torch.Tensor | None = getattr(self, param_name, None)
        if param is None or param_name.endswith(("_blocks", "_scales")):
            raise ValueError(f"{type(self).__name__} has no parameter {param_name!r}")
        if param_name.startswith("gate_up_proj"):
            tensor = _rank_slice(tensor, tensor.dim() - 1, self.tp.rank, self.tp.size, param_name)
        elif param_name == "down_proj":
            tensor = _rank_slice(tensor, 1, self.tp.rank, self.tp.size, param_name)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"{param_name}: checkpoint shape {tuple(tensor.shape)} (this rank's part) != expected "
                f"{tuple(param.shape)}"
            )
        param.copy_(tensor)


class GptOssMoeBlock(nn.Module):
    """hidden [T, H] -> sum over each token's top-k experts of weight * expert(hidden): `router` (replicated), top-k
    of its logits softmaxed in the model dtype, `experts` this rank's (see GptOssExperts)."""

    def __init__(self, config: Any, dtype: torch.dtype, ep: ExpertParallel, tp: TensorParallel) -> None:
        super().__init__()
        self.top_k, self.ep, self.tp = config.num_experts_per_tok, ep, tp
        if not 0 < self.top_k <= config.num_local_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {config.num_local_experts}]")
        self.router = ColumnLinear(config.hidden_size, config.num_local_experts, True, dtype, TensorParallel.single())
        self.experts = GptOssExperts(config, dtype, ep, tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.router(hidden)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        out = self.ep.run_experts(hidden, ids, weights, self.experts.num_experts, self.experts)
        return self.tp.all_reduce(out)


class GptOssDecoderLayer(nn.Module):
    """Pre-norm attention and MoE over a residual stream carried whole (the call of LlamaDecoderLayer, residual
    always None)."""

    def __init__(
        self,
        config: Any,
        head_dim: int,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        mlp: nn.Module,
        tp: TensorParallel,
        window: int,
    ) -> None:
        super().__init__()
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GptOssAttention(config, head_dim, rotary_emb, dtype, tp, window)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), batch, k_cache, v_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), None


class GptOssModel(nn.Module):
    """Embedding, GPT-OSS layers (each with its layer type's window), final norm; LlamaModel's constructor and
    forward (`mlp_factory` builds each layer's MoE block)."""

    def __init__(
        self,
        config: Any,
        head_dim: int,
        dtype: torch.dtype,
        mlp_factory: MLPFactory | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        if mlp_factory is None:
            raise ValueError("GptOssModel needs the MoE block factory of GptOssForCausalLM")
        tp = TensorParallel.single() if tp is None else tp
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.rotary_emb = RotaryEmbedding(config, head_dim)
        if self.rotary_emb.length_dependent:
            raise NotImplementedError(f"{config.model_type}: rope_type 'longrope' is not supported")
        windows = layer_windows(config)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(config, head_dim, self.rotary_emb, dtype, mlp_factory(i), tp, windows[i])
            for i in range(config.num_hidden_layers)
        )
        self.norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp_size = tp.size

    def forward(
        self,
        batch: ForwardBatch,
        kv_cache: KVCache,
        layers: Sequence[Callable[..., tuple[torch.Tensor, None]]] | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        self.rotary_emb.reserve(max(batch.context_lens, default=0))
        steps: Iterable[Callable[..., tuple[torch.Tensor, None]]] = self.layers if layers is None else layers
        for layer, k_cache, v_cache in zip(steps, kv_cache.k, kv_cache.v, strict=True):
            hidden, _ = layer(batch.positions, hidden, None, batch, k_cache, v_cache)
        return self.norm(hidden)


class GptOssForCausalLM(LlamaForCausalLM):
    """GPT-OSS (model_type "gpt_oss"); see the module docstring."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }
    base_model_class: ClassVar[Any] = GptOssModel
    supports_step_graphs: ClassVar[bool] = False  # expert dispatch is data-dependent
    supports_expert_parallel: ClassVar[bool] = True

    def __init__(
        self, config: Any, dtype: torch.dtype, ep: ExpertParallel | None = None, tp: TensorParallel | None = None
    ) -> None:
        method = _quant_method(config)
        if method not in (None, "mxfp4"):
            raise NotImplementedError(
                f"gpt_oss: quantization_config.quant_method {method!r} is not supported "
                f"(only mxfp4, dequantized at load)"
            )
        ep = ExpertParallel.single() if ep is None else ep
        tp_ = TensorParallel.single() if tp is None else tp

        def moe_block(layer_index: int) -> nn.Module:
            return GptOssMoeBlock(config, dtype, ep, tp_)

        super().__init__(config, dtype, mlp_factory=moe_block, tp=tp)
        self.ep = ep
