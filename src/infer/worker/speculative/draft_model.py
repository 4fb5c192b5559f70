"""DraftModelProposer: draft tokens from a smaller model of the same vocabulary, run by the target's worker.

The draft model has a KV pool of its own (as many blocks of the same size as the target's pool: tokens for the
same requests, in the draft's smaller per-token bytes) and a BlockManager over it (no prefix caching). It keeps,
per target request, a shadow sequence (a `Request` of its own: the tokens whose K/V its pool holds, its block
table). Each proposal first brings the shadow in line with the target request: tokens the target kept are kept,
the shadow's K/V past the first token the target did not accept are dropped by bookkeeping (its blocks trimmed),
and the target's new tokens are computed in one prefill-like chunk; then k greedy decode steps, batched over
the requests, each appending its argmax. Greedy drafts make the draft distribution a point mass, the case
worker/speculative/verification.py's acceptance is exact for. A shadow whose blocks cannot be had (the pool is full of
other shadows) evicts the least recently used others; failing that, the request gets no drafts this step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from infer.kernels.paged_attention import decode_split_tokens
from infer.worker.distributed.expert_parallel import ExpertParallel
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.block_manager import BlockManager
from infer.worker.engine.forward_batch import KVCache
from infer.worker.engine.model_runner import build_forward_batch
from infer.worker.engine.request import Request
from infer.worker.engine.scheduler import ScheduledChunk
from infer.worker.loading.loader import load_model
from infer.worker.loading.model_files import resolve_model

if TYPE_CHECKING:
    from infer.worker.models.registry import CausalLM


class DraftModelProposer:
    """Greedy drafts from the model at `model_path` (module docstring). `vocab_size`: the target's, which the
    draft's must equal (the same tokenizer)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        model = load_model(resolve_model(model_path), dtype, device, ExpertParallel.single(), TensorParallel.single())
        self.model = cast("CausalLM", model)  # one of our model classes, which meet the CausalLM contract
        if int(self.model.vocab_size) != vocab_size:
            raise ValueError(
                f"speculative_config: the draft model's vocabulary ({self.model.vocab_size} tokens) is "
                f"not the target's ({vocab_size}): a draft model must share the target's tokenizer"
            )
        context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        if context and context < max_model_len:
            raise ValueError(
                f"speculative_config: the draft model's context ({context} tokens) is shorter than "
                f"the target's max_model_len ({max_model_len})"
            )
        self.device = device
        self.block_size = block_size
        self.split_tokens = decode_split_tokens(max_model_len)
        self.kv_cache = KVCache.allocate(
            self.model.num_layers, num_blocks, block_size, self.model.num_kv_heads, self.model.head_dim, dtype, device
        )
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self._seqs: OrderedDict[str, _Shadow] = OrderedDict()  # least recently used first

    def release(self, request_id: str) -> None:
        shadow = self._seqs.pop(request_id, None)
        if shadow is not None:
            self.blocks.free(shadow.seq)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        shadows = {r.request_id: self._sync(r) for r in requests}
        wanted = dict(zip((r.request_id for r in requests), num_tokens))
        drafts: dict[str, list[int]] = {rid: [] for rid in shadows}
        for _ in range(max(num_tokens, default=0)):
            chunks = self._chunks([s for rid, s in shadows.items() if len(drafts[rid]) < wanted[rid]], set(shadows))
            if not chunks:
                break
            for chunk, token_id in zip(chunks, self._greedy(chunks)):
                seq = chunk.request
                seq.num_computed_tokens = chunk.end
                seq.token_ids.append(token_id)
                drafts[seq.request_id].append(token_id)
        return [drafts[r.request_id] for r in requests]

    def _sync(self, request: Request) -> _Shadow:
        """The request's shadow with the target's tokens; K/V past the first difference dropped."""
        shadow = self._seqs.pop(request.request_id, None)
        if shadow is None:
            shadow = _Shadow(Request(request.request_id, list(request.prompt_token_ids), request.params), 0)
        self._seqs[request.request_id] = shadow  # most recently used
        seq, tokens = shadow.seq, request.token_ids
        same = shadow.synced  # tokens the shadow took from the target: equal (the target only appends)
        limit = min(len(seq.token_ids), len(tokens))
        while same < limit and seq.token_ids[same] == tokens[same]:
            same += 1
        seq.token_ids = list(tokens)
        shadow.synced = len(tokens)
        seq.num_computed_tokens = min(seq.num_computed_tokens, same, len(tokens) - 1)
        if seq.block_table:
            self.blocks.trim(seq)
        return shadow

    def _chunks(self, shadows: list[_Shadow], keep: set[str]) -> list[ScheduledChunk]:
        """Each shadow's uncomputed tokens as one chunk (decodes first), blocks allocated; a shadow whose blocks
        cannot be had even after evicting shadows outside `keep` is left out."""
        chunks = []
        for shadow in shadows:
            seq = shadow.seq
            n = seq.num_tokens - seq.num_computed_tokens
            if self._allocate(seq, n, keep):
                chunks.append(ScheduledChunk.of(seq, n))
        return sorted(chunks, key=lambda c: not c.is_decode)

    def _allocate(self, seq: Request, n: int, keep: set[str]) -> bool:
        while not self.blocks.allocate(seq, n):
            victim = next((rid for rid in self._seqs if rid not in keep), None)
            if victim is None:
                return False
            self.release(victim)
        return True

    def _greedy(self, chunks: list[ScheduledChunk]) -> list[int]:
        batch = build_forward_batch(chunks, self.block_size, self.device, self.split_tokens)
        hidden = self.model(batch, self.kv_cache)
        return self.model.compute_logits(hidden[batch.logits_indices]).argmax(dim=-1).tolist()


class _Shadow:
    """The draft model's copy of one request: `seq` (its tokens, computed count, blocks in the draft pool) and
    `synced`, how many of its tokens came from the target (the rest are its own drafts)."""

    def __init__(self, seq: Request, synced: int) -> None:
        self.seq = seq
        self.synced = synced
