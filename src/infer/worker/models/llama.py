"""The Llama family in one implementation: Llama, Mistral, Qwen2, Qwen3, SmolLM2.

They differ only in details read from the config (`LlamaVariant`): biases on the qkv / o / MLP projections,
per-head RMSNorm of q and k before rope (Qwen3), an explicit head_dim, tied embeddings, and each layer's
sliding window (`layer_windows`). A config that asks for anything else that changes the math is refused at
load, naming it (`refuse_unsupported`).
Module and parameter names follow transformers', except for the fused `qkv_proj` and `gate_up_proj`
(see `packed_modules_mapping`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from infer.kernels.dispatch import Kernels, kernels_here
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.attention import paged_attention
from infer.worker.engine.forward_batch import ForwardBatch, KVCache
from infer.worker.engine.lora import lora_rows_active
from infer.worker.models.layers import (
    LMHead,
    MergedColumnLinear,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    VocabEmbedding,
)
from infer.worker.models.native_decode import NativeDecoder


@dataclass(frozen=True)
class LlamaVariant:
    """What distinguishes the family members, derived from a transformers config."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_config(cls, config: Any) -> LlamaVariant:
        if config.model_type in ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text"):  # biases on q, k, v only, always
            return cls(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=config.model_type in ("qwen3", "qwen3_moe"),
        )


# Model types whose transformers implementation applies `sliding_window` to every layer when it is set (and no
# `layer_types` says otherwise). Llama's ignores the field.
_WINDOW_ON_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe", "phi3")
_LAYER_TYPES = ("full_attention", "sliding_attention")

# Config fields that change the math where set (not None / False / 0), none of which these layers implement.
_UNSUPPORTED_FIELDS = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "query_pre_attn_scalar": "a query pre-attention scalar",
    "attention_chunk_size": "chunked attention",
    "no_rope_layers": "layers without rope",
    "sinks": "attention sinks",
    "use_attention_sinks": "attention sinks",
    "logits_scaling": "logit scaling",
    "embedding_multiplier": "an embedding multiplier",
    "attention_multiplier": "an attention multiplier",
    "residual_multiplier": "a residual multiplier",
    "use_bidirectional_attention": "bidirectional attention",
}


def refuse_unsupported(config: Any, implemented: frozenset[str] = frozenset()) -> None:
    """NotImplementedError naming the first config feature these layers do not compute (rope types are checked
    by RotaryEmbedding, activations by the MLPs, layer types by `layer_windows`); `implemented`: the fields a
    family's own layers compute."""
    for name, what in _UNSUPPORTED_FIELDS.items():
        if name in implemented:
            continue
        value = getattr(config, name, None)
        if value is not None and value is not False and value != 0:
            raise NotImplementedError(f"{config.model_type}: {name}={value!r} ({what}) is not supported")


