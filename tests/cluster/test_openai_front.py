"""The official `openai` client against `infer-serve` (2 workers, the tiny Llama): chat and completions,
streaming and not, n, stop, logprobs, usage, errors with the documented statuses, 64 concurrent streams of
which 8 are cut off (and aborted on the workers), /metrics moving by known amounts."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import Served

from infer.client.inference_client import SyncInferenceClient

MODEL = "tiny-llama"
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1"]
GREEDY = dict(temperature=0)
MAX_BODY_BYTES = 100_000


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory) -> Served:
    server = Served(
        tiny_llama,
        tmp_path_factory.mktemp("serve") / "serve.log",
        MODEL,
        ["--max-body-bytes", str(MAX_BODY_BYTES), *ENGINE_FLAGS],
    )
    yield server
    server.stop()


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def aclient(served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(model_type, obj):
    """Re-validate a response the client built (it skips validation) against the package's own type."""
    return model_type.model_validate(obj.to_dict())


# ---- completions and chat -----------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_stream_equals_non_stream_and_usage_counts_tokens(client):
    prompt = list(range(100, 112))
    full = _valid(
        OpenAICompletion,
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True}, **GREEDY),
    )
    assert full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (12, 12, 24)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    for chunk in chunks:  # the package types finish_reason as non-null, so mid-stream chunks cannot validate
        if not chunk.choices or chunk.choices[0].finish_reason:
            _valid(OpenAICompletion, chunk)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_stream_equals_non_stream(client, smollm2_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    full = _valid(
        ChatCompletion, client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    )
    expected_prompt = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(expected_prompt, "keys"):  # newer transformers return a BatchEncoding
        expected_prompt = expected_prompt["input_ids"]
    assert full.usage.prompt_tokens == len(expected_prompt)
    assert full.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    for chunk in chunks:
        _valid(ChatCompletionChunk, chunk)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_n_choices_and_batch_prompts(client):
    out = _valid(
        OpenAICompletion,
        client.completions.create(
            model=MODEL,
            prompt=[[5, 6, 7], [8, 9, 10, 11]],
            n=2,
            max_tokens=4,
            seed=3,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        ),
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 3 + 4 and out.usage.completion_tokens == 16
    again = client.completions.create(
        model=MODEL,
        prompt=[[5, 6, 7], [8, 9, 10, 11]],
        n=2,
        max_tokens=4,
        seed=3,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible


def test_stop_string_cuts_the_text(client):
    prompt = [42, 43, 44]
    free = (
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, extra_body={"ignore_eos": True}, **GREEDY)
        .choices[0]
        .text
    )
    assert len(free) > 8
    stop = free[5:8]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=[stop], **GREEDY).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free[: free.index(stop)]


def test_logprobs_in_completions_and_chat(client):
    out = client.completions.create(
        model=MODEL, prompt=[1, 2, 3], max_tokens=5, logprobs=3, extra_body={"ignore_eos": True}, **GREEDY
    )
    lp = _valid(OpenAICompletion, out).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert out.usage.completion_tokens == 5
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(token_lp)  # greedy picks the top token
    assert "".join(lp.tokens) == out.choices[0].text
    chat = _valid(
        ChatCompletion,
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            logprobs=True,
            top_logprobs=2,
            **GREEDY,
        ),
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and bytes(t.bytes).decode(errors="replace") for t in content)


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, status, words",
    [
        (dict(temperature=-1), 400, "temperature"),
        (dict(top_p=1.5), 400, "top_p"),
        (dict(max_tokens=0), 400, "max_tokens"),
        (dict(n=0), 400, "n"),
        (dict(model="no-such-model"), 404, "no-such-model"),
        (dict(prompt=[7] * 300), 400, "maximum context length is 256"),
        (dict(max_tokens=250, prompt=[7] * 10), 400, "250 in the completion"),
        (dict(extra_body={"frobnicate": 1}), 400, "frobnicate"),
        (dict(extra_body={"top_k": -5}), 400, "top_k"),
        (dict(prompt=[10**9]), 400, "outside the vocabulary"),
        (dict(extra_body={"top_k": 2**64}), 400, "top_k: 18446744073709551616 is outside the 64-bit"),
        (dict(seed=-(2**63) - 1), 400, "seed"),
        (dict(extra_body={"stop_token_ids": [3, 2**64]}), 400, "stop_token_ids.1"),
        (dict(prompt="hello " * 15_000), 400, "refused without tokenizing"),  # 90 kB: far past 256 tokens
    ],
)
def test_invalid_parameters_get_the_documented_status(client, override, status, words):
    kwargs = dict(model=MODEL, prompt="hello", max_tokens=4)
    kwargs.update(override)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**kwargs)
    assert err.value.status_code == status
    assert words in err.value.message
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).choices  # unharmed


