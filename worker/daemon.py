"""infer-worker: one DP rank on the wire. `infer-worker --coordinator tcp://H:P [--model M] [engine options]`.

One zmq DEALER (its routing identity a random secret, never the worker id others may guess) talks to the
coordinator's ROUTER. The loop reads in four lines:
take every pending frame (blocking in poll only while there is nothing to compute), step the engine, send
that step's deltas as one StepBatch, keep the link alive (heartbeats, re-registration).

Liveness does not depend on step length: the loop's thread owns the socket except during an engine step (or
an add_request, which tokenizes), when it hands it (a lock: a full memory barrier, so one thread at a time
uses it) to a heartbeat thread that sends a Heartbeat each interval the step lasts, with the last load and
the step's age (`step_age_s`). A stopped process (SIGSTOP) stops both threads, so silence still means hung;
an engine stuck inside one step shows in the age (the coordinator's --max-step-time).

Lifecycle and exit codes:
- start: Hello -> Welcome ("worker ready" is logged) or Refused (exit 3); a handshake the coordinator
  refuses (a key it does not let in as a worker, a wrong --coordinator-key, keys on one side only): exit 3
  at once, saying which; no Welcome within --connect-timeout: exit 1.
- the coordinator silent for --coordinator-timeout, or an Error("unknown worker ..."): Hello again with the
  ids still running (re-registration); running requests keep going meanwhile.
- SIGTERM / SIGINT: drain (new Dispatches get an error delta "worker is draining"; running requests finish,
  the rest is aborted after --drain-timeout), exit 0. A second signal ends the drain at once.
- Control "stop": abort everything, exit 0. Bad options: exit 2. Any other fatal error: exit 1.
Nothing from the wire can end the worker except Refused and "stop": a bad frame gets an Error back.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from infer.protocol.keys import CurveKeys
from infer.protocol.logs import add_logging_args, setup_logging
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.messages import (
    MAX_DP_RANK, MAX_ID_LEN, Abort, Control, ControlAck, Delta, Dispatch, Error, Heartbeat, Hello, Load, Message,
    ProtocolError, Refused, RequestSnapshot, StepBatch, TokenIds, UpdateWeights, Welcome, WeightsUpdated, decode
)
from infer.protocol.outputs import RequestOutput
from infer.protocol.sampling import SamplingParams
from infer.protocol.transport import HANDSHAKE_EVENTS, frames_for, handshake_failure, make_socket
from infer.worker.config import DTYPES, SUSPEND_WEIGHTS, EngineConfig
from infer.worker.scheduler import SCHEDULING_POLICIES
from infer.worker.group_sync import EpOptions, GroupBroken
from infer.worker.request import Request, overdue_message
from infer.worker.tp_group import TpOptions, resolve_ranks

if TYPE_CHECKING:
    from infer.worker.group_sync import GroupSync

log = logging.getLogger("infer.worker")

EXIT_OK, EXIT_FATAL, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3
_CLOSE_LINGER_MS = 2000      # how long the final frames may take to leave on exit
_MAX_FRAMES_PER_TURN = 4096  # frames handled between two engine steps, so a flood cannot starve the engine
_SHED_CHECK_S = 0.25         # how often the queue is checked for requests past --max-queue-time
MAX_QUEUE_TIME_S = 86400.0   # the largest --max-queue-time


class WorkerExit(Exception):
    """Ends the worker with exit `code` once its message is logged."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class EngineLike(Protocol):
    """What the worker needs of an engine: the real Engine, or BenchmarkEngine."""

    config: EngineConfig
    model_id: str
    block_size: int
    max_model_len: int

    @property
    def num_kv_blocks(self) -> int: ...
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    resumed_token_ids: Sequence[int] = (), resumed_text_len: int | None = None,
                    priority: int = 0) -> Request: ...
    def step(self) -> list[RequestOutput]: ...
    def take_pending(self) -> list[RequestOutput]: ...
    def shed_overdue(self, max_queue_time: float) -> int: ...
    def abort(self, request_id: str, release_text: bool = True) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def load(self) -> Load: ...
    def suspend(self) -> int: ...
    def resume(self) -> int: ...
    def prepare_update(self, msg: UpdateWeights) -> object: ...
    def update_weights(self, source: object, version: int | None = None) -> int: ...


@dataclass
class _PendingRefit:
    """An UpdateWeights whose tensors are checked and waiting for the engine's requests to finish (a drain)."""

    msg: UpdateWeights
    update: object          # the engine's WeightUpdate
    deadline: float