def layer_windows(config: Any) -> tuple[int, ...]:
    """Each layer's sliding window (keys in (p - W, p] for the query at p), 0 for full attention, as transformers
    reads the config: `layer_types` ("sliding_attention" / "full_attention", Qwen2 / Qwen3 derive it from
    `use_sliding_window` and `max_window_layers`) where given, else `sliding_window` on every layer for the types
    whose transformers model applies it so. NotImplementedError for another layer type, ValueError for a window
    that is no positive int."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None and config.model_type in ("qwen2", "qwen3") and getattr(config, "use_sliding_window", False):
        first = getattr(config, "max_window_layers", num_layers)
        layer_types = [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)
        ]
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise NotImplementedError(
                f"{config.model_type}: layer type(s) {', '.join(unknown)} are not supported; "
                f"supported: {', '.join(_LAYER_TYPES)}"
            )
        if "sliding_attention" not in layer_types:
            return (0,) * num_layers
    elif config.model_type in _WINDOW_ON_EVERY_LAYER and window is not None:
        layer_types = ["sliding_attention"] * num_layers
    else:
        return (0,) * num_layers
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{config.model_type}: sliding_window must be a positive int, got {window!r}")
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


class LlamaAttention(nn.Module):
    """Self-attention over the paged KV pool. With tensor parallelism this rank computes its query heads
    (tp.part of them) and the KV heads they read (`TensorParallel.kv_heads`); o_proj sums the ranks'
    partial outputs. `window` > 0: a sliding window (see `layer_windows`); 0: full causal attention."""

    def __init__(
        self,
        config: Any,
        variant: LlamaVariant,
        head_dim: int,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        tp: TensorParallel,
        window: int = 0,
    ) -> None:
        super().__init__()
        self.window = window
        self.softcap = 0.0  # attention logit soft-capping (Gemma 2 sets it)
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads = len(tp.part(total_heads, "the number of attention heads"))
        kv_heads = tp.kv_heads(total_kv_heads)
        self.num_kv_heads = len(kv_heads)
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        q_size, kv_size = total_heads * head_dim, total_kv_heads * head_dim
        kv_parts = (tp.size, tp.rank) if total_kv_heads >= tp.size else (total_kv_heads, kv_heads.start)
        self.qkv_proj = MergedColumnLinear(
            config.hidden_size,
            {"q": q_size, "k": kv_size, "v": kv_size},
            variant.qkv_bias,
            dtype,
            tp,
            shard_parts={"k": kv_parts, "v": kv_parts},
        )
        self.o_proj = RowLinear(q_size, config.hidden_size, variant.o_bias, dtype, tp)
        # per-head norms of q and k (Qwen3's RMSNorm; Gemma 3 puts its own norm here)
        self.q_norm: nn.Module | None = RMSNorm(head_dim, config.rms_norm_eps, dtype) if variant.qk_norm else None
        self.k_norm: nn.Module | None = RMSNorm(head_dim, config.rms_norm_eps, dtype) if variant.qk_norm else None
        self.rotary_emb = rotary_emb  # shared by all layers
        self.kernels: Kernels = kernels_here()

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """positions [T], hidden [T, hidden_size] -> [T, hidden_size]; writes this layer's new K, V into the
        cache."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # rows the positions index: the model's cos/sin cache, or a step's per-token rows (M-RoPE)
        cos_sin = self.rotary_emb.cos_sin_cache if batch.rope_cache is None else batch.rope_cache
        self.rotary_emb(positions, q, None, cos_sin)  # q in place; K is rotated by the KV append as it is stored
        out = paged_attention(
            self.kernels,
            q,
            k,
            v,
            k_cache,
            v_cache,
            batch,
            self.scale,
            cos_sin,
            self.rotary_emb.is_neox,
            self.window,
            self.softcap,
        )
        return self.o_proj(out.view(num_tokens, -1))


