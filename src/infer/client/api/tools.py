"""Tool calling for the chat endpoint: the parsers of the tool-call formats our models write, the output
constraints of `tool_choice`, and the messages' tool fields as chat templates want them.

Parsers (vLLM's `--tool-call-parser` names) turn a finished output into (content, tool calls):
- `hermes` (Qwen2 / Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more;
  text outside the tags is content.
- `llama3_json` (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}` (or "arguments"),
  optionally after `<|python_tag|>`, several joined by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`.
A parser never raises: output that does not parse as its format (malformed JSON, a call without a name) is
returned whole as content, with no tool calls.

`ToolCallStream` does the same on a stream (the chat endpoint's SSE): content is released as it comes and each
call as soon as it is complete (hermes: at its `</tool_call>`; "required": at the end of its array element; a
named function: its arguments text as it comes), so a client sees the first call while the model writes the
second. llama3_json and mistral calls are released at the end of the output (content that cannot be a call
still streams). The pieces of a stream reassemble to the whole output's parse, with one difference: a malformed
hermes call after a complete one leaves the complete one a call (the whole output's parse makes all of it text).

`tool_choice` "required" and a named function are enforced with structured outputs: the output must be the
named function's arguments (a JSON object of its parameters schema), or a JSON array of
`{"name", "parameters"}` objects, one per call (at most one without parallel_tool_calls, else at most
MAX_PARALLEL_CALLS), each matching its
tool; "auto" generates freely and parses; "none" leaves the tools out.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 16  # "required" with parallel_tool_calls: a small model may otherwise repeat calls forever


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A ToolCall from a parsed {"name": str, "arguments" | "parameters": object}; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: object = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def _every(calls: list[ToolCall | None]) -> list[ToolCall] | None:
    """`calls` if each one parsed, else None."""
    parsed = [c for c in calls if c is not None]
    return parsed if len(parsed) == len(calls) else None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    if "<tool_call>" not in text:
        return text, []
    calls = _every([_call(_json(m.group(1))) for m in _HERMES.finditer(text)])
    if not calls:
        return text, []
    content = _HERMES.sub("", text).strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = _every([_call(_json(part)) for part in _split_top_level(body, ";")])
    if not calls:
        return text, []
    return None, calls


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    if "[TOOL_CALLS]" not in text:
        return text, []
    content, _, rest = text.partition("[TOOL_CALLS]")
    rest = rest.strip()
    if rest.startswith("["):
        items = _json(rest)
        calls: list[ToolCall | None] = [_call(item) for item in items] if isinstance(items, list) and items else [None]
    else:  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        calls = []
        for part in rest.split("[TOOL_CALLS]"):
            name, sep, args = part.partition("[ARGS]")
            calls.append(_call({"name": name.strip(), "arguments": _json(args)}) if sep else None)
    parsed = _every(calls)
    if parsed is None:
        return text, []
    return content.strip() or None, parsed


PARSERS: dict[str, Callable[[str], tuple[str | None, list[ToolCall]]]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}


def _split_top_level(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside JSON strings and brackets."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def default_parser(chat_template: str | None) -> str:
    """The parser of the format a chat template teaches: Mistral's or Llama 3's markers, else Hermes'."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


# ---- tool_choice as an output constraint ----------------------------------------------------------------


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": a JSON array of calls, each {"name": one tool's name, "parameters": its
    arguments}; one call unless parallel."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t["function"]["name"]]}, "parameters": parameters_schema(t)},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    return {
        "type": "array",
        "minItems": 1,
        "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def calls_of_required(text: str, truncated: bool = False) -> list[ToolCall] | None:
    """The calls of an output made under `required_schema`; None if it is not such an array. `truncated` (the
    output was cut at max_tokens): the complete calls it starts with, None if there are none."""
    items = leading_array_items(text) if truncated else _json(text)
    if not isinstance(items, list) or not items:
        return None
    return _every([_call(item, ("parameters",)) for item in items])


_DECODER = json.JSONDecoder()


