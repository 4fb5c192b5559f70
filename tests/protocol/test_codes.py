"""The str enums on the wire (protocol/codes.py): validated on decode and on construction, the same bytes as the
plain strings old peers send, and equal to those strings in user code."""

from __future__ import annotations

import json

import msgpack
import pytest

from infer.protocol.codes import ClusterState, Command, ErrorCode, FinishReason, WorkerState
from infer.protocol.messages import (
    PROTOCOL_VERSION,
    ClusterStats,
    Control,
    ControlAck,
    Delta,
    Error,
    ProtocolError,
    TokenIds,
    Welcome,
    decode,
    encode,
)


def _frame(kind: str, body: dict) -> bytes:
    """A frame as a peer that knows nothing of the enums writes it: plain strings."""
    return msgpack.packb({"type": kind, "v": PROTOCOL_VERSION, "body": body}, use_bin_type=True)


def _final(**body) -> bytes:
    return _frame("delta", {"request_id": "r", "token_ids": [], "text": "", "finished": True, **body})


def test_an_unknown_finish_reason_on_the_wire_names_the_field_and_the_value():
    with pytest.raises(ProtocolError) as info:
        decode(_final(finish_reason="halted"))
    assert str(info.value) == "field 'finish_reason': Invalid enum value 'halted'"
    assert info.value.message_type == "delta"


@pytest.mark.parametrize(
    "frame, text",
    [
        (_final(finish_reason=3), "field 'finish_reason': Expected `str | null`, got `int`"),
        (_final(finish_reason="error", error_code="busy"), "field 'error_code': Invalid enum value 'busy'"),
        (_frame("error", {"message": "m", "code": "oops"}), "field 'code': Invalid enum value 'oops'"),
        (_frame("control", {"command": "halt"}), "field 'command': Invalid enum value 'halt'"),
        (
            _frame("control_ack", {"command": "pause", "state": "sleeping"}),
            "field 'state' must be one of running, paused, suspended, stopped, draining, got 'sleeping'",
        ),
        (
            _frame("welcome", {"coordinator_id": "c", "state": "draining"}),
            "field 'state': Invalid enum value 'draining'",
        ),
    ],
)
def test_every_enum_field_refuses_other_words(frame, text):
    with pytest.raises(ProtocolError, match=f"^{text}"):
        decode(frame)


def test_old_and_new_peers_write_the_same_frames():
    """A member encodes as its string: a frame made with members equals one made with plain strings."""
    with_members = Delta(
        request_id="r",
        token_ids=TokenIds([5]),
        text="x",
        finished=True,
        finish_reason=FinishReason.ERROR,
        error="e",
        error_code=ErrorCode.TIMEOUT,
    )
    with_strings = Delta(
        request_id="r",
        token_ids=TokenIds([5]),
        text="x",
        finished=True,
        finish_reason="error",
        error="e",
        error_code="timeout",
    )  # type: ignore[arg-type]
    assert encode(with_members) == encode(with_strings)
    plain = _frame(
        "delta",
        {
            "request_id": "r",
            "token_ids": [5],
            "text": "x",
            "finished": True,
            "finish_reason": "error",
            "error": "e",
            "error_code": "timeout",
        },
    )
    assert msgpack.unpackb(encode(with_members)) == msgpack.unpackb(plain)  # (msgspec writes map16 headers)
    assert msgpack.unpackb(encode(Control(command=Command.SUSPEND))) == msgpack.unpackb(
        _frame("control", {"command": "suspend"})
    )


def test_decoded_words_are_members_that_equal_their_strings():
    delta = decode(_final(finish_reason="length"))
    assert delta.finish_reason is FinishReason.LENGTH
    assert delta.finish_reason == "length" and f"{delta.finish_reason}" == "length"
    assert f"{delta.finish_reason!r}" == "'length'" and "finish_reason='length'" in repr(delta)
    assert {"length": 1}[delta.finish_reason] == 1
    assert json.dumps({"finish_reason": delta.finish_reason}) == '{"finish_reason": "length"}'
    ack = decode(_frame("control_ack", {"command": "stop", "state": "draining"}))
    assert ack.command is Command.STOP and ack.state is WorkerState.DRAINING
    ack = decode(_frame("control_ack", {"command": "pause", "state": "paused"}))
    assert ack.state is ClusterState.PAUSED and ack.state == WorkerState.PAUSED


def test_messages_built_with_strings_hold_members():
    assert Delta.final("r", "abort").finish_reason is FinishReason.ABORT
    assert Delta.final("r", "error", "why", "overloaded").error_code is ErrorCode.OVERLOADED
    assert Error(message="m", code="client_lost").code is ErrorCode.CLIENT_LOST  # type: ignore[arg-type]
    assert Welcome(coordinator_id="c", state="suspended").state is ClusterState.SUSPENDED  # type: ignore[arg-type]
    stats = ClusterStats(
        coordinator_id="c",
        state="running",
        policy="p",
        model_id=None,
        workers=[],  # type: ignore[arg-type]
        num_clients=0,
        num_in_flight=0,
        num_held=0,
        requests_submitted=0,
        requests_completed=0,
        requests_failed=0,
        requests_aborted=0,
        requests_redispatched=0,
        frames_rejected=0,
        uptime_s=0.0,
    )
    assert stats.state is ClusterState.RUNNING
    with pytest.raises(ProtocolError, match="field 'finish_reason' must be one of"):
        Delta.final("r", "done")
    with pytest.raises(ProtocolError, match="field 'state' must be one of"):
        ControlAck(command="pause", state="asleep")  # type: ignore[arg-type]
