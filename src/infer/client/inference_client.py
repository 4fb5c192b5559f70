"""InferenceClient: submit, stream, abort and drive the lifecycle of an infer cluster; SyncInferenceClient wraps it.

One DEALER socket per client (zmq.asyncio) and a single receive task that demultiplexes the
coordinator's frames by request id into per-request queues. While requests or calls are outstanding
the client sends a Heartbeat every `heartbeat_interval` (the coordinator answers with one); if nothing
arrives for `silence_timeout`, every outstanding request and call fails with ClusterError.

Coordinator restarts: each answer names the coordinator's process (`instance`). When it changes (the
coordinator died and a new one runs on the same address), the client re-attaches every request in flight:
it sends each Submit again with the output tokens it already holds, so the new coordinator hands the
stream back from the worker that still runs it, or resumes it from those tokens; no token is lost or
repeated. A restart that takes longer than `silence_timeout` fails what is in flight instead. The same
re-attachment runs when the coordinator answers with Error "client_lost" (this client was stopped, or cut off,
past the coordinator's client timeout); "client_too_slow" (it did not read) ends every request with that code.
A pause of this process itself (SIGSTOP) is not taken for the coordinator's silence.

Several coordinators (`InferenceClient("tcp://h1:5555,tcp://h2:5555,tcp://h3:5555")`; docs/architecture.md,
"Several coordinators"): one leads, and only it serves; `address` is the one in use, `addresses` all of them.
connect() says Hello to the first; a Redirect sends it to the leader named (or, none known yet, to the next
address) after 0.1-0.25 s, and so on around the list until one welcomes it, or ClusterError at connect_timeout
naming every address tried and why the last did not do. Once connected, a Redirect (the leader was deposed), the
socket monitor's word that the connection broke (a leader killed with -9), or silence for half of
`silence_timeout` while something is in flight switch the client the same way, on a fresh DEALER; the new
leader's Welcome re-attaches every request in flight (as after a restart: each stream resumes exactly), and the
call under way is sent there again once (lifecycle commands, stats and LoRA commands are idempotent; an
update_weights fails instead, its outcome unknown). Requests submitted during the switch go out after that
Welcome. Direct streams keep flowing from their workers throughout. Only silence from every coordinator for
`silence_timeout` fails what is in flight. A Redirect never ends the client; with one address, a Redirect
answering connect() fails it naming the leader, and a later one moves the client to that leader.

Errors, and where they surface:
- Request-level failures (the prompt is too long, its worker failed and retries ran out, the cluster was
  stopped before it finished) are *returned*: `generate` gives a Completion with finish_reason "error"
  and the server's text in `error`; `stream` ends with a delta carrying the same.
- Transport and cluster failures *raise* ClusterError with the server's message: no answer to connect,
  a refused handshake, a coordinator gone silent, a refused lifecycle command, the client closed.
  A CURVE handshake the coordinator refuses (an unknown key, a wrong coordinator key, keys on one side
  only) fails connect() at once, from the socket's handshake events, not at the connect timeout. A
  `Refused` from the coordinator at any time (this key lost its role, or was revoked) ends the client:
  everything in flight and every later call fails with its reason.

The socket's routing identity is a random secret (never `client_id`, which request ids carry): with keys
the coordinator keeps a routing identity with the connection that has it, and no other peer can learn it.
Closing a stream early (break, aclose, garbage collection) aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import os
import random
import secrets
import socket
import threading
import time
import uuid
import warnings
from collections.abc import AsyncGenerator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from infer.client.audio import split_audio, wire_audio
from infer.client.engine_client import ClusterError
from infer.client.multimodal import split_prompt, wire_images
from infer.client.prompt_forms import split_encoder_decoder
from infer.protocol.codes import Command, ErrorCode
from infer.protocol.journal import StreamJournal
from infer.protocol.keys import CurveKeys, PathLike
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.lora import LoRARequest, check_lora_name
from infer.protocol.messages import (
    MAX_ID_LEN,
    MAX_REFIT_TIMEOUT_S,
    MAX_REQUEST_TIMEOUT_S,
    MAX_SESSION_ID_LEN,
    ON_RUNNING,
    Abort,
    ClusterStats,
    Control,
    ControlAck,
    Delta,
    DeltaBatch,
    DrainStarted,
    DrainWorker,
    Error,
    Heartbeat,
    Hello,
    LoraCommand,
    LoraDone,
    Message,
    Placement,
    ProtocolError,
    Redirect,
    Refused,
    RequestSpec,
    StatsRequest,
    StreamBatch,
    Submit,
    Subscribe,
    TokenIds,
    UpdateWeights,
    WeightsUpdated,
    Welcome,
    decode,
    encode,
)
from infer.protocol.outputs import Completion, RequestOutput
from infer.protocol.sampling import SamplingParams, check_priority
from infer.protocol.tracing import check_traceparent
from infer.protocol.transport import HANDSHAKE_EVENTS, handshake_failure, make_socket, split_addresses

log = logging.getLogger("infer.client")

Prompt = (
    str | Sequence[int] | dict[str, Any]
)  # a dict: vLLM's multimodal or encoder-decoder form (client/multimodal.py, prompt_forms.py)
CLOSE_LINGER_MS = 200
_KEY_FLAGS = ("curve_key", "coordinator_key")
_CURVE_HINT = (
    "CURVE keys are configured: the coordinator may have refused this client's key (its log names "
    "refused keys), or coordinator_key is not the coordinator's public key"
)
_NO_CURVE_HINT = "if the coordinator requires CURVE keys, pass curve_key and coordinator_key"
DEADLINE_GRACE_S = 5.0  # past a request's timeout, how long to wait for the coordinator's own "timeout"
# Several coordinators: the pause before trying another one (a leader is elected meanwhile), and how long one may
# leave a Hello unanswered before the next is tried.
SWITCH_BACKOFF_S = (0.1, 0.25)
ATTEMPT_S = 1.0
_CONNECTION_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
# calls that may go to the new leader again when a switch interrupted them (lifecycle commands and LoRA loads are
# idempotent); a refit may not: whether the old leader started it is unknown
_REPEATABLE = (StatsRequest, Control, LoraCommand)


def parse_addresses(address: str) -> tuple[str, ...]:
    """`address` as the coordinators' addresses: one (taken as it is), or several, comma-separated
    (protocol/transport.py `split_addresses`: ValueError naming the entry that is not one)."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a string, got {type(address).__name__}")
    return (address,) if "," not in address else split_addresses(address)


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_REQUEST_TIMEOUT_S
    ):
        raise ValueError(f"timeout must be a number of seconds in (0, {MAX_REQUEST_TIMEOUT_S:g}], got {timeout!r}")


@dataclass(eq=False)
class _Request:
    """One request in flight. `submit` and `received` are kept until it finishes: after a coordinator restart
    they are what re-attaches it (nothing the client sent or got is lost with the coordinator)."""

    request_id: str
    submit: Submit
    deadline: float | None = None  # monotonic end of its timeout
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | ClusterError
    prompt_token_ids: list[int] | None = None  # a token-id prompt's own; a text prompt's from its first delta
    received: StreamJournal = field(default_factory=StreamJournal)  # the output tokens and text delivered so far
    seed: int | None = None  # the seed the first delta reported
    placement: Placement | None = None  # where its direct stream runs (None: relayed, or detached)
    started: bool = False  # a delta of it reached the caller (a later one carries no seed or prompt ids)
    sent: bool = False  # its Submit went to a coordinator (else, submitted during a switch, it goes after the Welcome)
    sending: bool = False  # its Submit is in the socket and submit() has not yet heard so: it goes as it is


