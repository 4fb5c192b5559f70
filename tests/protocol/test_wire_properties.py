"""Generative tests of the codec (issue 43): whatever bytes arrive, `decode` returns a valid message or raises
ProtocolError, never anything else; a message it returns encodes and decodes back to itself. The frames are
tests/wire_frames.py's: every registered type, valid and mutated, spliced with raw hostile bytes, damaged,
random. (The hypothesis profile in tests/conftest.py sets how many: HYPOTHESIS_PROFILE=soak for many more.)"""

from __future__ import annotations

from hypothesis import example, given

from infer.protocol.messages import REGISTRY, Message, ProtocolError, decode, encode, peek_request_id
from tests.wire_frames import ISSUE_43_FRAMES, frames, valid_frames


@given(frames())
@example(ISSUE_43_FRAMES[0])
@example(ISSUE_43_FRAMES[1])
@example(ISSUE_43_FRAMES[2])
def test_decode_returns_a_valid_message_or_raises_protocol_error(frame):
    try:
        msg = decode(frame)
    except ProtocolError as e:
        assert e.message_type is None or e.message_type in REGISTRY
        assert len(str(e)) < 4096  # the answer's text is bounded too (the frame may be megabytes)
        peek = peek_request_id(frame)  # never raises
        assert peek is None or isinstance(peek, str)
        return
    assert isinstance(msg, Message) and REGISTRY[msg.TYPE] is type(msg)
    again = encode(msg)
    assert encode(decode(again)) == again  # (bytes: a NaN field is equal to itself here)


@given(valid_frames())
def test_valid_frames_round_trip_byte_for_byte(frame):
    assert encode(decode(frame)) == frame
