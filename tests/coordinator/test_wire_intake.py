"""Generative tests of the coordinator core's intake (issue 43; the live process: tests/cluster/test_wire_attacks.py):
any frame (tests/wire_frames.py) from a client, a stranger or a worker costs at most that frame: `handle` never
raises, and a bystander's request, dispatched before, relays exactly its worker's deltas to its client."""

from __future__ import annotations

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from infer.protocol.messages import CommitWeights, Control, Error, Hello, LoraCommand, UpdateWeights, decode, encode
from tests.core_harness import Harness, client_deltas, delta, dispatches
from tests.wire_frames import ISSUE_43_FRAMES, frames

PEERS = [b"hostile-client", b"stranger", b"w0"]  # w0: the registered worker's own identity


def _instruction(frame: bytes) -> bool:
    """Valid frames that legitimately change the cluster (without keys every peer may): lifecycle commands, weight
    updates (which may abort running requests), adapter commands, and a Hello (a registration: a worker taking over
    w0's identity, a client re-attaching)."""
    try:
        return isinstance(decode(frame), (Control, UpdateWeights, CommitWeights, LoraCommand, Hello))
    except Exception:  # noqa: BLE001 - a frame decode refuses (by its contract a ProtocolError, but the filter
        # must not be where a codec bug shows up: the intake under test is)
        return False


@given(st.lists(st.tuples(st.sampled_from(PEERS), frames()), min_size=1, max_size=3))
@example([(peer, frame) for peer, frame in zip(PEERS, ISSUE_43_FRAMES)])
def test_no_frame_costs_more_than_itself_and_a_bystander_is_relayed_exactly(sent):
    assume(not any(_instruction(frame) for _, frame in sent))
    h = Harness()
    h.worker("w0", 0)
    h.send(b"hostile-client", Hello(role="client", peer_id="hostile"))
    h.send(b"by", Hello(role="client", peer_id="by"))
    out = h.submit(b"by", "by-1", [1, 2, 3], max_tokens=4)
    assert [d.request_id for d in dispatches(out)[b"w0"]] == ["by-1"]
    relayed = []
    for n, (peer, frame) in enumerate(sent):
        h.raw(peer, [frame])  # raises if anything escaped handle
        relayed += client_deltas(h.step("w0", delta("by-1", n)), b"by")
    relayed += client_deltas(h.step("w0", delta("by-1", 99, finish="length")), b"by")
    assert [t for d in relayed for t in d.token_ids] == [*range(len(sent)), 99]
    assert relayed[-1].finish_reason == "length"


def test_a_decoding_bug_costs_one_frame(monkeypatch):
    """decode raises only ProtocolError; if a bug made it raise anything else, the frame is answered and lost."""
    h = Harness()

    def broken(frame: bytes):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr("infer.coordinator.core.decode", broken)
    ((to, error),) = h.raw(b"c", [encode(Hello(role="client", peer_id="c"))])
    assert (
        to == b"c" and isinstance(error, Error) and error.message == "bad frame: it could not be read (RecursionError)"
    )
    monkeypatch.undo()
    assert [type(m).__name__ for _, m in h.send(b"c", Hello(role="client", peer_id="c"))] == ["Welcome"]


@pytest.mark.parametrize("where", ["v", "body"])
def test_a_nested_frame_is_refused_naming_the_bound(where):
    deep = b"\x91" * 1000 + b"\x04"
    head = b"\x83\xa4type\xa6submit\xa1v"
    frame = head + deep + b"\xa4body\x80" if where == "v" else head + b"\x04\xa4body" + deep
    ((_, error),) = Harness().raw(b"c", [frame])
    assert isinstance(error, Error) and error.message == "bad frame: frame refused: nesting deeper than 32 levels"
