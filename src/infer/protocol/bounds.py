"""The codec's bounds on a frame's shape, and the pre-scan that checks them before anything is built.

A msgpack frame's header bytes say each container's length, so the shape of a frame (nesting depth, the
length of every array and map) can be read without decoding a value. `check_shape` walks those headers and
raises ShapeError naming the first bound a frame breaks; it reports nothing else (malformed or truncated
msgpack is left to the decoder, whose messages say what is wrong). Nothing deeper than MAX_DEPTH reaches
msgspec, whose skipping of a value (`msgspec.Raw`, `Any`) recurses once per level: a frame nested 1,000
deep would otherwise raise RecursionError out of `decode`.

The message types are bounded the same way where msgspec decodes them (protocol/messages.py's fast path):
every array and map in a message is one of the aliases below, whose length msgspec checks at the container's
header, before it decodes an item, and the schema is far shallower than MAX_DEPTH
(tests/protocol/test_wire_bounds.py checks both for every registered message).
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec

MAX_DEPTH = 32  # containers inside containers, the frame's own map counted (the schema needs 7)
MAX_ITEMS = 1 << 21  # items of one array, entries of one map (token ids of one prompt: 2,097,152)

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")
Items = Annotated[list[T], msgspec.Meta(max_length=MAX_ITEMS)]  # a bounded msgpack array, as a list
Many = Annotated[tuple[T, ...], msgspec.Meta(max_length=MAX_ITEMS)]  # a bounded msgpack array, as a tuple
Mapping = Annotated[dict[K, V], msgspec.Meta(max_length=MAX_ITEMS)]  # a bounded msgpack map


class ShapeError(ValueError):
    """A frame nested too deep or with a container too long; the text names the bound."""


def _fixed_sizes() -> list[int]:
    """Bytes taken by a value starting with each header byte when that is known from the byte alone
    (fixints, nil, bools, floats, ints, fixext); 0 for containers, strings, bins, exts and 0xc1 (never used)."""
    sizes = [0] * 256
    for b in [*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3]:
        sizes[b] = 1
    for b, size in {0xCC: 2, 0xD0: 2, 0xCD: 3, 0xD1: 3, 0xCA: 5, 0xCE: 5, 0xD2: 5, 0xCB: 9, 0xCF: 9, 0xD3: 9}.items():
        sizes[b] = size
    for b, size in {0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}.items():  # fixext 1 .. 16
        sizes[b] = size
    return sizes


_FIXED = _fixed_sizes()
# byte -> (bytes of its length field, bytes before the payload) for str / bin / ext with a length field
_SIZED = {0xD9: (1, 2), 0xDA: (2, 3), 0xDB: (4, 5), 0xC4: (1, 2), 0xC5: (2, 3), 0xC6: (4, 5)}
_SIZED.update({0xC7: (1, 3), 0xC8: (2, 4), 0xC9: (4, 6)})  # ext: a type byte after the length
# byte -> (bytes of its length field, items per entry, what it is)
_CONTAINERS = {0xDC: (2, 1, "an array"), 0xDD: (4, 1, "an array"), 0xDE: (2, 2, "a map"), 0xDF: (4, 2, "a map")}


def check_shape(frame: bytes | bytearray | memoryview, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS) -> None:
    """ShapeError if the msgpack value in `frame` nests containers deeper than `max_depth` or has an array or
    map of more than `max_items` items (entries); returns quietly otherwise, malformed msgpack included.
    Costs one pass over the headers in Python, 0.1-0.2 us per value (strings and bins are skipped whole): several
    times a decode of the same frame, which is why `decode` runs it only off its fast path."""
    data = frame if isinstance(frame, bytes) else bytes(frame)
    stack: list[int] = []  # what was left to read of each enclosing container
    end, pos, left = len(data), 0, 1  # left: values still to read in the innermost container
    fixed = _FIXED
    while True:
        while left == 0:
            if not stack:
                return
            left = stack.pop()
        if pos >= end:
            return  # truncated: the decoder says so
        b = data[pos]
        left -= 1
        size = fixed[b]
        if size:
            pos += size
        elif 0xA0 <= b <= 0xBF:  # fixstr
            pos += 1 + (b & 0x1F)
        elif 0x80 <= b <= 0x9F:  # fixmap, fixarray: at most 15 items
            if len(stack) >= max_depth:
                raise ShapeError(f"nesting deeper than {max_depth} levels")
            pos += 1
            stack.append(left)
            left = (b & 0x0F) * (2 if b < 0x90 else 1)
        elif b in _SIZED:
            width, skip = _SIZED[b]
            pos += skip + int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
        elif b in _CONTAINERS:
            width, per_item, what = _CONTAINERS[b]
            n = int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
            if n > max_items:
                unit = "items" if per_item == 1 else "entries"
                raise ShapeError(f"{what} of {n} {unit} exceeds the limit of {max_items}")
            if len(stack) >= max_depth:
                raise ShapeError(f"nesting deeper than {max_depth} levels")
            pos += 1 + width
            stack.append(left)
            left = n * per_item
        else:
            return  # 0xc1: not msgpack; the decoder says so