class LlamaMLP(nn.Module):
    """SiLU-gated MLP of `intermediate_size` (default: the config's)."""

    def __init__(
        self,
        config: Any,
        variant: LlamaVariant,
        dtype: torch.dtype,
        tp: TensorParallel,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        size = config.intermediate_size if intermediate_size is None else intermediate_size
        tp.part(size, "the intermediate size")
        self.gate_up_proj = MergedColumnLinear(
            config.hidden_size, {"gate": size, "up": size}, variant.mlp_bias, dtype, tp
        )
        self.down_proj = RowLinear(size, config.hidden_size, variant.mlp_bias, dtype, tp)
        self.kernels: Kernels = kernels_here()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


# Builds the feed-forward sublayer of layer i: (layer index) -> module mapping [T, hidden] -> [T, hidden].
MLPFactory = Callable[[int], nn.Module]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block over a residual stream that is carried between layers (vLLM's layout): each norm adds
    the previous sublayer's output into `residual` in place, fused with the norm. `mlp` is the feed-forward
    sublayer (a `LlamaMLP`, or an MoE block in the MoE models); `self_attn` the attention (a `LlamaAttention`, or
    DeepSeek's MLA in its subclass)."""

    def __init__(
        self,
        config: Any,
        variant: LlamaVariant,
        head_dim: int,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        mlp: nn.Module,
        tp: TensorParallel,
        window: int = 0,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn: nn.Module = LlamaAttention(config, variant, head_dim, rotary_emb, dtype, tp, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = mlp

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden_size]: the previous layer's MLP output (or, with residual None, the embeddings)
        -> (this layer's MLP output, residual stream up to its input)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch, k_cache, v_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm. `mlp_factory` builds each layer's feed-forward sublayer
    (default: the dense `LlamaMLP`)."""

    # whether the family keeps its q / k heads in partial_rotary_order (a partial_rotary_factor is refused if not)
    partial_rotary: ClassVar[bool] = False
    # the rotary embedding its layers share (Qwen2-VL's text model: M-RoPE)
    rotary_class: ClassVar[type[RotaryEmbedding]] = RotaryEmbedding

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
        variant = LlamaVariant.from_config(config)
        if mlp_factory is None:

            def mlp_factory(layer_index: int) -> nn.Module:
                return LlamaMLP(config, variant, dtype, tp)

        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.rotary_emb = self.rotary_class(config, head_dim, partial=self.partial_rotary)
        windows = layer_windows(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, variant, head_dim, self.rotary_emb, dtype, mlp_factory(i), tp, windows[i])
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.tp_size = tp.size
        # Steps of 1-8 decoding sequences in one native call (CPU; worker/models/native_decode.py), built on the
        # first step after the weights changed; `native_decode = False` keeps every step on the layers one by one.
        self.native_decode: NativeDecoder | Literal[False] | None = None

    def native_decoder(self) -> NativeDecoder | None:
        """The native step for this model's decodes (worker/models/native_decode.py), or None where it does not
        apply (it runs only these dense classes' layers, exactly)."""
        return NativeDecoder.for_model(self, self.tp_size, (LlamaDecoderLayer, LlamaAttention, LlamaMLP))

    def forward(
        self,
        batch: ForwardBatch,
        kv_cache: KVCache,
        layers: Sequence[Callable[..., tuple[torch.Tensor, torch.Tensor]]] | None = None,
    ) -> torch.Tensor:
        """`layers` stand in for self.layers, one for one (the step graphs' compiled copies)."""
        hidden, residual = self.embed_tokens(batch.input_ids), None
        if batch.image_rows is not None and batch.image_embeds is not None:  # a vision model's (models/llava.py)
            hidden = hidden.index_copy(0, batch.image_rows, batch.image_embeds.to(hidden.dtype))
        self.rotary_emb.reserve(max(batch.context_lens, default=0))
        batch = self.rotary_emb.rope_batch(batch)
        if (
            layers is None
            and batch.num_decodes
            and batch.rope_cache is None
            and not torch.compiler.is_compiling()
            and not lora_rows_active()
        ):
            if self.native_decode is None:
                self.native_decode = self.native_decoder() or False
            if (
                isinstance(self.native_decode, NativeDecoder)
                and hidden.dtype == self.native_decode.dtype
                and hidden.dim() == 2
                and self.native_decode.takes(batch, kv_cache)
            ):
                return self.native_decode.run(hidden, batch, kv_cache)
        steps: Iterable[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = self.layers if layers is None else layers
        for layer, k_cache, v_cache in zip(steps, kv_cache.k, kv_cache.v, strict=True):
            hidden, residual = layer(batch.positions, hidden, residual, batch, k_cache, v_cache)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache (see `infer.worker.models.registry.CausalLM`)."""

    # checkpoint module name -> (our fused module, shard)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    # Step graphs (worker/engine/step_graphs.py) can compile its decoder layers: dense layers trace into one graph
    # each. (The MoE models' expert dispatch is data-dependent: they run eagerly.)
    supports_step_graphs: ClassVar[bool] = True

    # What a family built on these classes changes: the model it runs (same constructor as LlamaModel) and the
    # config fields of _UNSUPPORTED_FIELDS its layers compute.
    base_model_class: ClassVar[Callable[..., Any]] = LlamaModel
    implemented_fields: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self, config: Any, dtype: torch.dtype, mlp_factory: MLPFactory | None = None, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = TensorParallel.single() if tp is None else tp
        self.num_layers: int = config.num_hidden_layers
        self.tp.part(config.num_attention_heads, "the number of attention heads")
        self.num_kv_heads: int = len(self.tp.kv_heads(config.num_key_value_heads))  # on this rank
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.vocab_size: int = config.vocab_size
        refuse_unsupported(config, self.implemented_fields)
        # each layer's sliding window, 0 for full attention (every layer's KV blocks are kept: none are freed)
        self.layer_windows: tuple[int, ...] = layer_windows(config)
        self.model = self.base_model_class(config, self.head_dim, dtype, mlp_factory, self.tp)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype, self.tp)
        if getattr(config, "tie_word_embeddings", False):
            self.tie_lm_head()

    def tie_lm_head(self) -> None:
        """Share the embedding table with the LM head (tied embeddings, or no lm_head in the checkpoint)."""
        self.lm_head.tie_to(self.model.embed_tokens)

    @property
    def lm_head_tied(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight

    def forward(
        self,
        batch: ForwardBatch,
        kv_cache: KVCache,
        layers: Sequence[Callable[..., tuple[torch.Tensor, torch.Tensor]]] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden_size] of every token of the batch; K, V of the new tokens are cached.
        `layers`: see LlamaModel.forward."""
        return self.model(batch, kv_cache, layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (e.g. hidden[batch.logits_indices]) -> logits [N, vocab] float32. With
        tensor parallelism a collective; the logits come out on TP rank 0 only (None on the others)."""
        return self.lm_head(hidden)
