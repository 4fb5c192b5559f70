"""The routable workers of each model ordered by load, so that a least-loaded choice costs O(log W) instead of a
scan of every worker. Pure Python (no sockets, no torch).

With direct streams the coordinator's cost per request is what grows with the cluster: `routing.least_loaded`
scores every candidate of every request (232 us a Submit at 64 workers, 2.1 ms at 1,000 on a Zen 3 core). This
index keeps, per model, a heap of (score, requests in flight, dp_rank) keys, the order `least_loaded` picks by when
every EP group is one rank. Each worker has one live entry; `touch` replaces it after anything that may have lowered
its key (a load report, a request leaving it, a dispatch), older entries are skipped when they surface. A live
entry whose worker's key has changed without a touch is re-filed at its current key when it surfaces, so a missed
raise costs a re-push, never a wrong choice; a key may only fall through `touch`, which every place that can lower
it calls (books.Books.detach, relay / liveness on a load report).

A model with fewer than `min_workers` (8) routable workers is not indexed either: there the scan costs less than
keeping the heaps, which every dispatch and load report re-files (at 2 workers the index took ~8% of the
coordinator's CPU a one-token request in benchmarks/coordinator_overhead.py; a scan of 8 costs ~12 us on an
Intel Xeon core, the heaps ~3-4 us and their upkeep).

The answer is the scan's answer, exactly (tests/coordinator/test_load_index.py checks it against `least_loaded` over
random operation sequences). A model with an EP group of more than one rank is not indexed (`best` answers None):
the scan's first key there is the group's busiest rank, which changes with every member's report.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable

from infer.coordinator.state import WorkerRecord

Key = tuple[float, int, int]  # score, requests in flight, dp_rank: least_loaded's order for groups of one rank
MIN_INDEXED_WORKERS = 8  # below this many routable workers of a model, the scan decides (cheaper there)


def key_of(worker: WorkerRecord) -> Key:
    return (worker.score, len(worker.requests), worker.dp_rank)


class LoadIndex:
    """Per model, the routable workers in least-loaded order (see the module's docstring)."""

    def __init__(self, min_workers: int = MIN_INDEXED_WORKERS) -> None:
        self.min_workers = min_workers
        self._heaps: dict[str, list[tuple[Key, int, WorkerRecord]]] = {}
        self._live: dict[int, int] = {}  # id(worker) -> the sequence number of its live entry
        self._members: dict[str, list[WorkerRecord]] = {}
        self._seq = itertools.count()

    def rebuild(self, routable: Iterable[WorkerRecord]) -> None:
        """Index exactly `routable` (the routes changed: a worker joined, died, drains or changed version)."""
        self._heaps.clear()
        self._live.clear()
        self._members.clear()
        for worker in routable:
            self._members.setdefault(worker.model_id, []).append(worker)
        for model, workers in self._members.items():
            if len(workers) < self.min_workers:
                continue  # few workers: the scan decides for this model
            groups = {w.group_id for w in workers}
            if len(groups) < len(workers):
                continue  # an EP group of several ranks: the scan decides for this model
            heap = self._heaps[model] = []
            for worker in workers:
                seq = next(self._seq)
                self._live[id(worker)] = seq
                heap.append((key_of(worker), seq, worker))
            heapq.heapify(heap)

    def members(self, model_id: str) -> list[WorkerRecord]:
        """The routable workers of `model_id` (empty when none)."""
        return self._members.get(model_id, [])

    def touch(self, worker: WorkerRecord) -> None:
        """`worker`'s key may have changed (fallen, in particular): file it at its current key."""
        heap = self._heaps.get(worker.model_id)
        if heap is None or id(worker) not in self._live:
            return  # not routable, or its model is scanned
        seq = next(self._seq)
        self._live[id(worker)] = seq
        heapq.heappush(heap, (key_of(worker), seq, worker))
        if len(heap) > 4 * len(self._members[worker.model_id]) + 64:
            self._compact(worker.model_id)

    def indexed(self, model_id: str) -> bool:
        """Whether `best` decides for `model_id` (it has routable workers, each EP group of one rank)."""
        return model_id in self._heaps

    def best(self, model_id: str, has_room: Callable[[WorkerRecord], bool]) -> WorkerRecord | None:
        """The worker `routing.least_loaded` would choose among the routable workers of `model_id` that have room,
        or None when none has room (or the model is not indexed: `indexed`)."""
        heap = self._heaps.get(model_id)
        if heap is None:
            return None
        full: list[tuple[Key, int, WorkerRecord]] = []
        chosen = None
        while heap:
            key, seq, worker = heap[0]
            if self._live.get(id(worker)) != seq:
                heapq.heappop(heap)  # superseded by a later touch
                continue
            current = key_of(worker)
            if current != key:  # raised without a touch (a dispatch): re-file it where it belongs now
                seq = next(self._seq)
                self._live[id(worker)] = seq
                heapq.heapreplace(heap, (current, seq, worker))
                continue
            if has_room(worker):
                chosen = worker
                break
            full.append(heapq.heappop(heap))  # at its request limit: set aside while the others are looked at
        for entry in full:
            heapq.heappush(heap, entry)
        return chosen

    def _compact(self, model_id: str) -> None:
        """Drop the superseded entries of `model_id`'s heap."""
        heap = [entry for entry in self._heaps[model_id] if self._live.get(id(entry[2])) == entry[1]]
        heapq.heapify(heap)
        self._heaps[model_id] = heap
