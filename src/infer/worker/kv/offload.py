"""KvOffload: the engine's KV tiers beyond the pool: host memory (`--kv-offload-host-gb N`) and a local disk directory
(`--kv-offload-dir DIR --kv-offload-gb N`), either or both. Evicted blocks go pool -> host -> disk; a hit is looked
up in the pool, then the host tier, then the disk.

The bookkeeping is the block manager's (worker/engine/block_manager.py: `evicted`, `plan_restore`, `restore`: this
object is its `LowerTier`), the host tier's slots the host store's (worker/kv/host_store.py: LRU, checksums), the
files the disk store's (worker/kv/offload_store.py: format, checks, LRU bound, the writer thread); this module moves
the bytes between them and the pool, once per engine step:

- before scheduling, `restore(waiting)`: for the first waiting requests (as many as could start this step), the
  leading blocks their prefix misses in the pool but a tier holds are read (host first, then disk), checked and
  written into free blocks as cached content, so the scheduler's admission finds them as ordinary prefix-cache hits
  (counted in `prefix_cache_hits`, never prefilled). The reads are synchronous, within the step (a block of
  SmolLM2-135M is 360 KiB in bf16; a prefetch thread is the next step if disks prove slow);
- after scheduling (and before a beam's block copies), `spill_evicted()`: the blocks the allocator evicted are copied
  out before the forward overwrites them. With a host tier they go into its buffer (one gather; from a GPU, one
  asynchronous copy a block into pinned memory, then one wait for the stream, as the disk tier's gather waits
  today), and each is checksummed; the host tier's least recently used blocks make room, moved down to the disk's
  writer queue (their bytes copied and checked first) or dropped without a disk tier. Without a host tier they are
  copied to host memory and handed to the writer thread; the step never waits on the disk, and a full queue drops
  the spill (counted);
- `publish_changes()`: hashes that arrived in a tier or left it go into the KV events (worker/kv/events.py), so the
  coordinator's kv-aware index counts blocks in host memory or on disk as held (the event format has one tier: a
  worker "holds" a hash in its pool, host memory or disk alike; a block moved from host to disk stays held).

The fingerprint (16 bytes in every file) covers the model's files (path, names, sizes, modification times), the
weight version, quantization, the pool's dtype and the block geometry: a file written for anything else is foreign,
deleted when met. A weight update empties both tiers (`clear`); suspend keeps both (the weights come back the same,
so the blocks stay valid: the host tier's memory is not given back by suspend). Base-model blocks only: an adapter's
blocks are never spilled (its engine id is not stable across restarts).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.worker.engine.block_manager import BlockManager
from infer.worker.engine.forward_batch import KVCache
from infer.worker.engine.request import Request
from infer.worker.kv.host_store import Departed, HostCounters, HostStore
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


class HostTier:
    """The host tier's bytes: a buffer of `num_slots` blocks (pinned when the pool is on a GPU) and its store."""

    def __init__(self, kv: KVCache, max_bytes: int) -> None:
        device = kv.k[0].device
        block_bytes = kv.block_bytes
        num_slots = max_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(f"kv_offload_host_gb holds no block: {max_bytes} bytes, one block takes {block_bytes}")
        pinned = device.type == "cuda"  # asked of the device, not of the buffer: is_pinned() would start CUDA
        self.buffer = torch.empty((num_slots, *kv.block_shape), dtype=kv.k[0].dtype, pin_memory=pinned)
        raw = memoryview(self.buffer.view(-1).view(torch.uint8).numpy().data)  # the buffer's bytes, not a copy
        self.store = HostStore(num_slots, lambda slot: raw[slot * block_bytes : (slot + 1) * block_bytes])
        log.info(
            "KV offload: blocks spill to host memory%s, %d blocks (%d bytes)",
            " (pinned)" if pinned else "",
            num_slots,
            num_slots * block_bytes,
        )


