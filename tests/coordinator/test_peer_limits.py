"""Clients declared lost or too slow, per-client budgets, stuck engines and draining workers, driven frame by
frame (see core_harness.py): a lost client is told when it comes back and may re-attach; a client that reads
nothing loses its requests with "client_too_slow"; nobody can make the coordinator queue without bound."""

from __future__ import annotations

import pytest
from core_harness import Harness, delta

import infer.coordinator.liveness as liveness_module
from infer.coordinator.statistics import MAX_STATS_PER_CLIENT_S, MAX_STATS_WAITERS_PER_CLIENT
from infer.protocol.messages import (
    Abort,
    ClusterStats,
    DeltaBatch,
    Dispatch,
    Error,
    Heartbeat,
    Hello,
    Message,
    RequestSpec,
    StatsRequest,
    Submit,
    TokenIds,
    Welcome,
)
from infer.protocol.sampling import SamplingParams

C1, C2 = b"client-1", b"client-2"
W0, W1 = b"w0", b"w1"


def of_type(out: list[tuple[bytes, Message]], kind: type, to: bytes | None = None) -> list:
    return [m for identity, m in out if isinstance(m, kind) and (to is None or identity == to)]


def two_workers(**options) -> Harness:
    h = Harness(restart_grace=0.0, **options)
    h.worker("w0", 0)
    h.worker("w1", 1)
    return h


def _beat_workers_until(h: Harness, seconds: float, *also: bytes) -> list:
    out = []
    for _ in range(round(seconds / 0.15)):
        for identity in (W0, W1, *also):
            h.send(identity, Heartbeat(sent_at=0.0))
        out += h.advance(0.15)
    return out


def test_a_lost_client_is_told_when_it_comes_back_and_resumes_by_reattaching():
    h = two_workers()
    h.submit(C1, "a", prompt_ids=[1, 2, 3])
    worker = h.core.requests.get("a").worker_id.encode()
    h.step(worker.decode(), delta("a", 4, 5, prompt=[1, 2, 3]))
    out = _beat_workers_until(h, 1.5)  # C1 silent past the client timeout (1 s)
    assert of_type(out, Abort, worker)[0].request_ids == ["a"]
    # it comes back (it was stopped): its heartbeat is answered with the notice, not with a heartbeat
    out = h.send(C1, Heartbeat(sent_at=0.0))
    (notice,) = of_type(out, Error, C1)
    assert notice.code == "client_lost" and notice.request_id is None and "declared lost" in notice.message
    assert "1 request(s)" in notice.message and not of_type(out, Heartbeat, C1)
    assert h.send(C1, Heartbeat(sent_at=0.0)) == []  # a frame flood gets no flood of notices
    # the client re-registers and re-attaches: the stream resumes from the tokens it holds
    assert of_type(h.send(C1, Hello(role="client", peer_id="c1")), Welcome, C1)
    out = h.send(
        C1,
        Submit(
            request_id="a",
            spec=RequestSpec(
                prompt_token_ids=TokenIds([1, 2, 3]), sampling=SamplingParams(temperature=0.0, max_tokens=10)
            ),
            reattach=True,
            delivered_token_ids=TokenIds([4, 5]),
        ),
    )
    (dispatch,) = of_type(out, Dispatch)
    assert list(dispatch.resumed_token_ids) == [4, 5] and dispatch.spec.sampling.max_tokens == 10
    assert of_type(h.send(C1, Heartbeat(sent_at=0.0)), Heartbeat, C1)  # served as usual again
    assert h.core.stats(h.now).clients_lost == 1


def test_an_unroutable_client_is_told_too_when_it_reconnects():
    h = two_workers()
    h.submit(C1, "a")
    h.core.peer_gone(C1, h.now)
    assert of_type(h.out(), Abort)[0].request_ids == ["a"]
    (notice,) = of_type(h.send(C1, Submit(request_id="b", spec=RequestSpec(prompt_token_ids=TokenIds([1])))), Error, C1)
    assert notice.code == "client_lost"
    assert h.core.requests.get("b") is None  # dropped until it says hello again


def test_an_idle_client_whose_connection_went_is_simply_forgotten():
    h = two_workers()
    h.send(C1, Heartbeat(sent_at=0.0))
    h.core.peer_gone(C1, h.now)
    assert of_type(h.send(C1, StatsRequest()), ClusterStats, C1)  # nothing was lost: no notice
    assert h.core.stats(h.now).clients_lost == 0


