"""The OpenAI-compatible HTTP front: an ASGI app over any EngineClient (a cluster or an in-process engine).

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent events),
GET /v1/models, GET /health, GET /metrics; vLLM's POST /tokenize, POST /detokenize and GET /version.

The path of a request:
1. `_authorize` (401 without the API key when one is set: one answer for a missing header, another
   scheme or a wrong key), the body (413 past `max_body_bytes`, refused from Content-Length before it is
   read, or as soon as a chunked body passes it), `_parse` (400 for malformed or hostile JSON (body.py) or
   an invalid field, naming it), the model name (404 if it is not the served one).
2. Admission: 503 with Retry-After and code "overloaded" at once when this front already has
   `max_concurrent_requests` engine requests in flight; 503 "unavailable" when the cluster is stopping or
   no worker is healthy (a cluster view at most `view_max_age` old, refreshed by one stats round trip).
3. Prompts are tokenized here (chat: the tokenizer's chat template), so the length is checked against the
   cluster's context length before anything is sent (400, with both numbers). A text prompt is first
   checked by its size (protocol/prompt_limits.py: one too big to fit is refused untokenized); the body's
   JSON, the template and the tokenizer run on the front's tokenizer threads, never on the event loop.
4. One engine request per (prompt, choice), with the body's `timeout` as its deadline. Non-streaming: all
   run to the end, then one JSON answer.
   Streaming: the first delta of every request is awaited before the 200 goes out, so a request the
   cluster rejects still gets its proper status (400 / 503); then SSE chunks as deltas arrive, a usage
   chunk when asked for, and `data: [DONE]`.
5. A client that disconnects has its requests aborted: a watcher on the ASGI receive channel cancels the
   work (non-streaming and before the first byte), and the server cancels a stream whose client is gone;
   cancelling a stream aborts its request on the worker, which frees its KV blocks.
A stream always ends with `[DONE]`: a failure once the 200 is out (the cluster's, a timeout, an engine
stream that ends without a final delta, an exception here) is an SSE `error` event just before it.

Failed requests' error codes pick the status (`_request_error`): invalid_request 400, overloaded 503 (+
Retry-After: a queue on the way was full, nothing ran), unavailable, client_too_slow and client_lost 503 (the
last two: this front, the coordinator's client, fell behind or was cut off), timeout 504, anything else 500.
Nothing internal leaves the front: an unexpected exception, or an "internal" failure in the cluster, is
answered 500 with a short id and logged here, with its traceback, under the same id. Unknown routes (404),
wrong methods (405) and every other error also answer in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import importlib.metadata
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from infer.client.api.body import decode_body
from infer.client.api.reasoning import REASONING_PARSERS, ReasoningSplitter
from infer.client.api.tools import (
    PARSERS, TOOL_PARSERS, ToolCall, calls_of_required, default_parser, new_call_id, template_messages,
    tools_system_prompt
)
from infer.client.api.metrics import CONTENT_TYPE, FrontMetrics, RequestTracker
from infer.client.api.schemas import (
    ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, UpdateWeightsRequest
)
from infer.client.engine_client import EngineClient
from infer.client.inference_client import ClusterError
from infer.protocol.logsafe import safe
from infer.protocol.messages import ClusterStats
from infer.protocol.outputs import RequestOutput, TokenLogprobs
from infer.protocol.prompt_limits import max_token_bytes, prompt_size_error
from infer.protocol.sampling import SamplingParams
from infer.protocol.structured import StructuredOutputsParams, grammar_error

log = logging.getLogger("infer.api")

Body = TypeVar("Body", bound=BaseModel)
R = TypeVar("R")
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
API_KEY_ENV = "INFER_API_KEY"
try:
    VERSION = importlib.metadata.version("infer")
except importlib.metadata.PackageNotFoundError:   # running from a tree that was never installed
    VERSION = "0+unknown"
GRAMMAR_CHECK_TIMEOUT_S = 5.0
TOKENIZER_THREADS = 2   # body parsing, chat templates and tokenization run on these, never on the event loop


@dataclass(frozen=True)
class FrontConfig:
    """Options of one HTTP front. `served_model_name`: the name clients put in `model`."""

    served_model_name: str
    api_key: str | None = None
    max_concurrent_requests: int = 1024   # engine requests in flight through this front (n counts n times)
    health_timeout: float = 5.0           # seconds /health (and /metrics) wait for the cluster's answer
    view_max_age: float = 1.0             # seconds a cluster view serves admission before a fresh round trip
    retry_after: int = 1                  # seconds, in the Retry-After header of a 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES   # a larger request body is refused with 413
    tool_call_parser: str | None = None   # client/api/tools.py; None: the one the chat template's format calls for
    reasoning_parser: str | None = None   # client/api/reasoning.py; None: no reasoning_content

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to serve without a key)")
        for name in ("max_concurrent_requests", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("health_timeout", "view_max_age"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.retry_after < 0:
            raise ValueError(f"retry_after must be >= 0, got {self.retry_after}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")


def resolve_api_key(api_key: str | None, api_key_file: str | None,
                    environ: dict[str, str] | None = None) -> str | None:
    """The front's API key: `api_key` (a flag), else the first line of `api_key_file`, else $INFER_API_KEY
    (read here only; `environ` defaults to os.environ), else None (no key). ValueError, naming the source,
    for both flags at once, an unreadable or empty file, or an empty value."""
    if api_key is not None and api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise ValueError(f"--api-key-file {api_key_file}: cannot read it: {why}") from None
        if not key:
            raise ValueError(f"--api-key-file {api_key_file}: the file is empty (its first line is the key)")
        return key
    if api_key is None:
        api_key = (os.environ if environ is None else environ).get(API_KEY_ENV)
        if api_key is not None and not api_key.strip():
            raise ValueError(f"${API_KEY_ENV} is set but empty; unset it to serve without a key")
    elif not api_key.strip():
        raise ValueError("--api-key must not be empty")
    return None if api_key is None else api_key.strip()


@dataclass
class Job:
    """One engine request of an HTTP request: prompt `prompt_index`, choice `index` of the response."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    tracker: RequestTracker
    timeout: float | None = None
    priority: int = 0
    echo: str = ""                 # completions' `echo`: the prompt's text, shown before the first text
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None   # prompt tokens 1..

    def add(self, delta: RequestOutput) -> None:
        self.tracker.on_delta(delta)
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.num_prompt_tokens:
            self.num_prompt_tokens = delta.num_prompt_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason


