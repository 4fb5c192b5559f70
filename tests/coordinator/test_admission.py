"""Admission control and deadlines in the coordinator's logic, driven frame by frame (see test_core.py).

Bounded queues: a worker takes at most its limit of requests (the coordinator's flag, capped by what the
worker says it holds), the coordinator holds at most --max-held-requests; past them a Submit is refused at
once with error code "overloaded" and nothing already accepted is dropped. Deadlines: a request past its
`timeout_s` fails with code "timeout" and is aborted on its worker.
"""

from __future__ import annotations

import msgspec
from core_harness import Harness, delta

from infer.protocol.messages import Abort, DeltaBatch, Dispatch, Error, Hello, RequestSpec, Submit, TokenIds
from infer.protocol.sampling import SamplingParams

CLIENT = b"client-1"


def _of(out, kind):
    return [(identity, msg) for identity, msg in out if isinstance(msg, kind)]


def _final(out, rid):
    finals = [d for _, m in _of(out, DeltaBatch) for d in m.deltas if d.request_id == rid and d.finished]
    return finals[0] if finals else None


def test_a_full_cluster_refuses_at_once_and_admits_again_when_room_frees():
    h = Harness(max_requests_per_worker=2)
    h.worker("w0", 0)
    h.worker("w1", 1)
    dispatched = [m for rid in "abcd" for _, m in _of(h.submit(CLIENT, rid), Dispatch)]
    assert len(dispatched) == 4
    refused = _of(h.submit(CLIENT, "e"), Error)
    assert len(refused) == 1 and refused[0][1].code == "overloaded" and refused[0][1].request_id == "e"
    assert "overloaded" in refused[0][1].message and "retry later" in refused[0][1].message
    owner = h.core.requests.get("a").worker_id
    h.step(owner, delta("a", 7, prompt=[1, 2, 3], finish="length"))
    assert [m.request_id for _, m in _of(h.submit(CLIENT, "f"), Dispatch)] == ["f"]
    stats = h.core.stats(h.now)
    assert stats.requests_rejected == 1 and stats.num_in_flight == 4


def test_the_workers_own_bound_caps_the_coordinators():
    h = Harness(max_requests_per_worker=100)
    h.send(
        b"w0",
        Hello(
            role="worker",
            peer_id="w0",
            model_id="tiny-model",
            dp_rank=0,
            group_id="dp0",
            num_kv_blocks=100,
            block_size=16,
            max_num_seqs=2,
            max_model_len=256,
            max_waiting=1,
        ),
    )
    assert sum(len(_of(h.submit(CLIENT, rid), Dispatch)) for rid in "abc") == 3
    assert _of(h.submit(CLIENT, "d"), Error)[0][1].code == "overloaded"


def test_held_requests_are_bounded_too():
    h = Harness(max_held_requests=2)
    assert not h.submit(CLIENT, "a") and not h.submit(CLIENT, "b")  # no worker yet: held
    refused = _of(h.submit(CLIENT, "c"), Error)
    assert refused[0][1].code == "overloaded" and "--max-held-requests 2" in refused[0][1].message
    out = h.worker("w0", 0)
    assert sorted(m.request_id for _, m in _of(out, Dispatch)) == ["a", "b"]


def test_moved_requests_wait_for_room_instead_of_failing():
    h = Harness(max_requests_per_worker=1, queue_timeout=60.0)
    h.worker("w0", 0)
    h.worker("w1", 1)
    h.submit(CLIENT, "a")
    h.submit(CLIENT, "b")
    victim = h.core.requests.get("a").worker_id
    other = "w1" if victim == "w0" else "w0"
    rid_on_victim = "a"
    h.step(victim, delta(rid_on_victim, 5, prompt=[1, 2, 3]))
    h.core.peer_gone(victim.encode(), h.now)  # its connection is gone: its request moves
    h.out()
    assert h.core.requests.get(rid_on_victim).worker_id is None  # held: the other worker is full
    out = h.step(other, delta("b", 9, prompt=[1, 2, 3], finish="length"))
    moved = [m for _, m in _of(out, Dispatch) if m.request_id == rid_on_victim]
    assert moved and list(moved[0].resumed_token_ids) == [5]


def _one_request_on_two_workers() -> tuple[Harness, str]:
    """A harness with workers w0 and w1 and request "a" dispatched; (the harness, a's worker)."""
    h = Harness()
    h.worker("w0", 0)
    h.worker("w1", 1)
    h.submit(CLIENT, "a")
    return h, h.core.requests.get("a").worker_id


def test_a_worker_that_says_it_is_full_gets_its_request_moved():
    h, first = _one_request_on_two_workers()
    out = h.step(first, delta("a", prompt=[1, 2, 3], finish="error", error="worker is full", code="overloaded"))
    again = _of(out, Dispatch)
    assert again and again[0][0].decode() != first and _final(out, "a") is None


def test_a_request_that_waited_past_the_workers_queue_time_fails_as_overloaded_without_moving():
    h, first = _one_request_on_two_workers()
    waited = msgspec.structs.replace(
        delta(
            "a",
            prompt=[1, 2, 3],
            finish="error",
            code="overloaded",
            error="the worker is overloaded: ... (--max-queue-time 60 s)",
        ),
        queue_time_s=60.2,
    )
    out = h.step(first, waited)
    final = _final(out, "a")
    assert not _of(out, Dispatch), "a whole cluster's overload is not moved from worker to worker"
    assert final.error_code == "overloaded" and "--max-queue-time" in final.error and final.queue_time_s == 60.2
    assert "a" not in h.core.requests.by_id and h.core.stats(h.now).requests_failed == 1


def test_a_request_past_its_timeout_fails_and_is_aborted_on_its_worker():
    h = Harness()
    h.worker("w0", 0)
    h.send(
        CLIENT,
        Submit(
            request_id="slow",
            spec=RequestSpec(prompt_token_ids=TokenIds([1, 2]), sampling=SamplingParams(max_tokens=50)),
            timeout_s=0.25,
        ),
    )
    h.send(
        CLIENT,
        Submit(
            request_id="fast",
            spec=RequestSpec(prompt_token_ids=TokenIds([1, 2]), sampling=SamplingParams(max_tokens=50)),
            timeout_s=30.0,
        ),
    )
    h.step("w0", delta("slow", 4, prompt=[1, 2]), delta("fast", 4, prompt=[1, 2]))
    assert h.core.next_deadline() <= 0.25
    out = h.advance(0.3)
    final = _final(out, "slow")
    assert final.finish_reason == "error" and final.error_code == "timeout" and "timeout" in final.error
    assert any(isinstance(m, Abort) and m.request_ids == ["slow"] for i, m in out if i == b"w0")
    assert h.core.requests.get("fast") is not None and h.core.stats(h.now).requests_timed_out == 1


def test_a_structured_dispatch_carries_a_tag_of_its_client_for_the_workers_compile_bounds():
    h = Harness()
    h.worker("w0", 0)
    spec = {"structured_outputs": {"regex": "[a-z]+"}}
    tags = {
        rid: m.client
        for rid, client, kw in [
            ("a1", CLIENT, spec),
            ("a2", CLIENT, spec),
            ("b1", b"client-2", spec),
            ("plain", CLIENT, {}),
        ]
        for _, m in _of(h.submit(client, rid, **kw), Dispatch)
    }
    assert tags["a1"] == tags["a2"] != tags["b1"] and len(tags["a1"]) == 16
    assert CLIENT.hex() not in tags["a1"] and tags["plain"] is None  # a hash, and only where it is needed
