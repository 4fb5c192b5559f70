"""The wire of routing by what the workers hold: KvEvents on StepBatch, KvResync, Welcome.kv_events and
Submit.session_id are optional fields with defaults, so frames of peers that predate them decode unchanged, and
frames that do not use them are the bytes they were; their bounds are checked where the frame enters."""

from __future__ import annotations

import msgpack
import pytest

from infer.protocol.messages import (
    MAX_KV_EVENTS,
    MAX_SESSION_ID_LEN,
    PROTOCOL_VERSION,
    KvEvents,
    Load,
    ProtocolError,
    RequestSpec,
    StepBatch,
    Submit,
    TokenIds,
    Welcome,
    decode,
    encode,
)

LOAD = {"num_waiting": 0, "num_running": 1, "num_free_blocks": 3, "num_total_blocks": 4, "num_queued_tokens": 2}


def _frame(kind, body):
    return msgpack.packb({"type": kind, "v": PROTOCOL_VERSION, "body": body}, use_bin_type=True)


def test_frames_of_older_peers_decode_with_the_defaults():
    batch = decode(_frame("step_batch", {"deltas": [], "load": LOAD}))
    assert isinstance(batch, StepBatch) and batch.kv_events is None
    welcome = decode(_frame("welcome", {"coordinator_id": "c", "state": "running"}))
    assert isinstance(welcome, Welcome) and welcome.kv_events is False
    submit = decode(_frame("submit", {"request_id": "r", "spec": {"prompt": "hi"}}))
    assert isinstance(submit, Submit) and submit.session_id is None


def test_frames_that_use_nothing_new_are_the_bytes_an_older_peer_sends():
    batch = StepBatch(deltas=[], load=Load(**LOAD))
    assert msgpack.unpackb(encode(batch))["body"] == {"deltas": [], "load": LOAD}
    welcome = Welcome(coordinator_id="c", state="running")
    assert "kv_events" not in msgpack.unpackb(encode(welcome))["body"]


def test_block_hashes_are_unsigned_64_bit():
    events = KvEvents(epoch=1, seq=2, stored=[2**64 - 1], removed=[0])
    assert decode(encode(StepBatch(deltas=[], load=Load(**LOAD), kv_events=events))).kv_events == events
    bad = {"deltas": [], "load": LOAD, "kv_events": {"epoch": 1, "seq": 0, "stored": [-1]}}
    with pytest.raises(ProtocolError, match=r"kv_events.stored\[0\]"):
        decode(_frame("step_batch", bad))


def test_a_frame_past_the_events_bound_is_refused_naming_it():
    huge = {"deltas": [], "load": LOAD, "kv_events": {"epoch": 1, "seq": 0, "stored": list(range(MAX_KV_EVENTS + 1))}}
    with pytest.raises(ProtocolError, match=r"kv_events.stored"):
        decode(_frame("step_batch", huge))


def test_a_reset_starts_its_epoch():
    with pytest.raises(ProtocolError, match="a reset starts its epoch"):
        decode(_frame("step_batch", {"deltas": [], "load": LOAD, "kv_events": {"epoch": 1, "seq": 4, "reset": True}}))


@pytest.mark.parametrize("session", ["", "s" * (MAX_SESSION_ID_LEN + 1)])
def test_a_session_id_is_bounded_built_or_decoded(session):
    with pytest.raises(ProtocolError, match="session_id"):
        Submit(request_id="r", spec=RequestSpec(prompt_token_ids=TokenIds([1])), session_id=session)
    with pytest.raises(ProtocolError, match="session_id"):
        decode(_frame("submit", {"request_id": "r", "spec": {"prompt": "hi"}, "session_id": session}))
