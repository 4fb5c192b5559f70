"""Tool-call and reasoning parsers on recorded outputs of each supported format, well-formed and malformed
(malformed output comes back whole as content, never an exception)."""

from __future__ import annotations

import json

import pytest

from infer.client.api.reasoning import ReasoningSplitter
from infer.client.api.tools import (
    calls_of_required,
    default_parser,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    required_schema,
    template_messages,
)


def calls(parsed):
    content, found = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in found]


HERMES = {  # Qwen2.5 / Qwen3 outputs
    "one call": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    "content then two calls": (
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>',
        "Let me check.",
        [("a", {}), ("b", {"x": [1, 2]})],
    ),
    "arguments as a JSON string": (
        '<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>',
        None,
        [("f", {"k": 1})],
    ),
    "unterminated last tag": ('<tool_call>{"name": "f", "arguments": {"q": "x"}}', None, [("f", {"q": "x"})]),
}
HERMES_MALFORMED = [
    '<tool_call>{"name": "f", "arguments": {</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>["f"]</tool_call>',
    "<tool_call></tool_call>",
    "plain text, no call",
    '<tool_call>{"name": "f", "arguments": 5}</tool_call>',
]


@pytest.mark.parametrize("name", HERMES)
def test_hermes(name):
    text, content, want = HERMES[name]
    assert calls(parse_hermes(text)) == (content, want)


@pytest.mark.parametrize("text", HERMES_MALFORMED)
def test_malformed_hermes_is_content(text):
    assert parse_hermes(text) == (text, [])


def test_llama3_json():
    assert calls(parse_llama3_json('{"name": "search", "parameters": {"q": "infer"}}')) == (
        None,
        [("search", {"q": "infer"})],
    )
    assert calls(
        parse_llama3_json('<|python_tag|>{"name": "a", "parameters": {"s": "x;y"}}; {"name": "b", "arguments": {}}')
    ) == (None, [("a", {"s": "x;y"}), ("b", {})])
    for text in ("Sure, here you go.", '{"name": "a", "parameters": ', '{"nome": "a"}', '{"name": "a"} trailing'):
        assert parse_llama3_json(text) == (text, [])


def test_mistral():
    assert calls(
        parse_mistral('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]')
    ) == (None, [("f", {"a": 1}), ("g", {})])
    assert calls(parse_mistral('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}')) == (
        None,
        [("f", {"a": 1}), ("g", {})],
    )
    assert calls(parse_mistral('Thinking aloud. [TOOL_CALLS][{"name": "f", "arguments": {}}]')) == (
        "Thinking aloud.",
        [("f", {})],
    )
    for text in ("[TOOL_CALLS][{]", "[TOOL_CALLS][]", "[TOOL_CALLS]f{}", "[TOOL_CALLS]f[ARGS]{not json", "no calls"):
        assert parse_mistral(text) == (text, [])


def test_required_outputs_and_the_default_parser():
    assert [
        (c.name, json.loads(c.arguments)) for c in calls_of_required('[{"name": "f", "parameters": {"a": 1}}]')
    ] == [("f", {"a": 1})]
    assert calls_of_required('[{"name": "f"}') is None and calls_of_required("[]") is None
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert required_schema([tool], parallel=False)["maxItems"] == 1
    assert required_schema([tool, tool], parallel=True)["maxItems"] == 16
    assert default_parser("... [TOOL_CALLS] ...") == "mistral"
    assert default_parser("... <|python_tag|> ...") == "llama3_json"
    assert default_parser("<tool_call>") == default_parser(None) == "hermes"


def test_tool_call_arguments_reach_templates_as_objects():
    messages = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "42"},
    ]
    out = template_messages(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and out[1] == messages[1]


REASONING = {  # (parser, output, reasoning_content, content)
    "qwen3 with thinking": (
        "qwen3",
        "<think>\nLet me think.\n</think>\n\nIt is 4.",
        "\nLet me think.\n",
        "\n\nIt is 4.",
    ),
    "qwen3 without": ("qwen3", "It is 4.", None, "It is 4."),
    "qwen3 never closed": ("qwen3", "<think>hmm", "hmm", None),
    "r1 without the start tag": ("deepseek_r1", "Reasoning here.</think>Answer.", "Reasoning here.", "Answer."),
    "r1 with it": ("deepseek_r1", "<think>R</think>A", "R", "A"),
    "r1 never closed": ("deepseek_r1", "all reasoning", "all reasoning", None),
    "a tag-like text in content": ("qwen3", "Use <thin> tags", None, "Use <thin> tags"),
}


@pytest.mark.parametrize("name", REASONING)
def test_reasoning_split_is_the_same_whole_and_streamed_at_every_cut(name):
    parser, text, reasoning, content = REASONING[name]
    assert ReasoningSplitter(parser).split(text) == (reasoning, content)
    for size in (1, 2, 3, 5):
        splitter, got_r, got_c = ReasoningSplitter(parser), "", ""
        for i in range(0, len(text), size):
            r, c = splitter.feed(text[i : i + size])
            got_r, got_c = got_r + r, got_c + c
        r, c = splitter.finish()
        assert (got_r + r or None, got_c + c or None) == (reasoning, content), size
