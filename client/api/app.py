"""The OpenAI-compatible HTTP front's routes: an ASGI app over any EngineClient (a cluster or an in-process engine).
Beside it: `admission.py` (the API key, admission), `formats.py` (OpenAI's response objects and stream chunks),
`errors.py` (error codes to statuses, the error body).

Routes (an unknown path's 404 lists them from the app: `route_list`): POST /v1/completions, POST
/v1/chat/completions (both with `stream: true` as server-sent events), POST /v1/embeddings, GET /v1/models (the
served model and its LoRA adapters, each with `parent`), GET /health, GET /metrics; vLLM's POST /tokenize, POST
/detokenize, GET /version, POST /v1/load_lora_adapter and /v1/unload_lora_adapter; POST /v1/update_weights; POST
/v1/requests/{id}/cancel (cancel.py: by the caller that sent it, or the admin key).

The path of a request:
1. `authorize` (admission.py: 401 without the API key when one is set: one answer for a missing header, another
   scheme or a wrong key), the body (413 past `max_body_bytes`, refused from Content-Length before it is
   read, or as soon as a chunked body passes it), `_parse` (400 for malformed or hostile JSON (body.py) or
   an invalid field, naming it), the model name (404 if it is neither the served model nor a LoRA adapter; an
   adapter's name runs the request with it: SamplingParams.lora_name).
2. Admission: 503 with Retry-After and code "overloaded" at once when this front already has
   `max_concurrent_requests` engine requests in flight (400 "too_many_engine_requests" for a request of more
   engine requests than that limit: it could never pass); 503 "unavailable" when the cluster is stopping or
   no worker is healthy (a cluster view at most `view_max_age` old, refreshed by one stats round trip).
3. Prompts are tokenized here, with the tokenizer of the model the request runs on (tokenization.py: 503 when
   this front cannot read it; chat: that tokenizer's chat template), so the length is checked against the
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

Failed requests' error codes pick the status (`errors.request_error`): invalid_request 400 (404 model_not_found
when the request's LoRA adapter is gone: unloaded elsewhere since this front last listed them), overloaded 503 (+
Retry-After: a queue on the way was full, nothing ran), unavailable, client_too_slow and client_lost 503 (the
last two: this front, the coordinator's client, fell behind or was cut off), timeout 504, anything else 500.
Nothing internal leaves the front: an unexpected exception, or an "internal" failure in the cluster, is
answered 500 with a short id and logged here, with its traceback, under the same id. Unknown routes (404),
wrong methods (405) and every other error also answer in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar, cast

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from infer.client.api.admission import Admission, authorize, check_length, max_model_len
from infer.client.api.body import decode_body
from infer.client.api.cancel import Cancellable, Cancellations, bearer_digest, caller_request_id
from infer.client.api.config import FrontConfig
from infer.client.api.errors import (
    ended_early,
    error_response,
    http_phrase,
    internal_error,
    request_error,
    too_large,
    unhealthy,
    validation_error,
)
from infer.client.api.formats import (
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    beam_choices,
    best_of,
    embedding_json,
    num_candidates,
    sse_event,
)
from infer.client.api.jobs import Job
from infer.client.api.metrics import CONTENT_TYPE, FrontMetrics
from infer.client.api.schemas import (
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    UpdateWeightsRequest,
)
from infer.client.api.tokenization import Tokenization, Tokenizations
from infer.client.api.tools import template_messages, tools_system_prompt
from infer.client.engine_client import ClusterError, EngineClient
from infer.protocol.codes import ClusterState, ErrorCode, FinishReason
from infer.protocol.logsafe import safe
from infer.protocol.messages import MAX_SESSION_ID_LEN, ClusterStats, ModelStats
from infer.protocol.outputs import RequestOutput
from infer.protocol.prompt_limits import prompt_size_error
from infer.protocol.sampling import SamplingParams
from infer.protocol.structured import StructuredOutputsParams, grammar_error
from infer.protocol.tracing import Attribute, HopSpan, open_sink, parse_traceparent

log = logging.getLogger("infer.api")


class _RequestBody(Protocol):
    """A request schema (a pydantic model). One with a `model` field names the model it asks for (None: the one
    served); `_parse` reads it with getattr, so the LoRA admin bodies, which name none, are bodies too."""

    @classmethod
    def model_validate(cls, obj: Any) -> Self: ...


Body = TypeVar("Body", bound=_RequestBody)
R = TypeVar("R")
try:
    VERSION = importlib.metadata.version("infer")
except importlib.metadata.PackageNotFoundError:  # running from a tree that was never installed
    VERSION = "0+unknown"
GRAMMAR_CHECK_TIMEOUT_S = 5.0
TOKENIZER_THREADS = 2  # body parsing, chat templates and tokenization run on these, never on the event loop


def caller_session_id(request: Request) -> str | None:
    """The caller's `X-Session-ID` (vLLM router's name: the conversation a request belongs to, which the cluster
    runs where its previous turn ran): 1 to MAX_SESSION_ID_LEN printable ASCII characters; ValueError otherwise."""
    value = request.headers.get("x-session-id")
    if value is None:
        return None
    if not value or len(value) > MAX_SESSION_ID_LEN or not (value.isascii() and value.isprintable()):
        raise ValueError(
            f"X-Session-ID must be 1 to {MAX_SESSION_ID_LEN} printable ASCII characters, got {len(value)} "
            f"characters starting {value[:40]!r}"
        )
    return value


class Front:
    """The handlers and the state they share; `build_app` wires them to routes."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        config: FrontConfig,
        tokenizers_for: Mapping[str, Any] | None = None,
        tokenizer_dir: Path | None = None,
    ) -> None:
        """`tokenizer`: the default model's (read from `tokenizer_dir`, when known); `tokenizers_for`: other models'
        by name (--tokenizer-for). Every other model's is loaded when a request first needs it (tokenization.py)."""
        self.engine = engine
        self.config = config

        def make(loaded: Any) -> Tokenization:
            return Tokenization.of(loaded, None, config.tool_call_parser, config.reasoning_parser)

        default = Tokenization.of(tokenizer, config.chat_template, config.tool_call_parser, config.reasoning_parser)
        self.tokenizations = Tokenizations(
            default,
            make,
            tokenizers_for,
            tokenizer_dir,
            config.tokenizer_load_timeout,
            config.retry_after,
        )
        self.metrics = FrontMetrics(config.served_model_name)
        self.admission = Admission(engine, config)
        self.cancellations = Cancellations(config.admin_api_key)
        self.created = int(time.time())
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="infer-tokenize")
        # its own thread, so that a spec slow to parse never holds up tokenizing
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="infer-grammar-check")
        self._xgrammar: asyncio.Future | None = None
        self.lora_adapters: dict[str, str] = {}  # the engine(s)' LoRA adapters as last seen: name -> folder
        self.spans = open_sink("infer-front", config.otlp_traces_endpoint)

    def close(self) -> None:
        """Stop the tokenizer threads (work already queued is dropped); export the last spans."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if self.spans is not None:
            self.spans.close()

    async def _off_loop(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """`fn(*args, **kwargs)` on the tokenizer threads, so the event loop keeps serving meanwhile."""
        work = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    # ---- routes -----------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        tok = await self.tokenization(body)

        async def token_ids(max_len: int) -> list[list[int]]:
            return await self._prompt_token_ids(tok, body.prompts(), max_len)

        fmt = CompletionFormat(body, tok)
        max_tokens = (
            body.max_tokens
            if "max_tokens" in body.model_fields_set
            else self.config.sampling_defaults.get("max_tokens", body.max_tokens)
        )
        return await self._serve(request, body, tok, token_ids, max_tokens, body.logprobs, fmt)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        tok = await self.tokenization(body)

        async def token_ids(max_len: int) -> list[list[int]]:
            return [await self._chat_token_ids(tok, body, max_len)]

        fmt = ChatFormat(body, tok)
        max_tokens = body.max_new_tokens
        if max_tokens is None:
            max_tokens = self.config.sampling_defaults.get("max_tokens")
        return await self._serve(request, body, tok, token_ids, max_tokens, body.num_logprobs, fmt)

    async def embeddings(self, request: Request) -> Response:
        """POST /v1/embeddings (OpenAI's shape): one pooling request per input (worker/pooling.py), through the same
        admission, cluster and failover as generation; `dimensions` only for a Matryoshka model (FrontConfig)."""
        body = await self._parse(request, EmbeddingRequest)
        tok = await self.tokenization(body)
        self._check_dimensions(body.dimensions)
        inputs = body.prompts()
        params = SamplingParams(
            pooling=body.pooling, normalize=body.normalize, temperature=0, max_tokens=1, lora_name=self.lora_of(body)
        )
        base_id = f"embd-{uuid.uuid4().hex}"
        self.admission.reserve(len(inputs), param="input")
        try:
            model = self.model_of(body)
            max_len = await self.admission.admit(model)
            prompts = await self._prompt_token_ids(tok, inputs, max_len, param="input")
            for ids in prompts:
                check_length(len(ids), None, max_len)
            tracker = functools.partial(self.metrics.tracker, self.metrics_label(body))
            jobs = [
                Job(i, i, ids, params, f"{base_id}-{i}", tracker(), body.timeout, body.priority, model=model)
                for i, ids in enumerate(prompts)
            ]
            await _cancel_on_disconnect(request, self._run_to_end(jobs))
        finally:
            self.admission.release(len(inputs))
        data = [
            {
                "object": "embedding",
                "index": job.index,
                "embedding": embedding_json(job.embedding or [], body.dimensions, body.normalize, body.encoding_format),
            }
            for job in jobs
        ]
        tokens = sum(len(job.prompt_token_ids) for job in jobs)
        return JSONResponse(
            {
                "id": base_id,
                "object": "list",
                "data": data,
                "model": body.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    def _check_dimensions(self, dimensions: int | None) -> None:
        allowed = self.config.matryoshka_dimensions
        if dimensions is None:
            return
        if allowed is None:
            raise ApiError(
                400,
                "dimensions: this model does not support Matryoshka embeddings (its config.json "
                "declares no matryoshka_dimensions / is_matryoshka): the full vector is the only "
                "size",
                param="dimensions",
            )
        if allowed and dimensions not in allowed:
            raise ApiError(
                400,
                f"dimensions: {dimensions} is not among this model's sizes {', '.join(map(str, allowed))}",
                param="dimensions",
            )

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt (or chat messages through the template) -> its token ids. The bounds of the
        generation routes apply (the chat template's output checked too), and the ids must fit the context."""
        body = await self._parse(request, TokenizeRequest)
        tok = await self.tokenization(body)
        max_len = await self._any_max_model_len(self.model_of(body))
        if body.prompt is not None:
            param = "prompt"
            self._check_text_size(tok, body.prompt, max_len, param)
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self._off_loop(tok.encode, body.prompt, add_special_tokens=special)
        else:
            param = "messages"
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            ids = await self._chat_prompt(tok, body, tools, max_len)
            if body.add_special_tokens:
                ids = tok.chat_encoder.with_added_special_tokens(ids)
        if len(ids) > max_len:
            raise ApiError(
                400,
                f"{param}: {len(ids)} tokens; this model's maximum context length is {max_len} tokens",
                param=param,
                code="context_length_exceeded",
            )
        strs = [tok.token_text(t) for t in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids -> text (at most the context length of ids, each in the vocabulary)."""
        body = await self._parse(request, DetokenizeRequest)
        tok = await self.tokenization(body)
        max_len = await self._any_max_model_len(self.model_of(body))
        if len(body.tokens) > max_len:
            raise ApiError(
                400, f"tokens: {len(body.tokens)} token ids; at most the context length ({max_len})", param="tokens"
            )
        self._check_vocab(tok, "tokens", body.tokens)
        text = await self._off_loop(tok.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    async def version(self, request: Request) -> Response:
        authorize(request, self.config.api_key)
        return JSONResponse({"version": VERSION})

    async def _any_max_model_len(self, model: str | None) -> int:
        """The context length of `model`'s workers (None: the cluster's), healthy or not: tokenizing needs no
        worker."""
        view: ClusterStats | None
        try:
            view = await self.admission.cluster_view()
        except ApiError:
            view = self.admission.last_view
        max_len = max_model_len(view, healthy_only=False, model=model) if view is not None else None
        if max_len is None:
            raise self.admission.unavailable("no worker has reported its context length yet")
        return max_len

    @staticmethod
    def _check_vocab(tok: Tokenization, param: str, token_ids: list[int]) -> None:
        vocab = tok.vocab_size
        bad = next((t for t in token_ids if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    async def models(self, request: Request) -> Response:
        authorize(request, self.config.api_key)
        view: ClusterStats | None
        try:
            view = await self.admission.cluster_view()
        except ApiError:
            view = self.admission.last_view
        try:
            await self._refresh_adapters()
        except (ClusterError, ValueError):
            pass  # the adapters as last seen
        if view is not None and len(view.models) > 1:
            return JSONResponse({"object": "list", "data": self._model_cards(view)})
        max_len = max_model_len(view, healthy_only=False) if view is not None else None
        card = self._card(self.config.served_model_name, self.engine.model_id, None, max_len)
        adapters = [
            self._card(name, path, self.config.served_model_name, max_len)
            for name, path in sorted(self.lora_adapters.items())
            if name != self.config.served_model_name  # `model` names the base model: one id, one model
        ]
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    def _card(self, name: str, root: str | None, parent: str | None, max_len: int | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "infer",
            "root": root,
            "parent": parent,
            "max_model_len": max_len,
        }

    def _model_cards(self, view: ClusterStats) -> list[dict[str, Any]]:
        """Every model of a cluster of several, then each one's LoRA adapters with it as their parent; the model
        Welcome named (the cluster's default) under this front's --served-model-name."""
        cards, adapters = [], []
        for model in view.models:
            name = self.served_name(model.model_id)
            cards.append(self._card(name, model.model_id, None, model.max_model_len))
            adapters += [
                self._card(adapter, path, name, model.max_model_len)
                for adapter, path in sorted(model.lora_adapters.items())
            ]
        return cards + adapters

    def served_name(self, model_id: str) -> str:
        """The name clients give the cluster's model `model_id`: this front's --served-model-name for the model the
        cluster named when the front joined, else the model's id."""
        return self.config.served_model_name if model_id == self.engine.model_id else model_id

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}: every engine loads the PEFT folder, served
        from then on as model `lora_name`. Behind the API key; through a cluster the front's key must be an
        administrator's (the coordinator refuses a client key before any worker reads the path). 400 with the reason
        otherwise (a missing file, a rank above --max-lora-rank, LoRA not enabled, the name taken)."""
        body = await self._parse(request, LoadLoraAdapterRequest)
        if body.lora_name == self.config.served_model_name:
            raise ApiError(400, f"lora_name {body.lora_name!r} is the served model's name", param="lora_name")
        try:
            self.lora_adapters = await self.engine.load_lora_adapter(body.lora_name, body.lora_path)
        except (ValueError, ClusterError) as e:
            raise ApiError(400, f"load_lora_adapter failed: {safe(e, 2000)}", param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"}: requests that name it from then on get 404; those
        running finish with it. The same roles as loading; 400 for a name no engine has."""
        body = await self._parse(request, UnloadLoraAdapterRequest)
        try:
            self.lora_adapters = await self.engine.unload_lora_adapter(body.lora_name)
        except (ValueError, ClusterError) as e:
            raise ApiError(400, f"unload_lora_adapter failed: {safe(e, 2000)}", param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def _refresh_adapters(self) -> None:
        self.lora_adapters = dict(await self.engine.list_lora_adapters())

    async def _adapter_known_now(self, name: str) -> bool:
        """Whether `name` is a LoRA adapter, the list asked of the cluster again first (kept as it was when the
        cluster cannot answer)."""
        try:
            await self._refresh_adapters()
        except (ClusterError, ValueError):
            pass
        return name in self.lora_adapters

    async def _check_model(self, model: str) -> None:
        """404 unless `model` is a served model or a LoRA adapter (looked up again when not seen yet: a model that
        joined the cluster since the last view, an adapter loaded through another front)."""
        if self._known_model(model):
            return
        with contextlib.suppress(ApiError):
            await self.admission.cluster_view(fresh=True)
        if not self._known_model(model) and not await self._adapter_known_now(model):
            raise self._model_not_found(model)

    def _cluster_models(self) -> Sequence[ModelStats]:
        """The cluster's models as last seen, when it serves several (else none: the front's one model)."""
        view = self.admission.last_view
        return view.models if view is not None and len(view.models) > 1 else ()

    def _known_model(self, model: str) -> bool:
        return (
            model == self.config.served_model_name
            or model in self.lora_adapters
            or any(
                model in (m.model_id, self.served_name(m.model_id)) or model in m.lora_adapters
                for m in self._cluster_models()
            )
        )

    def _model_not_found(self, model: str) -> ApiError:
        models = [self.served_name(m.model_id) for m in self._cluster_models()] or [self.config.served_model_name]
        names = ", ".join(map(repr, sorted(set(self.lora_adapters) - set(models))))
        adapters = f" and the LoRA adapters {names}" if names else ""
        return ApiError(
            404,
            f"the model {model[:200]!r} does not exist; this server serves {', '.join(map(repr, models))}{adapters}",
            param="model",
            code="model_not_found",
        )

    async def failure(self, delta: RequestOutput, lora: str | None) -> ApiError:
        """The answer to an engine request that failed (errors.request_error), but 404 model_not_found when it named
        a LoRA adapter that is gone: unloaded through another front or an admin client after this front last
        looked (its list is refreshed here, on the failure path only)."""
        if lora is not None and delta.error_code == ErrorCode.INVALID_REQUEST:
            if not await self._adapter_known_now(lora):
                return self._model_not_found(lora)
        return request_error(delta, self.config.retry_after)

    def lora_of(self, body: Any) -> str | None:
        """The LoRA adapter a checked body's `model` names (None: a base model)."""
        model = getattr(body, "model", None)
        if model is None or model == self.config.served_model_name:
            return None
        return (
            None if any(model in (m.model_id, self.served_name(m.model_id)) for m in self._cluster_models()) else model
        )

    def model_of(self, body: Any) -> str | None:
        """The cluster's model a checked body's `model` runs on, when the cluster serves several (an adapter's:
        its base model's); None on a cluster of one model, whose default it is (older engines take no model)."""
        models = self._cluster_models()
        if not models:
            return None
        name = getattr(body, "model", None)
        if name is None or name == self.config.served_model_name:
            return self.engine.model_id
        for m in models:
            if name == m.model_id or name in m.lora_adapters:
                return m.model_id
        return name  # an adapter loaded since the last view: the coordinator finds its base

    async def tokenization(self, body: Any) -> Tokenization:
        """The Tokenization of the model a checked body runs on (an adapter: its base model's): --model's on a
        cluster of one model, else that model's (client/api/tokenization.py: 503 when this front cannot read it)."""
        with contextlib.suppress(ApiError):  # the models and where their workers read their tokenizers, as of now
            await self.admission.cluster_view()  # (the view admission reads next: one round trip a second at most)
        model = self.model_of(body)
        if model is None:
            return self.tokenizations.default
        stats = self._stats_of(model)
        if stats is None:  # an adapter loaded since the last view: its base model from a fresh one
            with contextlib.suppress(ApiError):
                await self.admission.cluster_view(fresh=True)
            stats = self._stats_of(model)
        if stats is None:
            raise self.admission.unavailable(f"the base model of {model[:200]!r} is not known yet; retry later")
        default = self.tokenizations.default if stats.model_id == self.engine.model_id else None
        if default is not None and not stats.tokenizers:  # its id is the path --model defaults to, or no path
            return default
        name = self.served_name(stats.model_id)
        return await self.tokenizations.of(stats.model_id, name, stats.tokenizers, fallback=default)

    def _stats_of(self, model: str) -> ModelStats | None:
        """The cluster's model `model` (or the base model of the adapter `model`) as last seen."""
        return next((m for m in self._cluster_models() if model == m.model_id or model in m.lora_adapters), None)

    def metrics_label(self, body: Any) -> str:
        """The `model_name` label of a body's request metrics: the name of the base model it runs on."""
        model = self.model_of(body)
        return self.config.served_model_name if model is None else self.served_name(model)

    async def health(self, request: Request) -> Response:
        """200 only if a fresh round trip to the cluster shows it running with a healthy worker."""
        try:
            view = await self.admission.cluster_view(fresh=True)
        except ApiError as e:
            return unhealthy(e.message, self.config.retry_after)
        healthy = view.num_healthy_workers
        if view.state != ClusterState.RUNNING or healthy == 0:
            why = f"cluster is {view.state}" if view.state != ClusterState.RUNNING else "no healthy worker"
            return unhealthy(why, self.config.retry_after, view)
        return JSONResponse(
            {"status": "ok", "state": view.state, "healthy_workers": healthy, "workers": len(view.workers)}
        )

    async def update_weights(self, request: Request) -> Response:
        """POST /v1/update_weights {"model", "path", "on_running", "timeout"}: every engine loads the safetensors
        directory `path` (all or nothing); 200 {"weight_version": N} once all serve it. Behind the API key; through
        a cluster it needs the front's key to be an administrator's: the front never looks at `path` itself, so a
        front whose key may not refit answers the same refusal whatever the path. 400 with the reason when the
        update is refused (a bad tensor, a path no worker reads, a suspended cluster): the old weights keep
        serving on every worker."""
        body = await self._parse(request, UpdateWeightsRequest)
        try:
            version = await self.engine.update_weights(body.path, on_running=body.on_running, timeout=body.timeout)
        except (ValueError, ClusterError) as e:
            raise ApiError(400, f"update_weights failed: {safe(e, 2000)}", param="path") from None
        return JSONResponse({"object": "weight_update", "weight_version": version, "path": body.path})

    async def metrics_text(self, request: Request) -> Response:
        try:
            view = await self.admission.cluster_view(fresh=True)
        except ApiError:
            view = None
        return Response(self.metrics.exposition(view, self.served_name), media_type=CONTENT_TYPE)

    # ---- parsing ----------------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 past `max_body_bytes`: from Content-Length before reading anything,
        and while reading (a chunked body, or one longer than it said) as soon as it passes the limit."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, f"invalid Content-Length header {declared[:40]!r}")
            if int(declared) > limit:
                raise too_large(f"{int(declared)} bytes", limit)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(f"more than {limit} bytes", limit)
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(499, "the client disconnected") from None
        return b"".join(chunks)

    async def _parse(self, request: Request, model: type[Body]) -> Body:
        authorize(request, self.config.api_key)
        raw = await self._read_body(request)
        data = await self._off_loop(decode_body, raw)  # 400 for what JSON allows and we cannot take
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        name = getattr(body, "model", None)
        if name is not None:
            await self._check_model(name)
        return body

    async def _prompt_token_ids(
        self, tok: Tokenization, prompts: list[str | list[int]], max_len: int, param: str = "prompt"
    ) -> list[list[int]]:
        """Every prompt checked against the context without tokenizing, then tokenized off the loop."""
        for prompt in prompts:
            self._check_prompt(tok, prompt, max_len, param)
        return [
            prompt if isinstance(prompt, list) else await self._off_loop(tok.encode, prompt, add_special_tokens=True)
            for prompt in prompts
        ]

    def _check_prompt(self, tok: Tokenization, prompt: str | list[int], max_len: int, param: str) -> None:
        """400 for an empty prompt, a token id outside the vocabulary, or a prompt that cannot fit the
        context: token ids by their count, text by its size (prompt_limits), both without tokenizing."""
        if not prompt:
            raise ApiError(400, f"{param} must not be empty", param=param)
        if isinstance(prompt, str):
            return self._check_text_size(tok, prompt, max_len, param)
        check_length(len(prompt), None, max_len)
        vocab = tok.vocab_size
        if max(prompt) >= vocab:
            bad = next(t for t in prompt if t >= vocab)
            raise ApiError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    @staticmethod
    def _check_text_size(tok: Tokenization, text: str, max_len: int, param: str) -> None:
        too_long = prompt_size_error(text, max_len, tok.token_bytes)
        if too_long is not None:
            raise ApiError(400, f"{param}: {too_long}", param=param, code="context_length_exceeded")

    async def _chat_token_ids(self, tok: Tokenization, body: ChatCompletionRequest, max_len: int) -> list[int]:
        return await self._chat_prompt(tok, body, body.tool_dicts if body.tool_mode is not None else None, max_len)

    async def _chat_prompt(
        self,
        tok: Tokenization,
        body: ChatCompletionRequest | TokenizeRequest,
        tools: list[dict[str, Any]] | None,
        max_len: int,
    ) -> list[int]:
        """The chat template's text, tokenized with the messages' content as plain text (client/chat_encoding.py)
        unless the body allows special tokens in it. Checked before anything runs: the number of messages (each
        takes a token at least), their content's size before the template, the text's size after it (all off
        the loop); the caller checks the count of ids."""
        template = tok.chat_template
        if not template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        # a TokenizeRequest comes here only without a prompt, and then has messages (its validator `_one_input`)
        chat = cast("list[ChatMessage]", body.messages)
        if len(chat) > max_len:
            raise ApiError(
                400,
                f"messages: {len(chat)} messages; a context of {max_len} tokens holds at most {max_len}",
                param="messages",
                code="context_length_exceeded",
            )
        messages = template_messages([m.as_template_message() for m in chat])
        if tools and "tools" not in template:  # a template that ignores `tools`
            messages = [{"role": "system", "content": tools_system_prompt(tools)}, *messages]
        content = "".join(m["content"] for m in messages) + json.dumps(tools or [])
        self._check_text_size(tok, content, max_len, "messages")

        def render(chat: list[dict[str, Any]]) -> str:
            text = self._render_chat(tok, chat, body.add_generation_prompt, tools, body.chat_template_kwargs)
            self._check_text_size(tok, text, max_len, "messages")
            return text

        try:
            _, ids = await self._off_loop(
                tok.chat_encoder.encode, messages, render, body.allow_special_tokens_in_content
            )
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        return ids

    @staticmethod
    def _render_chat(
        tok: Tokenization,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        try:
            return tok.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **(kwargs or {})
            )
        except Exception as e:  # the template's own checks (jinja raise_exception), e.g. role order
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    # ---- admission --------------------------------------------------------------------------------

    # ---- running requests -------------------------------------------------------------------------

    async def _serve(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        tok: Tokenization,
        token_ids: Callable[[int], Awaitable[list[list[int]]]],
        max_tokens: int | None,
        logprobs: int | None,
        fmt: ResponseFormat,
    ) -> Response:
        """`token_ids(max_len)`: the prompts' token ids, or a 400 for a prompt that cannot fit max_len."""
        num_prompts = len(body.prompts()) if isinstance(body, CompletionRequest) else 1
        num_requests = num_prompts * num_candidates(body)
        for param, ids in body.token_id_fields().items():
            self._check_vocab(tok, param, ids)
        structured = await self._structured(body)
        engine_base_id = fmt.id  # the front's own: engine request ids never take the caller's X-Request-Id
        try:
            fmt.id = caller_request_id(request) or fmt.id
        except ValueError as e:
            raise ApiError(400, str(e), param="X-Request-Id") from None
        try:
            session_id = caller_session_id(request)
        except ValueError as e:
            raise ApiError(400, str(e), param="X-Session-ID") from None
        self.admission.reserve(num_requests, param="prompt" if num_prompts > 1 else "n")
        run: StreamRun | None = None
        cancellable = Cancellable(bearer_digest(request))
        try:
            max_len = await self.admission.admit(self.model_of(body))
            prompts = await token_ids(max_len)
            for ids in prompts:
                check_length(len(ids), max_tokens, max_len)
            jobs = self._jobs(tok, engine_base_id, prompts, body, max_tokens, logprobs, structured)
            traceparent = request.headers.get("traceparent")
            for job in jobs:  # W3C: an invalid header is ignored (a new trace starts), not refused
                job.traceparent = traceparent if traceparent and parse_traceparent(traceparent) else None
                job.session_id = session_id
            cancellable.engine_request_ids = [job.request_id for job in jobs]
            self.cancellations.add(fmt.id, cancellable)
            if not body.stream:
                await _cancel_on_disconnect(request, self._run_to_end(jobs))
                choices = beam_choices(jobs, body.n) if body.use_beam_search else best_of(jobs, body.n)
                return JSONResponse(
                    fmt.response(choices, usage_of=choices if body.use_beam_search else jobs),
                    headers={"X-Request-Id": fmt.id},
                )
            run = StreamRun(self, jobs, functools.partial(self.cancellations.remove, fmt.id, cancellable))
        finally:
            if run is None:  # else the run's close() does both
                self.admission.release(num_requests)
                self.cancellations.remove(fmt.id, cancellable)
        await _cancel_on_disconnect(request, run.start())  # on failure, start() closed the run
        return _EventStream(self._sse(run, fmt, body.include_usage, body.continuous_usage), run, fmt.id)

    async def cancel(self, request: Request) -> Response:
        """POST /v1/requests/{request_id}/cancel: abort a request in flight by its id, for the caller that sent it
        or the admin (client/api/cancel.py); its answer (or stream) ends with finish_reason "abort"."""
        caller = bearer_digest(request)
        if not self.cancellations.is_admin(caller):
            authorize(request, self.config.api_key)
        request_id = request.path_params["request_id"]
        entries = self.cancellations.find(request_id, caller)
        if not entries:
            raise ApiError(
                404,
                f"no request {request_id[:128]!r} in flight that this caller may cancel: the caller "
                "that sent a request may cancel it with the same 'Authorization: Bearer' token, the "
                "admin key any",
                param="request_id",
                code="request_not_found",
            )
        ids = [rid for entry in entries for rid in entry.engine_request_ids]
        await asyncio.gather(*(self.engine.abort(rid) for rid in ids))
        return JSONResponse({"id": request_id, "object": "request.cancelled", "cancelled": len(entries)})

    async def _structured(self, body: Any) -> StructuredOutputsParams | None:
        """The body's output constraint, parsed by xgrammar on the front's grammar thread (400 naming the field
        if it does not parse, or if parsing takes longer than GRAMMAR_CHECK_TIMEOUT_S)."""
        given = body.structured_spec()
        if given is None:
            return None
        param, spec = given
        if self._xgrammar is None:  # imported on first use, on the grammar thread (seconds: not on the clock)
            self._xgrammar = asyncio.wrap_future(self._grammar_pool.submit(importlib.import_module, "xgrammar"))
        await asyncio.shield(self._xgrammar)
        check = asyncio.get_running_loop().run_in_executor(self._grammar_pool, grammar_error, spec)
        try:
            error = await asyncio.wait_for(check, GRAMMAR_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(
                400, f"{param}: checking it took longer than {GRAMMAR_CHECK_TIMEOUT_S:g} s; simplify it", param=param
            ) from None
        if error is not None:
            raise ApiError(400, f"{param}: {error}", param=param)
        return spec

    def _jobs(
        self,
        tok: Tokenization,
        base_id: str,
        prompts: list[list[int]],
        body: Any,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> list[Job]:
        jobs = []
        candidates = num_candidates(body)
        if candidates > body.n and logprobs is None:
            logprobs = 0  # best_of ranks candidates by the sum of their sampled tokens' logprobs
        echoes = body.prompts() if getattr(body, "echo", False) else None
        lora, model, label = self.lora_of(body), self.model_of(body), self.metrics_label(body)
        for p, ids in enumerate(prompts):
            echo = "" if echoes is None else (echoes[p] if isinstance(echoes[p], str) else tok.tokenizer.decode(ids))
            for c in range(candidates):
                index = p * candidates + c
                try:
                    params = body.sampling_params(
                        max_tokens,
                        logprobs,
                        seed_offset=c,
                        structured=structured,
                        defaults=self.config.sampling_defaults,
                        prompt_logprobs=getattr(body, "prompt_logprobs_wanted", body.prompt_logprobs),
                    )
                    if lora is not None:
                        params = msgspec.structs.replace(params, lora_name=lora)
                except ValueError as e:  # SamplingParams' FieldError names the field
                    raise ApiError(400, str(e), param=getattr(e, "field", None)) from None
                jobs.append(
                    Job(
                        index,
                        p,
                        ids,
                        params,
                        f"{base_id}-{index}",
                        self.metrics.tracker(label),
                        body.timeout,
                        body.priority,
                        echo=echo,
                        model=model,
                    )
                )
        return jobs

    def engine_stream(self, job: Job) -> AsyncIterator[RequestOutput]:
        """The engine request of `job`, with its deadline; its span when this front traces, else the caller's trace
        context passed on."""
        extra: dict[str, Any] = {"priority": job.priority} if job.priority else {}  # older engine clients work on
        if job.model is not None:
            extra["model"] = job.model
        if job.session_id is not None:
            extra["session_id"] = job.session_id
        if self.spans is not None:
            return self._traced_stream(job, extra)
        if job.traceparent is not None:
            extra["traceparent"] = job.traceparent
        return self.engine.stream(
            job.prompt_token_ids, job.params, request_id=job.request_id, timeout=job.timeout, **extra
        )

    async def _traced_stream(self, job: Job, extra: dict[str, Any]) -> AsyncIterator[RequestOutput]:
        """`job`'s engine request as the front's hop of its trace (protocol/tracing.py): from here to its last
        delta (or the caller leaving), with its first token and finish reason."""
        attributes: dict[str, Attribute] = {
            "gen_ai.request.id": job.request_id,
            "gen_ai.response.model": self.config.served_model_name,
            "gen_ai.usage.prompt_tokens": len(job.prompt_token_ids),
        }
        span = HopSpan.child_of(
            "front",
            job.traceparent,
            time.monotonic(),
            **attributes,
        )
        finish_reason, num_tokens = "abandoned", 0
        try:
            async for delta in self.engine.stream(
                job.prompt_token_ids,
                job.params,
                request_id=job.request_id,
                timeout=job.timeout,
                traceparent=span.traceparent,
                **extra,
            ):
                if delta.token_ids and not num_tokens:
                    span.event("first token", time.monotonic())
                num_tokens += len(delta.token_ids)
                if delta.finished:
                    finish_reason = str(delta.finish_reason)
                yield delta
        finally:
            finished: dict[str, Attribute] = {
                "gen_ai.response.finish_reasons": finish_reason,
                "gen_ai.usage.completion_tokens": num_tokens,
            }
            span.finish(time.monotonic(), **finished)
            if self.spans is not None:
                self.spans.export([span])

    async def _run_to_end(self, jobs: list[Job]) -> None:
        async def one(job: Job) -> None:
            async for delta in self.engine_stream(job):
                job.add(delta)
                if delta.finish_reason == FinishReason.ERROR:
                    raise await self.failure(delta, job.params.lora_name)
            if job.finish_reason is None:
                raise ended_early(job)

        try:
            await _gather_or_cancel([one(job) for job in jobs])
        except ClusterError as e:
            raise self.admission.unavailable(f"the cluster failed: {e}") from None

    async def _sse(
        self, run: StreamRun, fmt: ResponseFormat, include_usage: bool, continuous_usage: bool
    ) -> AsyncIterator[str]:
        """The events of a stream whose 200 went out: chunks (with `continuous_usage`, each with its choice's usage
        so far), then the usage chunk when asked for, then `[DONE]` however it ends (an error of the cluster or of
        this front is an `error` event first). Only cancellation (the client is gone) ends it otherwise."""

        def event(chunk: dict[str, Any], job: Job) -> str:
            return sse_event(fmt.with_usage(chunk, job) if continuous_usage else chunk)

        try:
            if fmt.body.use_beam_search:  # the beams are final only at the end: each choice whole, in one chunk
                async for event_text in self._beam_events(run, fmt, include_usage, event):
                    yield event_text
                yield "data: [DONE]\n\n"
                return
            for chunk, job in zip(fmt.opening_chunks(run.jobs), run.jobs):
                yield event(chunk, job)
            async for job, delta in run.deltas():
                if delta.finish_reason == FinishReason.ERROR:
                    yield sse_event((await self.failure(delta, job.params.lora_name)).body())
                    break
                for chunk in fmt.chunks(job, delta):
                    yield event(chunk, job)
            else:
                if include_usage:
                    yield sse_event(fmt.usage_chunk(run.jobs))
        except ApiError as e:
            yield sse_event(e.body())
        except Exception:  # the 200 went out already: the client gets an error event, the log the details
            yield sse_event(internal_error("a response stream").body())
        yield "data: [DONE]\n\n"

    @staticmethod
    async def _beam_events(
        run: StreamRun, fmt: ResponseFormat, include_usage: bool, event: Callable[[dict[str, Any], Job], str]
    ) -> AsyncIterator[str]:
        """A streamed beam search (vLLM streams nothing before the end either): once every search is done, its
        best n beams as choices, each in one chunk with its finish_reason."""
        async for _ in run.deltas():  # one final delta per search (start() raised already for a failed one)
            pass
        choices = beam_choices(run.jobs, fmt.body.n)
        for chunk, job in zip(fmt.opening_chunks(choices), choices):
            yield event(chunk, job)
        for job in choices:
            whole = RequestOutput.final(
                job.request_id, job.finish_reason or "stop", token_ids=job.token_ids, text=job.text
            )
            for chunk in fmt.chunks(job, whole):
                yield event(chunk, job)
        if include_usage:
            yield sse_event(fmt.usage_chunk(choices))


class StreamRun:
    """The engine requests of one streaming HTTP request, merged into one sequence of (job, delta).

    One pump task per job feeds a shared queue. `start()` returns once every job has its first delta (or
    one failed); those are replayed first by `deltas()`. `close()` cancels the pumps, which aborts every
    request not finished yet.
    """

    def __init__(self, front: Front, jobs: list[Job], on_close: Callable[[], None] = lambda: None) -> None:
        self.front = front
        self.jobs = jobs
        self._on_close = on_close
        self._queue: asyncio.Queue[tuple[Job, RequestOutput | BaseException]] = asyncio.Queue()
        self._buffer: list[tuple[Job, RequestOutput]] = []
        self._pumps: list[asyncio.Task] = []
        self._unfinished = len(jobs)
        self._closed = False  # the front counted len(jobs) in flight (Admission.reserve); close() releases them

    async def start(self) -> None:
        self._pumps = [asyncio.create_task(self._pump(job)) for job in self.jobs]
        started: set[int] = set()
        try:
            while len(started) < len(self.jobs):
                job, delta = await self._next()
                if delta.finish_reason == FinishReason.ERROR:
                    raise await self.front.failure(delta, job.params.lora_name)
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
            if not finished:  # the reader waits for a final delta: it gets an error instead
                self._queue.put_nowait((job, ended_early(job)))
        except ClusterError as e:
            self._queue.put_nowait(
                (
                    job,
                    ApiError(
                        503, f"the cluster failed: {e}", code="unavailable", retry_after=self.front.config.retry_after
                    ),
                )
            )
        except Exception:  # never leave the reader waiting for a delta that cannot come
            self._queue.put_nowait((job, internal_error(f"engine request {job.request_id}")))

    async def close(self) -> None:
        """Cancel the pumps (aborting unfinished requests) and release the front's capacity; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.front.admission.release(len(self.jobs))
        self._on_close()
        for task in self._pumps:
            task.cancel()
        if self._pumps:
            await asyncio.gather(*self._pumps, return_exceptions=True)


class _EventStream(StreamingResponse):
    """Server-sent events whose StreamRun is closed however the response ends: finished, failed, or
    cancelled because the client went away (possibly before the generator ever ran)."""

    def __init__(self, content: AsyncIterator[str], run: StreamRun, request_id: str) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Request-Id": request_id}
        )
        self.run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.run.close()


# ---- response shapes ------------------------------------------------------------------------------


# ---- helpers --------------------------------------------------------------------------------------


# Failures of the cluster or of this front's link to it, not of the request: 503 + Retry-After. The front is
# the coordinator's client, so client_too_slow / client_lost mean this process fell behind or was cut off.


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


def route_list(app: FastAPI) -> list[str]:
    """The app's routes as "METHOD /path", in the order they were added (what a 404 answer lists)."""
    return [
        f"{method} {route.path}"
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in sorted(route.methods or ())
    ]


def build_app(
    engine: EngineClient,
    tokenizer: Any,
    config: FrontConfig,
    tokenizers_for: Mapping[str, Any] | None = None,
    tokenizer_dir: Path | None = None,
) -> FastAPI:
    """The ASGI app of one front (Front's arguments). Every error leaves as OpenAI's error body; bad input never gets
    a 500, and no answer carries a traceback, an exception's text or a path."""
    front = Front(engine, tokenizer, config, tokenizers_for, tokenizer_dir)
    app = FastAPI(title="infer", version="0.1.0", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.front = front

    def route(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as e:
                return error_response(e)
            except Exception:
                return error_response(internal_error(f"{request.method} {request.url.path}"))

        endpoint.__name__ = handler.__name__
        return endpoint

    app.add_api_route("/v1/completions", route(front.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", route(front.chat_completions), methods=["POST"])
    app.add_api_route("/v1/embeddings", route(front.embeddings), methods=["POST"])
    app.add_api_route("/v1/models", route(front.models), methods=["GET"])
    app.add_api_route("/health", route(front.health), methods=["GET"])
    app.add_api_route("/metrics", route(front.metrics_text), methods=["GET"])
    app.add_api_route("/tokenize", route(front.tokenize), methods=["POST"])
    app.add_api_route("/detokenize", route(front.detokenize), methods=["POST"])
    app.add_api_route("/version", route(front.version), methods=["GET"])
    app.add_api_route("/v1/update_weights", route(front.update_weights), methods=["POST"])
    app.add_api_route("/v1/load_lora_adapter", route(front.load_lora_adapter), methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", route(front.unload_lora_adapter), methods=["POST"])
    app.add_api_route("/v1/requests/{request_id}/cancel", route(front.cancel), methods=["POST"])

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404, 405, ...
        if exc.status_code == 404:
            error = ApiError(
                404,
                f"no route {request.url.path[:200]!r}; the routes are {', '.join(route_list(request.app))}",
                code="not_found",
            )
        elif exc.status_code == 405:
            error = ApiError(
                405,
                f"method {request.method} is not allowed on {request.url.path[:200]!r}",
                code="method_not_allowed",
                headers=exc.headers,
            )
        else:
            error = ApiError(exc.status_code, http_phrase(exc.status_code), headers=exc.headers)
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, "invalid request"))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        return error_response(internal_error(f"{request.method} {request.url.path}"))

    return app