@pytest.mark.parametrize(
    "path, body, param",
    [  # the openai client cannot send these: raw JSON
        ("/v1/completions", '{"model": "%s", "prompt": "a\\ud800b"}' % MODEL, "prompt"),
        ("/v1/completions", '{"model": "%s", "prompt": "hi", "stop": ["\\udc00"]}' % MODEL, "stop.0"),
        (
            "/v1/chat/completions",
            '{"model": "%s", "messages": [{"role": "user", "content": "\\udbff"}]}' % MODEL,
            "messages.0.content",
        ),
        ("/v1/completions", '{"model": "%s", "prompt": %s}' % (MODEL, "[" * 40_000 + "]" * 40_000), "prompt"),
    ],
)
def test_unpaired_surrogates_and_deep_nesting_are_400s_naming_the_field(served, client, path, body, param):
    request = urllib.request.Request(
        f"{served.url}{path}", data=body.encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 400 and error["param"] == param and param in error["message"]
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).choices  # unharmed


def test_malformed_json_is_a_400_naming_the_problem(served):
    request = urllib.request.Request(
        f"{served.url}/v1/chat/completions",
        data=b'{"model": "x", ',
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400
    body = json.loads(err.value.read())
    assert "not valid JSON" in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"


def test_a_body_over_max_body_bytes_is_refused_before_it_is_read_and_errors_reveal_nothing(served):
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # headers only, never the body
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(MAX_BODY_BYTES + 1).encode() + b"\r\n\r\n"
        )
        answer = sock.makefile("rb").read()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b" 413 " in head.split(b"\r\n")[0]
    assert json.loads(body)["error"]["code"] == "request_too_large"
    for url, method in ((f"{served.url}/v1/nothing", "GET"), (f"{served.url}/v1/completions", "GET")):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30)
        text = err.value.read().decode()
        assert err.value.code in (404, 405) and set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
        assert "Traceback" not in text and ".py" not in text


# ---- concurrency and disconnects ------------------------------------------------------------------


async def _open_stream(url: str, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw HTTP/1.1 streaming request, read until its first SSE data line (so it is running)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 60)
    assert b" 200 " in status, status
    while b"data: " not in await asyncio.wait_for(reader.readline(), 60):
        pass
    return reader, writer


