"""The HTTP front's hardening, on a direct-mode front (HttpFront over a LocalEngine, the tiny Llama): body
size limits (from Content-Length before reading, and while reading a chunked body), no internals in any
answer, the API key (one 401 for every way of getting it wrong; --api-key-file and $INFER_API_KEY),
overload (the front's own limit and "overloaded" from the cluster: 503 + Retry-After), and per-request
timeouts (504, or an SSE error event mid-stream; the engine's KV blocks all free afterwards)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

import pytest
from front_harness import MODEL, local_engine, serving
from front_harness import error_of as _error
from front_harness import http as _http

from infer.client.api.admission import resolve_api_key
from infer.client.api.config import FrontConfig
from infer.client.local_engine import LocalEngine
from infer.protocol.outputs import RequestOutput

STEP_DELAY_S = 0.01  # the slowed engine's extra time per step: 240 tokens take more than 2.4 s
SECRET = "secret-detail at /srv/infer/private/module.py line 42"
LONG = dict(model=MODEL, prompt=[3, 4, 5], max_tokens=240, ignore_eos=True, temperature=0)
SHORT = dict(model=MODEL, prompt=[3, 4, 5], max_tokens=4, temperature=0)
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"  # a raw request's first lines


# ---- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local(tiny_model_dir) -> Iterator[LocalEngine]:
    engine = local_engine(tiny_model_dir("llama"))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def slow_local(tiny_model_dir) -> Iterator[LocalEngine]:
    """Steps at least STEP_DELAY_S long, so a long request reliably outlives a short timeout."""
    engine = local_engine(tiny_model_dir("llama"), STEP_DELAY_S)
    yield engine
    asyncio.run(engine.close())


class FailingEngine:
    """An EngineClient over a real LocalEngine that fails on cue, as a broken component or a full cluster
    would: `raises` is raised by stream(); `error_code` ends each stream with that error after `after` real
    deltas (the real request is left, so the engine aborts it)."""

    def __init__(
        self,
        inner: LocalEngine,
        *,
        raises: Exception | None = None,
        error_code: str | None = None,
        error: str = "",
        after: int = 0,
    ) -> None:
        self.inner, self.raises, self.error_code, self.error = inner, raises, error_code, error
        self.after = after

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def stream(
        self, prompt, params=None, *, request_id=None, timeout=None, priority=0
    ) -> AsyncIterator[RequestOutput]:
        if self.raises is not None:
            raise self.raises
        inner = self.inner.stream(prompt, params, request_id=request_id, timeout=timeout, priority=priority)
        async with aclosing(inner) as deltas:
            n = 0
            async for delta in deltas:
                if n == self.after:
                    yield RequestOutput(
                        delta.request_id,
                        [],
                        "",
                        finished=True,
                        finish_reason="error",
                        error=self.error,
                        error_code=self.error_code,
                    )
                    return
                yield delta
                n += 1


# ---- helpers --------------------------------------------------------------------------------------


def _raw(url: str, head: bytes, *chunks: bytes, read_timeout: float = 10.0) -> bytes:
    """Send `head` and `chunks` on one connection, then read until the server closes or `read_timeout`."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(head)
        for chunk in chunks:
            sock.sendall(chunk)
        out = b""
        try:
            while data := sock.recv(65536):
                out += data
        except TimeoutError:
            pass
        return out


