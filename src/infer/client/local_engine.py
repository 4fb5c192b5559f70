"""LocalEngine: the EngineClient over one Engine in this process, stepped by a thread of its own.

The engine thread owns the Engine. Its loop: apply every queued command (add, abort, stats), step while
there is work, otherwise block on the command queue. Callers live on asyncio event loops (any number);
each request's deltas go to its own asyncio.Queue on the loop that submitted it, posted with
`loop.call_soon_threadsafe` once per step per loop.

Failures, and where they surface (the EngineClient contract):
- A prompt or option the engine rejects: the request's only delta, finish_reason "error", error_code
  "invalid_request". Nothing raises.
- A request past its `timeout`: the engine thread checks deadlines each time it wakes (after every step and
  every batch of commands; a request's deadline only matters while the engine has work, when it steps
  without blocking), aborts it (its KV blocks are freed at once) and ends its stream with finish_reason
  "error", error_code "timeout". A `timeout` out of range raises ValueError at the call (as in
  InferenceClient).
- An engine step that raises: every in-flight request ends with an "error" delta, error_code "internal";
  the engine thread then stops and later calls raise ClusterError with the reason.
- After close(): calls raise ClusterError; requests still in flight at close were aborted on the engine
  and their waiters get ClusterError.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from infer.client.audio import split_audio, wire_audio
from infer.client.engine_client import ClusterError
from infer.client.multimodal import split_prompt
from infer.client.prompt_forms import split_encoder_decoder
from infer.protocol.codes import ClusterState, FinishReason
from infer.protocol.deadlines import DeadlineHeap
from infer.protocol.lora import LoRARequest
from infer.protocol.messages import MAX_ID_LEN, MAX_REQUEST_TIMEOUT_S, ClusterStats, WorkerStats
from infer.protocol.outputs import Completion, RequestOutput
from infer.protocol.sampling import SamplingParams, check_priority

if TYPE_CHECKING:
    from infer.worker.engine.engine import Engine

log = logging.getLogger("infer.local_engine")

Prompt = (
    str | Sequence[int] | dict[str, Any]
)  # a dict: vLLM's multimodal or encoder-decoder form (client/multimodal.py, prompt_forms.py)

IDLE_WAIT_S = 1.0  # an idle engine thread wakes up this often (a bounded wait, nothing is polled)
CALL_TIMEOUT_S = 30.0  # stats() round trip through the engine thread
CLOSE_TIMEOUT_S = 30.0  # close() waits this long for the engine thread (it may be inside a long step)


def direct_mode_error(command: str) -> RuntimeError:
    """The error of a lifecycle command in direct mode (shared by LocalEngine and LLM)."""
    return RuntimeError(
        f"{command}() needs coordinator mode: this engine runs in-process (direct mode), where there is no "
        f"cluster to {command}; create the LLM / AsyncLLM with use_coordinator=True "
        f"(or coordinator_address=...)"
    )


@dataclass
class RequestCounters:
    """Requests seen by one in-process engine, counted like the coordinator counts them (for ClusterStats)."""

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    aborted: int = 0

    def record_final(self, finish_reason: str | None) -> None:
        if finish_reason == FinishReason.ERROR:
            self.failed += 1
        elif finish_reason == FinishReason.ABORT:
            self.aborted += 1
        else:
            self.completed += 1


def local_stats(engine: Engine, counters: RequestCounters, *, num_in_flight: int, uptime_s: float) -> ClusterStats:
    """ClusterStats of a one-engine "cluster": state "running", one healthy worker with the engine's live
    load. Call it on the thread that owns the engine."""
    worker = WorkerStats(
        worker_id="local",
        dp_rank=0,
        group_id="dp0",
        healthy=True,
        num_kv_blocks=engine.num_kv_blocks,
        block_size=engine.block_size,
        max_num_seqs=engine.config.max_num_seqs,
        max_model_len=engine.max_model_len,
        requests_routed=counters.submitted,
        num_in_flight=num_in_flight,
        seconds_since_heard=0.0,
        load=engine.load(),
    )
    return ClusterStats(
        coordinator_id="local",
        state=ClusterState.RUNNING,
        policy="direct",
        model_id=engine.model_id,
        workers=[worker],
        num_clients=1,
        num_in_flight=num_in_flight,
        num_held=0,
        requests_submitted=counters.submitted,
        requests_completed=counters.completed,
        requests_failed=counters.failed,
        requests_aborted=counters.aborted,
        requests_redispatched=0,
        frames_rejected=0,
        uptime_s=uptime_s,
        weight_version=engine.weight_version,
    )


# ---- commands: caller -> engine thread -------------------------------------------------------------


@dataclass(eq=False)
class _Stream:
    """One request as its caller sees it. `queue` (RequestOutput | ClusterError) is filled on `loop` only;
    `prompt_token_ids` is set by the engine thread before the first delta is posted."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_token_ids: list[int] | None = None