@dataclass(frozen=True)
class WorkerOptions:
    """The worker's own options (the engine's are EngineConfig). Times are seconds."""

    coordinator: str
    worker_id: str
    dp_rank: int | None = None          # None: the coordinator assigns one (the lowest free rank)
    group_id: str | None = None         # None: "dp<rank>" (an EP group's members name their group)
    heartbeat_interval: float = 1.0
    coordinator_timeout: float = 10.0   # silence after which the worker says Hello again
    drain_timeout: float = 30.0
    connect_timeout: float = 60.0       # for the first Welcome
    benchmark_mode: bool = False
    benchmark_step_time: float = 0.0    # with benchmark_mode: seconds each step lasts
    ep: EpOptions | None = None         # this rank's EP group (None: a group of one)
    tp: TpOptions | None = None         # this DP rank's TP group (None: one process)
    max_waiting_requests: int = 1024    # beyond max_num_seqs running: a Dispatch past it is "overloaded"
    max_queue_time: float = 60.0        # a request not started this long after it came fails "overloaded"; 0: never
    curve: CurveKeys | None = None      # CurveZMQ towards the coordinator (and the EP group's wake channel)

    def __post_init__(self) -> None:
        if not self.coordinator.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--coordinator must be tcp://HOST:PORT (or ipc://PATH), got {self.coordinator!r}")
        for name in ("worker_id", "group_id"):
            value = getattr(self, name)
            if value is not None and not 0 < len(value) <= MAX_ID_LEN:
                raise ValueError(f"{name} must be 1..{MAX_ID_LEN} characters, got {value!r}")
        if self.dp_rank is not None and not 0 <= self.dp_rank <= MAX_DP_RANK:
            raise ValueError(f"dp_rank must be in [0, {MAX_DP_RANK}], got {self.dp_rank}")
        for name in ("heartbeat_interval", "coordinator_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if not 0 <= self.max_queue_time <= MAX_QUEUE_TIME_S:
            raise ValueError(f"max_queue_time must be in [0, {MAX_QUEUE_TIME_S:g}] s (0: no bound), got "
                             f"{self.max_queue_time}")
        if not 0 <= self.benchmark_step_time <= 3600 or (self.benchmark_step_time and not self.benchmark_mode):
            raise ValueError(f"--benchmark-step-time must be in [0, 3600] s and needs --benchmark-mode, got "
                             f"{self.benchmark_step_time}")
        if self.ep is not None and self.benchmark_mode:
            raise ValueError("--benchmark-mode has no model, so no EP group: leave out --ep-size")
        if self.tp is not None and self.benchmark_mode:
            raise ValueError("--benchmark-mode has no model, so no TP group: leave out --tp-size")
        if self.coordinator_timeout <= self.heartbeat_interval:
            raise ValueError(f"coordinator_timeout ({self.coordinator_timeout}) must exceed heartbeat_interval "
                             f"({self.heartbeat_interval})")


class Worker:
    """Runs `engine` for the coordinator at `options.coordinator` until told to stop (see the module doc).

    Invariant: `_requests` holds exactly the ids dispatched here whose finished delta has not been sent,
    each with what its deltas carried so far (`_Sent`): the Hello of a re-registration (say, with a
    restarted coordinator) sends it, so the coordinator can hand each stream back to its client.
    """

    def __init__(self, engine: EngineLike, options: WorkerOptions, ctx: zmq.Context,
                 group: GroupSync | None = None) -> None:
        self.engine, self.options, self.group = engine, options, group
        self.sock = make_socket(ctx, zmq.DEALER, identity=secrets.token_hex(16).encode(), curve=options.curve)
        self.handshakes = self.sock.get_monitor_socket(HANDSHAKE_EVENTS)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.handshakes, zmq.POLLIN)
        if group is not None:
            self.poller.register(group.wake_socket, zmq.POLLIN)
        self._leaving: str | None = None       # why this rank leaves its EP group (said in the next round)
        self._last_round = time.monotonic()
        self._last_shed_check = 0.0
        self.state = "running"                 # running | paused | suspended (lifecycle, by Control)
        self._requests: dict[str, _Sent] = {}
        self._silenced: set[str] = set()       # aborted at the coordinator's request: their final delta is dropped
        self._instance: str | None = None      # the coordinator process that welcomed us (a change: it restarted)
        self._incarnation = uuid.uuid4().hex[:16]   # this process, as the coordinator tells it from another
        self._dispatches_seen = 0              # Dispatch frames received since that coordinator's Welcome
        self._rank = options.dp_rank           # the DP rank and group the coordinator's Welcome gave us
        self._group_id = options.group_id
        self._outbox: list[Delta] = []         # deltas made outside a step (rejected Dispatches)
        now = time.monotonic()
        self._last_sent = self._last_heard = self._hello_sent_at = now
        self._connect_deadline = now + options.connect_timeout
        self._welcomed = False                 # a Welcome answered the latest Hello
        self._ever_welcomed = False
        self._signals = 0                      # SIGTERM / SIGINT received (set by the handler)
        self._wakeup: socket.socket | None = None
        self._wakeup_writer: socket.socket | None = None
        self._drain_deadline: float | None = None
        self._warn = RateLimitedLog(log)
        self._socket_lock = threading.Lock()    # held by the loop's thread except inside an engine step
        self._step_started: float | None = None
        self._last_load: Load = engine.load()  # what a heartbeat sent during a step reports
        self._beats_stop = threading.Event()
        self._refit: _PendingRefit | None = None   # an UpdateWeights waiting for a drain

    # ---- running -------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGINT start a drain; a wakeup fd in the poller makes a blocked poll return at once."""
        self._wakeup, writer = socket.socketpair()
        self._wakeup.setblocking(False)
        writer.setblocking(False)
        self._wakeup_writer = writer           # kept open for as long as the fd is installed
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self.poller.register(self._wakeup, zmq.POLLIN)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1

    def run(self) -> int:
        """Serve until the end; returns the exit code. The socket is closed on return."""
        self._socket_lock.acquire()
        beats = threading.Thread(target=self._beat_during_steps, name="infer-worker-heartbeat", daemon=True)
        beats.start()
        try:
            self.sock.connect(self.options.coordinator)
            self._send_hello()
            while True:
                self._receive(self._poll_timeout())
                self._handle_signals()
                self._advance()
                self._keep_alive()
                if self._drain_finished():
                    if self.group is not None:   # the group cannot step without this rank: it leaves too
                        self._leave_group("drained")
                    log.info("drained; exiting")
                    return EXIT_OK
        except WorkerExit as e:
            (log.info if e.code == EXIT_OK else log.error)("%s", safe(e, 2000))
            return e.code
        finally:   # let the last frames leave, unless no coordinator ever answered
            self._beats_stop.set()
            self._socket_lock.release()
            beats.join(timeout=5)
            self.sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS if self._ever_welcomed else 0)
            self.sock.disable_monitor()
            self.handshakes.close(0)
            self.sock.close()
            if self.group is not None:
                self.group.close()

    def _poll_timeout(self) -> float:
        """Seconds to block in poll: 0 while the engine has work, else until the next timer is due."""
        if self.state == "running" and self.engine.has_unfinished():
            return 0.0
        if self._refit is not None:
            return 0.0 if not self.engine.has_unfinished() else max(0.0, self._refit.deadline - time.monotonic())
        if self.group is not None and (self.group.active or self._leaving is not None):
            return 0.0
        now = time.monotonic()
        due = [max(self._last_heard, self._hello_sent_at) + self.options.coordinator_timeout]
        due.append(self._last_sent + self.options.heartbeat_interval if self._ever_welcomed
                   else self._connect_deadline)
        if self._drain_deadline is not None:
            due.append(self._drain_deadline)
        if self.group is not None:   # an idle group checks its members once per heartbeat interval
            due.append(self._last_round + self.options.heartbeat_interval)
        return max(0.0, min(due) - now)

    def _receive(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a frame, then handle every frame already queued."""
        events = dict(self.poller.poll(math.ceil(timeout_s * 1000)))
        # zmq.Poller reports a plain socket by its fd number, not by the object it was registered with
        if self._wakeup is not None and (self._wakeup.fileno() in events or self._wakeup in events):
            self._wakeup.recv(4096)
        if self.handshakes in events:
            self._on_handshake_events()
        for _ in range(_MAX_FRAMES_PER_TURN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            self._on_frames(frames)

    def _advance(self) -> None:
        """One engine step (unless paused), then one StepBatch with its deltas and any rejections."""
        self._shed_overdue()
        if self.group is not None:
            return self._advance_group()
        if self.state == "running" and self.engine.has_unfinished():
            outputs = self._engine_step(self.engine.step)
        else:
            outputs = self.engine.take_pending()
        self._send_step_batch(outputs)
        if self._refit is not None:
            self._apply_refit()

    def _shed_overdue(self) -> None:
        """At most once per _SHED_CHECK_S: fail the requests that waited past --max-queue-time without starting
        (the cluster is overloaded: the client hears it now instead of waiting without end). Not while paused:
        a pause holds requests on purpose."""
        limit, now = self.options.max_queue_time, time.monotonic()
        if not limit or self.state != "running" or now - self._last_shed_check < _SHED_CHECK_S:
            return
        self._last_shed_check = now
        self.engine.shed_overdue(limit)

    def _engine_step(self, step: Callable[[], list[RequestOutput]]) -> list[RequestOutput]:
        try:
            with self._socket_handed_over():
                return step()
        except GroupBroken as e:   # raised by a MoE layer's exchange: a member of the group is gone
            self._group_broken(str(e))
        except Exception as e:  # the engine fails single requests itself; this is the engine broken: exit 1
            log.exception("engine step failed")
            self._send(Error(message=f"worker {self.options.worker_id} failed: engine step: {e!r}"))
            raise WorkerExit(EXIT_FATAL, f"fatal: engine step failed: {e!r}") from None

    @contextmanager
    def _socket_handed_over(self) -> Iterator[None]:
        """The socket belongs to the heartbeat thread for the length of the block (an engine step, or an
        add_request that tokenizes a prompt)."""
        self._step_started = time.monotonic()
        self._socket_lock.release()
        try:
            yield
        finally:
            self._socket_lock.acquire()
            self._step_started = None

    def _beat_during_steps(self) -> None:
        """The heartbeat thread: while an engine step runs, a Heartbeat each interval (see the module doc)."""
        interval = self.options.heartbeat_interval
        while not self._beats_stop.wait(interval / 4):
            if self._step_started is None or not self._socket_lock.acquire(blocking=False):
                continue
            try:
                started, now = self._step_started, time.monotonic()
                if started is not None and self._ever_welcomed and now - self._last_sent >= interval:
                    self._send(Heartbeat(sent_at=time.time(), load=self._last_load,
                                         step_age_s=round(now - started, 3)))
            finally:
                self._socket_lock.release()

    # ---- EP group lockstep (see infer.worker.group_sync) -------------------------------------------

    def _advance_group(self) -> None:
        """Enter the group's next round when anyone may have work (or to check the members while idle),
        then run this rank's step, or a dummy forward, if anyone has work."""
        group, now = self.group, time.monotonic()
        has_work = self.state == "running" and self.engine.has_unfinished()
        woken = group.woken()
        check_due = now - self._last_round >= self.options.heartbeat_interval
        if not (group.active or has_work or woken or check_due or self._leaving is not None):
            return self._send_step_batch(self.engine.take_pending())
        if not (group.active or woken):
            group.wake_peers()   # the peers are idle in their polls: bring them into this round
        try:
            any_work, any_leaving = group.agree(has_work, self._leaving is not None)
        except GroupBroken as e:
            self._group_broken(str(e))
        self._last_round = time.monotonic()
        if any_leaving:
            if self._leaving is not None:
                return
            self._group_broken(f"a member of EP group {self._group_id!r} left")
        if any_work:
            outputs = self._engine_step(self.engine.step if has_work else self.engine.dummy_step)
        else:
            outputs = self.engine.take_pending()
        self._send_step_batch(outputs)

    def _leave_group(self, reason: str) -> None:
        """Tell the group this rank is leaving (one last round), so the others leave too instead of hanging
        in a collective."""
        self._leaving = reason
        try:
            self._advance_group()
        except WorkerExit:
            pass

    def _group_broken(self, reason: str) -> NoReturn:
        """The group cannot step any more: give every request back (the coordinator moves them to another
        group, resuming each stream where it stands) and exit."""
        log.error("%s; giving back %d request(s) and exiting", reason, len(self._requests))
        self._abort_all()
        raise WorkerExit(EXIT_FATAL, f"fatal: {reason}")

    def _send_step_batch(self, outputs: list[RequestOutput]) -> None:
        silenced = 0
        if self._silenced:
            kept = [out for out in outputs if not self._silence(out)]
            silenced, outputs = len(outputs) - len(kept), kept
        deltas, self._outbox = self._outbox + [self._delta(out) for out in outputs], []
        if deltas or silenced:     # an abort freed blocks: the coordinator hears of it at once
            self._last_load = self.engine.load()
            self._send(StepBatch(deltas=deltas, load=self._last_load))

    def _silence(self, out: RequestOutput) -> bool:
        if out.finish_reason == "abort" and out.request_id in self._silenced:
            self._silenced.discard(out.request_id)
            return True
        return False

    def _delta(self, out: RequestOutput) -> Delta:
        sent = self._requests.pop(out.request_id, None) if out.finished else self._requests.get(out.request_id)
        prompt_ids = None
        if sent is not None:
            prompt_ids = None if sent.echoed else sent.prompt_token_ids
            sent.record(out.token_ids, out.text)
        return Delta(request_id=out.request_id, token_ids=TokenIds(out.token_ids), text=out.text,
                     finished=out.finished, finish_reason=out.finish_reason, error=out.error,
                     logprobs=out.logprobs, num_prompt_tokens=out.num_prompt_tokens,
                     num_cached_tokens=out.num_cached_tokens, prompt_token_ids=prompt_ids,
                     error_code=out.error_code, queue_time_s=out.queue_time_s, seed=out.seed,
                     prompt_logprobs=out.prompt_logprobs, weight_version=out.weight_version)

    # ---- liveness and registration ----------------------------------------------------------------

    def _keep_alive(self) -> None:
        now = time.monotonic()
        if not self._ever_welcomed and now >= self._connect_deadline:
            raise WorkerExit(EXIT_FATAL, f"fatal: no Welcome from the coordinator at {self.options.coordinator} "
                                         f"within {self.options.connect_timeout:g} s")
        if (now - max(self._last_heard, self._hello_sent_at) >= self.options.coordinator_timeout
                and not self.sock.poll(0, zmq.POLLIN)):     # frames that came during a long step: not silence
            log.warning("nothing heard from the coordinator for %.1f s; registering again", now - self._last_heard)
            self._send_hello()
        elif self._ever_welcomed and now - self._last_sent >= self.options.heartbeat_interval:
            self._last_load = self.engine.load()
            self._send(Heartbeat(sent_at=time.time(), load=self._last_load))

    def _send_hello(self) -> None:
        engine = self.engine
        self._send(Hello(role="worker", peer_id=self.options.worker_id, model_id=engine.model_id,
                         dp_rank=self.options.dp_rank, group_id=self.options.group_id, rank_hint=self._rank,
                         num_kv_blocks=engine.num_kv_blocks, block_size=engine.block_size,
                         max_num_seqs=engine.config.max_num_seqs, max_model_len=engine.max_model_len,
                         running=list(self._requests), max_waiting=self.options.max_waiting_requests,
                         incarnation=self._incarnation, dispatches_seen=self._dispatches_seen,
                         snapshots=[sent.snapshot(rid) for rid, sent in self._requests.items()]))
        self._welcomed = False
        self._hello_sent_at = time.monotonic()

    def _on_welcome(self, msg: Welcome) -> None:
        if self._welcomed:
            return
        self._welcomed = True
        if msg.instance != self._instance:     # a coordinator process new to us counts its Dispatches from 0
            self._instance, self._dispatches_seen = msg.instance, 0
        if msg.dp_rank is not None:
            if self._rank is not None and msg.dp_rank != self._rank:
                log.warning("the coordinator moved this worker from dp_rank %d to %d", self._rank, msg.dp_rank)
            self._rank, self._group_id = msg.dp_rank, msg.group_id or self._group_id
        if self._ever_welcomed:
            log.info("re-registered with coordinator %s (%d requests running)", safe(msg.coordinator_id),
                     len(self._requests))
            return
        self._ever_welcomed = True
        opts = self.options
        log.info("worker ready: rank %s group %s id %s coordinator %s (%s, state %s) model %s, %d KV blocks "
                 "of %d tokens", self._rank, safe(self._group_id), opts.worker_id, opts.coordinator,
                 safe(msg.coordinator_id), safe(msg.state), self.engine.model_id, self.engine.num_kv_blocks,
                 self.engine.block_size)

    def _on_handshake_events(self) -> None:
        """A failed CURVE handshake: before the first Welcome (or a refused key at any time) it ends the worker
        at once saying why; after it, one that may be a restarting coordinator is only logged."""
        while True:
            try:
                event = recv_monitor_message(self.handshakes, zmq.NOBLOCK)
            except zmq.Again:
                return
            problem = handshake_failure(event, self.options.curve is not None, ("--curve-key", "--coordinator-key"))
            if problem is None:
                continue
            if self._ever_welcomed and event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._warn.warning("a reconnection to the coordinator failed in the handshake: %s", problem)
                continue
            raise WorkerExit(EXIT_REFUSED, f"fatal: cannot register with the coordinator at "
                                           f"{self.options.coordinator}: {problem}")

    def _on_refused(self, msg: Refused) -> None:
        raise WorkerExit(EXIT_REFUSED, f"the coordinator refused this worker: {msg.reason}")

    def _on_error(self, msg: Error) -> None:
        self._warn.warning("coordinator reports an error%s: %s",
                           f" for request {safe(msg.request_id)}" if msg.request_id else "", safe(msg.message))
        # Many frames may cross a coordinator restart: one Hello per heartbeat interval answers them all.
        recent_hello = not self._welcomed and time.monotonic() - self._hello_sent_at < self.options.heartbeat_interval
        if msg.message.startswith("unknown worker") and not recent_hello:
            self._send_hello()

    # ---- requests ------------------------------------------------------------------------------

    def _on_dispatch(self, msg: Dispatch) -> None:
        self._dispatches_seen += 1
        self._handle_signals()   # a signal that came while this frame was queued wins
        if self._drain_deadline is not None:
            return self._reject(msg.request_id, "worker is draining", "draining", msg.prompt_token_ids)
        if msg.request_id in self._requests:
            return self._reject(msg.request_id, f"request id {msg.request_id!r} is already running on this worker",
                                "internal", msg.prompt_token_ids)
        limit = self.engine.config.max_num_seqs + self.options.max_waiting_requests
        if len(self._requests) >= limit:
            return self._reject(msg.request_id, f"worker {self.options.worker_id} is full: "
                                f"{len(self._requests)} requests (max_num_seqs + --max-waiting-requests = {limit})",
                                "overloaded",
                                msg.prompt_token_ids)
        prompt = msg.prompt if msg.prompt is not None else list(msg.prompt_token_ids)
        try:
            params = SamplingParams.from_dict(msg.sampling)
            with self._socket_handed_over():     # a huge prompt's tokenization: heartbeats go on meanwhile
                request = self.engine.add_request(msg.request_id, prompt, params, msg.resumed_token_ids,
                                                  msg.resumed_text_len, priority=msg.priority)
        except ValueError as e:
            return self._reject(msg.request_id, str(e), "invalid_request", msg.prompt_token_ids)
        self._requests[msg.request_id] = _Sent(TokenIds(request.prompt_token_ids), len(msg.resumed_token_ids),
                                               TokenIds(msg.resumed_token_ids), request.params.seed)

    def _reject(self, request_id: str, reason: str, code: str, prompt_token_ids: TokenIds | None = None) -> None:
        self._warn.warning("request %s rejected: %s", safe(request_id), safe(reason))
        self._outbox.append(Delta(request_id=request_id, token_ids=TokenIds(), text="", finished=True,
                                  finish_reason="error", error=reason, error_code=code,
                                  prompt_token_ids=prompt_token_ids))

    def _on_abort(self, msg: Abort) -> None:
        """The coordinator forgot these requests before it asked: free their KV blocks now and send no final
        delta (so the same id may be dispatched here again at once). Unknown or finished ids: nothing to do."""
        for request_id in msg.request_ids:
            if self._requests.pop(request_id, None) is not None and self.engine.abort(request_id):
                self._silenced.add(request_id)

    def _abort_all(self) -> None:
        """Give every request back. Text held back stays out of the final deltas: whoever resumes a request
        from its delivered tokens produces it (a stop string may yet cut it)."""
        for request_id in list(self._requests):
            self.engine.abort(request_id, release_text=False)
        self._send_step_batch(self.engine.take_pending())

    # ---- lifecycle -----------------------------------------------------------------------------

    def _on_control(self, msg: Control) -> None:
        if msg.command == "stop":
            self._abort_all()
            self._send(ControlAck(command=msg.command, state="stopped"))
            if self.group is not None:
                self._leave_group("stopped by the coordinator")
            raise WorkerExit(EXIT_OK, "stopped by the coordinator")
        released = restored = 0
        try:
            if msg.command == "suspend":
                released = self.engine.suspend()
            elif msg.command == "resume":
                restored = self.engine.resume()
        except Exception as e:   # the engine could not release or restore: say so, keep the old state
            log.exception("%s failed", msg.command)
            self._send(ControlAck(command=msg.command, state=self._state_name(), error=f"{type(e).__name__}: {e}"))
            return
        # resume brings a suspended worker back to paused, as the cluster (coordinator/lifecycle.py)
        self.state = {"pause": "paused", "suspend": "suspended", "resume": "paused"}.get(msg.command, "running")
        log.info("%s: now %s%s", msg.command, self.state, f" ({released} bytes released)" if released else
                 f" ({restored} bytes restored)" if restored else "")
        self._last_load = self.engine.load()
        self._send(Heartbeat(sent_at=time.time(), load=self._last_load))   # the new state, before the ack
        self._send(ControlAck(command=msg.command, state=self._state_name(), bytes_released=released,
                              bytes_restored=restored))

    # ---- weight refit --------------------------------------------------------------------------

    def _on_update_weights(self, msg: UpdateWeights) -> None:
        """Receive (from a trainer) and check the new weights now; apply them once no request is left (the
        coordinator aborted them first, or holds new ones while these drain). Answer WeightsUpdated."""
        if self._refit is not None:
            return self._send(WeightsUpdated(version=msg.version or 0, error="a weight update is already pending "
                                                                            "on this worker"))
        try:
            with self._socket_handed_over():      # a broadcast of many tensors: heartbeats go on meanwhile
                update = self.engine.prepare_update(msg)
        except Exception as e:   # noqa: BLE001 - a bad tensor, a failed transfer: the old weights keep serving
            log.error("weight update to version %s refused: %s", msg.version, e)
            return self._send(WeightsUpdated(version=msg.version or 0, error=f"{type(e).__name__}: {e}"))
        self._refit = _PendingRefit(msg, update, time.monotonic() + msg.timeout_s)
        self._apply_refit()

    def _apply_refit(self) -> None:
        refit = self._refit
        if self.engine.has_unfinished():
            if time.monotonic() < refit.deadline:
                return
            self._refit = None
            return self._send(WeightsUpdated(version=refit.msg.version or 0, error=(
                f"{len(self._requests)} request(s) did not finish within {refit.msg.timeout_s:g} s; the old "
                f"weights keep serving")))
        self._refit = None
        try:
            with self._socket_handed_over():
                version = self.engine.update_weights(refit.update, refit.msg.version)
        except Exception as e:   # noqa: BLE001
            log.exception("applying the weight update failed")
            return self._send(WeightsUpdated(version=refit.msg.version or 0, error=f"{type(e).__name__}: {e}"))
        self._last_load = self.engine.load()
        self._send(Heartbeat(sent_at=time.time(), load=self._last_load))
        self._send(WeightsUpdated(version=version, num_tensors=len(getattr(refit.update, "specs", ()))))

    def _state_name(self) -> str:
        return "draining" if self._drain_deadline is not None and self.state == "running" else self.state

    def _handle_signals(self) -> None:
        if not self._signals:
            return
        now = time.monotonic()
        if self._drain_deadline is None:
            self._drain_deadline = now + self.options.drain_timeout
            log.info("signal received: draining %d requests (at most %g s)", len(self._requests),
                     self.options.drain_timeout)
        elif self._signals > 1 and self._drain_deadline > now:
            log.info("second signal: aborting the %d requests left", len(self._requests))
            self._drain_deadline = now

    def _drain_finished(self) -> bool:
        if self._drain_deadline is None:
            return False
        if self._requests and time.monotonic() >= self._drain_deadline:
            log.warning("drain timeout: aborting %d requests", len(self._requests))
            self._abort_all()
        return not self._requests and not self.engine.has_unfinished()

    # ---- frames --------------------------------------------------------------------------------

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            return self._bad_frame(f"expected one frame per message, got {len(frames)}", frames[0][:64])
        try:
            msg = decode(frames[0])
        except ProtocolError as e:
            return self._bad_frame(e, frames[0])
        handler = self._HANDLERS.get(type(msg))
        if handler is None:
            self._send(Error(message=f"a worker does not handle {msg.TYPE!r} messages"))
            return
        handler(self, msg)

    def _bad_frame(self, problem: str | ProtocolError, frame: bytes) -> None:
        """Answer an undecodable frame: an error delta when it is a Dispatch whose id can be read (so that
        request fails alone), else an Error naming the problem (and the request id when readable)."""
        self._warn.warning("bad frame from the coordinator (%d bytes): %s", len(frame), safe(problem))
        kind = problem.message_type if isinstance(problem, ProtocolError) else None
        problem, request_id = str(problem), _peek_request_id(frame)
        if kind == Dispatch.TYPE and request_id is not None:
            self._reject(request_id, f"bad dispatch: {problem}", "invalid_request")
        else:
            self._send(Error(message=problem, request_id=request_id))

    def _send(self, msg: Message) -> None:
        try:
            self.sock.send_multipart(frames_for(msg), zmq.NOBLOCK)
        except zmq.Again:   # the coordinator is away and the queue is full: the frame is lost
            self._warn.warning("send queue to the coordinator is full; dropped a %r frame", msg.TYPE)
        self._last_sent = time.monotonic()

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        if self._welcomed and msg.instance is not None and self._instance not in (None, msg.instance):
            log.warning("the coordinator restarted (instance %s -> %s); registering again with %d request(s)",
                        safe(self._instance), safe(msg.instance), len(self._requests))
            self._send_hello()

    _HANDLERS: ClassVar[dict[type[Message], Callable[[Worker, Any], None]]] = {
        Welcome: _on_welcome, Refused: _on_refused, Error: _on_error, Dispatch: _on_dispatch,
        Abort: _on_abort, Control: _on_control, Heartbeat: _on_heartbeat, UpdateWeights: _on_update_weights,
    }


class _Sent:
    """What the deltas of one request carried so far: enough to rebuild its stream from any delta boundary
    (see RequestSnapshot). Tokens resumed from a failover come first; their text is the client's already."""

    __slots__ = ("prompt_token_ids", "resumed", "token_ids", "text_parts", "delta_ends", "text_ends", "text_len",
                 "echoed", "seed")

    def __init__(self, prompt_token_ids: TokenIds, resumed: int, resumed_token_ids: TokenIds,
                 seed: int | None = None) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.seed = seed
        self.resumed = resumed
        self.token_ids = resumed_token_ids
        self.text_parts: list[str] = []
        self.delta_ends: list[int] = []
        self.text_ends: list[int] = []
        self.text_len = 0
        self.echoed = False          # the first delta (which echoes the prompt ids) went out

    def record(self, token_ids: list[int], text: str) -> None:
        self.echoed = True
        if token_ids or text:
            self.token_ids.extend(token_ids)
            if text:
                self.text_parts.append(text)
                self.text_len += len(text)
            self.delta_ends.append(len(self.token_ids))
            self.text_ends.append(self.text_len)

    def snapshot(self, request_id: str) -> RequestSnapshot:
        return RequestSnapshot(request_id=request_id, prompt_token_ids=self.prompt_token_ids,
                               token_ids=TokenIds(self.token_ids), resumed=self.resumed, text="".join(self.text_parts),
                               delta_ends=list(self.delta_ends), text_ends=list(self.text_ends), seed=self.seed)


def _peek_request_id(frame: bytes) -> str | None:
    """The request id of a frame that failed to decode, when it can be read; never raises."""
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=False).get("body")
        request_id = body.get("request_id") if isinstance(body, dict) else None
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types; a frame we cannot read
        return None
    return request_id if isinstance(request_id, str) and 0 < len(request_id) <= MAX_ID_LEN else None