def leading_array_items(text: str) -> list[Any]:
    """The complete elements of the JSON array `text` opens: an array cut anywhere gives the elements written
    whole before the cut ([] if `text` does not open an array)."""
    items: list[Any] = []
    i = _skip_space(text, 0)
    if not text.startswith("[", i):
        return items
    i += 1
    while True:
        i = _skip_space(text, i)
        if items:
            if not text.startswith(",", i):
                return items
            i = _skip_space(text, i + 1)
        try:
            item, i = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            return items
        items.append(item)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class ToolCallStream:
    """One choice's output, fed as it is generated, split into content and tool calls (see the module doc).

    `feed(text)` and `finish()` return what can be released: (content, events), each event a complete
    `ToolCall`, or for a named function the call's opening (`ToolCall` with empty arguments) followed by
    argument pieces (str)."""

    def __init__(self, mode: str, parser: str, named: str | None = None) -> None:
        self.mode, self.parser, self.named = mode, parser, named
        self.calls = 0  # complete calls released
        self._buf = ""  # text not yet released
        self._inside = False  # hermes: within <tool_call> ... </tool_call>
        self._space = ""  # whitespace content held until more content follows
        self._items = 0  # required: array elements released
        self._passthrough = False  # llama3_json: the output is not a call, everything is content

    def feed(self, text: str) -> tuple[str, list[ToolCall | str]]:
        self._buf += text
        if self.mode == "named":
            return self._named()
        if self.mode == "required":
            return "", self._required()
        return {"hermes": self._hermes, "llama3_json": self._llama3, "mistral": self._mistral}[self.parser]()

    def finish(self) -> tuple[str, list[ToolCall | str]]:
        if self.mode == "named":
            return self._named()
        if self.mode == "required":
            events = self._required()
            if not self.calls and not events:  # not an array of calls: the text as it is
                text, self._buf = self._buf, ""
                return text, []
            return "", events
        if self.parser == "hermes":
            content, events = self._hermes()
            if self._inside:
                call = _call(_json(self._buf.strip()))
                if call is not None:
                    self.calls += 1
                    return content, [*events, call]
                content += self._rest(TOOL_CALL_START + self._buf)
            else:
                content += self._rest(self._buf)
            self._buf = ""
            return content, events
        rest, self._buf = self._buf, ""
        if self._passthrough:
            return rest, []
        head, calls = (parse_llama3_json if self.parser == "llama3_json" else parse_mistral)(rest)
        self.calls += len(calls)
        return (self._rest(head or "") if calls else self._space + rest), list(calls)

    def _content(self, text: str) -> str:
        """Content as it comes, less trailing whitespace: held until more content follows, and at the end
        dropped if the output called tools (the whole output's parse strips the content around calls)."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        return body

    def _rest(self, text: str) -> str:
        """The last content: what was held, unless there were calls."""
        content = self._content(text)
        space, self._space = self._space, ""
        return content if self.calls else content + space

    def _named(self) -> tuple[str, list[ToolCall | str]]:
        events: list[ToolCall | str] = []
        if not self.calls:
            self.calls = 1
            events.append(ToolCall(self.named or "", "", new_call_id()))
        if self._buf:
            events.append(self._buf)
            self._buf = ""
        return "", events

    def _required(self) -> list[ToolCall | str]:
        items = leading_array_items(self._buf)[self._items :]  # re-read whole: at most MAX_PARALLEL_CALLS
        self._items += len(items)
        calls = [c for c in (_call(item, ("parameters",)) for item in items) if c is not None]
        self.calls += len(calls)
        return list(calls)

    def _hermes(self) -> tuple[str, list[ToolCall | str]]:
        content = ""
        events: list[ToolCall | str] = []
        while True:
            if not self._inside:
                at = self._buf.find(TOOL_CALL_START)
                if at < 0:
                    keep = _partial_suffix(self._buf, TOOL_CALL_START)
                    content += self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return content, events
                content += self._content(self._buf[:at])
                self._buf, self._inside = self._buf[at + len(TOOL_CALL_START) :], True
            at = self._buf.find(TOOL_CALL_END)
            if at < 0:
                return content, events
            raw, self._buf, self._inside = self._buf[:at], self._buf[at + len(TOOL_CALL_END) :], False
            call = _call(_json(raw.strip()))
            if call is None:
                content += self._content(TOOL_CALL_START + raw + TOOL_CALL_END)
            else:
                self.calls += 1
                events.append(call)

    def _llama3(self) -> tuple[str, list[ToolCall | str]]:
        head = self._buf.lstrip()
        if head and not (head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)):
            self._passthrough = True  # not a call: content from here on
        if not self._passthrough:
            return "", []
        text, self._buf = self._buf, ""
        return text, []

    def _mistral(self) -> tuple[str, list[ToolCall | str]]:
        at = self._buf.find("[TOOL_CALLS]")
        if at >= 0:
            content = self._content(self._buf[:at])
            self._buf = self._buf[at:]
            return content, []
        keep = _partial_suffix(self._buf, "[TOOL_CALLS]")
        content = self._content(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return content, []


TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant's tool-call arguments as objects, not JSON text
    (what Qwen's and Llama's templates `tojson`)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(message)
    return out


def _with_object_arguments(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    parsed = _json(arguments) if isinstance(arguments, str) else arguments
    return {**call, "function": {**call["function"], "arguments": parsed if isinstance(parsed, dict) else {}}}


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Hermes' tool instructions, for a chat template that does not render `tools` itself."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are:\n<tools>\n"
        f"{lines}\n</tools>\nTo call a function, reply with a JSON object of its name and arguments in "
        '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )
