"""Gemma 2 and Gemma 3 (text): the Llama layers with what Gemma changes, and nothing else.

- RMSNorm scales by (1 + w), computed in float32 and cast back after the weight (`GemmaRMSNorm`); Gemma 3 norms q
  and k per head with it before rope (Gemma 2 does not).
- Sandwich norms: each sublayer's output is normed again before it joins the residual stream
  (post_attention_layernorm, pre_ / post_feedforward_layernorm).
- Embeddings scaled by sqrt(hidden_size), rounded to the model's dtype first, as transformers does.
- Attention scaled by query_pre_attn_scalar ** -0.5; local layers ("sliding_attention") with a sliding window and
  their own rope (rope_parameters["sliding_attention"]), global ones full with theirs.
- GeGLU: gelu (tanh approximation) of the gate times up.
- Attention logit soft-capping (`attn_logit_softcapping`, Gemma 2's 50): each scaled score s becomes
  c * tanh(s / c) before the mask and softmax (`LlamaAttention.softcap`: the native CPU attention kernels, the
  twins and the Triton kernels compute it).
- Final logit soft-capping (tanh(x / c) * c) where the config sets it (Gemma 2's 30; Gemma 3 none by default).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.forward_batch import ForwardBatch, KVCache
from infer.worker.models.layers import (
    MergedColumnLinear,
    RotaryEmbedding,
    RowLinear,
    VocabEmbedding,
    _param,
)
from infer.worker.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaVariant,
    MLPFactory,
    layer_windows,
)


class GemmaRMSNorm(nn.Module):
    """y = x / rms(x) * (1 + w) in float32, cast back to x's dtype (the weight is stored as w, zero-centred)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused as in LlamaMLP."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"hidden_activation {activation!r} is not supported (only gelu_pytorch_tanh)")
        size = config.intermediate_size
        tp.part(size, "the intermediate size")
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, {"gate": size, "up": size}, False, dtype, tp)
        self.down_proj = RowLinear(size, config.hidden_size, False, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Sandwich-normed attention and MLP over a residual stream carried whole between layers: the same call as
    LlamaDecoderLayer's (residual in and out is always None here), so step graphs compile it the same way.
    `qk_norm`: q and k normed per head (Gemma 3)."""

    def __init__(
        self,
        config: Any,
        head_dim: int,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        mlp: nn.Module,
        tp: TensorParallel,
        window: int,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        variant = LlamaVariant(
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=False,
            qk_norm=False,
        )
        self.self_attn = LlamaAttention(config, variant, head_dim, rotary_emb, dtype, tp, window)
        if qk_norm:
            self.self_attn.q_norm = GemmaRMSNorm(head_dim, eps, dtype)
            self.self_attn.k_norm = GemmaRMSNorm(head_dim, eps, dtype)
        self.self_attn.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.self_attn.softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """hidden [T, hidden_size]: the residual stream -> (the stream after this layer, None)."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), batch, k_cache, v_cache)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp), None


class _LayerTypeRope:
    """A config whose rope parameters are those of one layer type (Gemma 3 keeps one set per type)."""

    def __init__(self, config: Any, layer_type: str) -> None:
        self._config = config
        params = getattr(config, "rope_parameters", None) or {}
        if layer_type in params:
            self.rope_parameters = params[layer_type]
        elif layer_type == "sliding_attention" and hasattr(config, "rope_local_base_freq"):  # older configs
            self.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class Gemma3Model(nn.Module):
    """Scaled embeddings, Gemma layers (each with its layer type's rope and window), final norm. Same constructor
    and forward as LlamaModel (`mlp_factory` defaults to GemmaMLP; `layers` stand in for self.layers)."""

    qk_norm: ClassVar[bool] = True

    def __init__(
        self,
        config: Any,
        head_dim: int,
        dtype: torch.dtype,
        mlp_factory: MLPFactory | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        tp = TensorParallel.single() if tp is None else tp
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.embed_scale = config.hidden_size**0.5
        windows = layer_windows(config)
        self.rotary_local = RotaryEmbedding(_LayerTypeRope(config, "sliding_attention"), head_dim)
        self.rotary_global = RotaryEmbedding(_LayerTypeRope(config, "full_attention"), head_dim)
        if self.rotary_local.length_dependent or self.rotary_global.length_dependent:
            raise NotImplementedError(f"{config.model_type}: rope_type 'longrope' is not supported in Gemma layers")
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                config,
                head_dim,
                self.rotary_local if windows[i] else self.rotary_global,
                dtype,
                mlp_factory(i) if mlp_factory else GemmaMLP(config, dtype, tp),
                tp,
                windows[i],
                self.qk_norm,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.tp_size = tp.size

    def forward(
        self,
        batch: ForwardBatch,
        kv_cache: KVCache,
        layers: Sequence[Callable[..., tuple[torch.Tensor, None]]] | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        if batch.image_rows is not None and batch.image_embeds is not None:  # Gemma 3's images (gemma3_vision.py)
            hidden = hidden.index_copy(0, batch.image_rows, batch.image_embeds.to(hidden.dtype))
        longest = max(batch.context_lens, default=0)
        self.rotary_local.reserve(longest)
        self.rotary_global.reserve(longest)
        steps: Iterable[Callable[..., tuple[torch.Tensor, None]]] = self.layers if layers is None else layers
        for layer, k_cache, v_cache in zip(steps, kv_cache.k, kv_cache.v, strict=True):
            hidden, _ = layer(batch.positions, hidden, None, batch, k_cache, v_cache)
        return self.norm(hidden)


class Gemma2Model(Gemma3Model):
    """Gemma 2's: Gemma 3's without the q / k norms (its config has one rope for both layer types)."""

    qk_norm: ClassVar[bool] = False


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model (model_type "gemma3_text"); see the module docstring for what it changes."""

    base_model_class: ClassVar[Callable[..., Any]] = Gemma3Model
    implemented_fields: ClassVar[frozenset[str]] = frozenset(
        {"query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping"}
    )

    def __init__(
        self, config: Any, dtype: torch.dtype, mlp_factory: MLPFactory | None = None, tp: TensorParallel | None = None
    ) -> None:
        super().__init__(config, dtype, mlp_factory, tp)
        self.final_logit_softcapping: float | None = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if logits is not None and self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 (model_type "gemma2"); see the module docstring for what it changes."""

    base_model_class: ClassVar[Callable[..., Any]] = Gemma2Model
