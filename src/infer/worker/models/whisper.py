"""Whisper as an encoder-decoder model of the engine (worker/engine/encoder_decoder.py), its encoder fed by audio.

The math is transformers' WhisperForConditionalGeneration. Encoder: log-mel features [mel bins, 2 x
max_source_positions frames] (worker/engine/audio.py) through two conv1d layers with GELU (the second of stride 2),
plus its sinusoidal positions (a table in the checkpoint), pre-LN layers (attention with biases on q, v and out but
not k, 1/sqrt(head_dim) scaling; a GELU MLP), a final LayerNorm. Decoder: token embeddings plus learned positions,
pre-LN layers of self-attention, cross-attention and the MLP, a final LayerNorm, the output projection tied to the
token embedding (`proj_out`).

The encoder's output always has max_source_positions rows (Whisper pads every clip to its window), so a request's
cross blocks hold that many positions; `encode_audio` runs it over a step's new requests at once and writes each
decoder layer's cross K/V. The decoder's self-attention runs on the engine's paged kernels and its cross-attention on
the paged decode kernel. `max_target_positions` bounds the decoder's context. Module and parameter names are
transformers'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, cast

import torch
from torch import nn

from infer.kernels.dispatch import Kernels, kernels_here
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.attention import paged_attention
from infer.worker.engine.encoder_decoder import cross_attention, dense_attention, write_cross_kv
from infer.worker.engine.forward_batch import ForwardBatch, KVCache
from infer.worker.models.bart import BartLayer


class WhisperLayer(BartLayer):
    """BART's layer modules (k without a bias), pre-LN: each residual branch normalizes its input."""

    def __init__(self, config: Any, dtype: torch.dtype, decoder: bool) -> None:
        super().__init__(config, dtype, decoder, k_bias=False)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(self.act(self.fc1(self.final_layer_norm(h))))


class WhisperEncoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1, dtype=dtype)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1, dtype=dtype)
        self.embed_positions = nn.Embedding(config.max_source_positions, d, dtype=dtype)
        self.layers = nn.ModuleList(WhisperLayer(config, dtype, decoder=False) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d, dtype=dtype)

    def each_layer(self) -> list[WhisperLayer]:
        return [cast(WhisperLayer, layer) for layer in self.layers]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, mel bins, 2 x max_source_positions] -> [B x max_source_positions, d_model], clips end to end."""
        h = nn.functional.gelu(self.conv1(features))
        h = nn.functional.gelu(self.conv2(h)).permute(0, 2, 1)  # [B, S, d]
        batch, length = h.shape[0], h.shape[1]
        h = (h + self.embed_positions.weight[:length]).reshape(batch * length, -1)
        lengths = [length] * batch
        for layer in self.each_layer():
            attn = layer.self_attn
            x = layer.self_attn_layer_norm(h)
            out = dense_attention(
                attn.heads(attn.q_proj(x)), attn.heads(attn.k_proj(x)), attn.heads(attn.v_proj(x)), attn.scale, lengths
            )
            h = layer.mlp(h + attn.out_proj(out.reshape(h.shape[0], -1)))
        return self.layer_norm(h)


class WhisperDecoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, dtype=dtype)
        self.embed_positions = nn.Embedding(config.max_target_positions, config.d_model, dtype=dtype)
        self.layers = nn.ModuleList(WhisperLayer(config, dtype, decoder=True) for _ in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(config.d_model, dtype=dtype)

    def each_layer(self) -> list[WhisperLayer]:
        return [cast(WhisperLayer, layer) for layer in self.layers]


class WhisperModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(config, dtype)
        self.decoder = WhisperDecoder(config, dtype)


class WhisperForConditionalGeneration(nn.Module):
    """WhisperForConditionalGeneration's weights; `encode_audio` (the encoder over a step's new clips) and `forward`
    (the decoder over a ForwardBatch), as worker/engine/encoder_decoder.py's EncoderDecoderModel says, with audio
    features where the text families take encoder tokens (`takes_audio`)."""

    is_encoder_decoder = True
    takes_audio = True
    supports_step_graphs: ClassVar[bool] = False  # the encoder runs at a request's first step, eagerly
    packed_modules_mapping: dict[str, tuple[str, str]] = {}

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError("Whisper is not supported with tensor parallelism")
        self.config, self.dtype = config, dtype
        self.num_layers = config.decoder_layers
        self.num_kv_heads = config.decoder_attention_heads
        self.head_dim = config.d_model // config.decoder_attention_heads
        self.vocab_size = config.vocab_size
        self.decoder_start_token_id = int(config.decoder_start_token_id)
        self.max_encoder_len: int | None = int(config.max_source_positions)
        self.num_mel_bins = int(config.num_mel_bins)
        self.num_frames = 2 * int(config.max_source_positions)  # conv2's stride halves the frames
        self.model = WhisperModel(config, dtype)
        self.proj_out = nn.Linear(config.d_model, config.vocab_size, bias=False, dtype=dtype)
        self.tie_lm_head()  # Whisper's output projection is always its token embedding
        self.kernels: Kernels = kernels_here()

    def tie_lm_head(self) -> None:
        self.proj_out.weight = self.model.decoder.embed_tokens.weight

    def encode(self, input_ids: torch.Tensor, lengths: Sequence[int], slots: torch.Tensor, kv_cache: KVCache) -> None:
        raise ValueError("Whisper's encoder takes audio features (encode_audio), not tokens")

    def encode_audio(self, features: torch.Tensor, slots: torch.Tensor, kv_cache: KVCache) -> None:
        """features [B, mel bins, frames] (B clips); `slots` [B x max_source_positions]: each encoder position's cross
        K/V slot, the clips end to end."""
        h = self.model.encoder(features.to(self.dtype))
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
        decoder = self.model.decoder
        h = decoder.embed_tokens(batch.input_ids) + decoder.embed_positions(batch.positions)
        for i, layer in enumerate(decoder.each_layer()):
            attn = layer.self_attn
            x = layer.self_attn_layer_norm(h)
            q, k, v = attn.heads(attn.q_proj(x)), attn.heads(attn.k_proj(x)), attn.heads(attn.v_proj(x))
            out = paged_attention(
                self.kernels, q, k.contiguous(), v.contiguous(), kv_cache.k[i], kv_cache.v[i], batch, attn.scale
            )
            h = h + attn.out_proj(out.reshape(h.shape[0], -1))
            cross = layer.encoder_attn
            x = layer.encoder_attn_layer_norm(h)
            out = cross_attention(
                self.kernels, cross.heads(cross.q_proj(x)), kv_cache.k[i], kv_cache.v[i], batch, cross.scale
            )
            h = layer.mlp(h + cross.out_proj(out.reshape(h.shape[0], -1)))
        return decoder.layer_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj_out(hidden).float()