def _response(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _sse_events(text: str) -> list[Any]:
    return [
        json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


def _no_internals(text: str) -> None:
    for leak in ("Traceback", "secret", "/srv/", ".py", "RuntimeError", 'File "'):
        assert leak not in text, f"{leak!r} leaked: {text}"


async def _all_blocks_free(engine: LocalEngine) -> None:
    stats = await engine.stats()
    load = stats.workers[0].load
    assert (load.num_waiting, load.num_running, stats.num_in_flight) == (0, 0, 0)
    assert load.num_free_blocks == load.num_total_blocks


# ---- request body size ----------------------------------------------------------------------------


def test_a_body_over_the_limit_is_refused_from_content_length_before_it_is_read(local, smollm2_tokenizer):
    with serving(local, smollm2_tokenizer, max_body_bytes=1000) as url:
        started = time.monotonic()
        raw = _raw(
            url, POST + b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n"
        )  # and not one byte of the body
        status, body = _response(raw)
        assert status == 413 and time.monotonic() - started < 30  # answered, not waiting for a body that never comes
        error = _error(json.dumps(body))
        assert error["code"] == "request_too_large" and "1000000000 bytes" in error["message"]
        assert "1000" in error["message"] and error["type"] == "invalid_request_error"
        ok = json.dumps(SHORT).encode()  # a body under the limit is served
        assert len(ok) < 1000 and _http(f"{url}/v1/completions", ok)[0] == 200


def test_a_chunked_body_is_cut_off_at_the_limit(local, smollm2_tokenizer):
    with serving(local, smollm2_tokenizer, max_body_bytes=1000) as url:
        piece = b" " * 400
        chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        # three chunks pass the limit; the body never ends (no last chunk), so only a cut-off can answer
        raw = _raw(
            url, POST + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n", chunk, chunk, chunk
        )
        status, body = _response(raw)
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert "more than 1000 bytes" in body["error"]["message"]


def test_max_body_bytes_must_be_positive():
    with pytest.raises(ValueError, match="max_body_bytes must be >= 1"):
        FrontConfig(served_model_name=MODEL, max_body_bytes=0)


# ---- no internals in answers ----------------------------------------------------------------------


def test_an_exception_in_a_handler_is_a_500_with_an_id_and_nothing_else(local, smollm2_tokenizer, caplog):
    caplog.set_level(logging.ERROR, logger="infer.api")
    engine = FailingEngine(local, raises=RuntimeError(SECRET))
    with serving(engine, smollm2_tokenizer) as url:
        for stream in (False, True):  # streaming fails before the 200, so it gets the same answer
            status, _, text = _http(f"{url}/v1/completions", {**SHORT, "stream": stream})
            assert status == 500
            _no_internals(text)
            error = _error(text)
            assert error["code"] == "internal_error" and error["type"] == "internal_error"
            error_id = error["message"].split("(id ")[1].split(")")[0]
            logged = [r for r in caplog.records if error_id in r.getMessage()]
            assert logged and logged[0].exc_info and SECRET in str(logged[0].exc_info[1])


def test_an_internal_failure_in_the_cluster_is_a_500_with_an_id(local, smollm2_tokenizer, caplog):
    caplog.set_level(logging.ERROR, logger="infer.api")
    engine = FailingEngine(local, error_code="internal", error=f"Traceback (most recent call last): {SECRET}")
    with serving(engine, smollm2_tokenizer) as url:
        status, _, text = _http(f"{url}/v1/completions", SHORT)
        assert status == 500 and _error(text)["code"] == "internal_error"
        _no_internals(text)
        assert any(SECRET in r.getMessage() for r in caplog.records)  # the log keeps what the client lacks
        engine.after = 2  # mid-stream: an SSE error event, then [DONE]
        status, _, text = _http(f"{url}/v1/completions", {**SHORT, "stream": True})
        events = _sse_events(text)
        assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error"
        _no_internals(text)
    asyncio.run(_all_blocks_free(local))


def test_unknown_routes_wrong_methods_and_bad_headers_answer_in_openais_shape(local, smollm2_tokenizer):
    with serving(local, smollm2_tokenizer) as url:
        status, _, text = _http(f"{url}/v1/nothing-here")
        assert status == 404 and _error(text)["type"] == "not_found_error" and "/v1/completions" in text
        status, headers, text = _http(f"{url}/v1/completions")  # GET on a POST route
        assert status == 405 and _error(text)["code"] == "method_not_allowed" and headers["Allow"] == "POST"
        status, _, text = _http(f"{url}/health", b"{}", method="POST")
        assert status == 405 and "POST" in _error(text)["message"]
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert _http(f"{url}{path}")[0] == 404
        raw = _raw(url, POST + b'Content-Length: 12\r\n\r\n{"model": 1}')
        status, body = _response(raw)
        assert status == 400 and body["error"]["param"] == "model"


# ---- API key --------------------------------------------------------------------------------------


def test_every_wrong_key_gets_the_same_401(local, smollm2_tokenizer):
    with serving(local, smollm2_tokenizer, api_key="s3cret") as url:
        wrong = [
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic s3cret"},
            {"Authorization": "s3cret"},
            {"Authorization": "Bearer s3cret-and-more"},
            {"Authorization": "Bearer "},
            {"Authorization": "Bearer s3cre"},
        ]
        answers = set()
        for headers in wrong:
            for path, body in (("/v1/models", None), ("/v1/completions", SHORT)):
                status, got, text = _http(f"{url}{path}", body, headers=headers)
                assert status == 401 and got["WWW-Authenticate"] == "Bearer"
                answers.add(text)
        assert len(answers) == 1
        assert _error(answers.pop())["code"] == "invalid_api_key"
        for scheme in ("Bearer", "bearer"):
            headers = {"Authorization": f"{scheme} s3cret"}
            assert _http(f"{url}/v1/completions", SHORT, headers=headers)[0] == 200


def test_the_key_comes_from_the_flag_a_file_or_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_api_key("flag", None, {"INFER_API_KEY": "env"}) == "flag"
    assert resolve_api_key(None, str(key_file), {"INFER_API_KEY": "env"}) == "from-file"
    assert resolve_api_key(None, None, {"INFER_API_KEY": "env"}) == "env"
    assert resolve_api_key(None, None, {}) is None
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key("flag", str(key_file), {})
    with pytest.raises(ValueError, match="cannot read it"):
        resolve_api_key(None, str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_api_key(None, str(tmp_path / "empty"), {})
    with pytest.raises(ValueError, match="INFER_API_KEY is set but empty"):
        resolve_api_key(None, None, {"INFER_API_KEY": " "})


@pytest.mark.parametrize("command", ["infer.client.api.server", "infer.client.serve"])
def test_a_missing_or_empty_key_file_stops_the_command_at_startup(tmp_path, command):
    empty = tmp_path / "empty"
    empty.write_text("")
    for path, words in ((tmp_path / "missing", "cannot read it"), (empty, "is empty")):
        argv = [sys.executable, "-m", command, "--api-key-file", str(path)]
        if command == "infer.client.api.server":
            argv += ["--coordinator", "tcp://127.0.0.1:1"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and words in done.stderr and str(path) in done.stderr


# ---- overload -------------------------------------------------------------------------------------


def test_past_the_fronts_limit_a_request_is_overloaded_at_once_and_accepted_ones_complete(
    slow_local, smollm2_tokenizer
):
    with serving(slow_local, smollm2_tokenizer, max_concurrent_requests=2, retry_after=3) as url:
        host, port = url.removeprefix("http://").split(":")
        payload = json.dumps({**LONG, "max_tokens": 60, "n": 2, "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=60) as sock:  # holds both slots
            sock.sendall(
                POST + b"Content-Type: application/json\r\n"
                b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
            )
            reader = sock.makefile("rb")
            assert b" 200 " in reader.readline()
            for body in (SHORT, {**SHORT, "stream": True}):  # a 503, not queued for a slot (then a 200)
                status, headers, text = _http(f"{url}/v1/completions", body)
                assert status == 503 and headers["Retry-After"] == "3"
                error = _error(text)
                assert error["code"] == "overloaded" and "--max-concurrent-requests" in error["message"]
            events = [json.loads(line[6:]) for line in reader if line.startswith(b"data: {")]
        finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]
        assert finish == ["length", "length"]  # the accepted request ran to the end
        assert _http(f"{url}/v1/completions", SHORT)[0] == 200  # and the slots are free again


@pytest.mark.parametrize("stream", [False, True])
def test_overloaded_from_the_cluster_is_a_503_with_retry_after(local, smollm2_tokenizer, stream):
    engine = FailingEngine(local, error_code="overloaded", error="the cluster is overloaded: every worker is full")
    with serving(engine, smollm2_tokenizer, retry_after=2) as url:
        status, headers, text = _http(f"{url}/v1/completions", {**SHORT, "stream": stream})
        assert status == 503 and headers["Retry-After"] == "2"
        error = _error(text)
        assert error["code"] == "overloaded" and "every worker is full" in error["message"]
        engine.after = 1
        if stream:  # after the 200: an SSE error event
            status, _, text = _http(f"{url}/v1/completions", {**SHORT, "stream": True})
            events = _sse_events(text)
            assert status == 200 and events[-2]["error"]["code"] == "overloaded" and events[-1] == "[DONE]"
    asyncio.run(_all_blocks_free(local))


# ---- per-request timeouts -------------------------------------------------------------------------


def test_a_request_past_its_timeout_is_a_504_and_its_kv_blocks_are_freed(slow_local, smollm2_tokenizer):
    with serving(slow_local, smollm2_tokenizer) as url:
        started = time.monotonic()
        status, _, text = _http(f"{url}/v1/completions", {**LONG, "timeout": 0.5, "n": 2})
        elapsed = time.monotonic() - started
        assert status == 504 and elapsed >= 0.5  # the deadline, not an early answer
        error = _error(text)
        assert error["code"] == "timeout" and error["type"] == "timeout_error" and "0.5 s" in error["message"]
        asyncio.run(_all_blocks_free(slow_local))
        chat = dict(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=150, ignore_eos=True, timeout=0.3
        )
        status, _, text = _http(f"{url}/v1/chat/completions", chat)
        assert status == 504 and _error(text)["code"] == "timeout"
        asyncio.run(_all_blocks_free(slow_local))
        status, _, text = _http(f"{url}/v1/completions", {**SHORT, "timeout": 60})  # time enough: served
        assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "length"


def test_a_stream_past_its_timeout_ends_with_an_error_event(slow_local, smollm2_tokenizer):
    with serving(slow_local, smollm2_tokenizer) as url:
        status, _, text = _http(f"{url}/v1/completions", {**LONG, "timeout": 1.0, "stream": True})
        events = _sse_events(text)
        assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
        tokens = [e for e in events[:-2] if e["choices"][0]["text"]]
        assert tokens and all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
        asyncio.run(_all_blocks_free(slow_local))


@pytest.mark.parametrize("timeout", [0, -1, 7 * 86400 + 1, "soon"])
def test_an_invalid_timeout_is_a_400_naming_it(local, smollm2_tokenizer, timeout):
    with serving(local, smollm2_tokenizer) as url:
        status, _, text = _http(f"{url}/v1/completions", {**SHORT, "timeout": timeout})
        assert status == 400 and _error(text)["param"] == "timeout"


# ---- hostile input --------------------------------------------------------------------------------


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


_BIG = 2**64
HOSTILE_COMPLETIONS = {  # name: (JSON body text, the field the 400 names)
    "100000-deep prompt": ('{"model": "tiny", "prompt": %s}' % _deep(100_000), "prompt"),
    "40-deep prompt": ('{"model": "tiny", "prompt": %s}' % _deep(40), "prompt"),
    "surrogate in prompt": ('{"model": "tiny", "prompt": "ab\\ud800cd"}', "prompt"),
    "surrogate in a prompt list": ('{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
    "surrogate in stop": ('{"model": "tiny", "prompt": "hi", "stop": "\\ud83d"}', "stop"),
    "surrogate in a stop list": ('{"model": "tiny", "prompt": "hi", "stop": ["x", "\\udc00"]}', "stop.1"),
    "2^64 top_k": (f'{{"model": "tiny", "prompt": "hi", "top_k": {_BIG}}}', "top_k"),
    "-2^63-1 top_k": (f'{{"model": "tiny", "prompt": "hi", "top_k": {-(2**63) - 1}}}', "top_k"),
    "2^64 stop_token_ids": (f'{{"model": "tiny", "prompt": "hi", "stop_token_ids": [1, {_BIG}]}}', "stop_token_ids.1"),
    "2^64 min_tokens": (f'{{"model": "tiny", "prompt": "hi", "min_tokens": {_BIG}}}', "min_tokens"),
    "2^64 max_tokens": (f'{{"model": "tiny", "prompt": "hi", "max_tokens": {_BIG}}}', "max_tokens"),
    "2^64 seed": (f'{{"model": "tiny", "prompt": "hi", "seed": {_BIG}}}', "seed"),
    "2^64 logprobs": (f'{{"model": "tiny", "prompt": "hi", "logprobs": {_BIG}}}', "logprobs"),
    "2^64 n": (f'{{"model": "tiny", "prompt": "hi", "n": {_BIG}}}', "n"),
    "2^64 token id": (f'{{"model": "tiny", "prompt": [3, {_BIG}]}}', "prompt.1"),
    "2^64 in a token-id list": (f'{{"model": "tiny", "prompt": [[3], [4, {_BIG}]]}}', "prompt.1.1"),
    # a union's deepest problem is named (the id below 0), not its first member's ("the prompt is no string")
    "negative token id": ('{"model": "tiny", "prompt": [3, -5]}', "prompt.1"),
    "negative id in a token-id list": ('{"model": "tiny", "prompt": [[3], [-1]]}', "prompt.1.0"),
    "5000-digit max_tokens": ('{"model": "tiny", "prompt": "hi", "max_tokens": %s}' % ("9" * 5000), "max_tokens"),
    "NaN temperature": ('{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature"),
    "1e400 timeout": ('{"model": "tiny", "prompt": "hi", "timeout": 1e400}', "timeout"),
    "-1e999 in logit_bias": ('{"model": "tiny", "prompt": "hi", "logit_bias": {"5": -1e999}}', "logit_bias.5"),
}
HOSTILE_CHATS = {
    "surrogate in content": (
        '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
        "messages.0.content",
    ),
    "surrogate in a content part": (
        '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udbff"}]}]}',
        "messages.0.content.0.text",
    ),
    "100000-deep content": (
        '{"model": "tiny", "messages": [{"role": "user", "content": %s}]}' % _deep(100_000),
        "messages",
    ),
    "2^64 max_completion_tokens": (
        f'{{"model": "tiny", "messages": [{{"role": "user", "content": "hi"}}], "max_completion_tokens": {_BIG}}}',
        "max_completion_tokens",
    ),
    "2^64 top_logprobs": (
        '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
        f'"logprobs": true, "top_logprobs": {_BIG}}}',
        "top_logprobs",
    ),
}


@pytest.fixture(scope="module")
def front_url(local, smollm2_tokenizer) -> Iterator[str]:
    with serving(local, smollm2_tokenizer) as url:
        yield url


@pytest.mark.parametrize(
    "path, name",
    [("/v1/completions", n) for n in HOSTILE_COMPLETIONS] + [("/v1/chat/completions", n) for n in HOSTILE_CHATS],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_hostile_body_is_a_400_naming_the_field(front_url, path, name, stream):
    text, param = {**HOSTILE_COMPLETIONS, **HOSTILE_CHATS}[name]
    if stream:
        text = text[:-1] + ', "stream": true}'
    status, _, answer = _http(f"{front_url}{path}", text.encode())
    assert status == 400, answer
    error = _error(answer)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param in error["message"]
    _no_internals(answer)


def test_a_body_that_is_no_object_or_not_json_is_a_400(front_url):
    bodies = (b"NaN", b"[1, 2]", _deep(100_000).encode(), b"\xff\xfe", b'{"model": "tiny", "prompt": 1e999')
    for raw in bodies:
        status, _, answer = _http(f"{front_url}/v1/completions", raw)
        assert status == 400 and _error(answer)["type"] == "invalid_request_error", answer


def _stream_lines(url: str, body: dict[str, Any], lines: list[bytes]) -> threading.Thread:
    """A thread that posts a streaming `body` and collects the response's lines into `lines`."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({**body, "stream": True}).encode()

    def run() -> None:
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(
                POST
                + b"Content-Type: application/json\r\nContent-Length: "
                + str(len(payload)).encode()
                + b"\r\n\r\n"
                + payload
            )
            lines.extend(sock.makefile("rb"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_20_mb_prompt_is_refused_at_once_while_a_stream_goes_on_and_health_stays_fast(slow_local, smollm2_tokenizer):
    huge = "hello world " * (20_000_000 // 12)
    with serving(slow_local, smollm2_tokenizer) as url:
        lines: list[bytes] = []
        streaming = _stream_lines(url, LONG, lines)
        bodies = [
            json.dumps({**SHORT, "prompt": huge}).encode(),
            json.dumps(dict(model=MODEL, messages=[{"role": "user", "content": huge}])).encode(),
        ]
        for path, body, param in (
            ("/v1/completions", bodies[0], "prompt"),
            ("/v1/chat/completions", bodies[1], "messages"),
        ):
            status, _, text = _http(f"{url}{path}", body)
            assert status == 400, status
            error = _error(text)
            assert error["param"] == param and error["code"] == "context_length_exceeded"
            # nothing was tokenized: the refusal says so (the length was bounded from the text)
            assert "256 tokens" in error["message"] and "without tokenizing" in error["message"]
            assert _http(f"{url}/health")[0] == 200  # the loop still answers while the stream goes on
        streaming.join(60)
        events = _sse_events(b"".join(lines).decode())
        assert events[-1] == "[DONE]"
        finish = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
        assert finish == ["length"]
        assert len([e for e in events[:-1] if e["choices"][0]["text"]]) > 0
    asyncio.run(_all_blocks_free(slow_local))


def test_a_prompt_just_under_the_size_bound_is_tokenized_and_gets_the_exact_count(front_url):
    text = "hello " * 300  # ~300 tokens, 1800 bytes: under the size bound, over the context of 256
    status, _, answer = _http(f"{front_url}/v1/completions", {**SHORT, "prompt": text})
    error = _error(answer)
    assert status == 400 and error["code"] == "context_length_exceeded" and "tokens" in error["message"]
    assert "without tokenizing" not in error["message"]


# ---- a stream always ends -------------------------------------------------------------------------


class CutEngine(FailingEngine):
    """An EngineClient whose streams stop after `after` real deltas: silently (`raises` None, the stream
    just ends with no final delta) or by raising `raises` (the real request is left; the engine aborts it)."""

    async def stream(self, prompt, params=None, *, request_id=None, timeout=None) -> AsyncIterator[RequestOutput]:
        inner = self.inner.stream(prompt, params, request_id=request_id, timeout=timeout)
        async with aclosing(inner) as deltas:
            n = 0
            async for delta in deltas:
                if n == self.after:
                    if self.raises is not None:
                        raise self.raises
                    return
                yield delta
                n += 1


@pytest.mark.parametrize("raises", [None, RuntimeError(SECRET)], ids=["ends-early", "raises"])
def test_a_stream_cut_mid_way_ends_with_an_error_event_and_done(local, smollm2_tokenizer, raises):
    engine = CutEngine(local, raises=raises, after=2)
    with serving(engine, smollm2_tokenizer) as url:
        status, _, text = _http(f"{url}/v1/completions", LONG)  # not streaming: a 500, not a cut answer
        assert status == 500 and _error(text)["code"] == "internal_error"
        _no_internals(text)
        request = urllib.request.Request(
            f"{url}/v1/completions",
            method="POST",
            data=json.dumps({**LONG, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=20) as r:  # a stream that never ends: timeout
            status, text = r.status, r.read().decode()
        events = _sse_events(text)
        assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error"
        assert len(events) == 4  # two token chunks, the error, [DONE]
        _no_internals(text)
    asyncio.run(_all_blocks_free(local))


@pytest.mark.parametrize(
    "code, status",
    [
        ("invalid_request", 400),
        ("overloaded", 503),
        ("unavailable", 503),
        ("client_too_slow", 503),
        ("client_lost", 503),
        ("timeout", 504),
        ("internal", 500),
    ],
)
def test_a_failed_requests_error_code_picks_the_status(code, status):
    from infer.client.api.errors import request_error as _request_error

    error = _request_error(
        RequestOutput(
            request_id="r", token_ids=[], text="", finished=True, finish_reason="error", error="why", error_code=code
        )
    )
    assert error.status == status
    assert (error.retry_after is not None) == (status == 503)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ],
)
def test_a_body_without_model_runs_on_the_default_model(front_url, path, body):
    """vLLM's: `model` may be left out (OpenAI's clients always send it; curl users often do not)."""
    status, _, answer = _http(f"{front_url}{path}", json.dumps(body).encode())
    assert status == 200, answer
    assert json.loads(answer)["model"] == MODEL
    status, _, answer = _http(f"{front_url}{path}", json.dumps({**body, "model": "other"}).encode())
    assert status == 404 and _error(answer)["code"] == "model_not_found", answer
