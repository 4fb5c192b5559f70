"""Priorities in the coordinator's logic (lower first), driven frame by frame (and, at the end, prompt logprobs
relayed with the first delta): a request's priority travels
to its worker (and with a re-dispatch); held requests are dispatched best first; under admission pressure
the lowest priority is refused (or shed from the held queue) first."""

from __future__ import annotations

import msgspec
import pytest
from core_harness import Harness, delta

from infer.protocol.messages import (
    DeltaBatch,
    Dispatch,
    Error,
    ProtocolError,
    RequestSpec,
    Submit,
    TokenIds,
    decode,
    encode,
)
from infer.protocol.sampling import SamplingParams

CLIENT = b"client-1"


def submit(h: Harness, rid: str, priority: int):
    return h.send(
        CLIENT,
        Submit(
            request_id=rid,
            spec=RequestSpec(
                prompt_token_ids=TokenIds([1, 2, 3]),
                sampling=SamplingParams(temperature=0.0, max_tokens=10),
                priority=priority,
            ),
        ),
    )


def _of(out, kind):
    return [msg for _, msg in out if isinstance(msg, kind)]


def test_the_priority_reaches_the_worker_and_survives_a_redispatch():
    h = Harness()
    h.worker("w0", 0)
    first = _of(submit(h, "a", -7), Dispatch)
    assert first[0].spec.priority == -7
    h.step("w0", delta("a", 5, prompt=[1, 2, 3]))
    out = h.worker("w1", 1)
    h.now += 5
    out = h.advance(0.1)  # w0 silent past worker_timeout: "a" moves to w1
    moved = _of(out, Dispatch)
    assert [(d.request_id, d.spec.priority, list(d.resumed_token_ids)) for d in moved] == [("a", -7, [5])]


def test_a_priority_outside_64_bits_is_a_protocol_error_naming_the_field():
    frame = encode(Submit(request_id="a", spec=RequestSpec(prompt_token_ids=TokenIds([1]), priority=0)))
    with pytest.raises(ProtocolError, match="priority"):
        Submit(request_id="a", spec=RequestSpec(prompt_token_ids=TokenIds([1]), priority=2**63))
    assert decode(frame).spec.priority == 0


def test_held_requests_are_dispatched_best_priority_first():
    h = Harness()
    for rid, priority in (("a", 5), ("b", 0), ("c", 5), ("d", -1)):
        assert not submit(h, rid, priority)  # no worker yet: held
    out = h.worker("w0", 0)
    assert [d.request_id for d in _of(out, Dispatch)] == ["d", "b", "a", "c"]


def test_with_every_worker_full_a_better_priority_waits_for_the_next_seat_and_a_worse_one_is_refused():
    h = Harness(max_requests_per_worker=2)
    h.worker("w0", 0)
    assert len(_of(submit(h, "a", 3), Dispatch)) == 1
    assert len(_of(submit(h, "b", 3), Dispatch)) == 1
    refused = _of(submit(h, "low", 3), Error)  # no better than anything in flight: refused at once
    assert refused[0].code == "overloaded" and refused[0].request_id == "low"
    assert not submit(h, "high", 0)  # better than what runs: held, first in line
    assert not _of(submit(h, "low2", 9), Dispatch)
    out = h.step("w0", delta("a", 7, prompt=[1, 2, 3], finish="length"))
    assert [d.request_id for d in _of(out, Dispatch)] == ["high"]


def test_a_full_held_queue_sheds_its_worst_priority_for_a_better_newcomer():
    h = Harness(max_held_requests=2)
    assert not submit(h, "mid", 1) and not submit(h, "worst", 4)
    out = submit(h, "best", 0)
    shed = [d for m in _of(out, DeltaBatch) for d in m.deltas if d.finished]
    assert [(d.request_id, d.error_code) for d in shed] == [("worst", "overloaded")]
    assert "better priority" in shed[0].error
    refused = _of(submit(h, "also-bad", 4), Error)  # not better than any held: refused itself
    assert refused[0].code == "overloaded" and refused[0].request_id == "also-bad"
    out = h.worker("w0", 0)
    assert [d.request_id for d in _of(out, Dispatch)] == ["best", "mid"]


def test_the_held_queue_knows_its_worst_priority_through_holds_sheds_and_dispatches():
    """A full queue refuses a newcomer that could shed nobody from its count of priorities, without a scan: that
    count follows every hold, shed and dispatch."""
    h = Harness(max_held_requests=3)
    held = h.core.books.requests
    assert held.worst_held_priority() is None
    for rid, priority in [("a", 2), ("b", 5), ("c", 5)]:
        assert not submit(h, rid, priority)
    assert held.worst_held_priority() == 5
    submit(h, "d", 1)  # sheds c, the newest of the worst
    submit(h, "e", 1)  # sheds b
    assert held.worst_held_priority() == 2 and sorted(held.held) == ["a", "d", "e"]
    refused = _of(submit(h, "f", 2), Error)  # no better than the worst held: refused itself
    assert refused[0].code == "overloaded" and held.worst_held_priority() == 2
    out = h.worker("w0", 0)
    assert sorted(d.request_id for d in _of(out, Dispatch)) == ["a", "d", "e"]
    assert held.worst_held_priority() is None and not held.held


def test_prompt_logprobs_of_the_first_delta_reach_the_client():
    h = Harness()
    h.worker("w0", 0)
    submit(h, "a", 0)
    first = delta("a", 5, prompt=[1, 2, 3])
    first = msgspec.structs.replace(first, prompt_logprobs=[{2: -0.5}, {3: -1.5, 9: -0.1}])
    out = h.step("w0", first)
    [got] = [d for m in _of(out, DeltaBatch) for d in m.deltas]
    assert got.prompt_logprobs == [{2: -0.5}, {3: -1.5, 9: -0.1}] and got.prompt_token_ids == [1, 2, 3]
