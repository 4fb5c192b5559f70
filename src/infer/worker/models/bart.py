"""BART as an encoder-decoder model of the engine (worker/engine/encoder_decoder.py).

The math is transformers' BartForConditionalGeneration: token embeddings (times sqrt(d_model) with
`scale_embedding`) plus learned positions looked up at position + 2 (BART's offset), a LayerNorm over their sum,
post-norm layers (attention with biases and 1/sqrt(head_dim) scaling, then a GELU MLP, each followed by its
LayerNorm), the LM head tied to the shared embedding plus `final_logits_bias`.

The decoder's self-attention runs on the engine's paged kernels (worker/engine/attention.py) and its cross-attention on
the paged decode kernel; the encoder runs once per request, dense. `max_position_embeddings` bounds both the encoder's
input and the decoder's context. The generation config's forced BOS / EOS tokens are the engine's
(worker/engine/request.py forced_token). Module and parameter names are transformers'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import torch
from torch import nn

from infer.kernels.dispatch import Kernels, kernels_here
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.attention import paged_attention
from infer.worker.engine.encoder_decoder import cross_attention, dense_attention, positions_of, write_cross_kv
from infer.worker.engine.forward_batch import ForwardBatch, KVCache
from infer.worker.models.t5 import activation

POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding looks position p up at row p + 2


class BartAttention(nn.Module):
    """q / k / v / out projections (transformers' names), 1/sqrt(head_dim) scaling; `k_bias` False: k without a bias
    (Whisper's)."""

    def __init__(self, d_model: int, num_heads: int, dtype: torch.dtype, k_bias: bool = True) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(d_model, d_model, dtype=dtype)
        self.k_proj = nn.Linear(d_model, d_model, bias=k_bias, dtype=dtype)
        self.v_proj = nn.Linear(d_model, d_model, dtype=dtype)
        self.out_proj = nn.Linear(d_model, d_model, dtype=dtype)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.num_heads, self.head_dim)


class BartLayer(nn.Module):
    """One post-LN layer's modules: self-attention, (in the decoder) cross-attention, the MLP, each with its
    LayerNorm. `k_bias`: as BartAttention's."""

    def __init__(self, config: Any, dtype: torch.dtype, decoder: bool, k_bias: bool = True) -> None:
        super().__init__()
        d = config.d_model
        heads = config.decoder_attention_heads if decoder else config.encoder_attention_heads
        ffn = config.decoder_ffn_dim if decoder else config.encoder_ffn_dim
        self.self_attn = BartAttention(d, heads, dtype, k_bias)
        self.self_attn_layer_norm = nn.LayerNorm(d, dtype=dtype)
        if decoder:
            self.encoder_attn: BartAttention = BartAttention(d, heads, dtype, k_bias)
            self.encoder_attn_layer_norm: nn.LayerNorm = nn.LayerNorm(d, dtype=dtype)
        self.fc1 = nn.Linear(d, ffn, dtype=dtype)
        self.fc2 = nn.Linear(ffn, d, dtype=dtype)
        self.final_layer_norm = nn.LayerNorm(d, dtype=dtype)
        self.act = activation(config.activation_function)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.final_layer_norm(h + self.fc2(self.act(self.fc1(h))))


class BartStack(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, decoder: bool, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens  # the shared embedding (a tied alias in the checkpoint)
        self.embed_positions = nn.Embedding(
            config.max_position_embeddings + POSITION_OFFSET, config.d_model, dtype=dtype
        )
        self.layernorm_embedding = nn.LayerNorm(config.d_model, dtype=dtype)
        num_layers = config.decoder_layers if decoder else config.encoder_layers
        self.layers = nn.ModuleList(BartLayer(config, dtype, decoder) for _ in range(num_layers))
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0

    def each_layer(self) -> list[BartLayer]:
        return [cast(BartLayer, layer) for layer in self.layers]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids) * self.embed_scale
        return self.layernorm_embedding(h + self.embed_positions(positions + POSITION_OFFSET))


class BartModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.shared = nn.Embedding(config.vocab_size, config.d_model, dtype=dtype)
        self.encoder = BartStack(config, dtype, decoder=False, embed_tokens=self.shared)
        self.decoder = BartStack(config, dtype, decoder=True, embed_tokens=self.shared)


class BartForConditionalGeneration(nn.Module):
    """BartForConditionalGeneration's weights; `encode` (one request's encoder) and `forward` (the decoder over a
    ForwardBatch), as worker/engine/encoder_decoder.py's EncoderDecoderModel says."""

    is_encoder_decoder = True
    supports_step_graphs: ClassVar[bool] = False  # the encoder runs at a request's first step, eagerly
    packed_modules_mapping: dict[str, tuple[str, str]] = {}

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError("BART is not supported with tensor parallelism")
        self.config, self.dtype = config, dtype
        self.num_layers = config.decoder_layers
        self.num_kv_heads = config.decoder_attention_heads
        self.head_dim = config.d_model // config.decoder_attention_heads
        self.vocab_size = config.vocab_size
        self.decoder_start_token_id = int(config.decoder_start_token_id)
        self.max_encoder_len: int | None = int(config.max_position_embeddings)
        self.model = BartModel(config, dtype)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, dtype=dtype)
        self.final_logits_bias = nn.Parameter(torch.zeros(1, config.vocab_size, dtype=dtype))
        self.tie_lm_head()  # BART's head is always the shared embedding
        self.kernels: Kernels = kernels_here()

    def tie_lm_head(self) -> None:
        self.lm_head.weight = self.model.shared.weight

    def encode(self, input_ids: torch.Tensor, lengths: Sequence[int], slots: torch.Tensor, kv_cache: KVCache) -> None:
        stack = self.model.encoder
        h = stack.embed(input_ids, positions_of(lengths, input_ids.device))
        for layer in stack.each_layer():
            attn = layer.self_attn
            out = dense_attention(
                attn.heads(attn.q_proj(h)), attn.heads(attn.k_proj(h)), attn.heads(attn.v_proj(h)), attn.scale, lengths
            )
            h = layer.self_attn_layer_norm(h + attn.out_proj(out.reshape(h.shape[0], -1)))
            h = layer.mlp(h)
        for i, layer in enumerate(self.model.decoder.each_layer()):
            cross = layer.encoder_attn
            write_cross_kv(
                self.kernels,
                cross.heads(cross.k_proj(h)),
                cross.heads(cross.v_proj(h)),
                kv_cache.k[i],
                kv_cache.v[i],
                slots,
            )

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        stack = self.model.decoder
        h = stack.embed(batch.input_ids, batch.positions)
        for i, layer in enumerate(stack.each_layer()):
            attn = layer.self_attn
            q, k, v = attn.heads(attn.q_proj(h)), attn.heads(attn.k_proj(h)), attn.heads(attn.v_proj(h))
            out = paged_attention(
                self.kernels, q, k.contiguous(), v.contiguous(), kv_cache.k[i], kv_cache.v[i], batch, attn.scale
            )
            h = layer.self_attn_layer_norm(h + attn.out_proj(out.reshape(h.shape[0], -1)))
            cross = layer.encoder_attn
            out = cross_attention(
                self.kernels, cross.heads(cross.q_proj(h)), kv_cache.k[i], kv_cache.v[i], batch, cross.scale
            )
            h = layer.encoder_attn_layer_norm(h + cross.out_proj(out.reshape(h.shape[0], -1)))
            h = layer.mlp(h)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) + self.final_logits_bias).float()
