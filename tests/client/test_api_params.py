"""The HTTP front's extra parameters and routes on a direct-mode front (the tiny Llama, priority scheduling):
each accepted value does what it says; each invalid one is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from front_harness import MODEL, error_of, http, local_engine, serving, sse_events
from infer.client.local_engine import LocalEngine

SHORT = dict(model=MODEL, prompt=[3, 4, 5], max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def local(tiny_model_dir) -> Iterator[LocalEngine]:
    engine = local_engine(tiny_model_dir("llama"), scheduling_policy="priority")
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def url(local, smollm2_tokenizer) -> Iterator[str]:
    with serving(local, smollm2_tokenizer) as url:
        yield url


def test_a_priority_is_accepted_on_both_endpoints(url):
    status, _, text = http(f"{url}/v1/completions", {**SHORT, "priority": -5})
    assert status == 200, text
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, priority=3)
    status, _, text = http(f"{url}/v1/chat/completions", chat)
    assert status == 200, text


@pytest.mark.parametrize("priority", ["high", 1.5, True, 2**63, -2**63 - 1, None])
def test_an_invalid_priority_is_a_400_naming_it(url, priority):
    status, _, text = http(f"{url}/v1/completions", {**SHORT, "priority": priority})
    assert status == 400 and error_of(text)["param"] == "priority", text


# ---- logit processors ---------------------------------------------------------------------------------

def _greedy_text(url: str, **extra) -> tuple[list[int], str]:
    status, _, text = http(f"{url}/v1/completions", {**SHORT, "max_tokens": 6, "logprobs": 0, **extra})
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    return choice["logprobs"]["tokens"], choice["text"]


def test_logit_bias_allowed_token_ids_and_bad_words_change_greedy_output(url, smollm2_tokenizer):
    forced = 1234
    biased, _ = _greedy_text(url, logit_bias={str(forced): 100})
    assert biased == [smollm2_tokenizer.decode([forced])] * 6
    allowed = [300, 301]
    only, _ = _greedy_text(url, allowed_token_ids=allowed)
    assert set(only) <= {smollm2_tokenizer.decode([t]) for t in allowed}
    word = smollm2_tokenizer.decode([forced])
    _, text = _greedy_text(url, logit_bias={str(forced): 100}, bad_words=[word.strip() or word])
    assert word not in text


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"1": 101}), ("logit_bias", {"x": 1}), ("logit_bias", {"99999999": 1}),
    ("logit_bias", {str(i): 1 for i in range(1025)}), ("logit_bias", [1, 2]),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [10**9]),
    ("bad_words", [""]), ("bad_words", ["  "]), ("bad_words", "word"),
    ("user", "u" * 513), ("user", 5),
    ("best_of", 0), ("best_of", 17), ("suffix", "tail"),
])
def test_an_invalid_extra_parameter_is_a_400_naming_it(url, field, value):
    status, _, text = http(f"{url}/v1/completions", {**SHORT, field: value})
    assert status == 400 and error_of(text)["param"].split(".")[0] == field, text


def test_best_of_below_n_streamed_best_of_and_echo_with_logprobs_are_400s_naming_the_field(url):
    for extra, field in ((dict(n=3, best_of=2), "best_of"), (dict(n=1, best_of=2, stream=True), "best_of"),
                         (dict(echo=True, logprobs=1), "echo")):
        status, _, text = http(f"{url}/v1/completions", {**SHORT, **extra})
        assert status == 400 and error_of(text)["param"] == field, (extra, text)


# ---- best_of, echo, user --------------------------------------------------------------------------------

def test_best_of_returns_the_n_most_likely_of_its_candidates(url):
    body = {**SHORT, "temperature": 1.0, "seed": 11, "max_tokens": 5, "n": 2, "best_of": 5, "logprobs": 0}
    status, _, text = http(f"{url}/v1/completions", body)
    assert status == 200, text
    answer = json.loads(text)
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert scores == sorted(scores, reverse=True)
    candidates = []
    for c in range(5):    # each candidate alone: choice c of best_of is seed + c
        single = {**body, "n": 1, "best_of": None, "seed": 11 + c}
        candidates.append(sum(json.loads(http(f"{url}/v1/completions", single)[2])["choices"][0]["logprobs"]
                              ["token_logprobs"]))
    assert scores == pytest.approx(sorted(candidates, reverse=True)[:2])
    assert answer["usage"]["completion_tokens"] == 25            # every candidate is counted
    without = {k: v for k, v in body.items() if k != "logprobs"}
    assert all(c["logprobs"] is None for c in json.loads(http(f"{url}/v1/completions", without)[2])["choices"])


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_completion(url, stream):
    body = dict(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, echo=True, stream=stream)
    plain = json.loads(http(f"{url}/v1/completions", {**body, "echo": False, "stream": False})[2])
    status, _, text = http(f"{url}/v1/completions", body)
    assert status == 200, text
    if stream:
        got = "".join(e["choices"][0]["text"] for e in sse_events(text) if e != "[DONE]" and e["choices"])
    else:
        got = json.loads(text)["choices"][0]["text"]
    assert got == "Once upon a time" + plain["choices"][0]["text"]


def test_user_is_accepted(url):
    assert http(f"{url}/v1/completions", {**SHORT, "user": "user-1234"})[0] == 200


# ---- /tokenize, /detokenize, /version ---------------------------------------------------------------------

def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(url, smollm2_tokenizer):
    status, _, text = http(f"{url}/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    assert status == 200, text
    answer = json.loads(text)
    assert answer["tokens"] == smollm2_tokenizer("Hello world")["input_ids"]
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 256
    assert "".join(answer["token_strs"]) == smollm2_tokenizer.decode(answer["tokens"])
    status, _, text = http(f"{url}/detokenize", {"model": MODEL, "tokens": answer["tokens"]})
    assert status == 200 and json.loads(text) == {"prompt": "Hello world"}
    chat = json.loads(http(f"{url}/tokenize", {"messages": [{"role": "user", "content": "hi"}]})[2])
    rendered = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                     add_generation_prompt=True)
    assert chat["tokens"] == smollm2_tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": list(range(300))}, "tokens"),
])
def test_bad_tokenize_and_detokenize_bodies_are_refused_naming_the_field(url, path, body, field):
    status, _, text = http(f"{url}{path}", body)
    assert status in (400, 404) and error_of(text)["param"] == field, text


def test_version(url):
    status, _, text = http(f"{url}/version", method="GET")
    assert status == 200 and json.loads(text)["version"]


# ---- structured outputs: validation (the outputs themselves: tests/cluster/test_structured_http.py) --------

@pytest.mark.parametrize("body, param, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema", "Type should be a string"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "parenthesis is not closed"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs", "is not defined"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "1 to 256 strings"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs.yaml", ""),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "x" * 5000}, "guided_regex", "at most 4096 characters"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "several"),
    ({"guided_json": "[" * 40 + "]" * 40}, "guided_json", "deeper than 32"),
])
def test_an_invalid_output_constraint_is_a_400_naming_the_field(url, body, param, reason):
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    status, _, text = http(f"{url}/v1/chat/completions", {**chat, **body})
    error = error_of(text)
    assert status == 400 and error["param"] == param and reason in error["message"], text
