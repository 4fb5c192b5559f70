"""KvOffload: the engine's KV tier beyond the pool, on disk (`--kv-offload-dir DIR --kv-offload-gb N`).

The bookkeeping is the block manager's (worker/engine/block_manager.py: `evicted`, `plan_restore`, `restore`), the files
the store's (worker/kv/offload_store.py: format, checks, LRU bound, the writer thread); this module moves the bytes
between them and the pool, once per engine step:

- before scheduling, `restore(waiting)`: for the first waiting requests (as many as could start this step), the
  leading blocks their prefix misses in the pool but the store has on disk are read, checked and written into free
  blocks as cached content, so the scheduler's admission finds them as ordinary prefix-cache hits (counted in
  `prefix_cache_hits`, never prefilled). The reads are synchronous, within the step (a block of SmolLM2-135M is
  360 KiB in bf16; a prefetch thread is the next step if disks prove slow);
- after scheduling (and before a beam's block copies), `spill_evicted()`: the blocks the allocator evicted are copied
  to host memory (one gather) before the forward overwrites them, and handed to the writer thread; the step never
  waits on the disk, and a full queue drops the spill (counted);
- `publish_changes()`: hashes that arrived on disk or left it go into the KV events (worker/kv/events.py), so the
  coordinator's kv-aware index counts blocks on disk as held (the event format has one tier: a worker "holds" a
  hash in its pool or on its disk alike).

The fingerprint (16 bytes in every file) covers the model's files (path, names, sizes, modification times), the
weight version, quantization, the pool's dtype and the block geometry: a file written for anything else is foreign,
deleted when met. A weight update deletes every file (`new_weights`); suspend keeps them (the weights come back the
same). Base-model blocks only: an adapter's blocks are never spilled (its engine id is not stable across restarts).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.worker.engine.block_manager import BlockManager
from infer.worker.engine.forward_batch import KVCache
from infer.worker.engine.request import Request
from infer.worker.kv.offload_store import DiskStore, OffloadCounters

log = logging.getLogger("infer.kv_offload")


@dataclass(frozen=True)
class ModelFiles:
    """Where the weights came from: what a fingerprint names besides the pool's geometry."""

    path: Path
    weight_files: tuple[Path, ...]
    quantization: str

    def fingerprint(self, kv: KVCache, version: int) -> bytes:
        """What a spilled block's KV depends on, as 16 bytes (see the module docstring)."""
        files = []
        for file in self.weight_files:
            stat = file.stat()
            files.append(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}")
        parts = [str(self.path.resolve()), *files, str(kv.k[0].dtype), repr(kv.block_shape), self.quantization]
        return hashlib.blake2b("\0".join([*parts, f"v{version}"]).encode(), digest_size=16).digest()


class KvOffload:
    """The disk tier of one engine: its store, the pool it copies from and into, the block manager it serves."""

    def __init__(self, store: DiskStore, kv: KVCache, blocks: BlockManager, model: ModelFiles) -> None:
        self.store = store
        self.kv = kv
        self.blocks = blocks
        self.model = model
        blocks.attach_tier(store)

    @classmethod
    def open(cls, root: Path, max_bytes: int, kv: KVCache, blocks: BlockManager, model: ModelFiles) -> KvOffload:
        """The tier in this worker's slot under `root` (ValueError: the directory is unusable, or `max_bytes` holds
        no block)."""
        block_bytes = torch.empty((), dtype=kv.k[0].dtype).element_size() * math.prod(kv.block_shape)
        store = DiskStore(root, model.fingerprint(kv, version=0), max_bytes, block_bytes)
        log.info("KV offload: blocks spill to %s, at most %d bytes (%d a block)", store.path, max_bytes, block_bytes)
        return cls(store, kv, blocks, model)

    @property
    def counters(self) -> OffloadCounters:
        return self.store.counters

    def restore(self, waiting: Sequence[Request], seats: int) -> int:
        """Read back what the first `seats` waiting requests miss in the pool and have on disk, while the free queue
        holds it beside what they will compute (see the module docstring). Returns the blocks restored."""
        blocks = self.blocks
        room = blocks.num_free_blocks
        restored = 0
        for request in waiting[: max(0, seats)]:
            if room <= 0:
                break
            if request.computes_whole_prompt or request.lora_id:
                continue
            hits, wanted = blocks.plan_restore(request)
            free_hits = sum(1 for block_id in hits if blocks.ref_count(block_id) == 0)
            wanted = wanted[: max(0, min(room, blocks.num_free_blocks - free_hits))]
            loaded = []
            for block_hash, digest in wanted:
                payload = self.store.load(block_hash, digest)
                if payload is None:
                    break  # rejected (counted, deleted): this block and the rest are computed
                loaded.append(payload)
            ids = blocks.restore(request, hits, wanted[: len(loaded)])
            self.spill_evicted()  # what taking those blocks evicted, before their KV is overwritten
            for block_id, payload in zip(ids, loaded, strict=False):
                self.kv.write_block(block_id, self._tensor(payload))
            restored += len(ids)
            room -= blocks.blocks_for_tokens(request.num_tokens) - len(hits)
        return restored

    def spill_evicted(self) -> int:
        """Copy the blocks evicted since the last call out of the pool and queue them for the writer; returns how
        many were queued (the others are on disk already, or dropped: the queue is full)."""
        evicted = [e for e in self.blocks.take_evicted() if not self.store.holds(e[1])]
        if not evicted:
            return 0
        data = self.kv.read_blocks([block_id for block_id, _, _ in evicted])
        queued = 0
        for j, (_, block_hash, digest) in enumerate(evicted):
            queued += self.store.spill(block_hash, digest, _bytes_of(data[j]))
        return queued

    def publish_changes(self) -> None:
        """Hand the hashes that arrived on disk or left it to the KV events (when publishing)."""
        changes = self.store.take_changes()
        events = self.blocks.events
        if events is None:
            return
        for block_hash, on_disk in changes:
            if on_disk:
                events.stored(block_hash)
            elif not self.blocks.holds(block_hash) and not self.store.holds(block_hash):
                events.removed(block_hash)

    def clear(self) -> None:
        """Delete every spilled block (their KV is stale: the weights change). Before the prefix cache's reset, whose
        snapshot for the KV events then holds nothing of the disk."""
        dropped = self.store.clear()
        if dropped:
            log.info("KV offload: %d spilled block(s) deleted (new weights)", dropped)

    def new_weights(self, version: int) -> None:
        """The weights changed to `version`: files from now on carry its fingerprint (after `clear`)."""
        self.store.fingerprint = self.model.fingerprint(self.kv, version)

    def close(self) -> None:
        self.store.close()

    def _tensor(self, payload: memoryview) -> torch.Tensor:
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(self.kv.k[0].dtype).view(self.kv.block_shape)


def _bytes_of(block: torch.Tensor) -> Callable[[], bytes]:
    """A deferred conversion of one copied block to bytes (run on the writer thread)."""
    return lambda: block.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