@dataclass(eq=False)
class _StreamLink:
    """One DEALER to a worker's stream socket (docs/architecture.md, "Direct streams"), opened at the first
    Placement there; its routing identity stays across reconnections, so the worker's subscriptions do too."""

    address: str
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket  # its handshakes: after each reconnection, every stream on it is subscribed again
    tasks: list[asyncio.Task] = field(default_factory=list)
    last_heard: float = 0.0
    resubscribed: bool = False  # its silence was answered by subscribing again; next, the coordinator is asked


@dataclass(eq=False)
class _Connection:
    """What connect() opens and close() releases, all at once: the context, the socket to the coordinator in use
    with its monitor (handshakes; with several coordinators, broken connections too) and the two tasks that read
    them (a switch to another coordinator replaces these four), the event the loops end on, and the lock that
    keeps request-reply calls one at a time."""

    ctx: zmq.asyncio.Context
    sock: zmq.asyncio.Socket | None = None
    monitor: zmq.asyncio.Socket | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    call_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(eq=False)
class _Call:
    expect: tuple[type[Message], ...]
    future: asyncio.Future
    msg: Message
    send: asyncio.Future | None = None  # its latest send (None: not sent yet, a switch was under way)
    sends: int = 0


_DEFAULT_PARAMS = SamplingParams()


