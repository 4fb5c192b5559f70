"""The generation routes: completions and chat completions (one engine request per prompt and choice; answered
whole, or streamed as server-sent events through a StreamRun), and cancelling a request in flight."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from infer.client.api.admission import authorize, check_length
from infer.client.api.cancel import Cancellable, bearer_digest, caller_request_id
from infer.client.api.errors import ended_early, internal_error
from infer.client.api.formats import (
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    beam_choices,
    best_of,
    num_candidates,
    sse_event,
)
from infer.client.api.front import Front, cancel_on_disconnect
from infer.client.api.jobs import Job
from infer.client.api.schemas import ApiError, ChatCompletionRequest, CompletionRequest
from infer.client.api.tokenization import Tokenization
from infer.client.engine_client import ClusterError
from infer.protocol.codes import FinishReason
from infer.protocol.messages import MAX_SESSION_ID_LEN
from infer.protocol.outputs import RequestOutput
from infer.protocol.structured import StructuredOutputsParams
from infer.protocol.tracing import parse_traceparent


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


class Generation:
    """POST /v1/completions, POST /v1/chat/completions (both streamed as server-sent events on `stream: true`) and POST
    /v1/requests/{id}/cancel."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def completions(self, request: Request) -> Response:
        body = await self.front.parse(request, CompletionRequest)
        tok = await self.front.tokenization(body)

        async def token_ids(max_len: int) -> list[list[int]]:
            return await self.front.prompt_token_ids(tok, body.prompts(), max_len)

        fmt = CompletionFormat(body, tok)
        max_tokens = (
            body.max_tokens
            if "max_tokens" in body.model_fields_set
            else self.front.config.sampling_defaults.get("max_tokens", body.max_tokens)
        )
        return await self._serve(request, body, tok, token_ids, max_tokens, body.logprobs, fmt)

    async def chat_completions(self, request: Request) -> Response:
        body = await self.front.parse(request, ChatCompletionRequest)
        tok = await self.front.tokenization(body)

        async def token_ids(max_len: int) -> list[list[int]]:
            return [await self._chat_token_ids(tok, body, max_len)]

        fmt = ChatFormat(body, tok)
        max_tokens = body.max_new_tokens
        if max_tokens is None:
            max_tokens = self.front.config.sampling_defaults.get("max_tokens")
        images = await self.front.chat_images(body.messages)
        return await self._serve(request, body, tok, token_ids, max_tokens, body.num_logprobs, fmt, images)

    async def _chat_token_ids(self, tok: Tokenization, body: ChatCompletionRequest, max_len: int) -> list[int]:
        return await self.front.chat_prompt(tok, body, body.tool_dicts if body.tool_mode is not None else None, max_len)

    async def _serve(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        tok: Tokenization,
        token_ids: Callable[[int], Awaitable[list[list[int]]]],
        max_tokens: int | None,
        logprobs: int | None,
        fmt: ResponseFormat,
        images: list[bytes] | None = None,
    ) -> Response:
        """`token_ids(max_len)`: the prompts' token ids, or a 400 for a prompt that cannot fit max_len. `images`: a
        chat's, sent with its every engine request."""
        num_prompts = len(body.prompts()) if isinstance(body, CompletionRequest) else 1
        num_requests = num_prompts * num_candidates(body)
        for param, ids in body.token_id_fields().items():
            self.front.check_vocab(tok, param, ids)
        structured = await self.front.structured(body)
        engine_base_id = fmt.id  # the front's own: engine request ids never take the caller's X-Request-Id
        try:
            fmt.id = caller_request_id(request) or fmt.id
        except ValueError as e:
            raise ApiError(400, str(e), param="X-Request-Id") from None
        try:
            session_id = caller_session_id(request)
        except ValueError as e:
            raise ApiError(400, str(e), param="X-Session-ID") from None
        self.front.admission.reserve(num_requests, param="prompt" if num_prompts > 1 else "n")
        run: StreamRun | None = None
        cancellable = Cancellable(bearer_digest(request))
        try:
            max_len = await self.front.admission.admit(self.front.model_of(body))
            prompts = await token_ids(max_len)
            for ids in prompts:  # an encoder-decoder model's prompt is its encoder's: the decoder's context is free
                check_length(len(ids), None if tok.encoder_decoder else max_tokens, max_len)
            jobs = self._jobs(tok, engine_base_id, prompts, body, max_tokens, logprobs, structured)
            for job in jobs:
                job.images = images or []
            traceparent = request.headers.get("traceparent")
            for job in jobs:  # W3C: an invalid header is ignored (a new trace starts), not refused
                job.traceparent = traceparent if traceparent and parse_traceparent(traceparent) else None
                job.session_id = session_id
            cancellable.engine_request_ids = [job.request_id for job in jobs]
            self.front.cancellations.add(fmt.id, cancellable)
            if not body.stream:
                await cancel_on_disconnect(request, self.front.run_to_end(jobs))
                choices = beam_choices(jobs, body.n) if body.use_beam_search else best_of(jobs, body.n)
                return JSONResponse(
                    fmt.response(choices, usage_of=choices if body.use_beam_search else jobs),
                    headers={"X-Request-Id": fmt.id},
                )
            run = StreamRun(self.front, jobs, functools.partial(self.front.cancellations.remove, fmt.id, cancellable))
        finally:
            if run is None:  # else the run's close() does both
                self.front.admission.release(num_requests)
                self.front.cancellations.remove(fmt.id, cancellable)
        await cancel_on_disconnect(request, run.start())  # on failure, start() closed the run
        return _EventStream(self._sse(run, fmt, body.include_usage, body.continuous_usage), run, fmt.id)

    async def cancel(self, request: Request) -> Response:
        """POST /v1/requests/{request_id}/cancel: abort a request in flight by its id, for the caller that sent it
        or the admin (client/api/cancel.py); its answer (or stream) ends with finish_reason "abort"."""
        caller = bearer_digest(request)
        if not self.front.cancellations.is_admin(caller):
            authorize(request, self.front.config.api_key)
        request_id = request.path_params["request_id"]
        entries = self.front.cancellations.find(request_id, caller)
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
        await asyncio.gather(*(self.front.engine.abort(rid) for rid in ids))
        return JSONResponse({"id": request_id, "object": "request.cancelled", "cancelled": len(entries)})

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
        lora, model, label = self.front.lora_of(body), self.front.model_of(body), self.front.metrics_label(body)
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
                        defaults=self.front.config.sampling_defaults,
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
                        self.front.metrics.tracker(label),
                        body.timeout,
                        body.priority,
                        echo=echo,
                        model=model,
                    )
                )
        return jobs

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
                    yield sse_event((await self.front.failure(delta, job.params.lora_name)).body())
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
