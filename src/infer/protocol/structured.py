"""StructuredOutputsParams: what a request's output must match (vLLM's `structured_outputs`). Torch-free.

Exactly one of: `json` (a JSON schema, given as a dict or its JSON text), `regex`, `choice` (one of these
strings), `grammar` (EBNF, xgrammar's GBNF dialect: `root ::= ...`) or `json_object=True` (any JSON
object). Sizes are bounded here, on construction, so that no component spends unbounded time on one
request's spec; whether the spec compiles is checked by `grammar_error` (the HTTP front, before anything
runs) and by the worker's compiler (worker/engine/structured.py), which answers "invalid_request" with xgrammar's
message otherwise. A spec that admits no output at all is ours to name ("admits no output: ..."), whatever
xgrammar's version says of it: `admits_no_value` (a schema that only refers to itself) before xgrammar sees it,
and a compiled grammar that lets no byte begin (`NO_FIRST_TOKEN`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from msgspec.structs import force_setattr

from infer.protocol.bounds import Many

MAX_SCHEMA_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_REGEX_CHARS = 4096
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One constraint on a request's output; `json` is kept as compact JSON text (hashable; key order is kept,
    since it orders the output's properties)."""

    json: str | None = None
    regex: str | None = None
    choice: Many[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.json is not None:
            force_setattr(self, "json", _canonical_schema(self.json))
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes, dict)) or not hasattr(self.choice, "__iter__"):
                raise ValueError(
                    f"structured_outputs.choice must be a list of strings, got {type(self.choice).__name__}"
                )
            force_setattr(self, "choice", tuple(self.choice))
        self._validate()

    def _validate(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}, got {', '.join(given) or 'none'}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name, limit in (("regex", MAX_REGEX_CHARS), ("grammar", MAX_GRAMMAR_CHARS)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            if value is not None and len(value) > limit:
                raise ValueError(f"structured_outputs.{name} may be at most {limit} characters, got {len(value)}")
        if self.choice is not None:
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise ValueError(
                    f"structured_outputs.choice must hold 1 to {MAX_CHOICES} strings, got {len(self.choice)}"
                )
            for c in self.choice:
                if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                    raise ValueError(
                        f"structured_outputs.choice must hold non-empty strings of at most "
                        f"{MAX_CHOICE_CHARS} characters, got {str(c)[:40]!r}"
                    )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object))

    def to_dict(self) -> dict[str, Any]:
        """Named fields only, the one given (for the wire)."""
        kind = self.kind
        if kind == "json_object":
            return {"json_object": True}
        value = getattr(self, kind)
        return {kind: list(value) if kind == "choice" else value}

    @classmethod
    def from_dict(cls, d: Any) -> StructuredOutputsParams:
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be a mapping, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in KINDS)
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}; known: {', '.join(KINDS)}")
        return cls(**d)


def _canonical_schema(schema: Any) -> str:
    """A JSON schema (dict or JSON text) as sorted, compact JSON text; ValueError if it is not a JSON object,
    is too large or nests deeper than MAX_SCHEMA_DEPTH."""
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise ValueError(f"structured_outputs.json may be at most {MAX_SCHEMA_CHARS} characters, got {len(schema)}")
        _check_depth(schema)
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)  # key order kept: it orders properties
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"structured_outputs.json is not JSON-serializable: {e}") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"structured_outputs.json may be at most {MAX_SCHEMA_CHARS} characters, got {len(text)}")
    _check_depth(text)
    return text


def _check_depth(text: str) -> None:
    """ValueError if the JSON text nests arrays / objects deeper than MAX_SCHEMA_DEPTH (one pass, no parse)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels")
        elif ch in "]}":
            depth -= 1


def grammar_error(spec: StructuredOutputsParams) -> str | None:
    """xgrammar's complaint about `spec` (parsed without the model's tokenizer: cheap, but a real parse of the
    schema, regex or EBNF), or NO_FIRST_TOKEN if it admits no output at all, or None if it is valid. Imports
    xgrammar on first use; not for the coordinator."""
    import xgrammar as xgr

    if (reason := admits_no_value(spec)) is not None:
        return reason
    try:
        kind = spec.kind
        if kind == "json" and spec.json is not None:
            grammar = xgr.Grammar.from_json_schema(spec.json)
        elif kind == "regex" and spec.regex is not None:
            grammar = xgr.Grammar.from_regex(spec.regex)
        elif kind == "grammar" and spec.grammar is not None:
            grammar = xgr.Grammar.from_ebnf(spec.grammar)
        else:
            return None
        return None if _admits_a_first_byte(xgr, grammar) else NO_FIRST_TOKEN
    except Exception as e:  # xgrammar raises RuntimeError (C++) or its own error types, with the reason
        return grammar_reason(e)


NO_FIRST_TOKEN = (
    "admits no output: no token can start it (its rules never reach a character, e.g. a rule that "
    "only refers to itself)"
)


# Keywords that say nothing about a value: a schema of these and a `$ref` is only its reference.
_NO_CONTENT = frozenset(
    {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "examples", "default"}
)


def admits_no_value(spec: StructuredOutputsParams) -> str | None:
    """Our reason when `spec` is a JSON schema that no value matches because it only refers onward: from the root,
    a chain of `$ref`s (through schemas with nothing but annotations beside the `$ref`) that comes back to a
    schema it passed; None otherwise (also for a `$ref` that resolves nowhere: xgrammar says so). Found here, not
    left to xgrammar, whose versions compile such a schema to an empty grammar or refuse it, each in its words."""
    if spec.json is None:
        return None
    schema = json.loads(spec.json)
    chain: list[str] = []
    node, pointer = schema, "#"
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and set(node) <= _NO_CONTENT:
        if pointer in chain:
            loop = " -> ".join([*chain[chain.index(pointer) :], pointer])
            return f"admits no output: its $ref chain {loop} comes back to where it began without a schema"
        chain.append(pointer)
        pointer = node["$ref"]
        node = _resolve_pointer(schema, pointer)
    return None


def _resolve_pointer(schema: Any, pointer: str) -> Any:
    """The part of `schema` a local `$ref` ("#", "#/$defs/a") names; None where it names nothing."""
    if not pointer.startswith("#"):
        return None  # a remote reference: not ours to follow
    node = schema
    for part in pointer[1:].split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _admits_a_first_byte(xgr: Any, grammar: Any) -> bool:
    """Whether `grammar` lets anything begin: some byte, or the end right away. Compiled against a vocabulary of
    the 256 bytes and a stop token (milliseconds), so the answer holds for every byte-level tokenizer; a grammar
    whose rules never reach a terminal allows nothing here, where a model's sampler would find no token."""
    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[len(vocab) - 1])
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_grammar(grammar)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


def grammar_reason(error: Exception) -> str:
    """xgrammar's message without the C++ source location prefix ("[time] /path/file.cc:123: "), one line."""
    text = _SOURCE_PREFIX.sub("", str(error).strip())
    return text.splitlines()[0][:500] if text else type(error).__name__


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
