"""Encoder-decoder models (T5, BART, Whisper) in the engine: the pieces every such family shares.

A request of an encoder-decoder model carries its encoder's input (`Request.encoder_token_ids`: the caller's prompt)
and, as its `prompt_token_ids`, the decoder's prompt: the model's decoder start token, then the optional decoder
prefix. The decoder side is an ordinary causal sequence in the paged pool (self-attention K/V, chunked prefill,
preemption by recompute). Beside it the request holds a second block table, `cross_block_table`, taken with its
first blocks (the scheduler counts them at admission) and freed with them: blocks of the same pool that hold each
decoder layer's cross-attention K and V over the encoder's output, at the same block ids in every layer's K and V
tensors.

- `run_encoders`: at the first step of a request that holds cross blocks not written yet (new, or readmitted after
  preemption, which freed them), the model's `encode` runs its encoder once over the encoder tokens (bidirectional,
  dense: one request at a time) and writes the cross K/V of every decoder layer at the cross blocks' slots; an
  audio model's (`AudioEncoderDecoderModel`, Whisper) `encode_audio` runs over the requests' log-mel features.
- `cross_attention`: the decoder's queries over their request's cross blocks. Cross-attention is non-causal over a
  context of fixed length, so every query row, a prefill row or a decode, is one "sequence" of the paged decode
  kernel with the request's cross table and the encoder length as its context (ForwardBatch.cross_block_tables /
  cross_lens, one row per token): the native CPU kernel, Triton on CUDA, their twin elsewhere. Requests of any
  encoder lengths batch together.
- `biased_paged_attention`: causal self-attention over the paged pool with an additive per-head position bias
  (T5's relative position buckets), which no fused kernel takes: a torch path, one sequence at a time, reading
  its K/V through its block table.

What these models do not run is refused by name when the engine is built (`refusals`): speculative decoding, LoRA,
tensor / pipeline / expert parallelism, step graphs, quantized weights and the KV tier beyond the pool. Prefix
caching is turned off for them (a decoder block's keys depend on the encoder's input, which its hash does not
hold). Per request (worker/engine/intake.py): beam search, images, pooling and prompt logprobs are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch

from infer.kernels.dispatch import Kernels
from infer.worker.engine.forward_batch import ForwardBatch, KVCache
from infer.worker.engine.request import Request


@runtime_checkable
class EncoderDecoderModel(Protocol):
    """What the engine needs of an encoder-decoder model beyond models.registry.CausalLM's contract.

    `num_layers`, `num_kv_heads`, `head_dim` describe the decoder (its self- and cross-attention share the pool);
    `forward` runs the decoder over a ForwardBatch whose `cross_block_tables` / `cross_lens` are set.
    `encode(input_ids [T], lengths, slots [T])` runs the encoder over the tokens of one or more requests, laid end
    to end (`lengths`: each one's count; its projections and MLPs over all T rows at once, its attention within each
    request), and writes each decoder layer's cross-attention K/V at `slots` of the pool. `max_encoder_len`: the
    longest encoder input it takes (learned positions), None without a bound of its own."""

    is_encoder_decoder: bool
    decoder_start_token_id: int
    max_encoder_len: int | None

    def encode(
        self, input_ids: torch.Tensor, lengths: Sequence[int], slots: torch.Tensor, kv_cache: KVCache
    ) -> None: ...


@runtime_checkable
class AudioEncoderDecoderModel(EncoderDecoderModel, Protocol):
    """An encoder-decoder model whose encoder takes audio (Whisper, models/whisper.py): `encode_audio(features [B,
    num_mel_bins, num_frames], slots [B x max_encoder_len], kv_cache)` runs it over B clips' log-mel features
    (worker/engine/audio.py) and writes each decoder layer's cross K/V at `slots`; its output always has
    `max_encoder_len` positions, which a request's `encoder_token_ids` hold as placeholders."""

    takes_audio: bool
    num_mel_bins: int
    num_frames: int

    def encode_audio(self, features: torch.Tensor, slots: torch.Tensor, kv_cache: KVCache) -> None: ...


def takes_audio(model: object) -> bool:
    return bool(getattr(model, "takes_audio", False))


def is_encoder_decoder(model: object) -> bool:
    return bool(getattr(model, "is_encoder_decoder", False))


def refusals(config: Any, *, tp_size: int, pipeline: bool, ep_size: int) -> list[str]:
    """What an engine of an encoder-decoder model is asked for that it does not run (worker/engine/config.py's
    EngineConfig), each a sentence; empty when it can be built."""
    out = []
    if config.speculative_config is not None:
        out.append("speculative decoding (speculative_config)")
    if config.enable_lora:
        out.append("LoRA adapters (enable_lora)")
    if tp_size > 1 or pipeline or ep_size > 1:
        out.append("tensor, pipeline or expert parallelism")
    if config.enforce_eager is False:
        out.append("step graphs (enforce_eager=False): they run eagerly")
    if config.quantization not in ("auto", "none"):
        out.append(f"quantization {config.quantization!r}")
    if config.kv_offload_dir is not None:
        out.append("the KV tier beyond the pool (kv_offload_dir)")
    if config.kv_offload_host_gb is not None:
        out.append("the KV tier in host memory (kv_offload_host_gb)")
    return out


def check_engine(config: Any, model: object, *, tp_size: int, pipeline: bool, ep_size: int) -> None:
    """ValueError naming what an engine of an encoder-decoder model cannot run (nothing for another model)."""
    if not is_encoder_decoder(model):
        return
    refused = refusals(config, tp_size=tp_size, pipeline=pipeline, ep_size=ep_size)
    if refused:
        kind = getattr(getattr(model, "config", None), "model_type", "encoder-decoder")
        raise ValueError(f"{kind} (an encoder-decoder model) does not support {'; '.join(refused)}")


