"""Hypothesis strategies of wire frames, valid and hostile, for the codec and for live intakes (issue 43).

Every frame starts from a valid message of some registered type (tests/protocol/test_messages.py's EXAMPLES has
one or more of each), then is changed the way a buggy or hostile peer would: a field replaced by any msgpack
value or removed, an unknown field added, the header's type swapped for another type's, any schema version,
a value nested past every bound or a container header that lies about its length spliced in as raw bytes, the
frame truncated or a byte flipped; or it is random bytes. `frames()` draws from all of them.
"""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import strategies as st

from infer.protocol.messages import PROTOCOL_VERSION, REGISTRY, Message, encode
from tests.protocol.test_messages import EXAMPLES

TYPES = sorted(REGISTRY)
PLAIN = [msgpack.unpackb(encode(m), strict_map_key=False) for m in EXAMPLES]  # each frame as a dict
_SPLICE = b"\x00splice-raw-here\x00"  # a bin value in the tree, replaced by raw bytes after packing

INTS = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, -1, 2**31, 2**31 - 1, 2**63 - 1, 2**64 - 1]))
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(),  # NaN and infinities included
    st.text(max_size=12),
    st.binary(max_size=12),
    st.sampled_from(TYPES),  # words the protocol uses
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), INTS), inner, max_size=4)
    ),
    max_leaves=12,
)


_SUBMIT = b"\x83\xa4type\xa6submit\xa1v"


def issue_43_frames(depth: int = 10_000) -> list[bytes]:
    """The frames of the report: a Submit nested `depth` deep in v, in body, in body.spec.sampling.logit_bias; at 1,000
    each made `decode` raise RecursionError. Every generative test runs them first (hypothesis `@example`), 10,000
    deep: hypothesis raises Python's recursion limit by 2,000 while a test runs, which 1,000 levels would pass."""
    deep = b"\x91" * depth
    return [
        _SUBMIT + deep + b"\x04" + b"\xa4body\x80",
        _SUBMIT + b"\x04\xa4body" + deep + b"\x80",
        _SUBMIT
        + b"\x04\xa4body\x82\xaarequest_id\xa1r\xa4spec\x82\xa6prompt\xa1x\xa8sampling\x81\xaalogit_bias"
        + deep
        + b"\x04",
    ]


ISSUE_43_FRAMES = issue_43_frames()


def _nested(depth: int, opener: bytes, leaf: bytes) -> bytes:
    return opener * depth + leaf


RAW_VALUES = st.one_of(
    st.builds(
        _nested,
        # past MAX_DEPTH; past Python's recursion limit, which hypothesis raises by a few thousand while it runs
        st.sampled_from([10_000, 100_000, 33, 100]),
        st.sampled_from([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01"]),
        st.sampled_from([b"\x04", b"\x90", b"\xa1x"]),
    ),
    st.sampled_from(
        [
            b"\xdd\xff\xff\xff\xff",  # an array claiming 4G items
            b"\xdf\x00\x80\x00\x00\x01",  # a map claiming 8M entries
            b"\xdb\x7f\xff\xff\xff",  # a string claiming 2 GiB
            b"\xc6\xff\xff\xff\xff",  # a bin claiming 4 GiB
            b"\xc1",  # the byte msgpack never uses
            b"\xd9\x03\xff\xfe\xfd",  # a string that is not UTF-8
            b"\xc7\x01\x05\x00",  # an extension value
        ]
    ),
    st.builds(lambda n: b"\xdd" + n.to_bytes(4, "big") + b"\x07" * 64, st.integers(1 << 21, 1 << 24)),  # long, cut
)


def _containers(tree: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every map and list in `tree` (the root included)."""
    found = [path] if isinstance(tree, (dict, list)) else []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        found += _containers(value, (*path, key))
    return found


def _at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


@st.composite
def _mutated_tree(draw: st.DrawFn) -> Any:
    """A valid frame's dict with 1-3 changes: a value replaced, a key removed or added, header and version."""
    tree = msgpack.unpackb(msgpack.packb(draw(st.sampled_from(PLAIN)), use_bin_type=True), strict_map_key=False)
    for _ in range(draw(st.integers(1, 3))):
        change = draw(st.sampled_from(["replace", "remove", "add", "type", "version"]))
        if change == "type":
            tree["type"] = draw(st.one_of(st.sampled_from(TYPES), VALUES))
            continue
        if change == "version":
            tree["v"] = draw(st.one_of(st.integers(-2, PROTOCOL_VERSION + 2), VALUES))
            continue
        target = _at(tree, draw(st.sampled_from(_containers(tree))))
        keys = list(target) if isinstance(target, dict) else list(range(len(target)))
        if change == "add" or not keys:
            if isinstance(target, dict):
                target[draw(st.one_of(st.text(max_size=10), INTS))] = draw(VALUES)
            else:
                target.append(draw(VALUES))
        elif change == "remove":
            del target[draw(st.sampled_from(keys))]
        else:
            target[draw(st.sampled_from(keys))] = draw(VALUES)
    return tree


@st.composite
def _spliced(draw: st.DrawFn) -> bytes:
    """A mutated frame with raw bytes (nesting past the bounds, a lying length, invalid msgpack) at one spot."""
    tree = draw(_mutated_tree())
    target = _at(tree, draw(st.sampled_from(_containers(tree))))
    if isinstance(target, dict):
        target[draw(st.sampled_from([*target, "extra"]))] = _SPLICE
    else:
        target.append(_SPLICE)
    packed = msgpack.packb(tree, use_bin_type=True)
    return packed.replace(msgpack.packb(_SPLICE, use_bin_type=True), draw(RAW_VALUES), 1)


@st.composite
def _damaged(draw: st.DrawFn) -> bytes:
    """A valid frame truncated, or with one byte changed."""
    frame = bytearray(encode(draw(st.sampled_from(EXAMPLES))))
    if draw(st.booleans()):
        return bytes(frame[: draw(st.integers(0, len(frame) - 1))])
    frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
    return bytes(frame)


def _packed(tree: Any) -> bytes:
    return msgpack.packb(tree, use_bin_type=True)


def valid_frames() -> st.SearchStrategy[bytes]:
    return st.sampled_from(EXAMPLES).map(encode)


def frames() -> st.SearchStrategy[bytes]:
    """Any frame a peer could send: valid ones, mutated, spliced with raw hostile bytes, damaged, random."""
    return st.one_of(  # (hypothesis leans to the first of a choice: the frames past the bounds found bugs)
        _spliced(),
        valid_frames(),
        _mutated_tree().map(_packed),
        _damaged(),
        st.binary(max_size=64),
    )


def examples_of(kind: type[Message]) -> list[Message]:
    return [m for m in EXAMPLES if isinstance(m, kind)]