# ---- benchmark mode -------------------------------------------------------------------------------

class BenchmarkEngine:
    """--benchmark-mode: the engine interface with no model and no torch, for measuring coordinator overhead.

    Every request "generates" one token per step: token i (0-based, resumed tokens included) of a request
    with a P-token prompt is `(P + i) % 1000`, with empty text, until max_tokens (or the context length):
    finish_reason "length". A string prompt counts one token per UTF-8 byte. The first `max_num_seqs`
    requests in arrival order run; the KV pool is bookkept (blocks of the tokens held) but not allocated.
    """

    def __init__(self, config: EngineConfig, step_time: float = 0.0) -> None:
        self.config = config
        self.step_time = step_time      # --benchmark-step-time: each step lasts this long (a long prefill)
        self.model_id = config.model_id
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or 4096
        self._requests: dict[str, Request] = {}   # arrival order
        self._pending: list[RequestOutput] = []

    @property
    def num_kv_blocks(self) -> int:
        return self.config.max_num_seqs * -(-self.max_model_len // self.block_size)

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    resumed_token_ids: Sequence[int] = (), resumed_text_len: int | None = None,
                    priority: int = 0) -> Request:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        if isinstance(prompt, str) and len(prompt) >= self.max_model_len:   # a token per byte: never fits
            raise ValueError(f"the prompt is {len(prompt)} characters; the context is {self.max_model_len} "
                             f"tokens")
        prompt_ids = list(prompt.encode()) if isinstance(prompt, str) else list(prompt)
        num_tokens = len(prompt_ids) + len(resumed_token_ids)
        if not prompt_ids or num_tokens >= self.max_model_len:
            raise ValueError(f"prompt + resumed tokens must be 1..{self.max_model_len - 1} tokens, got {num_tokens}")
        left = self.max_model_len - num_tokens if params.max_tokens is None else params.max_tokens
        request = Request(request_id=request_id, prompt_token_ids=prompt_ids, params=params,
                          max_tokens=len(resumed_token_ids) + left, token_ids=prompt_ids + list(resumed_token_ids),
                          arrival_time=time.monotonic())
        self._requests[request_id] = request
        return request

    def _running(self) -> list[Request]:
        return list(self._requests.values())[:self.config.max_num_seqs]

    def step(self) -> list[RequestOutput]:
        if self.step_time > 0:
            time.sleep(self.step_time)      # stands for compute: the step's cost, not a wait for anything
        outputs = self.take_pending()
        for request in self._running():
            token = (request.num_prompt_tokens + request.num_output_tokens) % 1000
            request.append_token(token)
            done = request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len
            if done:
                del self._requests[request.request_id]
            outputs.append(RequestOutput(request.request_id, [token], "", finished=done,
                                         finish_reason="length" if done else None,
                                         num_prompt_tokens=request.num_prompt_tokens))
        return outputs

    def take_pending(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        return outputs

    def shed_overdue(self, max_queue_time: float) -> int:
        """As Engine.shed_overdue: the requests past the first max_num_seqs have not started."""
        now = time.monotonic()
        overdue = [r for r in list(self._requests.values())[self.config.max_num_seqs:]
                   if now - r.arrival_time > max_queue_time]
        for request in overdue:
            waited = now - request.arrival_time
            del self._requests[request.request_id]
            self._pending.append(RequestOutput(request.request_id, [], "", finished=True, finish_reason="error",
                                               error=overdue_message(waited, max_queue_time),
                                               error_code="overloaded", queue_time_s=waited,
                                               num_prompt_tokens=request.num_prompt_tokens))
        return len(overdue)

    def abort(self, request_id: str, release_text: bool = True) -> bool:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._pending.append(RequestOutput(request_id, [], "", finished=True, finish_reason="abort",
                                               num_prompt_tokens=request.num_prompt_tokens))
        return request is not None

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def suspend(self) -> int:
        return 0       # no KV pool, no weights

    def resume(self) -> int:
        return 0

    def prepare_update(self, msg: UpdateWeights) -> object:
        raise ValueError("a --benchmark-mode worker has no weights to update")

    def update_weights(self, source: object, version: int | None = None) -> int:
        raise ValueError("a --benchmark-mode worker has no weights to update")

    def load(self) -> Load:
        running = self._running()
        used = sum(-(-r.num_tokens // self.block_size) for r in running)
        return Load(num_waiting=len(self._requests) - len(running), num_running=len(running),
                    num_free_blocks=self.num_kv_blocks - used, num_total_blocks=self.num_kv_blocks,
                    num_queued_tokens=sum(r.max_tokens - r.num_output_tokens for r in self._requests.values()))


# ---- command line ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infer-worker", description="An inference worker (one DP rank): runs an "
                                "engine for the coordinator and streams token deltas back.")
    p.add_argument("--coordinator", help="the coordinator's address, tcp://HOST:PORT (required, except by TP "
                   "ranks > 0: only TP rank 0 talks to the coordinator)")
    engine = p.add_argument_group("engine options (vLLM's names)")
    engine.add_argument("--model", help="a safetensors model directory or a .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    engine.add_argument("--dtype", choices=DTYPES, default="auto")
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    for flag in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--seed"):
        engine.add_argument(flag, type=int)
    engine.add_argument("--kv-cache-memory", type=int, help="bytes for the KV cache pool")
    engine.add_argument("--kv-cache-memory-fraction", type=float,
                        help="share of memory for the KV pool when --kv-cache-memory is not given")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    engine.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction,
                        help="no step graphs: every step runs op by op (the default for now); "
                        "--no-enforce-eager: decode steps replay graphs compiled (CPU) or captured (CUDA) per "
                        "batch size")
    engine.add_argument("--max-graph-batch-size", type=int, metavar="N",
                        help="the largest decode batch a step graph is made for (default 256)")
    engine.add_argument("--threads", type=int, dest="num_threads", help="torch threads")
    engine.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                        help="fcfs (the default) or priority: lower request priority first, with aging")
    engine.add_argument("--priority-aging-steps", type=int, metavar="N",
                        help="with --scheduling-policy priority: a request that has waited N engine steps ranks "
                        "ahead of every younger one (default 1000)")
    engine.add_argument("--suspend-weights", choices=SUSPEND_WEIGHTS,
                        help="what suspend does with the weights: host_copy (pinned host memory on a GPU; kept on "
                        "a CPU), reload (freed, reloaded from their files on resume); default auto: host_copy on a "
                        "GPU, reload on a CPU. The KV pool is always freed")
    worker = p.add_argument_group("worker options")
    worker.add_argument("--dp-rank", type=int, help="this worker's DP rank (default: the coordinator assigns the "
                        "lowest free one, and keeps it when the worker registers again)")
    worker.add_argument("--group-id", help="the group of this rank (default: an EP group is named after its "
                        "--dist-init; otherwise dp<rank>)")
    worker.add_argument("--worker-id", help="this worker's identity (default: hostname-pid)")
    worker.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds (default 1)")
    worker.add_argument("--coordinator-timeout", type=float, default=10.0,
                        help="seconds of coordinator silence before registering again (default 10)")
    worker.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish after SIGTERM (default 30)")
    worker.add_argument("--connect-timeout", type=float, default=60.0,
                        help="seconds to wait for the first Welcome (default 60)")
    worker.add_argument("--max-waiting-requests", type=int, default=1024, metavar="N",
                        help="requests that may wait beyond the --max-num-seqs running ones; a request past that "
                        "is refused as overloaded (default 1024)")
    worker.add_argument("--max-queue-time", type=float, default=60.0, metavar="S",
                        help="a request that has waited S seconds in this worker's queue without starting fails "
                        "as overloaded, so its client can retry instead of waiting without end (default 60; "
                        "0: no bound)")
    tp = p.add_argument_group("tensor parallelism (a DP rank of several processes, each holding a shard of "
                              "every layer)")
    tp.add_argument("--tp-size", type=int, default=1,
                    help="processes in this DP rank (default 1). Without --tp-rank, this command starts and "
                    "supervises all of them on this node")
    tp.add_argument("--tp-rank", type=int, help="this process's rank in its TP group (one process per rank, "
                    "with --dist-init; default: from $RANK or $SLURM_PROCID, global rank = ep_rank x tp_size + "
                    "tp_rank; TP rank 0 talks to the coordinator)")
    tp.add_argument("--tp-timeout", type=float, default=60.0,
                    help="seconds a TP collective waits for a member, and a follower waits to hear from TP "
                    "rank 0, before giving up (default 60)")
    ep = p.add_argument_group("expert parallelism (an EP group of ranks sharing an MoE model's experts)")
    ep.add_argument("--ep-size", type=int, default=1, help="ranks in this EP group (default 1: no group)")
    ep.add_argument("--ep-rank", type=int,
                    help="this rank in the group (default: $RANK, else $SLURM_PROCID %% ep-size)")
    ep.add_argument("--dist-init", help="the EP / TP group's rendezvous, tcp://HOST:PORT, the same on every "
                    "member (default: tcp://$MASTER_ADDR:$MASTER_PORT)")
    ep.add_argument("--ep-timeout", type=float, default=60.0,
                    help="seconds a group collective waits for a member before giving up (default 60)")
    security = p.add_argument_group("security (CurveZMQ: both flags, when the coordinator has keys)")
    security.add_argument("--curve-key", metavar="FILE",
                          help="this worker's secret key file (infer-keygen NAME writes NAME.key_secret; its "
                          "NAME.key goes into the coordinator's --authorized-keys directory)")
    security.add_argument("--coordinator-key", metavar="FILE",
                          help="the coordinator's public key file (its NAME.key)")
    worker.add_argument("--benchmark-mode", action="store_true",
                        help="no model: each request yields token (prompt_len + i) %% 1000 per step, empty text, "
                        "up to max_tokens (for measuring coordinator overhead)")
    worker.add_argument("--benchmark-step-time", type=float, default=0.0, metavar="S",
                        help="with --benchmark-mode: each engine step lasts S seconds (to test long steps)")
    add_logging_args(p)
    return p


_ENGINE_FLAGS = ("model", "dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "seed", "kv_cache_memory", "kv_cache_memory_fraction", "enable_prefix_caching",
                 "enable_chunked_prefill", "num_threads", "enforce_eager", "max_graph_batch_size",
                 "scheduling_policy", "priority_aging_steps", "suspend_weights")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags given (the others keep EngineConfig's defaults); ValueError if invalid."""
    return EngineConfig.from_options(**{k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k) is not None})


def parallel_options(args: argparse.Namespace) -> tuple[EpOptions | None, TpOptions | None]:
    """This process's EP and TP groups from the flags (or torchrun / Slurm variables); None: a group of one."""
    if args.ep_size < 1:
        raise ValueError(f"--ep-size must be >= 1, got {args.ep_size}")
    if args.tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {args.tp_size}")
    tp_rank, ep_rank = resolve_ranks(args.tp_size, args.tp_rank, args.ep_size, args.ep_rank)
    ep = None
    if args.ep_size > 1:
        ep = EpOptions.resolve(args.ep_size, ep_rank, args.dist_init, args.ep_timeout)
    elif args.ep_rank not in (None, 0) or (args.dist_init is not None and args.tp_size == 1):
        raise ValueError("--ep-rank and --dist-init need --ep-size > 1 (or --tp-size > 1)")
    tp = None
    if args.tp_size > 1:
        tp = TpOptions(size=args.tp_size, rank=tp_rank, dist_init=_tp_dist_init(args, ep, tp_rank),
                       timeout_s=args.tp_timeout)
    elif args.tp_rank not in (None, 0):
        raise ValueError("--tp-rank needs --tp-size > 1")
    return ep, tp


def worker_options(args: argparse.Namespace) -> WorkerOptions:
    ep, tp = parallel_options(args)
    if args.coordinator is None:
        raise ValueError("--coordinator is required (tcp://HOST:PORT)")
    group_id = args.group_id or (ep.default_group_id if ep is not None
                                 else None if args.dp_rank is None else f"dp{args.dp_rank}")
    return WorkerOptions(
        coordinator=args.coordinator, worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        dp_rank=args.dp_rank, group_id=group_id,
        heartbeat_interval=args.heartbeat_interval, coordinator_timeout=args.coordinator_timeout,
        drain_timeout=args.drain_timeout, connect_timeout=args.connect_timeout,
        benchmark_mode=args.benchmark_mode, benchmark_step_time=args.benchmark_step_time, ep=ep, tp=tp,
        max_waiting_requests=args.max_waiting_requests, max_queue_time=args.max_queue_time,
        curve=CurveKeys.from_files(args.curve_key, args.coordinator_key,
                                   flags=("--curve-key", "--coordinator-key")))


def _tp_dist_init(args: argparse.Namespace, ep: EpOptions | None, tp_rank: int | None) -> str | None:
    """The TP group's rendezvous: --dist-init, the EP group's, $MASTER_ADDR:$MASTER_PORT, or (a supervisor
    with none of these) None: it picks a local port for the processes it starts."""
    if args.dist_init is not None or ep is not None:
        return args.dist_init if ep is None else ep.dist_init
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return None


def make_engine(config: EngineConfig, benchmark_mode: bool, ep: EpOptions | None = None,
                benchmark_step_time: float = 0.0, parallel: Any = None) -> EngineLike:
    """The engine; with `ep`, after joining the EP group's torch.distributed world (every member must);
    with `parallel` (TP rank 0 of a TP group, world joined), the engine on this rank's shards, connected to
    its followers."""
    if benchmark_mode:
        return BenchmarkEngine(config, benchmark_step_time)
    from infer.worker.engine import Engine, pick_device  # torch is imported only when a model runs

    if parallel is not None:
        from infer.worker.tp_commands import TpLeader

        engine = Engine(config, parallel.ep, tp=parallel.tp)
        engine.runner.followers = TpLeader(parallel)
        return engine
    if ep is None:
        return Engine(config)
    from infer.worker.group_sync import init_group

    return Engine(config, init_group(ep, pick_device(config.device)))


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config, (ep, tp) = engine_config(args), parallel_options(args)
        if tp is None or not tp.rank:   # TP ranks > 0 never talk to the coordinator
            options = worker_options(args)
    except ValueError as e:
        parser.error(str(e))   # exit 2
    if tp is not None and tp.rank is None:   # this DP rank's processes, on this node
        from infer.worker.tp_supervisor import supervise

        sys.exit(supervise(argv, tp))
    _exit(_run(config, options if tp is None or not tp.rank else None, ep, tp))


def _run(config: EngineConfig, options: WorkerOptions | None, ep: EpOptions | None, tp: TpOptions | None) -> int:
    """Start the engine (joining its TP group first) and serve; the exit code. A TP rank > 0 (`options`
    None) serves its group's rank 0 instead."""
    parallel = None
    try:
        if tp is not None:
            parallel, path, config = _join_tp_group(config, tp, ep)
            if parallel.tp.rank > 0:
                from infer.worker.tp_group import run_follower

                return run_follower(config, parallel, path)
        engine = make_engine(config, options.benchmark_mode, options.ep, options.benchmark_step_time, parallel)
    except ValueError as e:    # options the engine finds impossible (model path, KV budget, context length)
        log.error("fatal: %s", e)
        return EXIT_USAGE
    except Exception:  # reported with its traceback: exit 1
        log.exception("fatal: the engine failed to start")
        return EXIT_FATAL
    if options.curve is not None:   # the coordinator must hold this key in its workers/ folder
        log.info("CurveZMQ on: this worker's public key %s", options.curve.public_key.decode())
    followers = getattr(getattr(engine, "runner", None), "followers", None)
    try:
        return _serve(engine, options, parallel)
    finally:
        if followers is not None:   # rank 0 of a TP group: the other ranks end with it
            followers.stop()


def _exit(code: int) -> NoReturn:
    """Exit with `code`. A member of a torch.distributed world leaves at once, skipping the C++ destructors of
    its process groups: with a peer already gone they can abort the process (SIGABRT) instead of exiting."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _join_tp_group(config: EngineConfig, tp: TpOptions, ep: EpOptions | None) -> tuple[Any, Any, EngineConfig]:
    """Join the TP group's world: (this process's place there, the model directory, the config with this
    process's own GPU)."""
    from infer.worker.tp_group import join

    return join(config, tp, ep)


def _serve(engine: EngineLike, options: WorkerOptions, parallel: Any) -> int:
    ctx = zmq.Context()
    group = None
    if options.ep is not None:
        from infer.worker.group_sync import GroupSync

        try:
            group = GroupSync(options.ep, ctx, curve=options.curve,
                              group=None if parallel is None else parallel.ep_leaders_group)
        except Exception:
            log.exception("fatal: the EP group's wake channel could not be set up")
            return EXIT_FATAL
    worker = Worker(engine, options, ctx, group)
    worker.install_signal_handlers()
    code = worker.run()
    ctx.term()
    return code


if __name__ == "__main__":
    main()