def run_encoders(requests: Sequence[Request], model: EncoderDecoderModel, kv_cache: KVCache, block_size: int) -> None:
    """Run the encoder of each request whose cross blocks are not written yet, writing them: one encoder pass over
    all of them (a step's new requests share its matrix products), once per request."""
    todo = [r for r in requests if r.encoder_token_ids is not None and not r.encoder_computed]
    if not todo:
        return
    device = kv_cache.k[0].device
    slots = torch.cat([cross_slots(r, block_size, device) for r in todo])
    if isinstance(model, AudioEncoderDecoderModel) and model.takes_audio:
        features = torch.stack([cast(torch.Tensor, r.encoder_features) for r in todo]).to(device)
        model.encode_audio(features, slots, kv_cache)
    else:
        ids = torch.tensor([t for r in todo for t in r.encoder_token_ids or ()], dtype=torch.int64, device=device)
        model.encode(ids, [r.num_encoder_tokens for r in todo], slots, kv_cache)
    for request in todo:
        request.encoder_computed = True


def cross_slots(request: Request, block_size: int, device: torch.device) -> torch.Tensor:
    """[S] int64: the pool slot of each encoder position's cross K/V (its cross block * block_size + offset)."""
    positions = torch.arange(request.num_encoder_tokens, dtype=torch.int64)
    table = torch.tensor(request.cross_block_table, dtype=torch.int64)
    return (table[positions // block_size] * block_size + positions % block_size).to(device)


def cross_rows(
    chunks: Sequence[Any], rows_per_chunk: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """ForwardBatch.cross_block_tables [T, max blocks] int32 and cross_lens [T] int32: each query row's request's
    cross table (padded with 0) and encoder length, `rows_per_chunk[i]` rows for chunk i."""
    tables: list[list[int]] = []
    lens: list[int] = []
    for chunk, rows in zip(chunks, rows_per_chunk, strict=True):
        request = chunk.request
        tables += [request.cross_block_table] * rows
        lens += [request.num_encoder_tokens] * rows
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return (
        torch.tensor(padded, dtype=torch.int32).to(device),
        torch.tensor(lens, dtype=torch.int32).to(device),
    )


def cross_attention(
    kernels: Kernels, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """q [T, H, D] over each row's request's cross K/V (non-causal, the whole encoder length); [T, H, D] in q's
    dtype, rows past the real tokens 0."""
    if batch.cross_block_tables is None or batch.cross_lens is None:
        raise ValueError("cross-attention needs the batch's cross block tables (an encoder-decoder request's step)")
    out = torch.zeros_like(q)
    num_real = batch.num_real_tokens
    kernels.paged_decode_attention(
        q[:num_real].contiguous(),
        k_cache,
        v_cache,
        batch.cross_block_tables,
        batch.cross_lens,
        scale,
        out=out[:num_real],
    )
    return out


def write_cross_kv(
    kernels: Kernels,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """One decoder layer's cross K, V [S, Hkv, D] into its pool tensors at `slots` (no rotation)."""
    kernels.append_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, slots)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    lengths: Sequence[int],
    biases: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """An encoder's bidirectional attention within each request of a pass: q, k, v [T, H, D], the requests' tokens
    end to end (`lengths`), `biases[S]` [H, S, S] added to the scores of a request of S tokens; float32 inside,
    [T, H, D] in q's dtype."""
    out = []
    for start, end in _bounds(lengths):
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k[start:end].float()) * scale
        if biases is not None:
            scores = scores + biases[end - start].float()
        probs = torch.softmax(scores, dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v[start:end].float()))
    return torch.cat(out).to(q.dtype)


def positions_of(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """[T] int64: each token's position within its request, the requests end to end."""
    return torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths]).to(device)


def _bounds(lengths: Sequence[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + n))
        start += n
    return bounds


def biased_paged_attention(
    kernels: Kernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    bias: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Store k, v [T, Hkv, D] at the batch's slots, then causal attention of q [T, H, D] over each sequence's paged
    context with `bias(query positions [n], key positions [L])` -> [H, n, L] added to the scores (T5's relative
    position bias; no fused kernel takes an additive bias, so this is torch, one sequence at a time). Returns
    [T, H, D] in q's dtype; padding rows 0."""
    kernels.append_kv(k, v, k_cache, v_cache, batch.slot_mapping, batch.positions)
    out = torch.zeros_like(q)
    num_kv_heads, _, block_size, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    start = 0
    for i, (n, length) in enumerate(zip(batch.query_lens, batch.context_lens)):
        table = batch.block_tables[i, : math.ceil(length / block_size)].to(torch.int64)
        keys = k_cache[:, table].reshape(num_kv_heads, -1, head_dim)[:, :length].repeat_interleave(group, 0)
        values = v_cache[:, table].reshape(num_kv_heads, -1, head_dim)[:, :length].repeat_interleave(group, 0)
        q_pos = batch.positions[start : start + n]
        k_pos = torch.arange(length, device=q.device)
        scores = torch.einsum("nhd,hld->hnl", q[start : start + n].float(), keys.float()) * scale
        scores = scores + bias(q_pos, k_pos).float()
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + n] = torch.einsum("hnl,hld->nhd", probs, values.float()).to(q.dtype)
        start += n
    return out
