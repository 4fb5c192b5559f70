"""The codec's bounds (protocol/bounds.py): the shape pre-scan, the schema's own bounds, and the frames of
issue 43 that used to raise RecursionError out of `decode`."""

from __future__ import annotations

import time

import msgpack
import msgspec
import msgspec.inspect as mi
import pytest

from infer.protocol.bounds import MAX_DEPTH, MAX_ITEMS, ShapeError, check_shape
from infer.protocol.messages import (
    PROTOCOL_VERSION,
    REGISTRY,
    ProtocolError,
    RequestSpec,
    Submit,
    TokenIds,
    decode,
    encode,
)


def _nested(depth: int, leaf: bytes = b"\x04") -> bytes:
    return b"\x91" * depth + leaf


def _submit_frame(v: bytes = b"\x04", body: bytes = b"\x82\xaarequest_id\xa1r\xa6prompt\xa1x") -> bytes:
    return b"\x83\xa4type\xa6submit\xa1v" + v + b"\xa4body" + body


def test_the_issue_43_frames_are_refused_naming_the_depth_bound():
    # the frame of the report: `v` nested 1,000 deep (RecursionError before)
    issue = b"\x83\xa4type\xa6submit\xa1v" + b"\x91" * 1000 + b"\x04" + b"\xa4body\x80"
    deep_body = _submit_frame(body=_nested(1000))
    deep_bias = _submit_frame(
        body=b"\x83\xaarequest_id\xa1r\xa6prompt\xa1x\xa8sampling\x81\xaalogit_bias" + _nested(5000)
    )
    for frame in (issue, deep_body, deep_bias):
        with pytest.raises(ProtocolError, match=f"nesting deeper than {MAX_DEPTH} levels") as info:
            decode(frame)
        assert info.value.message_type is None


def test_depth_is_counted_from_the_frame_map():
    check_shape(_nested(MAX_DEPTH))
    check_shape(_nested(MAX_DEPTH - 1, b"\x90"))  # an empty container is a level too
    with pytest.raises(ShapeError, match="nesting deeper than 32 levels"):
        check_shape(_nested(MAX_DEPTH + 1))
    with pytest.raises(ShapeError, match="nesting deeper than 32 levels"):
        check_shape(_nested(MAX_DEPTH, b"\x80"))
    # maps (values and keys) and the 16 / 32-bit headers count the same
    as_map = b"\x81\xa1k" * MAX_DEPTH + b"\x04"
    check_shape(as_map)
    with pytest.raises(ShapeError):
        check_shape(b"\x81\xa1k" + as_map)
    with pytest.raises(ShapeError):
        check_shape(b"\xdc\x00\x01" * (MAX_DEPTH + 1) + b"\x04")
    with pytest.raises(ShapeError):
        check_shape(b"\xdf\x00\x00\x00\x01" * (MAX_DEPTH + 1) + b"\x04")


def test_long_containers_are_refused_at_their_header():
    with pytest.raises(ShapeError, match=f"an array of {MAX_ITEMS + 1} items exceeds the limit of {MAX_ITEMS}"):
        check_shape(b"\xdd" + (MAX_ITEMS + 1).to_bytes(4, "big"))  # the items need not even be there
    with pytest.raises(ShapeError, match="a map of 4294967295 entries exceeds"):
        check_shape(b"\x91\xdf\xff\xff\xff\xff")
    check_shape(b"\xdd" + MAX_ITEMS.to_bytes(4, "big"))  # at the limit: the decoder then finds it truncated


def test_scalars_strings_and_malformed_input_pass_the_scan_to_the_decoder():
    value = {"s": "x" * 300, "b": b"\x91" * 70000, "f": 1.5, "i": -(2**40), "n": None, "t": True, "l": [1] * 20}
    check_shape(msgpack.packb(value, use_bin_type=True))  # payload bytes that look like headers are skipped
    for frame in (b"", b"\xc1", b"\x92\x01", b"\xdc\x00", b"\xd9"):
        check_shape(frame)
        with pytest.raises(ProtocolError, match="not valid msgpack|must be a map"):
            decode(frame)


def test_a_frame_of_8m_token_ids_is_refused_at_once():
    ids = b"\xdd" + (8_000_000).to_bytes(4, "big") + b"\x07" * 8_000_000  # token id 7, 8M times
    body = b"\x82\xaarequest_id\xa1r\xb0prompt_token_ids" + ids
    for frame in (_submit_frame(body=body), b"\x83\xa4body" + body + b"\xa4type\xa6submit\xa1v\x04"):
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=f"an array of 8000000 items exceeds the limit of {MAX_ITEMS}"):
            decode(frame)
        # (not a timing assertion: the refusal reads one header; printed for the record)
        print(f"refused in {time.monotonic() - started:.4f} s")


def test_frames_as_encode_writes_them_and_any_other_key_order_decode_alike():
    submit = Submit(request_id="r", spec=RequestSpec(prompt_token_ids=TokenIds([1, 2, 3])))
    frame = encode(submit)
    assert frame.startswith(b"\x83\xa4type\xa6submit\xa1v" + bytes([PROTOCOL_VERSION]) + b"\xa4body")
    reordered = msgpack.packb(
        {"body": msgpack.unpackb(frame)["body"], "v": PROTOCOL_VERSION, "type": "submit"}, use_bin_type=True
    )
    assert decode(frame) == decode(reordered) == decode(bytearray(frame)) == decode(memoryview(frame)) == submit


def _walk(t: mi.Type, path: str, depth: int, problems: list[str]) -> int:
    """The deepest container level under `t` (a level per array / map / struct), recording unbounded parts."""
    if isinstance(t, mi.StructType):
        if not t.forbid_unknown_fields:  # an unknown field's value would be skipped: recursively, unbounded
            problems.append(f"{path}: {t.cls.__name__} ignores unknown fields")
        return max([depth] + [_walk(f.type, f"{path}.{f.name}", depth + 1, problems) for f in t.fields])
    if isinstance(t, mi.UnionType):
        return max(_walk(x, path, depth, problems) for x in t.types)
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType, mi.DictType)):
        if t.max_length is None or t.max_length > MAX_ITEMS:
            problems.append(f"{path}: {type(t).__name__} without max_length <= MAX_ITEMS")
        item = t.value_type if isinstance(t, mi.DictType) else t.item_type
        return _walk(item, f"{path}[]", depth + 1, problems)
    if isinstance(t, mi.TupleType):
        return max([depth] + [_walk(x, f"{path}[]", depth + 1, problems) for x in t.item_types])
    if isinstance(t, (mi.AnyType, mi.RawType)):
        problems.append(f"{path}: {type(t).__name__} (decoded without a schema)")
    return depth


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_every_message_schema_bounds_its_containers_and_depth(kind):
    """What makes the fast path of `decode` safe: msgspec checks a bounded container's length at its header,
    refuses an unknown field before reading its value, and goes no deeper than the schema."""
    problems: list[str] = []
    depth = _walk(mi.type_info(REGISTRY[kind]), kind, 2, problems)  # level 1: the frame's own map
    assert problems == []
    assert depth <= MAX_DEPTH // 2, depth


def test_msgspec_refuses_an_unknown_field_before_reading_its_value():
    body = b"\x82\xa5extra" + _nested(100_000) + b"\xaarequest_id\xa1r"
    with pytest.raises(msgspec.ValidationError, match="unknown field `extra`"):
        msgspec.msgpack.decode(body, type=REGISTRY["accepted"])
