"""The state the front's routes share, and the steps every route takes with a request: check its body (the API key,
its size, its JSON, its model), find its model and tokenizer, check and tokenize its prompts, run its engine
requests. The routes themselves sit in routes/ by family; app.py wires them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar, cast

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from infer.client.api.admission import Admission, authorize, check_length, max_model_len
from infer.client.api.body import decode_body
from infer.client.api.cancel import Cancellations
from infer.client.api.config import FrontConfig
from infer.client.api.errors import ended_early, request_error, too_large, validation_error
from infer.client.api.images import image_bytes_of
from infer.client.api.jobs import Job
from infer.client.api.metrics import FrontMetrics
from infer.client.api.schemas import ApiError, ChatCompletionRequest, ChatMessage, TokenizeRequest
from infer.client.api.tokenization import Tokenization, Tokenizations
from infer.client.api.tools import template_messages, tools_system_prompt
from infer.client.chat_encoding import ImageSlot, takes_content_parts
from infer.client.engine_client import ClusterError, EngineClient
from infer.protocol.codes import ErrorCode, FinishReason
from infer.protocol.messages import ClusterStats, ModelStats
from infer.protocol.outputs import RequestOutput
from infer.protocol.prompt_limits import prompt_size_error
from infer.protocol.structured import StructuredOutputsParams, grammar_error
from infer.protocol.tracing import Attribute, HopSpan, open_sink


class _RequestBody(Protocol):
    """A request schema (a pydantic model). One with a `model` field names the model it asks for (None: the one
    served); `Front.parse` reads it with getattr, so the LoRA admin bodies, which name none, are bodies too."""

    @classmethod
    def model_validate(cls, obj: Any) -> Self: ...


Body = TypeVar("Body", bound=_RequestBody)
R = TypeVar("R")
GRAMMAR_CHECK_TIMEOUT_S = 5.0
TOKENIZER_THREADS = 2  # body parsing, chat templates and tokenization run on these, never on the event loop


class Front:
    """What the routes share: the engine, the config, tokenizers, admission, metrics, cancellations, the spans
    sink, and the threads that parse bodies, render templates and tokenize off the event loop."""

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

    async def off_loop(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """`fn(*args, **kwargs)` on the tokenizer threads, so the event loop keeps serving meanwhile."""
        work = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    async def any_max_model_len(self, model: str | None) -> int:
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
    def check_vocab(tok: Tokenization, param: str, token_ids: list[int]) -> None:
        vocab = tok.vocab_size
        bad = next((t for t in token_ids if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def served_name(self, model_id: str) -> str:
        """The name clients give the cluster's model `model_id`: this front's --served-model-name for the model the
        cluster named when the front joined, else the model's id."""
        return self.config.served_model_name if model_id == self.engine.model_id else model_id

    async def refresh_adapters(self) -> None:
        self.lora_adapters = dict(await self.engine.list_loras())

    async def adapter_known_now(self, name: str) -> bool:
        """Whether `name` is a LoRA adapter, the list asked of the cluster again first (kept as it was when the
        cluster cannot answer)."""
        try:
            await self.refresh_adapters()
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
        if not self._known_model(model) and not await self.adapter_known_now(model):
            raise self.model_not_found(model)

    def cluster_models(self) -> Sequence[ModelStats]:
        """The cluster's models as last seen, when it serves several (else none: the front's one model)."""
        view = self.admission.last_view
        return view.models if view is not None and len(view.models) > 1 else ()

    def _known_model(self, model: str) -> bool:
        return (
            model == self.config.served_model_name
            or model in self.lora_adapters
            or any(
                model in (m.model_id, self.served_name(m.model_id)) or model in m.lora_adapters
                for m in self.cluster_models()
            )
        )

    def model_not_found(self, model: str) -> ApiError:
        models = [self.served_name(m.model_id) for m in self.cluster_models()] or [self.config.served_model_name]
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
            if not await self.adapter_known_now(lora):
                return self.model_not_found(lora)
        return request_error(delta, self.config.retry_after)

    def lora_of(self, body: Any) -> str | None:
        """The LoRA adapter a checked body's `model` names (None: a base model)."""
        model = getattr(body, "model", None)
        if model is None or model == self.config.served_model_name:
            return None
        return (
            None if any(model in (m.model_id, self.served_name(m.model_id)) for m in self.cluster_models()) else model
        )

    def model_of(self, body: Any) -> str | None:
        """The cluster's model a checked body's `model` runs on, when the cluster serves several (an adapter's:
        its base model's); None on a cluster of one model, whose default it is (older engines take no model)."""
        models = self.cluster_models()
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
        return next((m for m in self.cluster_models() if model == m.model_id or model in m.lora_adapters), None)

    def metrics_label(self, body: Any) -> str:
        """The `model_name` label of a body's request metrics: the name of the base model it runs on."""
        model = self.model_of(body)
        return self.config.served_model_name if model is None else self.served_name(model)

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

    async def parse(self, request: Request, model: type[Body]) -> Body:
        authorize(request, self.config.api_key)
        raw = await self._read_body(request)
        data = await self.off_loop(decode_body, raw)  # 400 for what JSON allows and we cannot take
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        fields = cast(Any, body)
        if "model" in type(fields).model_fields and fields.model is None:
            fields.model = self.config.served_model_name  # vLLM's: a body that names no model runs on the default
        elif getattr(body, "model", None) is not None:
            await self._check_model(fields.model)
        return body

    async def prompt_token_ids(
        self, tok: Tokenization, prompts: list[str | list[int]], max_len: int, param: str = "prompt"
    ) -> list[list[int]]:
        """Every prompt checked against the context without tokenizing, then tokenized off the loop."""
        for prompt in prompts:
            self._check_prompt(tok, prompt, max_len, param)
        return [
            prompt if isinstance(prompt, list) else await self.off_loop(tok.encode, prompt, add_special_tokens=True)
            for prompt in prompts
        ]

    def _check_prompt(self, tok: Tokenization, prompt: str | list[int], max_len: int, param: str) -> None:
        """400 for an empty prompt, a token id outside the vocabulary, or a prompt that cannot fit the
        context: token ids by their count, text by its size (prompt_limits), both without tokenizing."""
        if not prompt:
            raise ApiError(400, f"{param} must not be empty", param=param)
        if isinstance(prompt, str):
            return self.check_text_size(tok, prompt, max_len, param)
        check_length(len(prompt), None, max_len)
        vocab = tok.vocab_size
        if max(prompt) >= vocab:
            bad = next(t for t in prompt if t >= vocab)
            raise ApiError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    @staticmethod
    def check_text_size(tok: Tokenization, text: str, max_len: int, param: str) -> None:
        too_long = prompt_size_error(text, max_len, tok.token_bytes)
        if too_long is not None:
            raise ApiError(400, f"{param}: {too_long}", param=param, code="context_length_exceeded")

    async def chat_prompt(
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
        image = self._image_slot(tok, chat, body)
        # Gemma 3: each image's placeholder in the rendered text becomes its whole sequence before tokenizing, as
        # transformers' processor does (a template writing the placeholder itself: content parts)
        expand = tok.image_sequence if image is not None else None
        if image is not None and takes_content_parts(template):  # the template writes the image token itself
            image = None
            messages = template_messages([m.as_template_parts() for m in chat])
        else:
            marker = "" if image is None else image.marker
            messages = template_messages([m.as_template_message(marker) for m in chat])
        if tools and "tools" not in template:  # a template that ignores `tools`
            messages = [{"role": "system", "content": tools_system_prompt(tools)}, *messages]
        content = "".join(_text_of(m["content"]) for m in messages) + json.dumps(tools or [])
        self.check_text_size(tok, content, max_len, "messages")

        def render(chat: list[dict[str, Any]]) -> str:
            text = self._render_chat(tok, chat, body.add_generation_prompt, tools, body.chat_template_kwargs)
            if expand is not None:
                text = text.replace(*expand)
            self.check_text_size(tok, text, max_len, "messages")
            return text

        try:
            _, ids = await self.off_loop(
                tok.chat_encoder.encode, messages, render, body.allow_special_tokens_in_content, image
            )
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        return ids

    def _image_slot(self, tok: Tokenization, chat: list[ChatMessage], body: Any) -> ImageSlot | None:
        """Where the messages' image parts go (client/chat_encoding.py), or None when they have none; 400 for a
        model that takes no images."""
        if not any(m.image_urls for m in chat):
            return None
        if tok.image_token is None:
            raise ApiError(
                400,
                f"messages: model {getattr(body, 'model', None) or self.config.served_model_name!r} takes no "
                "images (its tokenizer has no image token): it is a text-only model",
                param="messages",
            )
        text, token_id = tok.image_token
        return ImageSlot.new(token_id, text)

    async def chat_images(self, chat: list[ChatMessage]) -> list[bytes]:
        """The encoded images of the messages' image_url parts, in order (client/api/images.py; off the loop)."""
        urls = [url for m in chat for url in m.image_urls]
        if not urls:
            return []
        return await self.off_loop(image_bytes_of, urls, self.config.allowed_local_media_path)

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

    async def structured(self, body: Any) -> StructuredOutputsParams | None:
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
        return self.engine.stream(job.prompt, job.params, request_id=job.request_id, timeout=job.timeout, **extra)

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
                job.prompt,
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

    async def run_to_end(self, jobs: list[Job]) -> None:
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


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[None]) -> None:
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


def _text_of(content: Any) -> str:
    """A template message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or ())
