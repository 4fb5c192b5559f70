"""HostStore: the KV tier in host memory, between the pool and the disk (no torch): the bookkeeping of its slots.

The bytes live in one preallocated buffer of `num_slots` blocks (worker/kv/offload.py owns it: pinned CPU memory when
the pool is on a GPU); this store decides which slot holds which block and checks a block before it is served. Each
entry keeps the block's hash (the prefix cache's key, protocol/prefix_hash.py), its prefix digest
(prefix_hash.prefix_digest: the proof that the slot holds *these* tokens' KV, since a 64-bit hash alone is never
trusted) and an xxh3 checksum of its payload, taken when the block was copied in. `load` checks all three; a mismatch
forgets the entry, counts it (`corrupt`) and the block is recomputed: its bytes are never served.

Bound: `num_slots` blocks, least recently used (stored or loaded) out first. `take_slot` hands the caller the slot
for a new block; when none is free it takes the least recently used entry's and hands that block back to the
caller (its bytes copied out and checked, when asked), who moves it down to the disk tier or drops it, before the
slot is overwritten. A slot taken is not indexed (and cannot be taken again) until `put` fills it, or `release`
gives it back unused.

`take_changes` hands the engine the hashes that arrived here or left, for the KV events (worker/kv/events.py). One
thread (the engine's) calls everything.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from infer.worker.kv.offload_store import payload_checksum

log = logging.getLogger("infer.kv_offload")


@dataclass
class HostCounters:
    """Since the store opened: blocks copied in, read back into the pool, let go with nowhere to go (no disk tier
    below, or no slot free for them), and entries rejected (checksum or prefix mismatch: recomputed)."""

    spilled: int = 0
    loaded: int = 0
    dropped: int = 0
    corrupt: int = 0


@dataclass(frozen=True)
class HostEntry:
    slot: int
    digest: bytes
    checksum: int


@dataclass(frozen=True)
class Departed:
    """A block `take_slot` pushed out of the tier: its payload (a copy, checked against its checksum) when the
    caller wanted it and it passed; None otherwise (not wanted, or corrupt: counted)."""

    block_hash: int
    digest: bytes
    payload: bytes | None


class HostStore:
    """An LRU index of hash -> slot over `num_slots` slots; `read(slot)` gives a slot's bytes (a view, no copy)."""

    def __init__(self, num_slots: int, read: Callable[[int], memoryview]) -> None:
        if num_slots < 1:
            raise ValueError("kv_offload_host_gb holds no block: give at least one block's size")
        self.num_slots = num_slots
        self.counters = HostCounters()
        self._read = read
        self._index: OrderedDict[int, HostEntry] = OrderedDict()  # hash -> entry, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._changes: list[tuple[int, bool]] = []  # (hash, now here) for the KV events

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._index

    def hashes(self) -> list[int]:
        return list(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def take_slot(self, wanted_below: Callable[[int], bool]) -> tuple[int, Departed | None] | None:
        """A slot for a new block: a free one, else the least recently used entry's, whose block is returned as
        `Departed` (with its payload copied out and checked when `wanted_below(its hash)`: the tier below takes it
        and lacks it). None: every slot is taken and not yet filled (the caller drops the block)."""
        if self._free:
            return self._free.pop(), None
        if not self._index:
            return None
        block_hash, entry = self._index.popitem(last=False)
        self._changes.append((block_hash, False))
        payload = None
        if wanted_below(block_hash):
            payload = bytes(self._read(entry.slot))
            if payload_checksum(payload) != entry.checksum:
                self._count_corrupt(block_hash, "checksum mismatch on its way to disk")
                payload = None
        return entry.slot, Departed(block_hash, entry.digest, payload)

    def put(self, block_hash: int, digest: bytes, slot: int) -> None:
        """Index a slot `take_slot` gave, now holding this block's payload (its checksum is taken now)."""
        self._index[block_hash] = HostEntry(slot, digest, payload_checksum(self._read(slot)))
        self._changes.append((block_hash, True))
        self.counters.spilled += 1

    def release(self, slot: int) -> None:
        """Give back a slot `take_slot` gave, unfilled."""
        self._free.append(slot)

    def load(self, block_hash: int, digest: bytes) -> int | None:
        """The slot of the block with this hash and prefix digest, checked (see the module docstring), or None: not
        here, or rejected (then forgotten and counted). Marks the entry recently used."""
        entry = self._index.get(block_hash)
        if entry is None:
            return None
        if entry.digest != digest:
            reason = "holds another prefix (digest differs)"
        elif payload_checksum(self._read(entry.slot)) != entry.checksum:
            reason = "checksum mismatch"
        else:
            self._index.move_to_end(block_hash)
            self.counters.loaded += 1
            return entry.slot
        self._forget(block_hash)
        self._count_corrupt(block_hash, reason)
        return None

    def take_changes(self) -> list[tuple[int, bool]]:
        """(hash, here now) since the last call, oldest first: arrivals and departures for the KV events."""
        changes, self._changes = self._changes, []
        return changes

    def clear(self) -> int:
        """Forget every entry (the KV they hold is stale: new weights). Returns how many went."""
        count = len(self._index)
        for entry in self._index.values():
            self._free.append(entry.slot)
        self._index.clear()
        self._changes.clear()
        return count

    def _forget(self, block_hash: int) -> None:
        entry = self._index.pop(block_hash)
        self._free.append(entry.slot)
        self._changes.append((block_hash, False))

    def _count_corrupt(self, block_hash: int, reason: str) -> None:
        log.warning("host-memory KV block %016x rejected (recomputed): %s", block_hash, reason)
        self.counters.corrupt += 1
