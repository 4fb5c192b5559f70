"""KvEventLog: the prefix cache's changes on their way to the coordinator (protocol/messages.py KvEvents), torch-free.

The block manager reports a block hash `stored` when the first cached block with that hash appears and `removed`
when the last one goes (protocol/prefix_hash.py: the hashes are the cache's own keys). The log keeps each hash's
latest state only (a hash stored and removed again before it went out is one `removed`), so what waits is bounded by
the hashes touched since the last frame, and `take` hands out at most `max_per_frame` of them at a time, oldest
first.

Invariant: applying every KvEvents taken since the last reset, in order, to an empty set gives exactly the hashes
the cache holds now plus those still pending here. Three things restart it with a reset (a snapshot of every hash
held, which may span several frames; the first carries `reset`): `restart()` (the coordinator welcomed the worker
or asked, KvResync), more than `max_pending` hashes waiting (the coordinator lags far behind: a snapshot is never
larger than the pool), and `cleared()` (the cache was emptied at once: suspend, new weights).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from infer.protocol.messages import KvEvents

MAX_EVENTS_PER_FRAME = 8192  # hashes (stored + removed) in one KvEvents; the wire allows MAX_KV_EVENTS of each


class KvEventLog:
    """The changes not yet sent; `held()` lists every hash the cache holds (for a snapshot)."""

    def __init__(
        self, held: Callable[[], Iterable[int]], max_pending: int, max_per_frame: int = MAX_EVENTS_PER_FRAME
    ) -> None:
        if max_pending < 1 or max_per_frame < 1:
            raise ValueError("max_pending and max_per_frame must be >= 1")
        self._held = held
        self.max_pending = max_pending
        self.max_per_frame = max_per_frame
        self._pending: OrderedDict[int, bool] = OrderedDict()  # hash -> held (its latest state), oldest first
        self.epoch = 0
        self._seq = 0
        self._reset = False
        self.restart()

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def pending(self) -> bool:
        return bool(self._pending) or self._reset

    def stored(self, block_hash: int) -> None:
        self._note(block_hash, True)

    def removed(self, block_hash: int) -> None:
        self._note(block_hash, False)

    def _note(self, block_hash: int, held: bool) -> None:
        pending = self._pending
        pending[block_hash] = held
        pending.move_to_end(block_hash)
        if len(pending) > self.max_pending:
            self.restart()

    def restart(self) -> None:
        """A new epoch: the next KvEvents resets the coordinator's view and carries every hash held now."""
        self.epoch += 1
        self._seq = 0
        self._reset = True
        self._pending = OrderedDict.fromkeys(self._held(), True)

    def cleared(self) -> None:
        """The cache forgot everything at once: a reset with nothing held."""
        self.epoch += 1
        self._seq = 0
        self._reset = True
        self._pending = OrderedDict()

    def take(self) -> KvEvents | None:
        """The next KvEvents (at most `max_per_frame` hashes), or None when nothing waits."""
        if not self.pending:
            return None
        stored: list[int] = []
        removed: list[int] = []
        pending = self._pending
        for _ in range(min(self.max_per_frame, len(pending))):
            block_hash, held = pending.popitem(last=False)
            (stored if held else removed).append(block_hash)
        events = KvEvents(epoch=self.epoch, seq=self._seq, reset=self._reset, stored=stored, removed=removed)
        self._seq += 1
        self._reset = False
        return events
