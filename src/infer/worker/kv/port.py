"""KvPort: an engine's KV blocks as bytes, out to another worker and in from one (disaggregated prefill and decode;
the wire and its state are worker/kv/transfer.py's, torch-free; this module touches the pool).

- `export(request_id)`: a producer's request after its prefill: the tokens whose KV it holds (its computed tokens'
  full blocks, plus one token so the consumer's lookup covers every one of them) and each full block's bytes (every
  layer's K and V in the pool's dtype and layout: one gather, then one bytes object per block).
- `first_missing(token_ids)`: how many leading full blocks of `token_ids` the prefix cache holds already (the
  producer sends only the others).
- `store(token_ids, first_block, payloads)`: blocks `first_block ..` into free blocks as cached prefix-cache content,
  right after the prefix the cache holds (BlockManager.restore, as the disk tier's loads): the continuation's
  admission then finds them as ordinary hits. Nothing is stored past a gap (the cache no longer holds the blocks
  before `first_block`), and as many as the free queue holds beside the prefix (the rest: counted as dropped).

The fingerprint names the model, its weight version, the pool's dtype and block geometry: a producer and a consumer
whose fingerprints differ exchange nothing (the consumer refuses the offer). A LoRA request's blocks go with its
adapter's name; the consumer looks them up and stores them under its own id for that name (`lora_id`: the engine's
name -> id, ValueError for an adapter it has not loaded) and the adapter's prefix-cache salt, as its own requests of
that adapter would find them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from infer.protocol.prefix_hash import adapter_salt
from infer.protocol.sampling import SamplingParams
from infer.worker.engine.block_manager import BlockManager
from infer.worker.engine.forward_batch import KVCache
from infer.worker.engine.request import Request
from infer.worker.engine.scheduler import Scheduler
from infer.worker.kv.offload import KvOffload
from infer.worker.kv.transfer import Exported


class KvPort:
    """The engine's pool seen as blocks of bytes (see the module docstring); counters for the worker's stats."""

    def __init__(
        self,
        kv: KVCache,
        scheduler: Scheduler,
        model_id: str,
        quantization: str,
        offload: KvOffload | None,
        lora_id: Callable[[str | None], int] = lambda name: 0,
    ) -> None:
        self.kv, self.scheduler, self.offload, self.lora_id = kv, scheduler, offload, lora_id
        self.model_id, self.quantization = model_id, quantization
        self.sent_blocks = 0  # blocks exported to consumers
        self.received_blocks = 0  # blocks stored from producers
        self.dropped_blocks = 0  # blocks received but not stored (no free block, a gap, a bad checksum)

    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.block_manager

    @property
    def block_bytes(self) -> int:
        return self.kv.block_bytes

    def fingerprint(self, weight_version: int) -> bytes:
        parts = [self.model_id, str(weight_version), str(self.kv.k[0].dtype), repr(self.kv.block_shape)]
        return hashlib.blake2b("\0".join([*parts, self.quantization]).encode(), digest_size=16).digest()

    def export(self, request_id: str) -> Exported | None:
        """(tokens, each full computed block's bytes, its adapter's name) of a running request; None if it is not here
        or holds no full block."""
        request = self.scheduler.get(request_id)
        if request is None:
            return None
        num_full = min(request.num_computed_tokens // self.blocks.block_size, len(request.block_table))
        ids = request.block_table[:num_full]
        if num_full == 0 or any(block_id < 0 for block_id in ids):
            return None
        data = self.kv.read_blocks(ids)
        payloads = [data[j].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for j in range(num_full)]
        self.sent_blocks += num_full
        tokens = request.token_ids[: num_full * self.blocks.block_size + 1]
        return Exported(tokens, payloads, request.params.lora_name)

    def first_missing(self, token_ids: Sequence[int], lora_name: str | None = None) -> int:
        """The leading full blocks of `token_ids` (all but its last token) this prefix cache holds, of `lora_name`'s
        KV."""
        return len(self.blocks.find_cached_prefix(self._probe(token_ids, lora_name)))

    def store(
        self, token_ids: Sequence[int], first_block: int, payloads: Sequence[bytes], lora_name: str | None = None
    ) -> int:
        """Store blocks `first_block ..` of `token_ids` (`lora_name`'s KV) as cached content (see the module
        docstring); returns how many were stored, counting the rest as dropped."""
        if any(len(p) != self.block_bytes for p in payloads):
            self.dropped_blocks += len(payloads)
            return 0
        probe = self._probe(token_ids, lora_name)
        hits = self.blocks.find_cached_prefix(probe)
        skip = len(hits) - first_block
        if skip < 0 or not self.blocks.enable_prefix_caching:
            self.dropped_blocks += len(payloads)
            return 0
        wanted = payloads[skip:]
        hashes = probe.block_hashes[len(hits) : len(hits) + len(wanted)]
        ids = self.blocks.restore(probe, hits, [(h, b"") for h in hashes])
        if self.offload is not None:  # what taking those blocks evicted, before their KV is overwritten
            self.offload.spill_evicted()
        for block_id, payload in zip(ids, wanted, strict=False):
            self.kv.write_block(block_id, self.kv.block_from_bytes(payload))
        self.received_blocks += len(ids)
        self.dropped_blocks += len(payloads) - len(ids) - max(0, min(skip, len(payloads)))
        return len(ids) + max(0, min(skip, len(payloads)))

    def _probe(self, token_ids: Sequence[int], lora_name: str | None) -> Request:
        """A request of these tokens that holds no blocks: what the block manager's lookups take (its full blocks are
        those of all tokens but the last, as for a request about to run), of `lora_name`'s KV."""
        probe = Request("kv-transfer", list(token_ids), SamplingParams(max_tokens=1, lora_name=lora_name))
        probe.lora_id, probe.cache_salt = self.lora_id(lora_name), adapter_salt(lora_name)
        return probe

    def counters(self) -> dict[str, Any]:
        return {
            "kv_transfer_sent_blocks": self.sent_blocks,
            "kv_transfer_received_blocks": self.received_blocks,
            "kv_transfer_dropped_blocks": self.dropped_blocks,
        }