class Front:
    """The handlers and the state they share; `build_app` wires them to routes."""

    def __init__(self, engine: EngineClient, tokenizer: Any, config: FrontConfig) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = FrontMetrics(config.served_model_name)
        self.in_flight = 0
        self._view: ClusterStats | None = None
        self._view_at = 0.0
        self._refresh: asyncio.Task | None = None
        self._token_text: dict[int, str] = {}
        self.created = int(time.time())
        self.token_bytes = max_token_bytes(tokenizer)   # bounds a text prompt's size before tokenizing it
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="infer-tokenize")
        # its own thread, so that a spec slow to parse never holds up tokenizing
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="infer-grammar-check")
        self._xgrammar: asyncio.Future | None = None
        self.tool_call_parser = config.tool_call_parser or default_parser(getattr(tokenizer, "chat_template", None))

    def close(self) -> None:
        """Stop the tokenizer threads (work already queued is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """`fn(*args, **kwargs)` on the tokenizer threads, so the event loop keeps serving meanwhile."""
        work = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    # ---- routes -----------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)

        async def token_ids(max_len: int) -> list[list[int]]:
            return await self._prompt_token_ids(body.prompts(), max_len)
        fmt = CompletionFormat(self, body)
        return await self._serve(request, body, token_ids, body.max_tokens, body.logprobs, fmt)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)

        async def token_ids(max_len: int) -> list[list[int]]:
            return [await self._chat_token_ids(body, max_len)]
        fmt = ChatFormat(self, body)
        return await self._serve(request, body, token_ids, body.max_new_tokens, body.num_logprobs, fmt)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt (or chat messages through the template) -> its token ids."""
        body = await self._parse(request, TokenizeRequest)
        max_len = await self._any_max_model_len()
        if body.prompt is not None:
            self._check_text_size(body.prompt, max_len, "prompt")
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self._off_loop(self._encode, body.prompt, add_special_tokens=special)
        else:
            messages = template_messages([m.as_template_message() for m in body.messages])
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            if tools and "tools" not in (self.tokenizer.chat_template or ""):   # as the chat endpoint renders it
                messages = [{"role": "system", "content": tools_system_prompt(tools)}, *messages]
            self._check_text_size("".join(m["content"] for m in messages), max_len, "messages")
            text = await self._off_loop(self._render_chat, messages, body.add_generation_prompt, tools,
                                        body.chat_template_kwargs)
            ids = await self._off_loop(self._encode, text, add_special_tokens=bool(body.add_special_tokens))
        strs = [self.token_text(t) for t in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids -> text."""
        body = await self._parse(request, DetokenizeRequest)
        max_len = await self._any_max_model_len()
        if len(body.tokens) > max_len:
            raise ApiError(400, f"tokens: {len(body.tokens)} token ids; at most the context length ({max_len})",
                           param="tokens")
        self._check_vocab("tokens", body.tokens)
        text = await self._off_loop(self.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    async def version(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"version": VERSION})

    async def _any_max_model_len(self) -> int:
        """The context length of the cluster's workers (healthy or not: tokenizing needs no worker)."""
        try:
            view = await self._cluster_view()
        except ApiError:
            view = self._view
        max_len = _max_model_len(view, healthy_only=False) if view is not None else None
        if max_len is None:
            raise self._unavailable("no worker has reported its context length yet")
        return max_len

    def _check_vocab(self, param: str, token_ids: list[int]) -> None:
        vocab = len(self.tokenizer)
        bad = next((t for t in token_ids if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        try:
            view = await self._cluster_view()
        except ApiError:
            view = self._view
        max_len = _max_model_len(view, healthy_only=False) if view is not None else None
        card = {"id": self.config.served_model_name, "object": "model", "created": self.created,
                "owned_by": "infer", "root": self.engine.model_id, "max_model_len": max_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        """200 only if a fresh round trip to the cluster shows it running with a healthy worker."""
        try:
            view = await self._cluster_view(fresh=True)
        except ApiError as e:
            return _unhealthy(e.message, self.config.retry_after)
        healthy = view.num_healthy_workers
        if view.state != "running" or healthy == 0:
            why = f"cluster is {view.state}" if view.state != "running" else "no healthy worker"
            return _unhealthy(why, self.config.retry_after, view)
        return JSONResponse({"status": "ok", "state": view.state, "healthy_workers": healthy,
                             "workers": len(view.workers)})

    async def update_weights(self, request: Request) -> Response:
        """POST /v1/update_weights {"model", "path", "on_running", "timeout"}: every engine loads the safetensors
        directory `path` (all or nothing); 200 {"weight_version": N} once all serve it. Behind the API key; through
        a cluster it needs the front's key to be an administrator's. 400 with the reason when the update is refused
        (a bad tensor, a path no worker reads, a suspended cluster): the old weights keep serving."""
        body = await self._parse(request, UpdateWeightsRequest)
        try:
            version = await self.engine.update_weights(body.path, on_running=body.on_running, timeout=body.timeout)
        except (ValueError, ClusterError) as e:
            raise ApiError(400, f"update_weights failed: {safe(e, 2000)}", param="path") from None
        return JSONResponse({"object": "weight_update", "weight_version": version, "path": body.path})

    async def metrics_text(self, request: Request) -> Response:
        try:
            view = await self._cluster_view(fresh=True)
        except ApiError:
            view = None
        return Response(self.metrics.exposition(view), media_type=CONTENT_TYPE)

    # ---- parsing ----------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        """401 unless the header is 'Authorization: Bearer <key>'. The key is compared in constant time,
        and a missing header, another scheme and a wrong key get the same answer."""
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        matches = hmac.compare_digest(token.strip().encode(), key.encode())
        if not (matches and scheme.lower() == "bearer"):
            raise ApiError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 past `max_body_bytes`: from Content-Length before reading anything,
        and while reading (a chunked body, or one longer than it said) as soon as it passes the limit."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, f"invalid Content-Length header {declared[:40]!r}")
            if int(declared) > limit:
                raise _too_large(f"{int(declared)} bytes", limit)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(f"more than {limit} bytes", limit)
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(499, "the client disconnected") from None
        return b"".join(chunks)

    async def _parse(self, request: Request, model: type[Body]) -> Body:
        self._authorize(request)
        raw = await self._read_body(request)
        data = await self._off_loop(decode_body, raw)   # 400 for what JSON allows and we cannot take
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        if body.model is not None and body.model != self.config.served_model_name:
            raise ApiError(404, f"the model {body.model[:200]!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", param="model", code="model_not_found")
        return body

    async def _prompt_token_ids(self, prompts: list[str | list[int]], max_len: int) -> list[list[int]]:
        """Every prompt checked against the context without tokenizing, then tokenized off the loop."""
        for prompt in prompts:
            self._check_prompt(prompt, max_len, "prompt")
        return [prompt if isinstance(prompt, list) else
                await self._off_loop(self._encode, prompt, add_special_tokens=True) for prompt in prompts]

    def _check_prompt(self, prompt: str | list[int], max_len: int, param: str) -> None:
        """400 for an empty prompt, a token id outside the vocabulary, or a prompt that cannot fit the
        context: token ids by their count, text by its size (prompt_limits), both without tokenizing."""
        if not prompt:
            raise ApiError(400, f"{param} must not be empty", param=param)
        if isinstance(prompt, str):
            return self._check_text_size(prompt, max_len, param)
        _check_length(len(prompt), None, max_len)
        vocab = len(self.tokenizer)
        if max(prompt) >= vocab:
            bad = next(t for t in prompt if t >= vocab)
            raise ApiError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def _check_text_size(self, text: str, max_len: int, param: str) -> None:
        too_long = prompt_size_error(text, max_len, self.token_bytes)
        if too_long is not None:
            raise ApiError(400, f"{param}: {too_long}", param=param, code="context_length_exceeded")

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    async def _chat_token_ids(self, body: ChatCompletionRequest, max_len: int) -> list[int]:
        """The chat template's text, tokenized; the messages' content is checked against the context before
        the template runs, and the text before it is tokenized (both off the loop)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        messages = template_messages([m.as_template_message() for m in body.messages])
        tools = body.tool_dicts if body.tool_mode is not None else None
        if tools and "tools" not in self.tokenizer.chat_template:   # a template that ignores `tools`
            messages = [{"role": "system", "content": tools_system_prompt(tools)}, *messages]
        self._check_text_size("".join(m["content"] for m in messages) + json.dumps(tools or []), max_len, "messages")
        text = await self._off_loop(self._render_chat, messages, body.add_generation_prompt, tools,
                                    body.chat_template_kwargs)
        self._check_text_size(text, max_len, "messages")
        return await self._off_loop(self._encode, text, add_special_tokens=False)

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except Exception as e:   # the template's own checks (jinja raise_exception), e.g. role order
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    # ---- admission --------------------------------------------------------------------------------

    async def _cluster_view(self, fresh: bool = False) -> ClusterStats:
        """The cluster's stats, at most `view_max_age` old (or fresh); one round trip serves every waiter."""
        age = time.monotonic() - self._view_at
        if not fresh and self._view is not None and age < self.config.view_max_age:
            return self._view
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._fetch_view())
        return await asyncio.shield(self._refresh)

    async def _fetch_view(self) -> ClusterStats:
        try:
            view = await asyncio.wait_for(self.engine.stats(), self.config.health_timeout)
        except (ClusterError, asyncio.TimeoutError) as e:
            raise ApiError(503, f"the cluster did not answer: {e or 'timed out'}", code="unavailable",
                           retry_after=self.config.retry_after) from None
        self._view, self._view_at = view, time.monotonic()
        return view

    def _reserve(self, num_requests: int) -> None:
        """Count `num_requests` engine requests in flight, or 503 "overloaded" at once past the limit. The
        caller releases them (`in_flight -= n`) when they end; a StreamRun does it in close()."""
        limit = self.config.max_concurrent_requests
        if self.in_flight + num_requests > limit:
            raise ApiError(503, f"the server is overloaded: {self.in_flight} requests in flight, its limit "
                                f"is {limit} (--max-concurrent-requests); retry later", code="overloaded",
                           retry_after=self.config.retry_after)
        self.in_flight += num_requests

    async def _admit(self) -> int:
        """The context length to check prompts against; ApiError 503 when the cluster cannot take them."""
        view = await self._cluster_view()
        if view.state == "stopped":
            raise self._unavailable("the cluster is stopping")
        max_len = _max_model_len(view)
        if max_len is None:
            if view.state == "running":
                raise self._unavailable("no worker is available to serve the request")
            max_len = _max_model_len(view, healthy_only=False) or 0
        return max_len

    def _unavailable(self, message: str) -> ApiError:
        return ApiError(503, message, code="unavailable", retry_after=self.config.retry_after)

    # ---- running requests -------------------------------------------------------------------------

    async def _serve(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                     token_ids: Callable[[int], Awaitable[list[list[int]]]], max_tokens: int | None,
                     logprobs: int | None, fmt: ResponseFormat) -> Response:
        """`token_ids(max_len)`: the prompts' token ids, or a 400 for a prompt that cannot fit max_len."""
        num_prompts = len(body.prompts()) if isinstance(body, CompletionRequest) else 1
        num_requests = num_prompts * _candidates(body)
        for param, ids in body.token_id_fields().items():
            self._check_vocab(param, ids)
        structured = await self._structured(body)
        self._reserve(num_requests)
        run: StreamRun | None = None
        try:
            max_len = await self._admit()
            prompts = await token_ids(max_len)
            for ids in prompts:
                _check_length(len(ids), max_tokens, max_len)
            jobs = self._jobs(fmt.id, prompts, body, max_tokens, logprobs, structured)
            if not body.stream:
                await _cancel_on_disconnect(request, self._run_to_end(jobs))
                return JSONResponse(fmt.response(_best(jobs, body.n), usage_of=jobs))
            run = StreamRun(self, jobs)   # releases the reservation in close()
        finally:
            if run is None:
                self.in_flight -= num_requests
        await _cancel_on_disconnect(request, run.start())   # on failure, start() closed the run
        return _EventStream(self._sse(run, fmt, body.include_usage), run)

    async def _structured(self, body: Any) -> StructuredOutputsParams | None:
        """The body's output constraint, parsed by xgrammar on the front's grammar thread (400 naming the field
        if it does not parse, or if parsing takes longer than GRAMMAR_CHECK_TIMEOUT_S)."""
        given = body.structured_spec()
        if given is None:
            return None
        param, spec = given
        if self._xgrammar is None:   # imported on first use, on the grammar thread (seconds: not on the clock)
            self._xgrammar = asyncio.wrap_future(self._grammar_pool.submit(importlib.import_module, "xgrammar"))
        await asyncio.shield(self._xgrammar)
        check = asyncio.get_running_loop().run_in_executor(self._grammar_pool, grammar_error, spec)
        try:
            error = await asyncio.wait_for(check, GRAMMAR_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(400, f"{param}: checking it took longer than {GRAMMAR_CHECK_TIMEOUT_S:g} s; simplify it",
                           param=param) from None
        if error is not None:
            raise ApiError(400, f"{param}: {error}", param=param)
        return spec

    def _jobs(self, base_id: str, prompts: list[list[int]], body: Any, max_tokens: int | None,
              logprobs: int | None, structured: StructuredOutputsParams | None = None) -> list[Job]:
        jobs = []
        candidates = _candidates(body)
        if candidates > body.n and logprobs is None:
            logprobs = 0      # best_of ranks candidates by the sum of their sampled tokens' logprobs
        echoes = body.prompts() if getattr(body, "echo", False) else None
        for p, ids in enumerate(prompts):
            echo = "" if echoes is None else (echoes[p] if isinstance(echoes[p], str)
                                              else self.tokenizer.decode(ids))
            for c in range(candidates):
                index = p * candidates + c
                try:
                    params = body.sampling_params(max_tokens, logprobs, seed_offset=c, structured=structured,
                                                  prompt_logprobs=getattr(body, "prompt_logprobs_wanted",
                                                                          body.prompt_logprobs))
                except ValueError as e:
                    raise ApiError(400, str(e)) from None
                jobs.append(Job(index, p, ids, params, f"{base_id}-{index}", self.metrics.tracker(),
                                body.timeout, body.priority, echo=echo))
        return jobs

    def engine_stream(self, job: Job) -> AsyncIterator[RequestOutput]:
        """The engine request of `job`, with its deadline."""
        extra = {"priority": job.priority} if job.priority else {}   # engine clients older than priorities work on
        return self.engine.stream(job.prompt_token_ids, job.params, request_id=job.request_id,
                                  timeout=job.timeout, **extra)

    async def _run_to_end(self, jobs: list[Job]) -> None:
        async def one(job: Job) -> None:
            async for delta in self.engine_stream(job):
                job.add(delta)
                if delta.finish_reason == "error":
                    raise _request_error(delta, self.config.retry_after)
            if job.finish_reason is None:
                raise _ended_early(job)
        try:
            await _gather_or_cancel([one(job) for job in jobs])
        except ClusterError as e:
            raise self._unavailable(f"the cluster failed: {e}") from None

    async def _sse(self, run: StreamRun, fmt: ResponseFormat, include_usage: bool) -> AsyncIterator[str]:
        """The events of a stream whose 200 went out: chunks, then `[DONE]` however it ends (an error of
        the cluster or of this front is an `error` event first). Only cancellation (the client is gone)
        ends it otherwise."""
        try:
            for chunk in fmt.opening_chunks(run.jobs):
                yield _event(chunk)
            async for job, delta in run.deltas():
                if delta.finish_reason == "error":
                    yield _event(_request_error(delta, self.config.retry_after).body())
                    break
                for chunk in fmt.chunks(job, delta):
                    yield _event(chunk)
            else:
                if include_usage:
                    yield _event(fmt.usage_chunk(run.jobs))
        except ApiError as e:
            yield _event(e.body())
        except Exception:   # the 200 went out already: the client gets an error event, the log the details
            yield _event(internal_error("a response stream").body())
        yield "data: [DONE]\n\n"

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


class StreamRun:
    """The engine requests of one streaming HTTP request, merged into one sequence of (job, delta).

    One pump task per job feeds a shared queue. `start()` returns once every job has its first delta (or
    one failed); those are replayed first by `deltas()`. `close()` cancels the pumps, which aborts every
    request not finished yet.
    """

    def __init__(self, front: Front, jobs: list[Job]) -> None:
        self.front = front
        self.jobs = jobs
        self._queue: asyncio.Queue[tuple[Job, RequestOutput | BaseException]] = asyncio.Queue()
        self._buffer: list[tuple[Job, RequestOutput]] = []
        self._pumps: list[asyncio.Task] = []
        self._unfinished = len(jobs)
        self._closed = False   # the front counted len(jobs) in flight (Front._reserve); close() releases them

    async def start(self) -> None:
        self._pumps = [asyncio.create_task(self._pump(job)) for job in self.jobs]
        started: set[int] = set()
        try:
            while len(started) < len(self.jobs):
                job, delta = await self._next()
                if delta.finish_reason == "error":
                    raise _request_error(delta, self.front.config.retry_after)
                started.add(job.index)
                self._buffer.append((job, delta))
        except BaseException:
            await self.close()
            raise

    async def deltas(self) -> AsyncIterator[tuple[Job, RequestOutput]]:
        buffered, self._buffer = self._buffer, []
        for job, delta in buffered:
            yield job, self._account(job, delta)
        while self._unfinished:
            job, delta = await self._next()
            yield job, self._account(job, delta)

    def _account(self, job: Job, delta: RequestOutput) -> RequestOutput:
        job.add(delta)
        if delta.finished:
            self._unfinished -= 1
        return delta

    async def _next(self) -> tuple[Job, RequestOutput]:
        job, item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return job, item

    async def _pump(self, job: Job) -> None:
        finished = False
        try:
            async for delta in self.front.engine_stream(job):
                finished = delta.finished
                self._queue.put_nowait((job, delta))
            if not finished:   # the reader waits for a final delta: it gets an error instead
                self._queue.put_nowait((job, _ended_early(job)))
        except ClusterError as e:
            self._queue.put_nowait((job, ApiError(503, f"the cluster failed: {e}", code="unavailable",
                                                  retry_after=self.front.config.retry_after)))
        except Exception:   # never leave the reader waiting for a delta that cannot come
            self._queue.put_nowait((job, internal_error(f"engine request {job.request_id}")))

    async def close(self) -> None:
        """Cancel the pumps (aborting unfinished requests) and release the front's capacity; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.front.in_flight -= len(self.jobs)
        for task in self._pumps:
            task.cancel()
        if self._pumps:
            await asyncio.gather(*self._pumps, return_exceptions=True)


class _EventStream(StreamingResponse):
    """Server-sent events whose StreamRun is closed however the response ends: finished, failed, or
    cancelled because the client went away (possibly before the generator ever ran)."""

    def __init__(self, content: AsyncIterator[str], run: StreamRun) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.run.close()


# ---- response shapes ------------------------------------------------------------------------------

class ResponseFormat:
    """How one endpoint shapes its JSON: the whole response, stream chunks, the usage chunk."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, front: Front, body: Any) -> None:
        self.front = front
        self.body = body
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = body.model

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def response(self, jobs: list[Job], usage_of: list[Job] | None = None) -> dict[str, Any]:
        """The whole answer with `jobs` as its choices; usage counts `usage_of` (every candidate of best_of)."""
        out = self._envelope(self.object_name, [self.choice(job) for job in jobs])
        out["usage"] = _usage(jobs if usage_of is None else usage_of)
        return out

    def usage_chunk(self, jobs: list[Job]) -> dict[str, Any]:
        out = self._envelope(self.chunk_object_name, [])
        out["usage"] = _usage(jobs)
        return out

    def opening_chunks(self, jobs: list[Job]) -> list[dict[str, Any]]:
        return []

    def choice(self, job: Job) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(self, job: Job, delta: RequestOutput) -> list[dict[str, Any]]:
        """The SSE chunks of one delta (`job` has taken it in already); none for a delta with nothing to
        show (no text, logprobs or end)."""
        if not delta.text and not delta.finished and not delta.logprobs:
            return []
        return [self._envelope(self.chunk_object_name, [self.chunk_choice(job, delta)])]

    def chunk_choice(self, job: Job, delta: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def choice(self, job: Job) -> dict[str, Any]:
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = self._logprobs(job.token_ids, job.logprobs, len(job.echo))
            if self.body.echo:
                logprobs = self._with_prompt(job, logprobs)
        out = {"index": job.index, "text": job.echo + job.text, "finish_reason": job.finish_reason,
               "logprobs": logprobs}
        if self.body.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs_json(self.front, job, self.body.prompt_logprobs)
        return out

    def _with_prompt(self, job: Job, completion: dict[str, Any]) -> dict[str, Any]:
        """echo with logprobs: the prompt's tokens first (the first with no logprob), then the completion's."""
        rows = job.prompt_logprobs or []
        ids = job.prompt_token_ids
        head = self._logprobs(ids[1:], rows, 0)
        first = self.front.token_text(ids[0])
        offsets = [0] + [o + len(first) for o in head["text_offset"]]
        return {"tokens": [first, *head["tokens"], *completion["tokens"]],
                "token_logprobs": [None, *head["token_logprobs"], *completion["token_logprobs"]],
                "top_logprobs": [None, *head["top_logprobs"], *completion["top_logprobs"]],
                "text_offset": [*offsets, *completion["text_offset"]]}

    def chunk_choice(self, job: Job, delta: RequestOutput) -> dict[str, Any]:
        logprobs = None
        if self.body.logprobs is not None and delta.logprobs:
            start = len(job.text) - len(delta.text)
            logprobs = self._logprobs(delta.token_ids, delta.logprobs, start)
        text, job.echo = job.echo + delta.text, ""     # the prompt's text goes out once, before the first text
        return {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    def _logprobs(self, token_ids: list[int], rows: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        text = self.front.token_text
        n = self.body.logprobs or 0
        tokens, token_lps, tops, offsets = [], [], [], []
        for token_id, row in zip(token_ids, rows):
            piece = text(token_id)
            tokens.append(piece)
            token_lps.append(_finite(row.get(token_id)))
            tops.append({text(t): _finite(lp) for t, lp in _top(row, n)})
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, front: Front, body: Any) -> None:
        super().__init__(front, body)
        self.tool_mode = body.tool_mode
        self.reasoning = front.config.reasoning_parser
        self.parse_tools = PARSERS[front.tool_call_parser]
        self._splitters: dict[int, ReasoningSplitter] = {}

    def choice(self, job: Job) -> dict[str, Any]:
        message, finish_reason = self._message(job)
        out = {"index": job.index, "message": message,
               "logprobs": self._logprobs(job.token_ids, job.logprobs) if job.params.logprobs is not None
               else None, "finish_reason": finish_reason}
        if self.body.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs_json(self.front, job, self.body.prompt_logprobs)
        return out

    def _message(self, job: Job) -> tuple[dict[str, Any], str | None]:
        """A finished job's assistant message (reasoning split off, tool calls parsed) and its finish_reason
        ("tool_calls" when it called tools)."""
        reasoning, content = ReasoningSplitter(self.reasoning).split(job.text) if self.reasoning else (None, job.text)
        calls: list[ToolCall] = []
        if self.tool_mode is not None and content:
            content, calls = self._tool_calls(content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, "tool_calls" if calls and job.finish_reason == "stop" else job.finish_reason

    def _tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.tool_mode == "named":
            try:
                arguments = json.loads(text)
            except ValueError:
                return text, []            # cut short by max_tokens: the text as it is
            name = self.body.tool_choice.function.name
            return None, [ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_call_id())]
        if self.tool_mode == "required":
            calls = calls_of_required(text)
            return (text, []) if calls is None else (None, calls)
        return self.parse_tools(text)

    def chunks(self, job: Job, delta: RequestOutput) -> list[dict[str, Any]]:
        if self.tool_mode is not None:
            return self._tool_chunks(job) if delta.finished else []
        if self.reasoning:
            return self._reasoning_chunks(job, delta)
        return super().chunks(job, delta)

    def _tool_chunks(self, job: Job) -> list[dict[str, Any]]:
        """With tools the stream is buffered: tool calls are known only once the output is. Then, OpenAI's
        shape: reasoning, content, per call its id and name, then its arguments, then the finish."""
        message, finish_reason = self._message(job)
        deltas: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            deltas.append({"reasoning_content": message["reasoning_content"]})
        if message["content"]:
            deltas.append({"content": message["content"]})
        for i, call in enumerate(message.get("tool_calls", [])):
            function = call["function"]
            deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                           "function": {"name": function["name"], "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": function["arguments"]}}]})
        out = [self._chunk_of(job, d, None) for d in deltas]
        return out + [self._chunk_of(job, {}, finish_reason)]

    def _reasoning_chunks(self, job: Job, delta: RequestOutput) -> list[dict[str, Any]]:
        splitter = self._splitters.setdefault(job.index, ReasoningSplitter(self.reasoning))
        reasoning, content = splitter.feed(delta.text)
        if delta.finished:
            rest = splitter.finish()
            reasoning, content = reasoning + rest[0], content + rest[1]
        fields = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
        if not fields and not delta.finished:
            return []
        return [self._chunk_of(job, fields, delta.finish_reason)]

    def _chunk_of(self, job: Job, fields: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return self._envelope(self.chunk_object_name, [{"index": job.index, "delta": fields, "logprobs": None,
                                                        "finish_reason": finish_reason}])

    def opening_chunks(self, jobs: list[Job]) -> list[dict[str, Any]]:
        return [self._envelope(self.chunk_object_name, [{"index": job.index, "delta": {"role": "assistant",
                                                                                       "content": ""},
                                                         "logprobs": None, "finish_reason": None}])
                for job in jobs]

    def chunk_choice(self, job: Job, delta: RequestOutput) -> dict[str, Any]:
        logprobs = None
        if job.params.logprobs is not None and delta.logprobs:
            logprobs = self._logprobs(delta.token_ids, delta.logprobs)
        content = {"content": delta.text} if delta.text or not delta.finished else {}
        return {"index": job.index, "delta": content, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}

    def _logprobs(self, token_ids: list[int], rows: list[TokenLogprobs]) -> dict[str, Any]:
        text = self.front.token_text
        n = self.body.top_logprobs or 0
        content = []
        for token_id, row in zip(token_ids, rows):
            piece = text(token_id)
            top = [{"token": text(t), "logprob": _finite(lp), "bytes": list(text(t).encode())}
                   for t, lp in _top(row, n)]
            content.append({"token": piece, "logprob": _finite(row.get(token_id)),
                            "bytes": list(piece.encode()), "top_logprobs": top})
        return {"content": content}


# ---- helpers --------------------------------------------------------------------------------------

def prompt_logprobs_json(front: Front, job: Job, n: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {id: {logprob,
    decoded_token}} for the token itself and the top n."""
    out: list[dict[str, Any] | None] = [None]
    for token_id, row in zip(job.prompt_token_ids[1:], job.prompt_logprobs or []):
        keep = dict(_top(row, n))
        keep[token_id] = row.get(token_id)
        out.append({str(t): {"logprob": _finite(lp), "decoded_token": front.token_text(t)} for t, lp in keep.items()})
    return out


def _candidates(body: Any) -> int:
    """Engine requests per prompt: completions' best_of (>= n) when given, else n."""
    return getattr(body, "best_of", None) or body.n


def _best(jobs: list[Job], n: int) -> list[Job]:
    """Per prompt, the n candidates with the highest sum of sampled-token logprobs (OpenAI's best_of),
    renumbered as choices 0..n-1 of their prompt; all of them when there are no more than n."""
    by_prompt: dict[int, list[Job]] = {}
    for job in jobs:
        by_prompt.setdefault(job.prompt_index, []).append(job)
    if all(len(group) <= n for group in by_prompt.values()):
        return jobs
    chosen = []
    for p, group in sorted(by_prompt.items()):
        ranked = sorted(group, key=lambda job: -sum(_finite(row.get(t)) for t, row in zip(job.token_ids,
                                                                                              job.logprobs)))
        for rank, job in enumerate(ranked[:n]):
            job.index = p * n + rank
            chosen.append(job)
    return chosen


def _top(row: TokenLogprobs, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of a logprobs row (the row holds the top n plus the sampled token)."""
    return sorted(row.items(), key=lambda kv: -kv[1])[:n]


def _finite(value: float | None) -> float:
    """JSON has no -inf: a token the sampler could not pick (masked) reports OpenAI's floor, -9999."""
    if value is None or value != value or value == float("-inf"):
        return -9999.0
    return value


def _usage(jobs: list[Job]) -> dict[str, int]:
    per_prompt = {job.prompt_index: job.num_prompt_tokens or len(job.prompt_token_ids) for job in jobs}
    prompt = sum(per_prompt.values())
    completion = sum(len(job.token_ids) for job in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _event(payload: dict[str, Any]) -> str:
    """One SSE event; text that is not valid Unicode (it cannot be sent as UTF-8) goes \\u-escaped."""
    text = json.dumps(payload, separators=(',', ':'), ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(payload, separators=(',', ':'))
    return f"data: {text}\n\n"


def _max_model_len(view: ClusterStats, healthy_only: bool = True) -> int | None:
    lens = [w.max_model_len for w in view.workers if w.healthy or not healthy_only]
    return min(lens) if lens else None


def _check_length(num_prompt: int, max_tokens: int | None, max_len: int) -> None:
    if num_prompt >= max_len:
        raise ApiError(400, f"this model's maximum context length is {max_len} tokens, but the prompt has "
                            f"{num_prompt} tokens; shorten it to leave room for at least one generated token",
                       param="prompt", code="context_length_exceeded")
    if max_tokens is not None and num_prompt + max_tokens > max_len:
        raise ApiError(400, f"this model's maximum context length is {max_len} tokens, but "
                            f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt, "
                            f"{max_tokens} in the completion); reduce the prompt or max_tokens",
                       param="max_tokens", code="context_length_exceeded")


# Failures of the cluster or of this front's link to it, not of the request: 503 + Retry-After. The front is
# the coordinator's client, so client_too_slow / client_lost mean this process fell behind or was cut off.
_RETRY_LATER = ("overloaded", "unavailable", "client_too_slow", "client_lost")


def _request_error(delta: RequestOutput, retry_after: int = 1) -> ApiError:
    """The answer to a request the cluster failed, by its error code. An internal failure's text stays in
    this front's log (it may quote exceptions); the client gets its id."""
    message = delta.error or "the request failed"
    code = delta.error_code
    if code == "invalid_request":
        return ApiError(400, message)
    if code in _RETRY_LATER:
        return ApiError(503, message, code=code, retry_after=retry_after)
    if code == "timeout":
        return ApiError(504, message, code="timeout")
    return internal_error(f"engine request {delta.request_id}", detail=f"{code}: {message}")


def _ended_early(job: Job) -> ApiError:
    return internal_error(f"engine request {job.request_id}", detail="its stream ended without a final delta")


def internal_error(where: str, detail: str | None = None) -> ApiError:
    """A 500 that reveals nothing but a short id; the log gets the id with `detail`, or the exception being
    handled and its traceback."""
    error_id = uuid.uuid4().hex[:12]
    if detail is None:
        log.exception("internal error %s in %s", error_id, where)
    else:
        log.error("internal error %s in %s: %s", error_id, safe(where), safe(detail, 2000))   # the cluster's text
    return ApiError(500, f"internal server error (id {error_id}); the server log has the details under "
                         f"this id", code="internal_error")


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body is {size}; the limit is {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


def _validation_error(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    param = ".".join(str(part) for part in first["loc"] if not _is_union_tag(part)) or None
    given = first.get("input")
    detail = first["msg"]
    if first["type"] not in ("missing", "extra_forbidden"):
        detail += f" (got {json.dumps(given, default=str)[:80]})"
    if first["type"] == "extra_forbidden":
        detail = "unknown field"
    more = f" (and {len(e.errors()) - 1} more problem(s))" if len(e.errors()) > 1 else ""
    return ApiError(400, f"{param}: {detail}{more}" if param else f"{detail}{more}", param=param)


def _is_union_tag(part: Any) -> bool:
    """pydantic names union members in `loc` (e.g. 'list[str]', 'function-after[...]'); not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))


def _unhealthy(why: str, retry_after: int, view: ClusterStats | None = None) -> JSONResponse:
    body: dict[str, Any] = {"status": "unavailable", "reason": why}
    if view is not None:
        body.update(state=view.state, healthy_workers=view.num_healthy_workers, workers=len(view.workers))
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(retry_after)})


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, work: Awaitable[None]) -> None:
    """Await `work`; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_until_disconnected(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ApiError(499, "the client disconnected")
    task.result()


async def _gather_or_cancel(coros: list[Awaitable[None]]) -> None:
    """Run all; the first exception cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- the app --------------------------------------------------------------------------------------

def build_app(engine: EngineClient, tokenizer: Any, config: FrontConfig) -> FastAPI:
    """The ASGI app of one front. Every error leaves as OpenAI's error body; bad input never gets a 500,
    and no answer carries a traceback, an exception's text or a path."""
    front = Front(engine, tokenizer, config)
    app = FastAPI(title="infer", version="0.1.0", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.front = front

    def route(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as e:
                return _error_response(e)
            except Exception:
                return _error_response(internal_error(f"{request.method} {request.url.path}"))
        endpoint.__name__ = handler.__name__
        return endpoint

    app.add_api_route("/v1/completions", route(front.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", route(front.chat_completions), methods=["POST"])
    app.add_api_route("/v1/models", route(front.models), methods=["GET"])
    app.add_api_route("/health", route(front.health), methods=["GET"])
    app.add_api_route("/metrics", route(front.metrics_text), methods=["GET"])
    app.add_api_route("/tokenize", route(front.tokenize), methods=["POST"])
    app.add_api_route("/detokenize", route(front.detokenize), methods=["POST"])
    app.add_api_route("/version", route(front.version), methods=["GET"])
    app.add_api_route("/v1/update_weights", route(front.update_weights), methods=["POST"])

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:   # 404, 405, ...
        if exc.status_code == 404:
            error = ApiError(404, f"no route {request.url.path[:200]!r}; the routes are POST "
                                  "/v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, "
                                  "GET /metrics, POST /tokenize, POST /detokenize, GET /version",
                             code="not_found")
        elif exc.status_code == 405:
            error = ApiError(405, f"method {request.method} is not allowed on {request.url.path[:200]!r}",
                             code="method_not_allowed", headers=exc.headers)
        else:
            error = ApiError(exc.status_code, _http_phrase(exc.status_code), headers=exc.headers)
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(ApiError(400, "invalid request"))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(internal_error(f"{request.method} {request.url.path}"))

    return app


def _error_response(error: ApiError) -> JSONResponse:
    headers = dict(error.headers)
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return JSONResponse(error.body(), status_code=error.status, headers=headers or None)


def _http_phrase(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"