async def test_64_streams_with_8_cut_off_aborts_those_and_finishes_the_rest(served, aclient):
    with SyncInferenceClient(served.address) as cluster:
        before = cluster.stats()
    long = dict(model=MODEL, prompt=[3, 4, 5, 6], max_tokens=200, stream=True, ignore_eos=True, temperature=0)
    cut = [await _open_stream(served.url, long) for _ in range(8)]

    async def complete(i: int) -> tuple[str, int]:
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=[10 + i, 11, 12],
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        reasons, usage = [], None
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage or usage
        return reasons[-1], usage.completion_tokens

    # Paused while the 8 are mid-stream, so that none can finish before its client vanishes (the tiny model
    # runs 200 tokens in well under a second); the 56 others wait in the coordinator meanwhile.
    with SyncInferenceClient(served.address) as cluster:
        cluster.pause()
    others = [asyncio.create_task(complete(i)) for i in range(56)]
    await asyncio.sleep(0.5)
    for _, writer in cut:
        writer.transport.abort()  # the client vanishes (RST), mid-stream
    cut_at = time.monotonic()
    with SyncInferenceClient(served.address) as cluster:
        while cluster.stats().requests_aborted < before.requests_aborted + 8:
            assert time.monotonic() - cut_at < 30, "the cut-off streams were not aborted within 30 s"
            await asyncio.sleep(0.1)
        cluster.unpause()
        results = await asyncio.wait_for(asyncio.gather(*others), 120)
        assert results == [("length", 24)] * 56
        # the last deltas reach the front straight from the worker; the coordinator counts them a moment later
        deadline = time.monotonic() + 30
        while (after := cluster.stats()).requests_completed < before.requests_completed + 56:
            assert time.monotonic() < deadline, "the coordinator did not count the 56 completed requests"
            time.sleep(0.1)
    assert after.requests_aborted == before.requests_aborted + 8
    assert after.requests_completed >= before.requests_completed + 56
    for worker in after.workers:  # every KV block is back
        assert worker.load.num_running == 0 and worker.load.num_free_blocks == worker.load.num_total_blocks


async def test_a_non_streaming_request_whose_client_leaves_is_aborted(served):
    with SyncInferenceClient(served.address) as cluster:
        before = cluster.stats().requests_aborted
    host, port = served.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(dict(model=MODEL, prompt=[9, 9, 9], max_tokens=250 - 4, ignore_eos=True)).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    await writer.drain()
    with SyncInferenceClient(served.address) as cluster:
        deadline = time.monotonic() + 10
        while cluster.stats().num_in_flight == 0:  # it reached a worker
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        writer.transport.abort()
        deadline = time.monotonic() + 30
        while cluster.stats().requests_aborted < before + 1:
            assert time.monotonic() < deadline, "the abandoned request was not aborted within 30 s"
            await asyncio.sleep(0.1)


# ---- metrics --------------------------------------------------------------------------------------


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "le"))
            if "le" in sample.labels:
                continue
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def test_metrics_move_by_the_workload(served, client):
    before = _scrape(served.url)
    lengths = [10, 20, 30]
    for n in lengths:
        client.completions.create(
            model=MODEL, prompt=list(range(200, 200 + n)), max_tokens=5, extra_body={"ignore_eos": True}
        )
    after = _scrape(served.url)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("infer:prompt_tokens_total{}") == 60
    assert moved("infer:generation_tokens_total{}") == 15
    assert moved("infer:request_success_total{finished_reason=length}") == 3
    assert moved("infer:time_to_first_token_seconds_count{}") == 3
    assert moved("infer:e2e_request_latency_seconds_count{}") == 3
    assert moved("infer:request_queue_time_seconds_count{}") == 3
    assert moved("infer:inter_token_latency_seconds_count{}") == 3 * 4
    assert moved("infer:prefix_cache_queries_total{}") == 60
    assert after["infer:num_requests_running{}"] == 0 and after["infer:num_healthy_workers{}"] == 2
    for name in (
        "infer:num_requests_waiting{}",
        "infer:kv_cache_usage_perc{}",
        "infer:num_preemptions_total{}",
        "infer:prefix_cache_hits_total{}",
    ):
        assert name in after


# ---- embeddings through the cluster ---------------------------------------------------------------


def test_embeddings_through_the_cluster_equal_the_direct_engines(client, tiny_llama):
    """/v1/embeddings on infer-serve (2 workers): the inputs spread over the workers, each vector what the
    in-process engine makes (itself checked against transformers in tests/worker/test_pooling.py)."""
    from infer import LLM

    inputs = [f"embedding number {i} " * (i + 1) for i in range(6)]
    got = client.embeddings.create(model=MODEL, input=inputs, extra_body={"pooling": "mean"})
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    want = llm.embed(inputs, pooling="mean", use_tqdm=False)
    assert [d.index for d in got.data] == list(range(6))
    for d, w in zip(got.data, want):
        assert d.embedding == pytest.approx(w.embedding, abs=1e-5)