@dataclass(frozen=True)
class _Add:
    """`timeout` counts from `submitted_at` (time.monotonic() on the caller's side)."""

    stream: _Stream
    prompt: Prompt
    params: SamplingParams | None
    timeout: float | None = None
    submitted_at: float = 0.0
    priority: int = 0


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _StatsQuery:
    future: concurrent.futures.Future


@dataclass(frozen=True)
class _UpdateWeights:
    source: object  # a directory, or a list of (name, tensor) pairs
    on_running: str
    future: concurrent.futures.Future


@dataclass(frozen=True)
class _Call:
    """`fn(engine)` on the engine thread, between steps (LoRA adapters' load / unload / listing)."""

    fn: Callable[[Engine], object]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class _Close:
    pass


_Command = _Add | _Abort | _StatsQuery | _UpdateWeights | _Call | _Close


class LocalEngine:
    """EngineClient over one in-process Engine (direct mode of AsyncLLM and the HTTP front).

    `LocalEngine(engine)` takes ownership of `engine`: from then on only the engine thread touches it.
    Usable from any event loop (each request's deltas go to the loop that submitted it); close() once.
    """

    def __init__(self, engine: Engine) -> None:
        self._setup()
        self.engine = engine
        self._thread = threading.Thread(target=self._run, name="infer-local-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def start(cls, make: Callable[[], Engine], timeout: float) -> LocalEngine:
        """A LocalEngine whose engine `make()` builds on the engine thread, which then steps it; raises what `make`
        raised, or TimeoutError past `timeout` seconds (the engine is closed once built).

        Where the engine is built matters on a CPU: libgomp gives each thread that starts parallel regions a pool
        of its own, and once the pools' threads outnumber the CPUs its threads stop spinning between regions and
        sleep; an engine built on one thread (its weights loaded, its kernels warmed up with all cores) and
        stepped on another decoded at half speed (2-core Zen 5, 2 threads: 5.1 ms a batch-1 step built and stepped
        on one thread, 11-12 ms built on another). Torch work with all cores on another thread of the process
        (the caller's own) costs the engine the same."""
        local = cls.__new__(cls)
        local._setup()
        built: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        local._thread = threading.Thread(
            target=local._build_and_run, args=(make, built), name="infer-local-engine", daemon=True
        )
        local._thread.start()
        try:
            local.engine = await asyncio.wait_for(asyncio.wrap_future(built), timeout)
        except BaseException:
            with local._lock:  # the thread closes the engine once built (or has failed to build it)
                local._closed_reason = "the local engine did not start"
                local._commands.put(_Close())
            raise
        return local

    def _build_and_run(self, make: Callable[[], Engine], built: concurrent.futures.Future[Engine]) -> None:
        try:
            self.engine = make()
        except BaseException as e:  # noqa: BLE001 - handed to the caller of start()
            if not built.cancelled():
                built.set_exception(e)
            return
        try:
            built.set_result(self.engine)
        except concurrent.futures.InvalidStateError:  # start() gave up waiting: close what it no longer wants
            self.engine.close()
            return
        self._run()

    def _setup(self) -> None:
        self._ids = itertools.count()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "is it closed?" + put against close()
        self._closed_reason: str | None = None
        self._streams: dict[str, _Stream] = {}  # engine thread only: requests in the engine
        # engine thread only: (stream, timeout) by deadline; finished streams are skipped
        self._deadlines: DeadlineHeap[tuple[_Stream, float]] = DeadlineHeap()
        self._counters = RequestCounters()  # engine thread only
        self._refit: _UpdateWeights | None = None  # engine thread only: a drain before new weights
        self._deferred: list[_Add] = []  # engine thread only: requests that came during that drain
        self._started_at = time.monotonic()

    @property
    def model_id(self) -> str | None:
        return self.engine.model_id

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    # ---- EngineClient ---------------------------------------------------------------------------

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        traceparent: str | None = None,
        model: str | None = None,
        session_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Deltas of one request; the last has `finished`. Leaving the loop early aborts the request.
        `timeout` (seconds from this call): past it the request is aborted and its last delta has
        finish_reason "error", error_code "timeout". `priority`: lower first (scheduling_policy "priority").
        `traceparent` and `session_id`: accepted for the EngineClient contract; the engine runs in this process, no
        hop to trace and no other engine to route to.
        `model`: None or this engine's model id (ValueError otherwise: one engine serves one model)."""
        self._check_model(model)
        stream = self._open(prompt, params, request_id, timeout, priority)
        async with aclosing(self._deltas(stream)) as deltas:
            async for delta in deltas:
                yield delta

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        model: str | None = None,
        session_id: str | None = None,
    ) -> Completion:
        """The request run to the end as one Completion; past `timeout` it ends with finish_reason "error",
        error_code "timeout" (aborted, KV blocks freed). `model` and `session_id`: as in `stream`."""
        self._check_model(model)
        stream = self._open(prompt, params, request_id, timeout, priority)
        plain = split_encoder_decoder(prompt)[0] if isinstance(prompt, dict) and "encoder_prompt" in prompt else prompt
        plain = plain.get("prompt", plain.get("prompt_token_ids")) if isinstance(plain, dict) else plain
        completion = Completion(stream.request_id, [], prompt=plain if isinstance(plain, str) else None)
        await self._fold(stream, completion)
        given = [] if isinstance(plain, str) or plain is None else list(plain)
        completion.prompt_token_ids = stream.prompt_token_ids or given
        return completion

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.model_id:
            raise ValueError(f"model {model[:200]!r} is not served here: this engine serves {self.engine.model_id!r}")

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort". Unknown ids are ignored."""
        self._send(_Abort(request_id))

    async def stats(self) -> ClusterStats:
        """A ClusterStats answered by the engine thread (a real round trip: a stuck thread times out)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_StatsQuery(future))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ClusterError(f"the engine thread did not answer stats within {CALL_TIMEOUT_S} s") from None

    async def pause(self) -> str:
        raise direct_mode_error("pause")

    async def unpause(self) -> str:
        raise direct_mode_error("unpause")

    async def suspend(self) -> str:
        raise direct_mode_error("suspend")

    async def resume(self) -> str:
        raise direct_mode_error("resume")

    async def update_weights(self, source: object, *, on_running: str = "drain", timeout: float = 600.0) -> int:
        """Load new weights into the engine (see Engine.update_weights); returns the new weight version.
        `on_running`: requests in flight finish on the old weights first ("drain": new ones wait meanwhile) or
        are aborted ("abort": finish_reason "abort" with the reason). ValueError for a bad source or tensor
        (the old weights keep serving); ClusterError if the engine thread does not answer within `timeout`."""
        if on_running not in ("drain", "abort"):
            raise ValueError(f"on_running must be one of drain, abort, got {on_running!r}")
        if isinstance(source, Mapping):
            source = list(source.items())
        elif isinstance(source, Iterable) and not isinstance(source, (str, os.PathLike)):
            source = list(source)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_UpdateWeights(source, on_running, future))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            raise ClusterError(f"the engine thread did not finish update_weights within {timeout} s") from None

    async def add_lora(self, lora_request: LoRARequest) -> dict[str, str]:
        """Load a PEFT LoRA adapter into the engine (Engine.add_lora: ValueError naming what is wrong)."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"add_lora takes a LoRARequest, got {type(lora_request).__name__}")
        name, path, int_id = lora_request.lora_name, lora_request.lora_path, lora_request.lora_int_id
        return await self._call(lambda engine: (engine.add_lora(name, path, int_id), _adapters(engine))[1])

    async def remove_lora(self, lora_name: str) -> dict[str, str]:
        """Unload an adapter (requests holding it finish with it); ValueError if none has that name."""

        def unload(engine: Engine) -> dict[str, str]:
            if not engine.remove_lora(lora_name):
                raise ValueError(f"no LoRA adapter {lora_name!r} is loaded")
            return _adapters(engine)

        return await self._call(unload)

    async def list_loras(self) -> dict[str, str]:
        return await self._call(_adapters)

    async def _call(self, fn: Callable[[Engine], Any], timeout: float = 120.0) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(fn, future))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            raise ClusterError(f"the engine thread did not answer within {timeout} s") from None

    async def close(self) -> None:
        """Stop the engine thread: in-flight requests are aborted on the engine and their waiters get
        ClusterError. Waits up to CLOSE_TIMEOUT_S for the thread (it finishes its current step first)."""
        with self._lock:
            if self._closed_reason is None:
                self._closed_reason = "the local engine was closed"
                self._commands.put(_Close())
        await asyncio.to_thread(self._thread.join, CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning(
                "the engine thread is still inside a step %s s after close(); leaving it (daemon)", CLOSE_TIMEOUT_S
            )

    # ---- caller side ----------------------------------------------------------------------------

    def _open(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        timeout: float | None,
        priority: int = 0,
    ) -> _Stream:
        if timeout is not None and not _valid_timeout(timeout):
            raise ValueError(f"timeout must be a number of seconds in (0, {MAX_REQUEST_TIMEOUT_S:g}], got {timeout!r}")
        check_priority(priority)
        if request_id is not None and len(request_id) > MAX_ID_LEN:  # as a cluster refuses it: deltas carry it
            raise ValueError(f"request_id must be at most {MAX_ID_LEN} characters, got {len(request_id)}")
        stream = _Stream(request_id or f"local-{next(self._ids)}", asyncio.get_running_loop())
        self._send(_Add(stream, prompt, params, timeout, time.monotonic(), priority))
        return stream

    async def _deltas(self, stream: _Stream) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread already forgot this request
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._send(_Abort(stream.request_id), quiet=True)

    async def _fold(self, stream: _Stream, completion: Completion) -> None:
        async with aclosing(self._deltas(stream)) as deltas:
            async for delta in deltas:
                completion.add(delta)

    def _send(self, command: _Command, quiet: bool = False) -> None:
        """Queue a command for the engine thread; ClusterError once closed (ignored when `quiet`)."""
        with self._lock:
            if self._closed_reason is None:
                self._commands.put(command)
                return
        if not quiet:
            raise ClusterError(self._closed_reason)

    # ---- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        reason = None
        try:
            while self._apply_commands(block=not self._stepping()):
                self._expire_deadlines()
                if self._stepping():
                    self._deliver(self.engine.step())
                if self._refit is not None and not self.engine.has_unfinished():
                    self._finish_refit(self._refit)
        except Exception as e:  # a failed step: the engine's state is unknown, so it serves nothing more
            log.exception("the engine failed; failing every request in flight")
            reason = f"the engine failed: {type(e).__name__}: {e}"
            self._fail_streams(reason)
        finally:
            self._stop(reason)
            self.engine.close()

    def _stepping(self) -> bool:
        """Whether the thread steps the engine: while requests of its own are in it. Requests that a caller added to
        `engine` directly and steps itself (a benchmark, a test, after LLM.generate returned) are left to that
        caller: two threads stepping one engine would each take the other's outputs."""
        return bool(self._streams) and self.engine.has_unfinished()

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command, waiting up to IDLE_WAIT_S for the first when `block`. False on
        close."""
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while not isinstance(command, _Close):
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add) and self._refit is not None:
            self._deferred.append(command)  # it runs on the new weights
        elif isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _UpdateWeights):
            self._start_refit(command)
        elif isinstance(command, _Abort):
            if self.engine.abort(command.request_id):
                self._deliver(self.engine.take_pending())  # the "abort" delta now, not after the next step
        elif isinstance(command, _StatsQuery):
            self._answer_stats(command.future)
        elif isinstance(command, _Call):
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as e:  # noqa: BLE001 - the caller's error (a bad adapter folder, say)
                command.future.set_exception(e)

    def _add(self, command: _Add) -> None:
        stream = command.stream
        self._counters.submitted += 1
        if stream.request_id in self._streams:
            return self._reject(stream, f"request id {stream.request_id!r} is already in flight", "invalid_request")
        try:
            prompt, decoder = split_encoder_decoder(command.prompt)  # {"encoder_prompt": ..., "decoder_prompt": ...}
            prompt, audio = split_audio(prompt)  # {"prompt": ..., "multi_modal_data": {"audio": ...}} (Whisper)
            prompt, images = split_prompt(prompt)  # vLLM's {"prompt": ..., "multi_modal_data": ...}
            request = self.engine.add_request(
                stream.request_id,
                prompt,
                command.params,
                priority=command.priority,
                images=images,
                decoder_prompt=decoder,
                audio=None if audio is None else wire_audio(audio),
            )
        except ValueError as e:
            return self._reject(stream, str(e), "invalid_request")
        except Exception as e:  # the engine is unchanged by a failed add; only this request fails
            log.exception("add_request(%r) failed", stream.request_id)
            return self._reject(stream, f"{type(e).__name__}: {e}", "internal")
        stream.prompt_token_ids = list(request.input_token_ids)
        self._streams[stream.request_id] = stream
        if command.timeout is not None:
            deadline = command.submitted_at + command.timeout
            self._deadlines.push(deadline, (stream, command.timeout), len(self._streams), self._in_engine)

    def _expire_deadlines(self) -> None:
        """Time out every request in the engine whose deadline has passed."""
        for _, (stream, timeout) in self._deadlines.pop_due(time.monotonic(), self._in_engine):
            self._time_out(stream, timeout)

    def _in_engine(self, _deadline: float, entry: tuple[_Stream, float]) -> bool:
        return self._streams.get(entry[0].request_id) is entry[0]

    def _time_out(self, stream: _Stream, timeout: float) -> None:
        """Abort the request (its KV blocks are freed now) and end its stream with a "timeout" error."""
        if not self.engine.abort(stream.request_id):
            return
        reason = f"request {stream.request_id!r} did not finish within its timeout of {timeout:g} s; it was aborted"
        self._deliver(
            [
                msgspec.structs.replace(out, finish_reason="error", error=reason, error_code="timeout")
                if out.request_id == stream.request_id
                else out
                for out in self.engine.take_pending()
            ]
        )

    def _reject(self, stream: _Stream, reason: str, code: str) -> None:
        self._counters.record_final("error")
        _post(stream.loop, [(stream, _error_delta(stream.request_id, reason, code))])

    def _start_refit(self, command: _UpdateWeights) -> None:
        if self._refit is not None:
            command.future.set_exception(ClusterError("a weight update is already under way"))
            return
        if command.on_running == "abort":
            for stream in list(self._streams.values()):
                self.engine.abort(stream.request_id)
            reason = "aborted: the weights are being updated (update_weights with on_running='abort')"
            self._deliver([msgspec.structs.replace(out, error=reason) for out in self.engine.take_pending()])
        self._refit = command
        if not self.engine.has_unfinished():
            self._finish_refit(command)

    def _finish_refit(self, command: _UpdateWeights) -> None:
        self._refit = None
        try:
            command.future.set_result(self.engine.update_weights(command.source))
        except Exception as e:  # noqa: BLE001 - a bad source or tensor: the old weights keep serving
            command.future.set_exception(e)
        deferred, self._deferred = self._deferred, []
        for add in deferred:
            self._add(add)

    def _answer_stats(self, future: concurrent.futures.Future) -> None:
        uptime = time.monotonic() - self._started_at
        try:
            future.set_result(
                local_stats(self.engine, self._counters, num_in_flight=len(self._streams), uptime_s=uptime)
            )
        except Exception as e:
            future.set_exception(ClusterError(f"stats failed: {type(e).__name__}: {e}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Post one step's deltas: one call_soon_threadsafe per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | BaseException]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                self._counters.record_final(output.finish_reason)
            by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            _post(loop, items)

    def _fail_streams(self, reason: str) -> None:
        for stream in self._streams.values():
            self._counters.record_final("error")
            _post(stream.loop, [(stream, _error_delta(stream.request_id, reason, "internal"))])
        self._streams.clear()

    def _stop(self, failure: str | None) -> None:
        """Refuse new commands, answer the queued ones, abort what is still in the engine."""
        with self._lock:
            if self._closed_reason is None or failure is not None:
                self._closed_reason = failure or "the local engine stopped"
            reason = self._closed_reason
        error = ClusterError(reason)
        for command in _drain(self._commands):
            if isinstance(command, _Add):
                _post(command.stream.loop, [(command.stream, error)])
            elif isinstance(command, (_StatsQuery, _UpdateWeights)):
                command.future.set_exception(error)
        held_back: list[_Add | _UpdateWeights] = [*self._deferred, *([self._refit] if self._refit is not None else [])]
        for held in held_back:
            if isinstance(held, _Add):
                _post(held.stream.loop, [(held.stream, error)])
            else:
                held.future.set_exception(error)
        self._deferred, self._refit = [], None
        for stream in self._streams.values():
            if failure is None:
                self.engine.abort(stream.request_id)
            _post(stream.loop, [(stream, error)])
        self._streams.clear()


def _adapters(engine: Engine) -> dict[str, str]:
    return {str(a["name"]): str(a["path"]) for a in engine.list_loras()}


def _valid_timeout(timeout: object) -> bool:
    return isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout <= MAX_REQUEST_TIMEOUT_S


def _error_delta(request_id: str, reason: str, code: str) -> RequestOutput:
    return RequestOutput.final(request_id, "error", reason, code)


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """Put each item into its stream's queue on `loop`; a closed loop has nobody waiting, so it is skipped."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:
        pass


def _put_all(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _drain(commands: queue.SimpleQueue) -> list[_Command]:
    out = []
    while True:
        try:
            out.append(commands.get_nowait())
        except queue.Empty:
            return out