class InferenceClient:
    """Async client of a cluster's coordinator. Use as `async with InferenceClient("tcp://host:port") as client:`;
    with several coordinators, `InferenceClient("tcp://h1:5555,tcp://h2:5555,tcp://h3:5555")`."""

    def __init__(
        self,
        address: str,
        *,
        connect_timeout: float = 10.0,
        call_timeout: float = 30.0,
        heartbeat_interval: float = 1.0,
        silence_timeout: float = 10.0,
        client_id: str | None = None,
        curve_key: PathLike | None = None,
        coordinator_key: PathLike | None = None,
        direct_streams: bool = True,
    ) -> None:
        """`address`: the coordinator's, or every coordinator's of a cluster with several, comma-separated (each
        tcp://HOST:PORT; ValueError naming an entry that is not): the client talks to the one that leads.
        `curve_key`, `coordinator_key`: CurveZMQ (both or neither): this client's secret key file and the
        coordinator's public key file (infer-keygen); the files are read here (ValueError if unusable).
        `direct_streams`: read deltas from the workers' stream sockets (False: the coordinator relays them)."""
        if heartbeat_interval <= 0 or silence_timeout <= heartbeat_interval:
            raise ValueError(
                f"need 0 < heartbeat_interval ({heartbeat_interval}) < silence_timeout ({silence_timeout})"
            )
        if connect_timeout <= 0 or call_timeout <= 0:
            raise ValueError("connect_timeout and call_timeout must be > 0")
        self.addresses = parse_addresses(address)
        self.address = self.addresses[0]  # the coordinator in use
        self.curve = CurveKeys.from_files(curve_key, coordinator_key)
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self.last_ack: ControlAck | None = None  # the last lifecycle answer (suspend / resume: the bytes)
        self.heartbeat_interval = heartbeat_interval
        self.silence_timeout = silence_timeout
        self.welcome: Welcome | None = None
        self._instance: str | None = None  # the coordinator process last heard (Welcome / Heartbeat)
        self._warn = RateLimitedLog(log)  # frames from the coordinator this client drops
        self._ids = itertools.count()
        self._requests: dict[str, _Request] = {}
        self._call: _Call | None = None
        self._conn: _Connection | None = None
        self._tasks: list[asyncio.Task] = []
        self._failure: ClusterError | None = None
        self._last_heard = 0.0
        self._links: dict[str, _StreamLink] = {}  # worker stream address -> its link
        self.direct_streams = direct_streams
        # a switch to another coordinator (several, or a Redirect): its task, the Hello it waits on, and the Aborts
        # sent meanwhile (they go to the new leader after its Welcome)
        self._rejoin: asyncio.Task | None = None
        self._attempt: asyncio.Future | None = None
        self._held: list[Abort] = []

    @property
    def _several(self) -> bool:
        return len(self.addresses) > 1

    @property
    def model_id(self) -> str | None:
        """The model the cluster serves (from the coordinator's Welcome); None before connect()."""
        return None if self.welcome is None else self.welcome.model_id

    # ---- connection -----------------------------------------------------------------------------

    async def __aenter__(self) -> InferenceClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def connect(self) -> Welcome:
        """Connect and handshake; ClusterError if refused or unanswered within `connect_timeout`."""
        if self._conn is not None:
            raise ClusterError("already connected")
        conn = self._conn = _Connection(zmq.asyncio.Context())
        self.welcome = None  # until this connection's Welcome
        self._last_heard = time.monotonic()
        self._failure = None
        self._tasks = [asyncio.create_task(self._heartbeat_loop(conn), name=f"{self.client_id}-heartbeat")]
        try:
            if self._several:
                self.welcome = await self._join(conn, self.addresses[0], time.monotonic() + self.connect_timeout)
                self._instance = self.welcome.instance
                return self.welcome
            self._open(conn, self.address)
            self.welcome = await self._request_reply(self._hello(), (Welcome,), self.connect_timeout)
        except BaseException as e:
            await self.close()
            if isinstance(e, ClusterError) and isinstance(e.__context__, asyncio.TimeoutError):
                # a refused CURVE handshake looks like silence from here: say what it may be
                raise ClusterError(f"{e} ({_CURVE_HINT if self.curve else _NO_CURVE_HINT})") from None
            raise
        return self.welcome

    async def close(self) -> None:
        """Abort what is still in flight, fail its waiters, and release the socket."""
        conn = self._conn
        if conn is None:
            return
        if self._requests:
            self._send_nowait(Abort(request_ids=list(self._requests)))
        self._fail_all(ClusterError("the client was closed"))
        conn.closed.set()
        links, self._links = list(self._links.values()), {}
        rejoin, self._rejoin = self._rejoin, None
        tasks = [*self._tasks, *conn.tasks, *(task for link in links for task in link.tasks)]
        tasks += [rejoin] if rejoin is not None else []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in links:
            link.sock.disable_monitor()
            link.monitor.close(linger=0)
            link.sock.close(linger=0)
        self._close_socket(conn, CLOSE_LINGER_MS)
        conn.ctx.term()
        self._conn = None

    def _open(self, conn: _Connection, address: str) -> None:
        """Connect `conn` to the coordinator at `address` with a fresh DEALER (the one before, if any, closed: a
        frame still queued there is dropped) and start its receive and monitor tasks."""
        self._close_socket(conn, 0)
        # the cast: an asyncio context makes asyncio sockets (make_socket is typed for both kinds)
        sock = cast(
            zmq.asyncio.Socket,
            make_socket(conn.ctx, zmq.DEALER, identity=secrets.token_hex(16).encode(), curve=self.curve),
        )
        conn.sock = sock
        conn.monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS | (_CONNECTION_EVENTS if self._several else 0))
        sock.connect(address)
        self.address = address
        conn.tasks = [
            asyncio.create_task(self._receive_loop(conn, sock), name=f"{self.client_id}-receive"),
            asyncio.create_task(self._handshake_loop(sock, conn.monitor), name=f"{self.client_id}-handshakes"),
        ]

    @staticmethod
    def _close_socket(conn: _Connection, linger: int) -> None:
        for task in conn.tasks:
            task.cancel()
        conn.tasks = []
        if conn.sock is not None:
            conn.sock.disable_monitor()
            cast(zmq.asyncio.Socket, conn.monitor).close(linger=0)
            conn.sock.close(linger=linger)
        conn.sock = conn.monitor = None

    def _hello(self) -> Hello:
        return Hello(role="client", peer_id=self.client_id, streams=self.direct_streams)

    # ---- generation -----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        pin_rank: int | None = None,
        timeout: float | None = None,
        priority: int = 0,
        traceparent: str | None = None,
        model: str | None = None,
        session_id: str | None = None,
    ) -> Completion:
        """Run one request to the end. Request-level failures come back as finish_reason "error"; transport
        failures raise. With `timeout` (seconds) the cluster aborts the request (freeing its KV blocks) if it
        has not finished by then, and the completion ends with error_code "timeout". `priority`: lower is
        served first (workers with --scheduling-policy priority; the coordinator sheds the highest first).
        `traceparent`: the caller's W3C trace context; the cluster's hops that trace (--otlp-traces-endpoint)
        record their spans under it (protocol/tracing.py). `model`: the model to run it on (a worker's model id, or
        a LoRA adapter: its base model's workers); None: the cluster's only model, or its default (--model-id);
        one not served ends it with error_code "model_not_found", the text naming the models served. `session_id`:
        the conversation it belongs to (the HTTP front's X-Session-ID, at most 256 characters): the cluster runs it
        where the session's previous request ran, while that worker is healthy and not overloaded (its KV is
        there)."""
        _check_timeout(timeout)
        request = await self._submit(
            prompt, params, request_id, pin_rank, timeout, priority, traceparent, model, session_id
        )
        prompt, _ = split_prompt(split_encoder_decoder(prompt)[0])
        completion = Completion(
            request.request_id, prompt_token_ids=[], prompt=prompt if isinstance(prompt, str) else None
        )
        async with contextlib.aclosing(self._deltas(request, timeout)) as deltas:
            async for delta in deltas:
                completion.add(delta)
        given = [] if isinstance(prompt, (str, dict)) else list(prompt)
        completion.prompt_token_ids = request.prompt_token_ids or given
        return completion

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        pin_rank: int | None = None,
        timeout: float | None = None,
        priority: int = 0,
        traceparent: str | None = None,
        model: str | None = None,
        session_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Deltas of one request as they arrive (`token_ids` and `text` new since the last one); the last
        has `finished` and `finish_reason`. Leaving the loop early aborts the request. `timeout`, `priority`,
        `traceparent`, `model` and `session_id`: as in `generate`; after a timeout the last delta has error_code
        "timeout"."""
        _check_timeout(timeout)
        request = await self._submit(
            prompt, params, request_id, pin_rank, timeout, priority, traceparent, model, session_id
        )
        async with contextlib.aclosing(self._deltas(request, timeout)) as deltas:
            async for delta in deltas:
                yield delta

    async def _deltas(self, request: _Request, timeout: float | None) -> AsyncGenerator[RequestOutput, None]:
        # The coordinator enforces the deadline; this one only covers a coordinator that cannot answer.
        deadline = None if timeout is None else time.monotonic() + timeout + DEADLINE_GRACE_S
        finished = False
        try:
            while not finished:
                delta = await self._next(request, deadline)
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self._abandon(request)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream (or generate) ends with finish_reason "abort"."""
        await self._send(Abort(request_ids=[request_id]))

    def prompt_token_ids(self, request_id: str) -> list[int] | None:
        """The prompt's token ids (in flight only): a token-id prompt's at once, a text prompt's as the cluster
        tokenized them once the first delta arrived."""
        request = self._requests.get(request_id)
        return None if request is None else request.prompt_token_ids

    async def _submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        pin_rank: int | None,
        timeout: float | None = None,
        priority: int = 0,
        traceparent: str | None = None,
        model: str | None = None,
        session_id: str | None = None,
    ) -> _Request:
        self._check_open()
        if session_id is not None and not (isinstance(session_id, str) and 0 < len(session_id) <= MAX_SESSION_ID_LEN):
            raise ValueError(
                f"session_id must be a string of 1..{MAX_SESSION_ID_LEN} characters, got {session_id!r:.80}"
            )
        check_priority(priority)
        check_traceparent(traceparent)
        params = _DEFAULT_PARAMS if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        rid = request_id or f"{self.client_id}-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in flight")
        prompt, decoder = split_encoder_decoder(prompt)  # vLLM's {"encoder_prompt": ..., "decoder_prompt": ...}
        prompt, audio = split_audio(prompt)  # {"prompt": ..., "multi_modal_data": {"audio": ...}} (Whisper)
        prompt, images = split_prompt(prompt)
        encoded = wire_images(images)
        spec = RequestSpec(
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=None if isinstance(prompt, str) else TokenIds.checked(prompt, "prompt"),
            sampling=params,
            priority=priority,
            images=encoded,
            decoder_prompt=decoder if isinstance(decoder, str) else None,
            decoder_prompt_token_ids=None
            if decoder is None or isinstance(decoder, str)
            else TokenIds.checked(decoder, "decoder_prompt"),
            audio=b"" if audio is None else wire_audio(audio),
        )
        submit = Submit(
            request_id=rid,
            spec=spec,
            pin_rank=pin_rank,
            timeout_s=timeout,
            traceparent=traceparent,
            model=model,
            session_id=session_id,
        )
        request = self._requests[rid] = _Request(
            rid,
            submit,
            None if timeout is None else time.monotonic() + timeout,
            # with images the worker echoes the ids with each image's tokens expanded (with audio: the decoder's, its
            # start token in front)
            prompt_token_ids=None if isinstance(prompt, (str, dict)) or encoded or audio is not None else list(prompt),
        )
        if len(self._requests) == 1 and self._call is None:
            self._last_heard = time.monotonic()  # the silence clock starts when there is something to wait for
        request.sending = True
        try:
            request.sent = await self._send(submit)
        except BaseException:
            self._requests.pop(rid, None)
            raise
        finally:
            request.sending = False
        return request

    async def _next(self, request: _Request, deadline: float | None) -> RequestOutput:
        if deadline is None:
            item = await request.queue.get()
        else:
            try:
                item = await asyncio.wait_for(request.queue.get(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self._abandon(request)
                return Delta.final(
                    request.request_id,
                    "error",
                    f"request {request.request_id!r} did not finish "
                    f"within its timeout, and the coordinator did not end it either; it was aborted",
                    "timeout",
                )
        if isinstance(item, BaseException):
            raise item
        return item

    def _abandon(self, request: _Request) -> None:
        """The caller stopped waiting before the end: abort it on the cluster."""
        if self._requests.pop(request.request_id, None) is not None and self._conn is not None:
            self._send_nowait(Abort(request_ids=[request.request_id]))

    # ---- lifecycle and stats --------------------------------------------------------------------

    async def pause(self) -> str:
        """Hold new requests in the coordinator (in-flight ones may pause too); returns the new state."""
        return await self._control(Command.PAUSE)

    async def unpause(self) -> str:
        return await self._control(Command.UNPAUSE)

    async def suspend(self) -> str:
        """From paused: let workers release memory. Returns the new state."""
        return await self._control(Command.SUSPEND)

    async def resume(self) -> str:
        """From suspended back to paused. Returns the new state."""
        return await self._control(Command.RESUME)

    async def stop(self) -> str:
        """Stop the cluster: pending requests fail with an error, workers stop, the coordinator exits."""
        return await self._control(Command.STOP)

    async def drain_worker(self, worker_id: str, wait: bool = True, timeout: float = 600.0) -> int:
        """Scale the cluster down by one worker (with keys: an administrator key). The coordinator routes nothing
        new to `worker_id` (as `stats().workers` names it) and the worker drains as on SIGTERM: with
        --kv-transfer-config its running requests continue on other workers with their KV, the others finish there
        (within its --drain-timeout); then it exits 0. Returns how many requests it held when the drain started;
        with `wait`, once it has left the cluster (ClusterError if it has not within `timeout` s). ClusterError
        naming the cluster's workers when `worker_id` is none of them."""
        if not isinstance(worker_id, str) or not 0 < len(worker_id) <= MAX_ID_LEN:
            raise ValueError(f"worker_id must be a string of 1..{MAX_ID_LEN} characters, got {worker_id!r:.80}")
        if not (isinstance(timeout, (int, float)) and 0 < timeout <= MAX_REQUEST_TIMEOUT_S):
            raise ValueError(f"timeout must be in (0, {MAX_REQUEST_TIMEOUT_S:g}] s, got {timeout!r}")
        started = await self._request_reply(DrainWorker(worker_id=worker_id), (DrainStarted,), self.call_timeout)
        deadline = time.monotonic() + timeout
        while wait:
            if not any(w.worker_id == worker_id and w.healthy for w in (await self.stats()).workers):
                break
            if time.monotonic() >= deadline:
                raise ClusterError(f"worker {worker_id!r} is draining but has not left the cluster within {timeout} s")
            await asyncio.sleep(0.25)
        return started.num_requests

    async def _control(self, command: Command) -> str:
        # suspend and resume are answered once every worker released / restored its memory
        timeout = self.call_timeout if command not in (Command.SUSPEND, Command.RESUME) else self.call_timeout + 300.0
        ack = await self._request_reply(Control(command=command), (ControlAck,), timeout)
        if ack.error is not None:
            raise ClusterError(ack.error)
        self.last_ack = ack
        return ack.state

    # ---- LoRA adapters --------------------------------------------------------------------------

    # One vocabulary with LLM and AsyncLLM (vLLM's engine names): add_lora(LoRARequest), remove_lora(name),
    # list_loras(). The HTTP front's routes keep vLLM's HTTP names (POST /v1/load_lora_adapter, ...).

    async def add_lora(self, lora_request: LoRARequest) -> dict[str, str]:
        """Load `lora_request`'s PEFT LoRA adapter (a folder every worker reads) on every worker under its
        `lora_name`; returns the cluster's adapters (name -> folder) once every worker did (its `lora_int_id` is not
        used: a cluster names adapters). Needs an administrator key (with keys); like a refit, the path is not
        looked at here. ClusterError naming each worker that failed (a missing file, a rank above --max-lora-rank,
        LoRA not enabled), or the refusal."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"add_lora takes a LoRARequest, got {type(lora_request).__name__}")
        path = os.path.abspath(lora_request.lora_path)
        return await self._lora_command(LoraCommand(action="load", lora_name=lora_request.lora_name, lora_path=path))

    async def remove_lora(self, lora_name: str) -> dict[str, str]:
        """Unload `lora_name` on every worker (requests holding it finish with it); returns the cluster's adapters."""
        return await self._lora_command(LoraCommand(action="unload", lora_name=check_lora_name(lora_name)))

    async def list_loras(self) -> dict[str, str]:
        """The healthy workers' adapters, name -> folder (from a fresh stats round trip)."""
        return dict((await self.stats()).lora_adapters)

    async def load_lora_adapter(self, lora_name: str, lora_path: str | os.PathLike[str]) -> dict[str, str]:
        """Deprecated: `add_lora(LoRARequest(lora_name, 1, lora_path))`, the name LLM and AsyncLLM use."""
        _deprecated("load_lora_adapter(name, path)", "add_lora(LoRARequest(name, 1, path))")
        return await self.add_lora(LoRARequest(lora_name, 1, os.fspath(lora_path)))

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        """Deprecated: `remove_lora(lora_name)`."""
        _deprecated("unload_lora_adapter", "remove_lora")
        return await self.remove_lora(lora_name)

    async def list_lora_adapters(self) -> dict[str, str]:
        """Deprecated: `list_loras()`."""
        _deprecated("list_lora_adapters", "list_loras")
        return await self.list_loras()

    async def _lora_command(self, msg: LoraCommand) -> dict[str, str]:
        reply = await self._request_reply(msg, (LoraDone,), self.call_timeout + 120.0)
        if reply.error is not None:
            raise ClusterError(reply.error)
        return dict(reply.lora_adapters)

    # ---- weight refit ---------------------------------------------------------------------------

    async def update_weights(
        self,
        source: str | os.PathLike[str] | Iterable[tuple[str, Any]] | Mapping[str, Any],
        *,
        on_running: str = "drain",
        timeout: float = 600.0,
        sync_host: str | None = None,
        bucket_bytes: int = 64 << 20,
    ) -> int:
        """Load new weights into every worker; returns the new weight version once every worker serves it
        (each delta carries its version: `RequestOutput.weight_version`, `Completion.weight_version`).

        `source`: a safetensors directory (a path every worker can read), or (checkpoint name, tensor) pairs
        (or a dict), which this process broadcasts to the workers over torch.distributed (a weight-sync group
        of its own: gloo, NCCL when the tensors are on a GPU; `sync_host`: this host's address as the workers
        reach it, found from the route to the coordinator when not given). `on_running`: requests in flight
        finish on the old weights first ("drain") or are aborted ("abort", finish_reason "abort" with the
        reason); new requests wait until the update is done. Needs an administrator key (with keys).

        All or nothing, cluster-wide: a tensor with a wrong name, shape or dtype, or NaN / inf values, or a
        directory some worker cannot read fails the update (ClusterError naming it) on every worker, and the old
        weights keep serving. ValueError for bad arguments.
        """
        if on_running not in ON_RUNNING:
            raise ValueError(f"on_running must be one of {', '.join(ON_RUNNING)}, got {on_running!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_REFIT_TIMEOUT_S:
            raise ValueError(f"timeout must be a number of seconds in (0, {MAX_REFIT_TIMEOUT_S:g}], got {timeout!r}")
        wait = timeout + self.call_timeout + 30.0
        if isinstance(source, (str, os.PathLike)):
            # Not looked at here: the coordinator checks this key's role first, and only the workers of an
            # administrator's refit read the path (so the answers of a refused caller say nothing about paths).
            path = os.path.abspath(os.fspath(source))
            msg = UpdateWeights(path=path, on_running=on_running, timeout_s=float(timeout))
            reply = await self._request_reply(msg, (WeightsUpdated,), wait)
            return reply.version
        return await self._update_from_tensors(source, on_running, float(timeout), sync_host, bucket_bytes, wait)

    async def _update_from_tensors(
        self, source: Any, on_running: str, timeout: float, sync_host: str | None, bucket_bytes: int, wait: float
    ) -> int:
        from infer.worker.distributed.weight_sync import WeightSender, describe  # torch: only for a trainer's tensors

        if isinstance(source, Mapping):
            source = source.items()
        if isinstance(source, (bytes, str)) or not isinstance(source, Iterable):
            raise ValueError(
                f"a weight source must be a safetensors directory or an iterable of (name, tensor) "
                f"pairs, got {type(source).__name__}"
            )
        pairs = list(source)
        describe(pairs)  # ValueError for a pair that is not (name, float tensor)
        num_workers = (await self.stats()).num_healthy_workers
        if num_workers < 1:
            raise ClusterError("update_weights: no healthy worker to send the weights to")
        host = sync_host or self._sync_host()
        sender = await asyncio.to_thread(WeightSender.open, host, num_workers, timeout, bucket_bytes)
        msg = UpdateWeights(sync=sender.sync(pairs), on_running=on_running, timeout_s=timeout)
        reply = asyncio.ensure_future(self._request_reply(msg, (WeightsUpdated,), wait))
        sending = asyncio.ensure_future(asyncio.to_thread(sender.send, pairs))
        await asyncio.wait({reply, sending}, return_when=asyncio.FIRST_EXCEPTION)
        refused = reply.exception() if reply.done() else None
        if refused is not None:
            sending.add_done_callback(_consume)  # its thread ends at its own timeout: nobody joins the group
            raise refused
        try:
            await sending
        except Exception as e:
            reply.cancel()
            raise ClusterError(f"update_weights: broadcasting the weights failed: {type(e).__name__}: {e}") from None
        return (await reply).version

    def _sync_host(self) -> str:
        """This host's address as seen on the route to the coordinator (loopback for a local coordinator)."""
        host, _, port = self.address.removeprefix("tcp://").rpartition(":")
        host = host.strip("[]")
        try:
            if host == "localhost" or ipaddress.ip_address(host).is_loopback:
                return "127.0.0.1"
        except ValueError:
            pass  # a host name
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
            probe.connect((host, int(port or 5555)))
            return probe.getsockname()[0]

    async def stats(self) -> ClusterStats:
        """Per-worker load and health, and the coordinator's own counts."""
        return await self._request_reply(StatsRequest(), (ClusterStats,), self.call_timeout)

    async def wait_for_workers(self, count: int, timeout: float) -> ClusterStats:
        """Wait (on the coordinator's side, no polling) until `count` workers are healthy; ClusterError if
        they are not within `timeout` seconds."""
        stats = await self._request_reply(
            StatsRequest(min_healthy_workers=count, timeout_s=timeout), (ClusterStats,), timeout + self.call_timeout
        )
        if stats.num_healthy_workers < count:
            raise ClusterError(f"only {stats.num_healthy_workers} of {count} workers are healthy after {timeout} s")
        return stats

    async def _request_reply(self, msg: Message, expect: tuple[type[Message], ...], timeout: float) -> Any:
        """Send `msg` and wait for the answer; one such call at a time (answers carry no request id)."""
        conn = self._check_open()
        async with conn.call_lock:
            call = self._call = _Call(expect, asyncio.get_running_loop().create_future(), msg)
            if not self._requests:
                self._last_heard = time.monotonic()
            if self._rejoin is None:  # else it goes to the next leader, after its Welcome
                self._send_call(conn, call)
            try:
                return await asyncio.wait_for(call.future, timeout)
            except asyncio.TimeoutError:
                raise ClusterError(
                    f"no answer to {msg.TYPE!r} from the coordinator at {self.address} within {timeout} s"
                ) from None
            finally:
                self._call = None
                if call.send is not None and not call.send.done():
                    call.send.cancel()

    @staticmethod
    def _send_call(conn: _Connection, call: _Call) -> None:
        # Not awaited before the answer: with no live pipe (a refused CURVE handshake tears it down, at times
        # before the Hello is queued) a DEALER's send waits for one; the handshake monitor fails the call
        # meanwhile, and the timeout bounds both.
        # pyzmq's stub says Awaitable; zmq.asyncio's send_multipart returns an asyncio.Future
        send: asyncio.Future = cast(zmq.asyncio.Socket, conn.sock).send_multipart([encode(call.msg)])  # type: ignore[assignment]
        send.add_done_callback(_consume)
        call.send = send
        call.sends += 1

    # ---- the receive side -----------------------------------------------------------------------

    async def _receive_loop(self, conn: _Connection, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                self._fail_all(ClusterError(f"the connection to {self.address} failed: {e}"))
                return
            heard = time.monotonic()
            if len(frames) != 1:
                log.warning("dropped a %d-frame message from the coordinator", len(frames))
                continue
            try:
                msg = decode(frames[0])
            except ProtocolError as e:
                self._warn.warning("dropped a bad frame from the coordinator: %s", safe(e))
                continue
            except Exception:  # noqa: BLE001 - decode raises ProtocolError only; anything else is a bug
                self._warn.exception("dropped a frame from the coordinator that could not be read")
                continue
            if not isinstance(msg, Redirect):  # a coordinator that does not lead serves nothing: not an answer
                self._last_heard = heard
            try:
                self._on_message(msg)
            except Exception:  # noqa: BLE001 - a bug a frame found costs that frame, never the connection
                self._warn.exception("dropped a %r frame from the coordinator: handling it failed", msg.TYPE)

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, DeltaBatch):
            for delta in msg.deltas:
                self._on_delta(delta)
        elif isinstance(msg, Delta):
            self._on_delta(msg)
        elif isinstance(msg, Error):
            self._on_error(msg)
        elif isinstance(msg, Placement):
            self._on_placement(msg)
        elif isinstance(msg, Refused):  # a refused Hello, or this client cut off: nothing more will work
            self._end(ClusterError(f"refused by the coordinator: {msg.reason}"))
        elif isinstance(msg, Heartbeat):
            self._check_instance(msg.instance)
        elif isinstance(msg, (Welcome, Redirect)) and self._attempt is not None and not self._attempt.done():
            self._attempt.set_result(msg)  # the answer to a switch's Hello
        elif isinstance(msg, Redirect):
            self._on_redirect(msg)
        else:
            if isinstance(msg, Welcome):
                self._check_instance(msg.instance)
            self._answer(msg, None)

    def _check_instance(self, instance: str | None) -> None:
        """A new coordinator instance on the same address (it restarted): re-attach what is in flight."""
        if instance is None or instance == self._instance:
            return
        restarted, self._instance = self._instance is not None, instance
        if restarted and self._conn is not None:
            self._reattach_all("the coordinator restarted")

    def _reattach_all(self, why: str, hello: bool = True) -> None:
        log.warning("%s (%s): re-attaching %d request(s) in flight", why, self.address, len(self._requests))
        if hello:
            self._send_nowait(self._hello())
        for request in list(self._requests.values()):
            self._reattach(request, why)

    def _reattach(self, request: _Request, why: str) -> None:
        """Send `request` again from what this client holds (the coordinator resumes it from there); if it cannot
        go on exactly, it ends with an error saying why. One no coordinator received yet goes as it is."""
        if request.sending:  # a restart noticed while its Submit is on its way: a second one would be refused
            return None  # ("already in flight") and end the request with that error
        if not request.sent:
            timeout = None if request.deadline is None else max(1e-3, request.deadline - time.monotonic())
            request.sent = self._send_nowait(msgspec.structs.replace(request.submit, timeout_s=timeout))
            return None
        submit = self._resubmission(request)
        if submit is not None:
            self._send_nowait(submit)
            return None
        del self._requests[request.request_id]
        request.queue.put_nowait(
            Delta.final(
                request.request_id,
                "error",
                f"request {request.request_id!r} cannot be resumed ({why}) without a "
                f"repeat: the coordinator never told this client the prompt's token ids",
                "unavailable",
            )
        )

    @staticmethod
    def _resubmission(request: _Request) -> Submit | None:
        """`request`'s Submit again, marked as a re-attachment with the tokens (and the length of the text)
        already here, the seed it runs with and the time left of its timeout; None if it cannot go on
        exactly (tokens arrived but not the prompt's ids)."""
        submit = request.submit
        timeout = None if request.deadline is None else max(1e-3, request.deadline - time.monotonic())
        spec = submit.spec
        if request.seed is not None:
            spec = msgspec.structs.replace(spec, sampling=spec.sampling.with_seed(request.seed))
        if not request.received.token_ids:
            return msgspec.structs.replace(submit, spec=spec, timeout_s=timeout, reattach=True)
        if request.prompt_token_ids is None:
            return None
        return msgspec.structs.replace(
            submit,
            spec=msgspec.structs.replace(spec, prompt=None, prompt_token_ids=TokenIds(request.prompt_token_ids)),
            timeout_s=timeout,
            reattach=True,
            delivered_token_ids=TokenIds(request.received.token_ids),
            delivered_text_len=request.received.text_len,
        )

    # ---- direct streams (docs/architecture.md, "Direct streams") ------------------------------------

    def _on_placement(self, msg: Placement) -> None:
        """Where a direct stream runs now: subscribe there from what this client holds; or (no address) it left
        its worker: send the coordinator this client's copy, which it resumes from."""
        request = self._requests.get(msg.request_id)
        if request is None:  # it ended here (its final delta came from its worker): nothing to run or resume
            self._send_nowait(Abort(request_ids=[msg.request_id]))
            return
        request.placement = msg if msg.stream_address is not None else None
        if request.placement is None:
            return self._ask_coordinator(request)
        self._subscribe(self._link(msg), request, msg)

    def _ask_coordinator(self, request: _Request) -> None:
        """Send the coordinator this client's copy, which it resumes `request` from; until it says where, no delta
        is taken (a late one of the old placement would move the copy past where the resumed stream starts)."""
        request.placement = None
        self._reattach(request, "its direct stream left its worker")

    def _link(self, placement: Placement) -> _StreamLink:
        address = cast(str, placement.stream_address)
        link = self._links.get(address)
        if link is not None:
            return link
        conn = self._connected()
        curve = None
        if self.curve is not None and placement.worker_key is not None:
            curve = CurveKeys(self.curve.public_key, self.curve.secret_key, server_key=placement.worker_key.encode())
        sock = cast(
            zmq.asyncio.Socket,
            make_socket(conn.ctx, zmq.DEALER, identity=secrets.token_hex(16).encode(), curve=curve),
        )
        monitor = cast(zmq.asyncio.Socket, sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
        sock.connect(address)
        link = self._links[address] = _StreamLink(address, sock, monitor, last_heard=time.monotonic())
        link.tasks = [
            asyncio.create_task(self._stream_loop(link), name=f"{self.client_id}-stream"),
            asyncio.create_task(self._watch_link(link), name=f"{self.client_id}-stream-monitor"),
        ]
        return link

    async def _watch_link(self, link: _StreamLink) -> None:
        """After every reconnection of `link` (a handshake past the first), subscribe again to each stream placed
        there, from what this client holds (the worker dropped the subscriptions its sends to it failed)."""
        handshakes = 0
        while True:
            try:
                parse_monitor_message(await link.monitor.recv_multipart())
            except zmq.ZMQError:
                return
            handshakes += 1
            if handshakes == 1:
                continue
            for request in [r for r in self._requests.values() if self._placed_at(r, link)]:
                self._subscribe(link, request, cast(Placement, request.placement))

    def _subscribe(self, link: _StreamLink, request: _Request, placement: Placement) -> None:
        received = request.received
        msg = Subscribe(
            request_id=request.request_id,
            stream_token=cast(str, placement.stream_token),
            num_tokens=len(received.token_ids),
            text_len=received.text_len or 0,
        )
        future: asyncio.Future = link.sock.send_multipart([encode(msg)])  # type: ignore[assignment]
        future.add_done_callback(_consume)

    async def _stream_loop(self, link: _StreamLink) -> None:
        while True:
            try:
                frames = await link.sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return
            link.last_heard, link.resubscribed = time.monotonic(), False
            try:
                self._on_stream_frame(link, frames)
            except Exception:  # noqa: BLE001 - a bug a frame found costs that frame, never the stream socket
                self._warn.exception("dropped a frame from worker stream %s: handling it failed", safe(link.address))
            # a worker that streams faster than this client decodes must not starve its other tasks (heartbeats to
            # the coordinator among them): a receive that finds a frame waiting does not yield by itself
            await asyncio.sleep(0)

    def _on_stream_frame(self, link: _StreamLink, frames: list[bytes]) -> None:
        try:
            msg = decode(frames[-1])
        except ProtocolError as e:
            self._warn.warning("dropped a bad frame from worker stream %s: %s", safe(link.address), safe(e))
            return
        if isinstance(msg, StreamBatch):
            self._on_stream_batch(link, msg)
        elif isinstance(msg, Error) and msg.request_id is not None:
            request = self._requests.get(msg.request_id)
            if request is None or not self._placed_at(request, link):
                return
            if msg.stream_token == cast(Placement, request.placement).stream_token:
                self._ask_coordinator(request)  # not served there: the coordinator resumes it from the copy

    @staticmethod
    def _placed_at(request: _Request, link: _StreamLink) -> bool:
        return request.placement is not None and request.placement.stream_address == link.address

    def _on_stream_batch(self, link: _StreamLink, batch: StreamBatch) -> None:
        """Each delta that continues its request's copy exactly, from its current placement; the rest dropped."""
        for delta, token_start, text_start in zip(batch.deltas, batch.token_starts, batch.text_starts):
            request = self._requests.get(delta.request_id)
            if request is None or not self._placed_at(request, link):
                continue
            if token_start != len(request.received.token_ids) or text_start != (request.received.text_len or 0):
                continue
            if request.started and (delta.seed is not None or delta.prompt_token_ids is not None):
                # a re-dispatch's first delta: what only the stream's first delta carries went out once already
                delta = msgspec.structs.replace(delta, seed=None, prompt_token_ids=None, queue_time_s=None)
            self._on_delta(delta)

    def _check_links(self, now: float) -> None:
        """A stream socket silent for half the silence timeout (workers beat on it): subscribe again; silent
        as long again: ask the coordinator where each of its streams runs (it resumes those it lost)."""
        for link in self._links.values():
            placed = [r for r in self._requests.values() if self._placed_at(r, link)]
            if not placed:
                link.last_heard = now
                continue
            if now - link.last_heard < self.silence_timeout / 2:
                continue
            link.last_heard = now
            for request in placed:
                if link.resubscribed:
                    self._ask_coordinator(request)
                else:
                    self._subscribe(link, request, cast(Placement, request.placement))
            link.resubscribed = not link.resubscribed

    def _on_delta(self, delta: Delta) -> None:
        request = self._requests.get(delta.request_id)
        if request is None:
            return  # a late delta of a request abandoned here
        if delta.prompt_token_ids is not None and request.prompt_token_ids is None:
            request.prompt_token_ids = list(delta.prompt_token_ids)
        request.received.record(delta.token_ids, delta.text)
        request.started = True
        if delta.seed is not None:
            request.seed = delta.seed
        request.queue.put_nowait(delta)
        if delta.finished:
            del self._requests[delta.request_id]

    def _on_error(self, error: Error) -> None:
        if error.request_id is None and error.code in (ErrorCode.CLIENT_LOST, ErrorCode.CLIENT_TOO_SLOW):
            return self._on_dropped(error)
        if error.request_id is not None:  # a request's failure: never a call's
            request = self._requests.pop(error.request_id, None)
            if request is not None:
                request.queue.put_nowait(
                    Delta.final(error.request_id, "error", error.message, error.code or "internal")
                )
            return
        if self._call is not None and not self._call.future.done():
            self._call.future.set_exception(ClusterError(error.message))
        else:
            log.warning("error from the coordinator: %s", safe(error.message))

    def _on_dropped(self, error: Error) -> None:
        """The coordinator declared this client lost (it was silent, say stopped, past the client timeout) or
        too slow (it did not read), aborted its requests and dropped the frame this answers. Lost: re-attach
        every request (each resumes from the tokens received); too slow: each ends with that error."""
        if self._call is not None and not self._call.future.done():
            self._call.future.set_exception(ClusterError(error.message))
        if error.code == ErrorCode.CLIENT_LOST and self._conn is not None:
            return self._reattach_all("the coordinator declared this client lost")
        log.warning("%s", safe(error.message, 500))
        for request in list(self._requests.values()):
            request.queue.put_nowait(Delta.final(request.request_id, "error", error.message, error.code))
        self._requests.clear()

    def _answer(self, msg: Message, error: ClusterError | None) -> None:
        call = self._call
        if call is None or call.future.done() or (error is None and not isinstance(msg, call.expect)):
            log.debug("unexpected %r from the coordinator", msg.TYPE)
            return
        if error is None:
            call.future.set_result(msg)
        else:
            call.future.set_exception(error)

    # ---- liveness -------------------------------------------------------------------------------

    async def _heartbeat_loop(self, conn: _Connection) -> None:
        closed = conn.closed
        woke = time.monotonic()
        while True:
            try:
                await asyncio.wait_for(closed.wait(), self.heartbeat_interval)
                return
            except asyncio.TimeoutError:
                pass
            now = time.monotonic()
            slept, woke = now - woke, now
            if slept > self.heartbeat_interval + self.silence_timeout / 2:
                # this process was stopped (SIGSTOP, a suspended laptop) or starved: the silence was ours, so
                # the coordinator gets a heartbeat (and a chance to answer) before it is judged
                self._last_heard = max(self._last_heard, now - self.heartbeat_interval)
            if not self._requests and self._call is None:
                continue
            self._check_links(now)
            silent = now - self._last_heard
            if silent > self.silence_timeout:
                where = (
                    f"any coordinator ({', '.join(self.addresses)})"
                    if self._several
                    else f"the coordinator at {self.address}"
                )
                self._fail_all(
                    ClusterError(f"no frame from {where} for {silent:.1f} s (silence timeout {self.silence_timeout} s)")
                )
            elif self._several and silent > self.silence_timeout / 2:
                self._switch(self._next_address(self.address), f"no frame from {self.address} for {silent:.1f} s")
            else:
                self._send_nowait(Heartbeat(sent_at=time.time()))

    async def _handshake_loop(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Failed CURVE handshakes, as the socket reports them: before the Welcome (and a refused key at any
        time) they end the client at once with what they mean; a later one that may be a restarting
        coordinator is only logged (the silence timeout covers a coordinator that never comes back), or, while a
        switch waits on this socket's Hello, moves it on. With several coordinators also a broken connection
        (a leader killed with -9): a switch to the next one, at once."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            attempt = self._attempt if self._attempt is not None and not self._attempt.done() else None
            if event["event"] & _CONNECTION_EVENTS:
                lost = "lost the connection" if event["event"] == zmq.EVENT_DISCONNECTED else "cannot connect"
                if attempt is not None:
                    attempt.set_result(lost)
                elif event["event"] == zmq.EVENT_DISCONNECTED and self.welcome is not None:
                    self._switch(self._next_address(self.address), f"{lost} to the coordinator at {self.address}")
                continue
            problem = handshake_failure(event, self.curve is not None, _KEY_FLAGS)
            if problem is None:
                continue
            if self.welcome is not None and event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                if attempt is not None:
                    attempt.set_result(f"the handshake failed: {problem}")
                else:
                    log.warning("a reconnection to %s failed in the handshake: %s", self.address, problem)
                continue
            self._end(ClusterError(f"cannot talk to the coordinator at {self.address}: {problem}"))

    def _end(self, error: ClusterError) -> None:
        """The coordinator will not serve this client: fail what waits, and every later call, with `error`."""
        self._failure = error
        self._fail_all(error)
        if self._attempt is not None and not self._attempt.done():
            self._attempt.set_exception(error)

    # ---- several coordinators (docs/architecture.md, "Several coordinators") ----------------------

    def _next_address(self, address: str) -> str:
        """The address after `address` in the list (the first, for a leader's address outside it)."""
        if address not in self.addresses:
            return self.addresses[0]
        return self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)]

    def _on_redirect(self, msg: Redirect) -> None:
        """The coordinator in use does not lead (any more): switch to the leader it names, else to the next
        address. Never an end. One address, while connecting: connect() fails saying where the leader is."""
        call = self._call
        if self.welcome is None:  # connecting (with several addresses, each Hello's Redirect goes to _join)
            if call is not None and not call.future.done():
                where = f"the leader is {msg.leader}" if msg.leader is not None else "no leader is known yet"
                call.future.set_exception(
                    ClusterError(
                        f"the coordinator at {self.address} does not lead the cluster ({msg.reason}); {where}: give "
                        f"the client every coordinator's address, comma-separated"
                    )
                )
            return
        if msg.leader == self.address:  # from the coordinator before, late (a coordinator never names itself)
            return
        target = msg.leader if msg.leader is not None else self._next_address(self.address)
        self._switch(target, f"the coordinator at {self.address} does not lead ({safe(msg.reason)})")

    def _switch(self, target: str, why: str) -> None:
        """Move to the coordinator at `target` (after a short pause), and on from there until one leads: its Welcome
        re-attaches every request in flight and re-sends the call under way. Direct streams go on meanwhile."""
        conn = self._conn
        if self._rejoin is not None or conn is None or self._failure is not None or self.welcome is None:
            return
        log.warning("%s: switching to %s (%d request(s) in flight)", why, target, len(self._requests))
        self._rejoin = asyncio.create_task(self._rejoin_at(conn, target, why), name=f"{self.client_id}-switch")

    async def _rejoin_at(self, conn: _Connection, target: str, why: str) -> None:
        try:
            await asyncio.sleep(random.uniform(*SWITCH_BACKOFF_S))
            welcome = await self._join(conn, target, None)
        finally:
            self._rejoin = None
        self.welcome, self._instance = welcome, welcome.instance
        self._last_heard = time.monotonic()
        self._reattach_all(f"{why}; {self.address} leads now", hello=False)
        held, self._held = self._held, []
        for abort in held:
            self._send_nowait(abort)
        self._resume_call(conn, why)

    async def _join(self, conn: _Connection, target: str, deadline: float | None) -> Welcome:
        """Hello to `target`, then to the leader a Redirect names, or to the next address, each after a short
        pause, until one welcomes this client; ClusterError at `deadline` (None: none) naming every address tried
        and why the last did not do."""
        tried: list[str] = []
        while True:
            self._open(conn, target)
            tried += [target] if target not in tried else []
            attempt = self._attempt = asyncio.get_running_loop().create_future()
            self._send_raw(conn, self._hello())
            wait = ATTEMPT_S if deadline is None else max(0.0, min(ATTEMPT_S, deadline - time.monotonic()))
            try:
                outcome = await asyncio.wait_for(attempt, wait)
            except asyncio.TimeoutError:
                outcome = f"no answer within {wait:.2g} s"
            finally:
                self._attempt = None
            if isinstance(outcome, Welcome):
                return outcome
            if isinstance(outcome, Redirect):
                last = f"{target} does not lead ({outcome.reason})"
                following = outcome.leader if outcome.leader not in (None, target) else self._next_address(target)
            else:
                last, following = f"{target}: {outcome}", self._next_address(target)
            pause = random.uniform(*SWITCH_BACKOFF_S)
            if deadline is not None and time.monotonic() + pause >= deadline:
                raise ClusterError(
                    f"no coordinator leads the cluster, or none answered, within {self.connect_timeout} s "
                    f"(tried {', '.join(tried)}); the last: {last}"
                )
            log.debug("%s; trying %s", last, following)
            await asyncio.sleep(pause)
            target = cast(str, following)

    def _resume_call(self, conn: _Connection, why: str) -> None:
        """The call under way when the switch began goes to the new leader: sent now if it was not yet, again (once)
        if it can be repeated safely; a refit fails instead (whether the old leader started it is unknown)."""
        call = self._call
        if call is None or call.future.done():
            return
        if call.sends == 0:
            return self._send_call(conn, call)
        if not isinstance(call.msg, _REPEATABLE) or call.sends > 1:
            what = "it cannot be repeated safely" if call.sends == 1 else "it was interrupted twice"
            call.future.set_exception(
                ClusterError(
                    f"{call.msg.TYPE!r} was interrupted by a switch of coordinator ({why}) before its answer, and "
                    f"{what}: whether it took effect is unknown (stats() shows the cluster's weight version)"
                )
            )
            return
        log.warning("re-sending %r to %s after the switch", call.msg.TYPE, self.address)
        self._send_call(conn, call)

    def _fail_all(self, error: ClusterError) -> None:
        for request in self._requests.values():
            request.queue.put_nowait(error)
        self._requests.clear()
        if self._call is not None and not self._call.future.done():
            self._call.future.set_exception(error)

    # ---- sending --------------------------------------------------------------------------------

    def _connected(self) -> _Connection:
        if self._conn is None:
            raise ClusterError("the client is not connected (use `async with InferenceClient(...)` or connect())")
        return self._conn

    def _check_open(self) -> _Connection:
        conn = self._connected()
        if self._failure is not None:
            raise self._failure
        return conn

    async def _send(self, msg: Message) -> bool:
        """Queue `msg` for the coordinator; False: held for the next leader, a switch is under way (see _hold). A
        DEALER with no live pipe (the coordinator refused the handshake, or is gone and its pipe with it) waits
        for one: past `silence_timeout` that is a ClusterError, not a hang."""
        conn = self._connected()
        if self._rejoin is not None:
            return self._hold(msg)
        # pyzmq's stub says Awaitable; zmq.asyncio's send_multipart returns an asyncio.Future
        send: asyncio.Future = cast(zmq.asyncio.Socket, conn.sock).send_multipart([encode(msg)])  # type: ignore[assignment]
        try:
            await asyncio.wait_for(asyncio.shield(send), self.silence_timeout)
        except asyncio.TimeoutError:
            raise ClusterError(
                f"could not send {msg.TYPE!r} to the coordinator at {self.address} within "
                f"{self.silence_timeout} s (no connection to it)"
            ) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if send.cancelled() and task is not None and not task.cancelling():
                return self._hold(msg)  # a switch closed the socket under it
            raise
        return True

    def _send_nowait(self, msg: Message) -> bool:
        """Queue `msg` for the coordinator; False: held for the next leader (see _hold)."""
        if self._rejoin is not None:
            return self._hold(msg)
        self._send_raw(self._connected(), msg)
        return True

    @staticmethod
    def _send_raw(conn: _Connection, msg: Message) -> None:
        # pyzmq's stub says Awaitable; zmq.asyncio's send_multipart returns an asyncio.Future
        future: asyncio.Future = cast(zmq.asyncio.Socket, conn.sock).send_multipart([encode(msg)])  # type: ignore[assignment]
        future.add_done_callback(_consume)

    def _hold(self, msg: Message) -> bool:
        """During a switch: an Abort waits for the next leader's Welcome; a Submit or re-attachment is not needed
        (that Welcome re-attaches every request in flight), nor is a Heartbeat."""
        if isinstance(msg, Abort):
            self._held.append(msg)
        return False


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.debug("send failed: %s", future.exception())


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"InferenceClient.{old} is deprecated and will be removed; use {new}, as LLM and AsyncLLM do",
        DeprecationWarning,
        stacklevel=3,
    )


class SyncInferenceClient:
    """Blocking facade: an InferenceClient on an event loop in a background thread.

    `with SyncInferenceClient("tcp://host:port") as client: client.generate("Hi", params)`.
    """

    def __init__(self, address: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="infer-sync-client", daemon=True)
        self._thread.start()
        self.client = InferenceClient(address, **options)
        try:
            self._run(self.client.connect())
        except BaseException:
            self._stop_loop()
            raise

    def __enter__(self) -> SyncInferenceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> Completion:
        return self._run(self.client.generate(prompt, params, **kwargs))

    def generate_many(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[Completion]:
        """All prompts concurrently; completions in prompt order."""

        async def run() -> list[Completion]:
            return list(await asyncio.gather(*(self.client.generate(p, params) for p in prompts)))

        return self._run(run())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> Iterator[RequestOutput]:
        agen = self.client.stream(prompt, params, **kwargs)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    def abort(self, request_id: str) -> None:
        self._run(self.client.abort(request_id))

    def pause(self) -> str:
        return self._run(self.client.pause())

    def unpause(self) -> str:
        return self._run(self.client.unpause())

    def suspend(self) -> str:
        return self._run(self.client.suspend())

    def resume(self) -> str:
        return self._run(self.client.resume())

    def stop(self) -> str:
        return self._run(self.client.stop())

    def drain_worker(self, worker_id: str, wait: bool = True, timeout: float = 600.0) -> int:
        return self._run(self.client.drain_worker(worker_id, wait, timeout))

    def update_weights(self, source: Any, **options: Any) -> int:
        return self._run(self.client.update_weights(source, **options))

    def stats(self) -> ClusterStats:
        return self._run(self.client.stats())

    def add_lora(self, lora_request: LoRARequest) -> dict[str, str]:
        return self._run(self.client.add_lora(lora_request))

    def remove_lora(self, lora_name: str) -> dict[str, str]:
        return self._run(self.client.remove_lora(lora_name))

    def list_loras(self) -> dict[str, str]:
        return self._run(self.client.list_loras())

    def wait_for_workers(self, count: int, timeout: float) -> ClusterStats:
        return self._run(self.client.wait_for_workers(count, timeout))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self.client.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