class KvOffload:
    """The KV tiers of one engine (host memory, disk, or both), the pool it copies from and into, the block manager
    it serves (as its `LowerTier`)."""

    def __init__(
        self,
        kv: KVCache,
        blocks: BlockManager,
        host: HostTier | None,
        store: DiskStore | None,
        model: ModelFiles | None,
    ) -> None:
        if host is None and store is None:
            raise ValueError("a KV offload needs a host tier, a disk tier or both")
        self.kv = kv
        self.blocks = blocks
        self.host = None if host is None else host.store
        self._host_buffer = None if host is None else host.buffer
        self.store = store  # the disk tier
        self.model = model
        blocks.attach_tier(self)

    @classmethod
    def open(
        cls,
        kv: KVCache,
        blocks: BlockManager,
        *,
        host_bytes: int | None = None,
        root: Path | None = None,
        disk_bytes: int | None = None,
        model: ModelFiles | None = None,
    ) -> KvOffload:
        """The tiers asked for: `host_bytes` of host memory; the disk in this worker's slot under `root`, at most
        `disk_bytes` (with `model`: what its files' fingerprint names). ValueError: the directory is unusable, or a
        bound holds no block."""
        host = None if host_bytes is None else HostTier(kv, host_bytes)
        store = None
        if root is not None and disk_bytes is not None and model is not None:
            store = DiskStore(root, model.fingerprint(kv, version=0), disk_bytes, kv.block_bytes)
            log.info("KV offload: blocks spill to %s, at most %d bytes", store.path, disk_bytes)
        return cls(kv, blocks, host, store, model)

    @property
    def counters(self) -> OffloadCounters:
        """The disk tier's counters (all 0 without one)."""
        return OffloadCounters() if self.store is None else self.store.counters

    @property
    def host_counters(self) -> HostCounters:
        """The host tier's counters (all 0 without one)."""
        return HostCounters() if self.host is None else self.host.counters

    # ---- the block manager's LowerTier ----------------------------------------------------------

    def holds(self, block_hash: int) -> bool:
        """In host memory, on disk, or queued for the disk's writer (a spilled hash stays held)."""
        return (self.host is not None and self.host.holds(block_hash)) or (
            self.store is not None and self.store.holds(block_hash)
        )

    def loadable(self, block_hash: int) -> bool:
        """In host memory or on disk (written): `restore` could read it now."""
        return (self.host is not None and self.host.holds(block_hash)) or (
            self.store is not None and self.store.on_disk(block_hash)
        )

    def hashes(self) -> list[int]:
        held = [] if self.host is None else self.host.hashes()
        return held + ([] if self.store is None else self.store.hashes())

    # ---- the moves, once per step ---------------------------------------------------------------

    def restore(self, waiting: Sequence[Request], seats: int) -> int:
        """Read back what the first `seats` waiting requests miss in the pool and a tier holds, while the free queue
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
                data = self._load(block_hash, digest)
                if data is None:
                    break  # rejected (counted, dropped): this block and the rest are computed
                loaded.append(data)
            ids = blocks.restore(request, hits, wanted[: len(loaded)])
            self.spill_evicted()  # what taking those blocks evicted, before their KV is overwritten
            for block_id, data in zip(ids, loaded, strict=False):
                self.kv.write_block(block_id, data)
            restored += len(ids)
            room -= blocks.blocks_for_tokens(request.num_tokens) - len(hits)
        return restored

    def _load(self, block_hash: int, digest: bytes) -> torch.Tensor | None:
        """One block's KV, checked, as a tensor of its own on the pool's device ([*block_shape]): from host memory,
        else from disk; None when neither has it whole."""
        if self.host is not None and self._host_buffer is not None:
            slot = self.host.load(block_hash, digest)
            if slot is not None:  # a copy: the slot may be reused by the spills before it is written to the pool
                return self._host_buffer[slot].to(self.kv.k[0].device, copy=True)
        if self.store is not None:
            payload = self.store.load(block_hash, digest)
            if payload is not None:
                return self.kv.block_from_bytes(payload)
        return None

    def spill_evicted(self) -> int:
        """Copy the blocks evicted since the last call out of the pool, into the host tier (else the disk's writer
        queue); returns how many were taken (the others are held already, or dropped: no room)."""
        evicted = self.blocks.take_evicted()
        if self.blocks.events is None:
            self.publish_changes()  # nobody publishes the tiers' changes: forget them (each step, so bounded)
        taken = 0
        if self.host is not None:
            evicted, taken = self._spill_to_host(evicted)
        return taken + self._spill_to_disk(evicted)

    def _spill_to_disk(self, evicted: list[tuple[int, int, bytes]]) -> int:
        store = self.store
        if store is None:
            return 0
        evicted = [e for e in evicted if not store.holds(e[1])]
        if not evicted:
            return 0
        data = self.kv.read_blocks([block_id for block_id, _, _ in evicted])
        queued = 0
        for j, (_, block_hash, digest) in enumerate(evicted):
            queued += store.spill(block_hash, digest, _bytes_of(data[j]))
        return queued

    def _spill_to_host(self, evicted: list[tuple[int, int, bytes]]) -> tuple[list[tuple[int, int, bytes]], int]:
        """Copy what the host tier has room for into it (pushing its least recently used out); returns the rest
        (for the disk, when there is one: more blocks than the host tier has slots) and how many it took."""
        host, buffer = self.host, self._host_buffer
        if host is None or buffer is None:
            return evicted, 0
        rest: list[tuple[int, int, bytes]] = []
        ids: list[int] = []
        slots: list[int] = []
        kept: list[tuple[int, bytes]] = []
        moved: list[Departed] = []
        seen: set[int] = set()
        for block_id, block_hash, digest in evicted:
            if host.holds(block_hash) or block_hash in seen:
                continue
            seen.add(block_hash)
            taken = host.take_slot(self._wanted_on_disk)
            if taken is None:  # every slot is being filled by this spill: the disk's, or dropped
                rest.append((block_id, block_hash, digest))
                host.counters.dropped += self.store is None
                continue
            slot, departed = taken
            if departed is not None:
                moved.append(departed)
            ids.append(block_id)
            slots.append(slot)
            kept.append((block_hash, digest))
        if ids:
            self.kv.copy_blocks_out(ids, buffer, slots)
            if self.kv.k[0].device.type == "cuda":
                torch.cuda.current_stream(self.kv.k[0].device).synchronize()  # the checksums read the copies
        for (block_hash, digest), slot in zip(kept, slots, strict=True):
            host.put(block_hash, digest, slot)
        for departed in moved:  # after the copies: the disk's writer starts once the step's part is done
            self._move_down(host, departed)
        return rest, len(ids)

    def _wanted_on_disk(self, block_hash: int) -> bool:
        """Whether a block pushed out of the host tier is to be copied down: there is a disk tier, and it lacks it."""
        return self.store is not None and not self.store.holds(block_hash)

    def _move_down(self, host: HostStore, departed: Departed) -> None:
        """A block pushed out of the host tier: to the disk's writer queue (it stays held), else dropped (no disk
        tier; with one, a block it holds already needs no copy, and a corrupt one was counted by the host store)."""
        if self.store is None:
            host.counters.dropped += 1
        elif departed.payload is not None:
            payload = departed.payload
            self.store.spill(departed.block_hash, departed.digest, lambda: payload)

    def publish_changes(self) -> None:
        """Hand the hashes that arrived in a tier or left it to the KV events (when publishing)."""
        changes = [] if self.host is None else self.host.take_changes()
        if self.store is not None:
            changes += self.store.take_changes()
        events = self.blocks.events
        if events is None:
            return
        for block_hash, arrived in changes:
            if arrived:
                events.stored(block_hash)
            elif not self.blocks.holds(block_hash) and not self.holds(block_hash):
                events.removed(block_hash)

    def clear(self) -> None:
        """Forget every spilled block, in host memory and on disk (their KV is stale: the weights change). Before
        the prefix cache's reset, whose snapshot for the KV events then holds nothing of the tiers."""
        dropped = 0 if self.host is None else self.host.clear()
        dropped += 0 if self.store is None else self.store.clear()
        if dropped:
            log.info("KV offload: %d spilled block(s) forgotten (new weights)", dropped)

    def new_weights(self, version: int) -> None:
        """The weights changed to `version`: files from now on carry its fingerprint (after `clear`)."""
        if self.store is not None and self.model is not None:
            self.store.fingerprint = self.model.fingerprint(self.kv, version)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def _bytes_of(block: torch.Tensor) -> Callable[[], bytes]:
    """A deferred conversion of one copied block to bytes (run on the writer thread)."""
    return lambda: block.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
