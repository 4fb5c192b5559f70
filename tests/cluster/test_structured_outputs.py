"""Structured outputs through the whole cluster. The official `openai` client against `infer-serve` on the
embedded SmolLM2-135M-Instruct: each of 20 JSON schemas gives output that validates (jsonschema), greedy and
at temperature 1, streamed and not; json_object, regex, choice and an arithmetic EBNF grammar match. And a
structured request whose worker is killed (kill -9) mid-stream resumes elsewhere and still validates."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re

import jsonschema
import openai
import pytest
from fault_streams import streams_through_a_fault
from serve_harness import Served
from structured_cases import ARITHMETIC_EBNF, MAX_TOKENS, SCHEMAS

from infer import SamplingParams
from infer.protocol.structured import StructuredOutputsParams

MODEL = "smollm2"
FLAGS = ["--dtype", "bfloat16", "--max-model-len", "1024", "--kv-cache-memory", "64000000", "--threads", "1"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir):
    server = Served(None, tmp_path_factory.mktemp("serve") / "serve.log", MODEL, FLAGS)
    yield server
    server.stop()


@pytest.fixture
def client(served):
    return openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=600)


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with a JSON value for '{name}'."}]


async def chat(client, stream: bool, **kwargs) -> tuple[str, str]:
    """(text, finish_reason) of one chat completion, streamed or not."""
    if not stream:
        done = await client.chat.completions.create(model=MODEL, **kwargs)
        return done.choices[0].message.content, done.choices[0].finish_reason
    parts, reason = [], None
    async for chunk in await client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return "".join(parts), reason


@pytest.mark.slow
async def test_twenty_schemas_validate_greedy_and_sampled_streamed_and_not(client):
    cases = [(name, t, s) for name in SCHEMAS for t in (0.0, 1.0) for s in (False, True)]

    async def one(name, temperature, stream):
        schema = SCHEMAS[name]
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
        return await chat(
            client,
            stream,
            messages=ask(name),
            response_format=fmt,
            temperature=temperature,
            seed=5,
            max_tokens=MAX_TOKENS,
        )

    results = await asyncio.gather(*(one(*case) for case in cases))
    for (name, temperature, stream), (text, reason) in zip(cases, results):
        assert reason == "stop", (name, temperature, stream, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
async def test_json_object_regex_choice_and_an_arithmetic_grammar_match(client, stream):
    common = dict(temperature=1.0, seed=9, max_tokens=MAX_TOKENS)
    obj, regex, choice, expr = await asyncio.gather(
        chat(client, stream, messages=ask("a person"), response_format={"type": "json_object"}, **common),
        chat(
            client,
            stream,
            messages=ask("a phone number"),
            extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}},
            **common,
        ),
        chat(
            client, stream, messages=ask("the sky's color"), extra_body={"guided_choice": ["blue", "green"]}, **common
        ),
        chat(
            client,
            stream,
            messages=[{"role": "user", "content": "Write an arithmetic expression."}],
            extra_body={"structured_outputs": {"grammar": ARITHMETIC_EBNF}},
            **common,
        ),
    )
    assert isinstance(json.loads(obj[0]), dict) and obj[1] == "stop"
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", regex[0])
    assert choice[0] in ("blue", "green")
    assert expr[1] == "stop" and set(expr[0]) <= set("0123456789+-*/()"), expr
    ast.parse(expr[0], mode="eval")


async def test_a_structured_stream_survives_kill_9_of_its_worker_and_still_validates(model_cluster):
    cluster = model_cluster(workers=2)  # the tiny Llama: fast, and it never closes a string itself
    names = ["nested object", "array of objects", "mixed", "matrix", "deep nesting", "tuple-like array"]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=20 + i,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]),
        )
        for i, name in enumerate(names)
    ]

    async def kill_the_busiest(client):
        victim = max((await client.stats()).workers, key=lambda w: w.num_in_flight)
        assert victim.num_in_flight > 0
        cluster.proc_of(victim.worker_id).kill9()

    streams, after = await streams_through_a_fault(
        cluster, [[3, 4, 5 + i] for i in range(len(names))], params, kill_the_busiest, strike_after=4
    )
    assert after.requests_redispatched > 0
    for name, deltas in zip(names, streams):
        assert deltas[-1].finish_reason == "stop", (name, deltas[-1])
        jsonschema.validate(json.loads("".join(d.text for d in deltas)), SCHEMAS[name])


# ---- bounds on a grammar's work ---------------------------------------------------------------------------------

COSTLY_REGEX = r"([\s\S]{0,100}){0,100}"  # compiles in 1 s, a cheap first mask, then masks of seconds a token
BOUNDED_FLAGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--kv-cache-memory",
    "8000000",
    "--threads",
    "1",
    "--max-grammar-compiles",
    "2",
    "--max-grammar-compiles-per-client",
    "2",
]


@pytest.fixture(scope="module")
def bounded_server(tmp_path_factory, tiny_llama):
    """infer-serve (two workers) on the tiny Llama, each worker compiling at most 2 grammars at once, each compile
    taking at least 2 s (INFER_TEST_GRAMMAR_COMPILE_DELAY_S: slow by construction, whatever xgrammar's version)."""
    os.environ["INFER_TEST_GRAMMAR_COMPILE_DELAY_S"] = "2"
    try:
        server = Served(tiny_llama, tmp_path_factory.mktemp("bounded") / "serve.log", "tiny", BOUNDED_FLAGS)
    finally:
        del os.environ["INFER_TEST_GRAMMAR_COMPILE_DELAY_S"]
    yield server
    server.stop()


@pytest.fixture
def bounded(bounded_server):
    return openai.AsyncOpenAI(base_url=f"{bounded_server.url}/v1", api_key="unused", max_retries=0, timeout=600)


async def test_a_grammar_too_costly_to_follow_is_a_400_and_a_plain_request_beside_it_completes(bounded):
    async def costly():
        with pytest.raises(openai.BadRequestError) as err:
            await bounded.completions.create(
                model="tiny",
                prompt="Say anything",
                max_tokens=64,
                temperature=1.0,
                seed=1,
                extra_body={"structured_outputs": {"regex": COSTLY_REGEX}},
            )
        return err.value

    error, plain = await asyncio.gather(
        costly(),
        bounded.completions.create(
            model="tiny", prompt="A plain request", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        ),
    )
    assert "the grammar is too costly to follow" in error.message and "--max-grammar-step-ms" in error.message
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 24


async def test_a_burst_of_distinct_compiles_past_the_bound_is_503_overloaded_and_the_admitted_complete(bounded):
    schemas = [{"type": "string", "minLength": 1, "maxLength": 10**6 + i} for i in range(10)]  # slow to compile

    async def one(schema):
        try:
            done = await bounded.completions.create(
                model="tiny",
                prompt="A string",
                max_tokens=4,
                temperature=0,
                extra_body={"structured_outputs": {"json": schema}},
            )
        except openai.APIStatusError as e:
            return e
        return done.choices[0]

    results = await asyncio.gather(*(one(s) for s in schemas))
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    served = [r for r in results if not isinstance(r, openai.APIStatusError)]
    assert all(
        e.status_code == 503 and e.code == "overloaded" and "--max-grammar-compiles" in e.message for e in refused
    ), [(e.status_code, e.message) for e in refused]
    assert len(refused) >= len(schemas) - 2 * 2, len(refused)  # two workers, two compiles each
    assert served and all(c.finish_reason == "length" and c.text.startswith('"') for c in served)


# ---- tool calling -----------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$"}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


async def stream_tool_calls(client, **kwargs):
    """The tool calls of a streamed answer, reassembled from their deltas, and its finish reason."""
    calls: dict[int, dict] = {}
    reason = None
    async for chunk in await client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.slow
async def test_tool_choice_required_gives_valid_calls_streamed_the_same(client):
    kwargs = dict(
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )  # in parallel, SmolLM2-135M repeats its call until max_tokens
    done = await client.chat.completions.create(model=MODEL, **kwargs)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)
    streamed, reason = await stream_tool_calls(client, **kwargs)
    assert reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ]


@pytest.mark.slow
async def test_a_named_function_and_the_tool_result_round_trip(client, served):
    named = {"type": "function", "function": {"name": "get_time"}}
    done = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=named, temperature=1.0, seed=3, max_tokens=MAX_TOKENS
    )
    [call] = done.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_calls([call])
    conversation = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "It is 14:05 in Europe/Paris."},
    ]
    answer = await client.chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, temperature=0, max_tokens=24
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = await asyncio.to_thread(
        _post_json, f"{served.url}/tokenize", {"messages": conversation, "return_token_strs": True}
    )
    assert "It is 14:05 in Europe/Paris." in "".join(rendered["token_strs"])


def _post_json(url: str, body: dict) -> dict:
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())
