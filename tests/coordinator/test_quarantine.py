"""Poison-request quarantine, frame by frame: a request whose worker died while running it is a suspect. It
is re-dispatched to one worker only (never duplicated; a worker running no other suspect when there is one),
and if a second worker dies while running it, it fails with code "internal" (it is quarantined) instead of
walking through the fleet and killing every worker. Requests that were on a dying worker alongside it fail
over as usual: on their first death they are suspects too, not culprits."""

from __future__ import annotations

from core_harness import Harness, client_deltas, delta, dispatches

from infer.protocol.messages import Abort, Heartbeat

C1, C2 = b"client-1", b"client-2"
W0, W1, W2 = b"w0", b"w1", b"w2"


def three_workers(**options) -> Harness:
    h = Harness(**options)
    for i in range(3):
        h.worker(f"w{i}", i)
    return h


def _finals(out, client: bytes) -> dict[str, object]:
    return {d.request_id: d for d in client_deltas(out, client) if d.finished}


def test_first_death_redispatches_once_second_death_quarantines():
    h = three_workers(max_retries=5)
    h.submit(C1, "poison", pin_rank=0)
    h.step("w0", delta("poison", 7, prompt=[1, 2, 3]))
    h.core.peer_gone(W0, h.now)  # w0 died while running it: a suspect, moved once
    moved = dispatches(h.out())
    assert sum(len(d) for d in moved.values()) == 1
    ((target, (d,)),) = moved.items()
    assert target in (W1, W2) and d.resumed_token_ids == [7]
    record = h.core.requests.get("poison")
    assert record.worker_deaths == ["w0"]
    h.core.peer_gone(target, h.now)  # and its next worker died while running it too
    out = h.out()
    assert not dispatches(out)  # it does not walk on to the third worker
    final = _finals(out, C1)["poison"]
    assert final.finish_reason == "error" and final.error_code == "internal"
    assert "two workers that died" in final.error and "quarantined" in final.error
    assert "'w0'" in final.error and f"'{target.decode()}'" in final.error
    assert h.core.requests.get("poison") is None
    assert h.core.workers.by_id["w2" if target == W1 else "w1"].requests == set()


def test_bystanders_fail_over_and_only_the_twice_hit_request_is_quarantined():
    h = Harness(max_retries=5)
    h.worker("w0", 0)
    h.worker("w1", 1)
    for rid in ("poison", "bystander"):
        h.submit(C1, rid, pin_rank=0)
    h.core.peer_gone(W0, h.now)  # both were on w0: both suspects, both move to w1
    assert {d.request_id for d in dispatches(h.out())[W1]} == {"poison", "bystander"}
    h.worker("w2", 2)  # a fresh worker joins; then a new request lands on w1
    h.submit(C2, "newcomer", pin_rank=1)
    h.core.peer_gone(W1, h.now)  # w1 dies: both suspects were on it
    out = h.out()
    finals = _finals(out, C1)
    assert finals["poison"].error_code == "internal" and finals["bystander"].error_code == "internal"
    # the newcomer had never seen a death: it moves on, and now is a suspect once
    (moved,) = dispatches(out)[W2]
    assert moved.request_id == "newcomer" and not _finals(out, C2)
    assert h.core.requests.get("newcomer").worker_deaths == ["w1"]


def test_a_bystander_that_finishes_elsewhere_is_untouched_by_the_poisons_second_death():
    h = three_workers(max_retries=5)
    for rid in ("poison", "bystander"):
        h.submit(C1, rid, pin_rank=0)
    h.core.peer_gone(W0, h.now)
    moved = {d.request_id: identity for identity, ds in dispatches(h.out()).items() for d in ds}
    # suspects are spread: each goes to a worker that runs no other suspect
    assert moved["poison"] != moved["bystander"]
    h.core.peer_gone(moved["poison"], h.now)
    out = h.out()
    assert _finals(out, C1)["poison"].error_code == "internal"
    assert "bystander" not in _finals(out, C1)
    done = h.step(moved["bystander"].decode(), delta("bystander", 5, prompt=[1, 2, 3], finish="length"))
    assert _finals(done, C1)["bystander"].finish_reason == "length"


def test_deaths_count_only_the_worker_that_died_not_its_group_mates_nor_a_drain():
    h = Harness(max_retries=5)
    h.worker("w0", 0, group="ep")
    h.worker("w1", 1, group="ep")
    h.worker("w2", 2)
    h.submit(C1, "on-mate", pin_rank=1)
    h.core.peer_gone(W0, h.now)  # w1's group is broken: its request moves, no strike
    assert h.core.requests.get("on-mate").worker_deaths == []
    h.submit(C1, "drained", pin_rank=2)
    out = h.step("w2", delta("drained", finish="error", error="worker is draining", code="draining"))
    assert h.core.requests.get("drained").worker_deaths == []
    assert not _finals(out, C1)


def test_failover_after_one_death_keeps_the_stream_exact():
    """The quarantine does not change one failover: the stream resumes with no gap and no repeat."""
    h = Harness()
    h.worker("w0", 0)
    h.worker("w1", 1)
    h.submit(C1, "r", max_tokens=5)
    h.step("w0", delta("r", 7, prompt=[1, 2, 3]))
    h.core.peer_gone(W0, h.now)
    (d,) = dispatches(h.out())[W1]
    assert d.resumed_token_ids == [7] and d.spec.sampling.max_tokens == 5
    out = h.step("w1", delta("r", 8, prompt=[1, 2, 3, 7]), delta("r", 9, finish="length"))
    assert [x.token_ids for x in client_deltas(out, C1)] == [[8], [9]]


def test_a_hung_workers_copy_is_aborted_so_a_suspect_never_runs_on_two_workers():
    """Declared dead by silence, a worker may only be hung: the Abort of what it ran is queued for it (it
    reads it before its next step when it wakes), and the request is dispatched to exactly one other worker."""
    h = three_workers(worker_timeout=0.5)
    h.submit(C1, "r", pin_rank=0)
    h.step("w0", delta("r", 7, prompt=[1, 2, 3]))
    out = []
    for _ in range(8):  # w1 and w2 keep talking, w0 is silent
        h.send(W1, Heartbeat(sent_at=0.0))
        h.send(W2, Heartbeat(sent_at=0.0))
        out += h.advance(0.1)
    assert [m.request_ids for identity, m in out if identity == W0 and isinstance(m, Abort)] == [["r"]]
    moved = dispatches(out)
    assert sum(len(d) for d in moved.values()) == 1 and W0 not in moved
    assert h.core.requests.get("r").worker_deaths == ["w0"]
