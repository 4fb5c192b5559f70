"""T5 (the original, v1.1 and Flan-T5) as an encoder-decoder model of the engine (worker/engine/encoder_decoder.py).

The math is transformers' T5ForConditionalGeneration: RMS-style layer norms without bias or mean (pre-norm), attention
with no 1/sqrt(d) scaling and a learned relative position bias (buckets of key - query distance: bidirectional in
the encoder, causal in the decoder; the first block's table serves every layer), a ReLU MLP (T5) or a gated GELU
one (v1.1 / Flan: `feed_forward_proj` "gated-gelu"), and the decoder's output scaled by d_model^-0.5 before the LM
head when the config says so (`scale_decoder_outputs`: the original T5, whose head is the tied embedding).

The decoder's self-attention takes T5's position bias, which no fused paged kernel adds, so it runs on the torch
path (`biased_paged_attention`) on every device; its cross-attention (no bias) runs on the paged decode kernel.
The encoder runs once per request, dense. Module and parameter names are transformers' (dense nn.Linear layers:
quantized weights are refused for these models).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, ClassVar, cast

import torch
from torch import nn

from infer.kernels.dispatch import Kernels, kernels_here
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.encoder_decoder import biased_paged_attention, cross_attention, dense_attention, write_cross_kv
from infer.worker.engine.forward_batch import ForwardBatch, KVCache


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activations T5 and BART configs name (transformers' definitions)."""
    if name == "relu":
        return torch.relu
    if name == "gelu":
        return nn.functional.gelu
    if name == "gelu_new":
        return lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if name in ("gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: nn.functional.gelu(x, approximate="tanh")
    if name == "silu":
        return nn.functional.silu
    raise ValueError(f"activation {name!r} is not supported (relu, gelu, gelu_new, gelu_pytorch_tanh, silu)")


def relative_position_bucket(
    relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """transformers' T5Attention._relative_position_bucket: key - query distance -> bucket in [0, num_buckets)."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).to(torch.long) * num_buckets
        relative = torch.abs(relative)
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    max_exact = num_buckets // 2
    is_small = relative < max_exact
    large = max_exact + (
        torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative, large)


class T5LayerNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


def _linear(rows: int, cols: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(cols, rows, bias=False, dtype=dtype)


class T5Attention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, relative_bias: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.d_kv
        inner = self.num_heads * self.head_dim
        self.q = _linear(inner, config.d_model, dtype)
        self.k = _linear(inner, config.d_model, dtype)
        self.v = _linear(inner, config.d_model, dtype)
        self.o = _linear(config.d_model, inner, dtype)
        if relative_bias:
            self.relative_attention_bias = nn.Embedding(
                config.relative_attention_num_buckets, self.num_heads, dtype=dtype
            )

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.num_heads, self.head_dim)


class T5Sublayer(nn.Module):
    """One of a block's sublayers: `SelfAttention`, `EncDecAttention` or `DenseReluDense`, with its pre-norm."""

    def __init__(self, config: Any, dtype: torch.dtype, **module: nn.Module) -> None:
        super().__init__()
        for name, m in module.items():
            setattr(self, name, m)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, dtype)


class T5DenseActDense(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.gated = bool(config.is_gated_act)
        if self.gated:
            self.wi_0 = _linear(config.d_ff, config.d_model, dtype)
            self.wi_1 = _linear(config.d_ff, config.d_model, dtype)
        else:
            self.wi = _linear(config.d_ff, config.d_model, dtype)
        self.wo = _linear(config.d_model, config.d_ff, dtype)
        self.act = activation(config.dense_act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        return self.wo(h)


class T5Block(nn.Module):
    """`layer`: self-attention, (in the decoder) cross-attention, then the MLP, each a T5Sublayer."""

    def __init__(self, config: Any, dtype: torch.dtype, decoder: bool, relative_bias: bool) -> None:
        super().__init__()
        parts = [T5Sublayer(config, dtype, SelfAttention=T5Attention(config, dtype, relative_bias))]
        if decoder:
            parts.append(T5Sublayer(config, dtype, EncDecAttention=T5Attention(config, dtype, relative_bias=False)))
        parts.append(T5Sublayer(config, dtype, DenseReluDense=T5DenseActDense(config, dtype)))
        self.layer = nn.ModuleList(parts)

    def part(self, index: int) -> T5Sublayer:
        return cast(T5Sublayer, self.layer[index])

    def attention(self, index: int) -> T5Attention:
        part = self.part(index)
        return cast(T5Attention, getattr(part, "SelfAttention", None) or getattr(part, "EncDecAttention"))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        part = self.part(len(self.layer) - 1)
        return h + cast(T5DenseActDense, getattr(part, "DenseReluDense"))(part.layer_norm(h))


class T5Stack(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, decoder: bool, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens  # the shared embedding (a tied alias in the checkpoint)
        num_layers = config.num_decoder_layers if decoder else config.num_layers
        self.block = nn.ModuleList(T5Block(config, dtype, decoder, relative_bias=i == 0) for i in range(num_layers))
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, dtype)

    def position_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor, bidirectional: bool, config: Any) -> torch.Tensor:
        """[H, n, L]: the first block's relative position bias of queries at `q_pos` over keys at `k_pos`."""
        buckets = relative_position_bucket(
            k_pos[None, :] - q_pos[:, None],
            bidirectional,
            config.relative_attention_num_buckets,
            config.relative_attention_max_distance,
        )
        table = cast(nn.Embedding, self.blocks()[0].attention(0).relative_attention_bias)
        return table(buckets).permute(2, 0, 1)

    def blocks(self) -> list[T5Block]:
        return [cast(T5Block, block) for block in self.block]


class T5ForConditionalGeneration(nn.Module):
    """T5ForConditionalGeneration's weights; `encode` (one request's encoder) and `forward` (the decoder over a
    ForwardBatch), as worker/engine/encoder_decoder.py's EncoderDecoderModel says."""

    is_encoder_decoder = True
    supports_step_graphs: ClassVar[bool] = False  # the encoder runs at a request's first step, eagerly
    packed_modules_mapping: dict[str, tuple[str, str]] = {}

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError("T5 is not supported with tensor parallelism")
        self.config, self.dtype = config, dtype
        self.num_layers = config.num_decoder_layers
        self.num_kv_heads, self.head_dim = config.num_heads, config.d_kv
        self.vocab_size = config.vocab_size
        start = getattr(config, "decoder_start_token_id", None)
        self.decoder_start_token_id = int(config.pad_token_id if start is None else start)
        self.max_encoder_len: int | None = None  # relative positions: no bound of the model's own
        self.scale_output = bool(getattr(config, "scale_decoder_outputs", getattr(config, "tie_word_embeddings", True)))
        self.shared = nn.Embedding(config.vocab_size, config.d_model, dtype=dtype)
        self.encoder = T5Stack(config, dtype, decoder=False, embed_tokens=self.shared)
        self.decoder = T5Stack(config, dtype, decoder=True, embed_tokens=self.shared)
        self.lm_head = _linear(config.vocab_size, config.d_model, dtype)
        self.kernels: Kernels = kernels_here()

    def tie_lm_head(self) -> None:
        self.lm_head.weight = self.shared.weight

    def skips_checkpoint_tensor(self, key: str) -> bool:
        # older checkpoints carry a relative bias table in the first cross-attention, which T5 never reads
        return key.endswith("EncDecAttention.relative_attention_bias.weight")

    def encode(self, input_ids: torch.Tensor, lengths: Sequence[int], slots: torch.Tensor, kv_cache: KVCache) -> None:
        stack = self.encoder
        h = self.shared(input_ids)
        biases = {}  # each request length's relative position bias, for every layer
        for n in set(lengths):
            pos = torch.arange(n, device=input_ids.device)
            biases[n] = stack.position_bias(pos, pos, True, self.config)
        for block in stack.blocks():
            attn = block.attention(0)
            x = block.part(0).layer_norm(h)
            q, k, v = attn.heads(attn.q(x)), attn.heads(attn.k(x)), attn.heads(attn.v(x))
            out = dense_attention(q, k, v, 1.0, lengths, biases)
            h = block.mlp(h + attn.o(out.reshape(h.shape[0], -1)))
        h = stack.final_layer_norm(h)
        for i, block in enumerate(self.decoder.blocks()):
            cross = block.attention(1)
            write_cross_kv(
                self.kernels, cross.heads(cross.k(h)), cross.heads(cross.v(h)), kv_cache.k[i], kv_cache.v[i], slots
            )

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        stack = self.decoder
        h = self.shared(batch.input_ids)

        def bias(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
            return stack.position_bias(q_pos, k_pos, False, self.config)

        for i, block in enumerate(stack.blocks()):
            attn = block.attention(0)
            x = block.part(0).layer_norm(h)
            q, k, v = attn.heads(attn.q(x)), attn.heads(attn.k(x)), attn.heads(attn.v(x))
            out = biased_paged_attention(self.kernels, q, k, v, kv_cache.k[i], kv_cache.v[i], batch, 1.0, bias)
            h = h + attn.o(out.reshape(h.shape[0], -1))
            cross = block.attention(1)
            x = block.part(1).layer_norm(h)
            out = cross_attention(self.kernels, cross.heads(cross.q(x)), kv_cache.k[i], kv_cache.v[i], batch, 1.0)
            h = block.mlp(h + cross.o(out.reshape(h.shape[0], -1)))
        h = stack.final_layer_norm(h)
        return h * (self.config.d_model**-0.5) if self.scale_output else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
