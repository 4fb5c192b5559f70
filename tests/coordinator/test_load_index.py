"""The routing index (coordinator/load_index.py) answers what the scan (`routing.least_loaded` over the workers with
room) answers, exactly: over random sequences of load reports, dispatches, finishes, full workers and membership
changes, by itself and inside the coordinator's core; and a model with an EP group of several ranks is left to the
scan."""

from __future__ import annotations

import random

import pytest
from core_harness import MODEL, Harness, delta, dispatches, worker_hello

from infer.coordinator.load_index import LoadIndex
from infer.coordinator.routing import least_loaded
from infer.coordinator.state import WorkerRecord
from infer.protocol.messages import Abort, Error, Load, StepBatch


def record(i: int, model: str = "m", group: str | None = None) -> WorkerRecord:
    hello = worker_hello(f"w{i}", i, model=model, group=group, blocks=64)
    return WorkerRecord(
        worker_id=f"w{i}", identity=f"w{i}".encode(), hello=hello, last_seen=0.0, dp_rank=i, group_id=hello.group_id
    )


def random_load(rng: random.Random) -> Load:
    free = rng.randrange(0, 65)
    return Load(
        num_waiting=rng.randrange(0, 3),
        num_running=rng.randrange(0, 5),
        num_free_blocks=free,
        num_total_blocks=64,
        num_queued_tokens=rng.choice([0, 0, 16, 100, 333]),
    )


@pytest.mark.parametrize("seed", range(20))
def test_the_index_chooses_what_the_scan_chooses_through_random_changes(seed):
    rng = random.Random(seed)
    workers = [record(i, model=rng.choice(["m", "m", "n"])) for i in range(rng.randrange(1, 24))]
    routable = [w for w in workers if rng.random() < 0.9]
    limit: dict[int, int] = {id(w): rng.randrange(1, 6) for w in workers}

    def has_room(w: WorkerRecord) -> bool:
        return len(w.requests) < limit[id(w)]

    index = LoadIndex(min_workers=1)
    index.rebuild(routable)
    next_request = 0
    for _ in range(400):
        w = rng.choice(workers)
        op = rng.random()
        if op < 0.3:  # a load report: the key may rise or fall
            w.load = random_load(rng) if rng.random() < 0.9 else None
            index.touch(w)
        elif op < 0.6:  # a dispatch: the key rises, nobody tells the index
            w.requests.add(f"r{next_request}")
            w.cost_in_flight += rng.randrange(1, 200)
            next_request += 1
        elif op < 0.8 and w.requests:  # a request leaves: the key falls (Books.detach touches)
            w.requests.discard(rng.choice(sorted(w.requests)))
            w.cost_in_flight = max(0, w.cost_in_flight - rng.randrange(0, 200))
            index.touch(w)
        elif op < 0.85:  # its request limit changes (another coordinator bound, a new Hello)
            limit[id(w)] = rng.randrange(0, 6)
        elif op < 0.88:  # a worker joins, dies or drains: the routes are worked out afresh
            routable = [x for x in workers if rng.random() < 0.9]
            index.rebuild(routable)
        for model in ("m", "n"):
            with_room = [x for x in routable if x.model_id == model and has_room(x)]
            expected = least_loaded(with_room) if with_room else None
            assert index.best(model, has_room) is expected
            assert index.members(model) == [x for x in routable if x.model_id == model]


def test_superseded_entries_are_dropped_so_the_heap_stays_bounded():
    workers = [record(i) for i in range(8)]
    index = LoadIndex(min_workers=1)
    index.rebuild(workers)
    rng = random.Random(7)
    for _ in range(5000):
        w = rng.choice(workers)
        w.load = random_load(rng)
        index.touch(w)
    assert len(index._heaps["m"]) <= 4 * len(workers) + 64
    assert index.best("m", lambda w: True) is least_loaded(workers)


def test_a_model_with_an_ep_group_of_several_ranks_is_left_to_the_scan():
    """The scan's first key there is the group's busiest rank: the index does not decide for that model."""
    grouped = [record(0, group="g"), record(1, group="g"), record(2, group="h")]
    single = [record(3, model="solo")]
    index = LoadIndex(min_workers=1)
    index.rebuild(grouped + single)
    assert not index.indexed("m") and index.best("m", lambda w: True) is None
    assert index.members("m") == grouped
    assert index.indexed("solo") and index.best("solo", lambda w: True) is single[0]
    index.touch(grouped[0])  # harmless for a scanned model
    assert not index.indexed("m")


def test_the_core_routes_every_submit_to_the_scans_choice_through_reports_and_finishes():
    """Inside the coordinator's core: before each Submit the scan's choice is worked out from the same records;
    the Dispatch goes there. Workers report random loads, requests finish or are aborted at random, some workers
    fill up."""
    rng = random.Random(3)
    h = Harness(max_requests_per_worker=3)
    for i in range(12):
        h.worker(f"w{i}", i)
    admission = h.core.admission
    running: dict[str, list[str]] = {f"w{i}": [] for i in range(12)}
    for n in range(300):
        wid = rng.choice(sorted(running))
        if rng.random() < 0.4 and running[wid]:  # one of its requests ends, with a new load report
            rid = running[wid].pop(rng.randrange(len(running[wid])))
            h.send(wid.encode(), StepBatch(deltas=[delta(rid, 7, finish="length")], load=random_load(rng)))
        elif rng.random() < 0.3:
            h.send(wid.encode(), StepBatch(deltas=[], load=random_load(rng)))
        elif rng.random() < 0.3 and running[wid]:  # its client aborts one: it leaves the worker with no report
            h.send(b"client", Abort(request_ids=[running[wid].pop(rng.randrange(len(running[wid])))]))
        candidates = [w for w in admission.routable_for(MODEL) if admission._has_room(w)]
        expected = least_loaded(candidates).worker_id if candidates else None
        out = h.submit(b"client", f"r{n}")
        sent = dispatches(out)
        chosen = next(iter(sent)).decode() if sent else None
        assert chosen == expected, n
        if chosen is not None:
            running[chosen].append(f"r{n}")
        else:  # every worker at its limit: refused at once as overloaded
            (refused,) = [m for _, m in out if isinstance(m, Error)]
            assert refused.code == "overloaded" and h.core.requests.get(f"r{n}") is None


def test_a_model_of_few_workers_is_left_to_the_scan():
    """Below `min_workers` routable workers (the default, 8) the scan is cheaper than the heaps: not indexed, its
    members still known; from that many on, indexed."""
    few, many = [record(i) for i in range(7)], [record(i, model="n") for i in range(7, 15)]
    index = LoadIndex()
    index.rebuild(few + many)
    assert not index.indexed("m") and index.members("m") == few and index.best("m", lambda w: True) is None
    assert index.indexed("n") and index.best("n", lambda w: True) in many