def test_a_client_that_reads_nothing_loses_its_requests_as_too_slow_and_others_go_on():
    h = two_workers()
    h.submit(C1, "a")
    h.submit(C1, "b")
    h.submit(C2, "c")
    h.core.peer_too_slow(C1, h.now)  # the daemon found C1's queue at the high-water mark
    aborted = sorted(rid for m in of_type(h.out(), Abort) for rid in m.request_ids)
    assert aborted == ["a", "b"] and h.core.requests.get("c") is not None
    # what it sends meanwhile (a stats flood) costs nothing but one notice per heartbeat interval
    out = [m for _ in range(50) for m in h.send(C1, StatsRequest())]
    (notice,) = of_type(out, Error, C1)
    assert notice.code == "client_too_slow" and "2 request(s)" in notice.message
    assert not of_type(out, ClusterStats)
    stats = h.core.stats(h.now)
    assert stats.clients_too_slow == 1 and stats.requests_aborted == 2
    h.core.peer_too_slow(C1, h.now)  # more sends to it fail: nothing more to do
    assert h.out() == []


def test_a_worker_that_reads_nothing_is_declared_dead_and_its_requests_move():
    h = two_workers()
    h.submit(C1, "a", pin_rank=0)
    h.core.peer_too_slow(W0, h.now)
    (dispatch,) = of_type(h.out(), Dispatch, W1)
    assert dispatch.request_id == "a"
    assert not h.core.stats(h.now).workers[0].healthy


def test_lost_client_tombstones_are_bounded_in_number_and_age(monkeypatch):
    monkeypatch.setattr(liveness_module, "MAX_LOST_CLIENTS", 3)
    h = two_workers()
    clients = [f"c{i}".encode() for i in range(5)]
    for i, c in enumerate(clients):
        h.submit(c, f"r{i}")
        h.core.peer_gone(c, h.now)
    h.out()
    assert of_type(h.send(clients[0], Heartbeat(sent_at=0.0)), Heartbeat)  # forgotten: the oldest
    assert of_type(h.send(clients[4], Heartbeat(sent_at=0.0)), Error)[0].code == "client_lost"
    h.advance(liveness_module.LOST_CLIENT_TTL_S + 1)
    assert of_type(h.send(clients[3], Heartbeat(sent_at=0.0)), Heartbeat)  # aged out


def test_stats_requests_past_the_per_client_budget_are_refused_as_overloaded():
    h = two_workers()
    out = [m for _ in range(MAX_STATS_PER_CLIENT_S + 20) for m in h.send(C1, StatsRequest())]
    assert len(of_type(out, ClusterStats, C1)) == MAX_STATS_PER_CLIENT_S
    refused = of_type(out, Error, C1)
    assert len(refused) == 20 and {e.code for e in refused} == {"overloaded"}
    assert of_type(h.send(C2, StatsRequest()), ClusterStats, C2)  # another client is served
    h.advance(1.0)
    assert of_type(h.send(C1, StatsRequest()), ClusterStats, C1)  # a new second, a new budget


def test_stats_waiters_of_one_client_are_bounded():
    h = two_workers()
    out = [
        m
        for _ in range(MAX_STATS_WAITERS_PER_CLIENT + 3)
        for m in h.send(C1, StatsRequest(min_healthy_workers=5, timeout_s=30.0))
    ]
    assert len(of_type(out, ClusterStats, C1)) == 3  # answered at once: the rest wait for workers
    out = _beat_workers_until(h, 0.5, C1) + h.worker("w2", 2) + h.worker("w3", 3) + h.worker("w4", 4)
    assert len(of_type(out, ClusterStats, C1)) == MAX_STATS_WAITERS_PER_CLIENT
    assert len(of_type(h.send(C1, StatsRequest(min_healthy_workers=9, timeout_s=30.0)), ClusterStats)) == 0


def test_a_worker_whose_engine_step_runs_past_max_step_time_is_declared_dead():
    h = two_workers(max_step_time=5.0)
    h.submit(C1, "a", pin_rank=0)
    assert h.send(W0, Heartbeat(sent_at=0.0, step_age_s=4.0)) == []  # a long step: fine
    assert h.core.stats(h.now).workers[0].healthy
    out = h.send(W0, Heartbeat(sent_at=0.0, step_age_s=6.0))
    assert of_type(out, Dispatch, W1)[0].request_id == "a"
    assert not h.core.stats(h.now).workers[0].healthy


@pytest.mark.parametrize(
    "code, text, draining",
    [
        ("draining", "shutting down", True),  # the code says it, whatever the text
        ("unavailable", "worker is draining", False),  # the text alone does not
    ],
)
def test_a_draining_worker_is_recognized_by_its_error_code(code, text, draining):
    h = two_workers()
    h.submit(C1, "s", pin_rank=0)
    out = h.step("w0", delta("s", finish="error", error=text, code=code))
    moved = [d.request_id for d in of_type(out, Dispatch, W1)]
    finals = [d for b in of_type(out, DeltaBatch, C1) for d in b.deltas if d.finished]
    assert (moved == ["s"] and not finals) if draining else (not moved and finals[0].error_code == code)
    assert h.core.stats(h.now).workers[0].healthy is not draining  # routable unless draining
