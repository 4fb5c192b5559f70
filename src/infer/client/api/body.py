"""A request body from bytes to a JSON object that is safe to validate, or a 400 that names the field.

`json.loads` takes whatever JSON allows, and some of that breaks what comes after it: nesting thousands
deep (pydantic, the error message, the chat template recurse), a lone UTF-16 surrogate ("\\ud800" is valid
JSON but no valid text: the tokenizer, msgpack and the JSON answer that would echo it all fail), integers
past 64 bits (msgpack cannot carry them) or past Python's 4300-digit conversion limit, and NaN / Infinity
(not JSON at all). `decode_body` refuses each of them, naming the field where there is one:
- nesting deeper than MAX_JSON_DEPTH (the parser's own recursion guard catches the very deep ones);
- a surrogate code point in any string or key (a valid pair is one character after parsing, so any
  surrogate left is unpaired);
- an integer outside the signed 64-bit range;
- NaN, Infinity and -Infinity (not JSON; Python's parser takes them), and number literals too large for a
  float (1e400: Python reads them as infinity).
The walk is iterative and linear in the body, which the front already bounds (--max-body-bytes).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from infer.client.api.schemas import ApiError

MAX_JSON_DEPTH = 32
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MAX_INT_DIGITS = 19  # a JSON integer with more digits than this is past 64 bits
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
Path = tuple[str | int, ...]
_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


class _Constant:
    """NaN, Infinity or -Infinity where a value was, kept only to name its field."""

    def __init__(self, name: str) -> None:
        self.name = name


class _HugeFloat:
    """A number literal past the float range (1e400), kept only to name its field."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


def _finite_float(literal: str) -> float | _HugeFloat:
    value = float(literal)
    return _HugeFloat(literal) if math.isinf(value) else value


class _HugeInt:
    """An integer literal too long to convert (past Python's digit limit), kept only to name its field."""

    def __init__(self, digits: str) -> None:
        self.num_digits = len(digits.lstrip("-"))


def decode_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object whose every string is valid Unicode, every integer fits 64 bits and whose
    nesting is at most MAX_JSON_DEPTH; ApiError 400 otherwise (naming the field when there is one)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid_json(f"it is not UTF-8 ({e.reason} at byte {e.start})") from None
    data = _loads(text)
    if not isinstance(data, dict):
        kind = _JSON_TYPES.get(type(data), "NaN or Infinity")
        raise ApiError(400, f"request body must be a JSON object, got {kind}")
    check_json_value(data)
    return data


def _loads(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_Constant, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep(_deep_field(text)) from None
    except json.JSONDecodeError as e:
        raise _invalid_json(str(e)) from None
    except ValueError:  # an integer past Python's digit limit: parse again, keeping it aside to name its field
        pass
    try:
        return json.loads(text, parse_constant=_Constant, parse_int=_bounded_int, parse_float=_finite_float)
    except (RecursionError, ValueError) as e:
        raise _invalid_json(str(e)) from None


def _bounded_int(digits: str) -> int | _HugeInt:
    return _HugeInt(digits) if len(digits) > _MAX_INT_DIGITS + 1 else int(digits)


def check_json_value(data: Any) -> None:
    """ApiError 400 at the first nesting past MAX_JSON_DEPTH, unpaired surrogate or out-of-range integer."""
    stack: list[tuple[Any, Path]] = [(data, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise _too_deep(path)
        if isinstance(node, list) and _numbers_in_range(node):
            continue  # the common long list (token ids), checked at C speed
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str):
                _check_string(key, path)
            if isinstance(value, (dict, list)):
                stack.append((value, (*path, key)))
            else:
                _check_scalar(value, (*path, key))


def _numbers_in_range(items: list[Any]) -> bool:
    """True when `items` are all numbers within the 64-bit integer range (anything else: False)."""
    try:
        return INT64_MIN <= min(items) and max(items) <= INT64_MAX
    except (TypeError, ValueError):  # not all numbers (or empty)
        return False


def _deep_field(text: str) -> Path:
    """The top-level field of a body nested too deep for the parser, found by counting brackets outside
    strings up to MAX_JSON_DEPTH (only for bodies the parser gave up on)."""
    depth, key = 0, None
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token[0] == '"':
            if depth == 1:
                key = token
        elif token in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                break
        else:
            depth -= 1
    try:
        return (json.loads(key),) if key is not None and depth > MAX_JSON_DEPTH else ()
    except ValueError:
        return ()


def _check_scalar(value: Any, path: Path) -> None:
    if isinstance(value, str):
        _check_string(value, path)
    elif isinstance(value, _Constant):
        param = field_name(path)
        raise ApiError(400, f"{param}: {value.name} is not a JSON value", param=param, code="invalid_json")
    elif isinstance(value, _HugeInt):
        raise _out_of_range(path, f"an integer of {value.num_digits} digits")
    elif isinstance(value, _HugeFloat):
        param = field_name(path)
        raise ApiError(400, f"{param}: {value.literal[:40]} is past the range of a float", param=param)
    elif isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
        raise _out_of_range(path, str(value))


def _check_string(value: str, path: Path) -> None:
    match = _SURROGATE.search(value)
    if match is not None:
        param = field_name(path)
        raise ApiError(
            400,
            f"{param or 'the request body'}: contains an unpaired UTF-16 surrogate "
            f"(U+{ord(match.group()):04X}) at character {match.start()}; strings must be "
            f"valid Unicode",
            param=param,
        )


def field_name(path: Path) -> str | None:
    """The dotted name of a field (`messages.0.content`), as the front's other 400s name fields."""
    name = ".".join(str(part) for part in path)[:200]
    return name.encode("utf-8", "backslashreplace").decode("utf-8") or None  # a key may hold a surrogate


def _out_of_range(path: Path, given: str) -> ApiError:
    param = field_name(path)
    return ApiError(
        400, f"{param}: {given} is outside the 64-bit integer range [{INT64_MIN}, {INT64_MAX}]", param=param
    )


def _too_deep(path: Path) -> ApiError:
    where = f" at {field_name(path[:8])}..." if path else ""
    return ApiError(
        400,
        f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels{where}",
        param=field_name(path[:1]),
        code="invalid_json",
    )


def _invalid_json(why: str) -> ApiError:
    return ApiError(400, f"request body is not valid JSON: {why}", code="invalid_json")
