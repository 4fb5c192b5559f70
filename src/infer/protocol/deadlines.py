"""DeadlineHeap: items by deadline, for request timeouts (the coordinator's admission, LocalEngine's engine
thread). No I/O, no clock: the caller says what time it is.

Entries are never removed when their item finishes or gets a new deadline; they go stale and are skipped when
popped (`is_current`), and the heap is compacted when stale entries outnumber the live items.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class DeadlineHeap(Generic[T]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []  # (deadline, arrival, item): items are never compared
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, deadline: float, item: T, num_live: int, is_current: Callable[[float, T], bool]) -> None:
        """Add `item` due at `deadline`. When the heap holds more than 2 * `num_live` + 64 entries, the stale ones
        (`is_current` false) are dropped first."""
        if len(self._heap) > 2 * num_live + 64:
            self._heap = [e for e in self._heap if is_current(e[0], e[2])]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (deadline, next(self._arrivals), item))

    def next_deadline(self) -> float:
        """The earliest deadline held (stale or not); inf when empty."""
        return self._heap[0][0] if self._heap else math.inf

    def pop_due(self, now: float, is_current: Callable[[float, T], bool]) -> Iterator[tuple[float, T]]:
        """Each current item whose deadline is at or before `now`, earliest first, with its deadline. Lazy: the
        caller may finish items (or push new ones) between two of them."""
        while self._heap and self._heap[0][0] <= now:
            deadline, _, item = heapq.heappop(self._heap)
            if is_current(deadline, item):
                yield deadline, item
