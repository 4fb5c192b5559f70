"""The prefix cache's changes as the coordinator sees them (worker/kv/events.py): the block manager reports a hash
stored when its first cached block appears and removed when its last goes; applying every KvEvents taken since the
last reset to an empty set always gives the hashes the cache holds; the log is bounded per frame and in total (past
it: a snapshot); the hashes are the ones the coordinator computes for the same prompt (protocol/prefix_hash.py)."""

from __future__ import annotations

import random

import pytest
from sched_sim import make_request

from infer.protocol.messages import KvEvents, KvResync, StepBatch, Welcome
from infer.protocol.prefix_hash import adapter_salt, prompt_block_hashes
from infer.worker.engine.block_manager import BlockManager
from infer.worker.engine.request import Request
from infer.worker.kv.events import KvEventLog

BS = 4


def compute(manager: BlockManager, request: Request) -> None:
    cached = manager.find_cached_prefix(request)
    assert manager.allocate(request, request.num_tokens - len(cached) * BS, cached)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)


class View:
    """The coordinator's side of one worker, minus the bounds: a set the KvEvents are applied to, in order."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.expected: tuple[int, int] | None = None

    def apply(self, events: KvEvents) -> None:
        if events.reset:
            self.hashes = set()
        else:
            assert (events.epoch, events.seq) == self.expected, "a gap"
        assert not set(events.stored) & set(events.removed)
        self.hashes -= set(events.removed)
        self.hashes |= set(events.stored)
        self.expected = (events.epoch, events.seq + 1)

    def drain(self, log: KvEventLog) -> None:
        while (events := log.take()) is not None:
            self.apply(events)


def held(manager: BlockManager) -> set[int]:
    return set(manager._cached)


def test_stored_and_removed_follow_the_first_and_last_block_of_a_hash():
    manager = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    log = manager.publish_events(True)
    assert log is not None and log.take() == KvEvents(epoch=1, seq=0, reset=True)  # an empty snapshot first
    a = make_request(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(manager, a)
    first = log.take()
    assert first is not None and first.stored == prompt_block_hashes(a.token_ids, BS, None, 2) and not first.removed
    manager.free(a)
    assert log.take() is None  # freed blocks keep their content: still held
    compute(manager, b := make_request(1, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]))
    events = log.take()
    assert events is not None and events.seq == 2
    assert len(events.removed) == 2 and set(events.removed) == set(first.stored)  # evicted for b's blocks
    assert set(events.stored) == set(prompt_block_hashes(b.token_ids, BS, None, 3))


def test_a_cleared_cache_is_one_reset_not_an_event_a_block():
    manager = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    log = manager.publish_events(True)
    assert log is not None
    log.take()
    compute(manager, a := make_request(0, list(range(1, 14))))
    manager.free(a)
    manager.reset_prefix_cache()
    events = log.take()
    assert events is not None and events.reset and not events.stored and not events.removed
    assert log.take() is None


def test_publishing_needs_prefix_caching_and_stops_when_asked():
    assert BlockManager(4, BS, enable_prefix_caching=False).publish_events(True) is None
    manager = BlockManager(4, BS, enable_prefix_caching=True)
    manager.publish_events(True)
    assert manager.publish_events(False) is None and manager.events is None


def test_each_frame_is_bounded_and_the_rest_follows_in_order():
    log = KvEventLog(lambda: range(100, 125), max_pending=1000, max_per_frame=10)
    frames = []
    while (events := log.take()) is not None:
        frames.append(events)
    assert [len(f.stored) for f in frames] == [10, 10, 5]
    assert [f.reset for f in frames] == [True, False, False] and [f.seq for f in frames] == [0, 1, 2]


def test_too_much_waiting_becomes_a_snapshot():
    cache = {1, 2, 3}
    log = KvEventLog(lambda: sorted(cache), max_pending=4, max_per_frame=100)
    log.take()
    for h in range(10, 15):  # five hashes touched and none sent: past max_pending
        log.removed(h)
    events = log.take()
    assert events is not None and events.reset and events.epoch == 2 and events.stored == [1, 2, 3]


def test_a_hash_keeps_only_its_latest_state():
    log = KvEventLog(lambda: [], max_pending=100)
    log.take()
    log.stored(7)
    log.removed(7)
    log.stored(8)
    assert log.take() == KvEvents(epoch=1, seq=1, stored=[8], removed=[7])


@pytest.mark.parametrize("seed", range(5))
def test_the_coordinator_view_equals_the_cache_through_any_churn(seed):
    rng = random.Random(seed)
    manager = BlockManager(num_blocks=24, block_size=BS, enable_prefix_caching=True)
    log = manager.publish_events(True)
    assert log is not None
    log.max_per_frame = 3  # frames lag behind the cache
    view, live = View(), []
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    for i in range(300):
        action = rng.random()
        if action < 0.5 and len(live) < 4:
            prompt = rng.choice(prefixes)[: rng.randrange(4, 13)] + [rng.randrange(50) for _ in range(rng.randrange(6))]
            request = make_request(i, prompt)
            cached = manager.find_cached_prefix(request)
            if manager.num_blocks_to_allocate(request, request.num_tokens - len(cached) * BS, cached) <= len(
                manager._free
            ):
                compute(manager, request)
                live.append(request)
        elif action < 0.85 and live:
            manager.free(live.pop(rng.randrange(len(live))))
        elif action < 0.9:
            log.restart()  # the coordinator asked (KvResync)
        if (events := log.take()) is not None:
            view.apply(events)
    view.drain(log)
    assert view.hashes == held(manager)


def test_the_coordinator_computes_the_worker_hashes_with_and_without_an_adapter():
    manager = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    base = make_request(0, list(range(1, 11)))
    lora = make_request(1, list(range(1, 11)))
    lora.cache_salt = adapter_salt("sql")
    for request in (base, lora):
        compute(manager, request)
    assert base.block_hashes == prompt_block_hashes(base.token_ids, BS, None, 2)
    assert lora.block_hashes == prompt_block_hashes(lora.token_ids, BS, adapter_salt("sql"), 2)
    assert set(base.block_hashes).isdisjoint(lora.block_hashes)


def test_the_worker_publishes_only_when_welcomed_so_and_starts_over_when_asked():
    from worker_harness import WorkerHarness

    harness = WorkerHarness()
    calls: list[bool] = []
    harness.engine.publish_kv_events = calls.append  # BenchmarkEngine has no cache: record what the core asks
    harness.send(KvResync(reason="not publishing yet"))
    assert calls == []
    harness.send(Welcome(coordinator_id="c", state="running", instance="coord-1", dp_rank=0, kv_events=True))
    harness.send(KvResync(reason="a gap"))
    assert calls == [True, True]
    harness.engine.take_kv_events = lambda: KvEvents(epoch=1, seq=0, reset=True, stored=[5])
    out = harness.advance(0.1)
    batches = [m for m in out if isinstance(m, StepBatch)]
    assert batches and batches[0].kv_events == KvEvents(epoch=1, seq=0, reset=True, stored=[5])
