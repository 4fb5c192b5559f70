"""infer-worker's shell: one DP rank on the wire (the command line is `worker/service/cli.py`; every decision is made by
`WorkerCore`, `worker/service/core.py`, which this module only feeds frames, signals, step outputs and the time).

One zmq DEALER (its routing identity a random secret, never the worker id others may guess) talks to the
coordinator's ROUTER. The loop reads in four lines:
take every pending frame (blocking in poll only while there is nothing to compute), step the engine, send
that step's deltas as one StepBatch, keep the link alive (heartbeats, re-registration).

Liveness does not depend on step length: the loop's thread owns the socket except during an engine step (or
an add_request, which tokenizes), when it hands it (a lock: a full memory barrier, so one thread at a time
uses it) to a heartbeat thread that sends a Heartbeat each interval the step lasts, with the last load and
the step's age (`step_age_s`), beats to each direct stream's reader, takes the stream socket's Subscribes, and
reads a producer's KV links (a hand-off's exchange with its consumer, and its end, go on beside the step).
A stopped process (SIGSTOP) stops both threads, so silence still means hung; an engine stuck inside one step
shows in the age (the coordinator's --max-step-time).

Lifecycle and exit codes:
- start: Hello -> Welcome ("worker ready" is logged) or Refused (exit 3); a handshake the coordinator
  refuses (a key it does not let in as a worker, a wrong --coordinator-key, keys on one side only): exit 3
  at once, saying which; no Welcome within --connect-timeout: exit 1.
- the coordinator silent for --coordinator-timeout, or an Error("unknown worker ..."): Hello again with the
  ids still running (re-registration); running requests keep going meanwhile.
- several coordinators (--coordinator tcp://H1:P,tcp://H2:P,tcp://H3:P; docs/architecture.md, "Several
  coordinators"): the worker registers with the one that leads. One that does not answers with Redirect: the
  worker registers at the leader it names (or, none known yet, at the next address) 0.2 s later, with the same
  Hello and snapshots as after a restart. The socket monitor reports a broken connection to the coordinator in
  use at once (a leader killed with -9): 0.2 s later the worker tries the next address; so does silence for
  --coordinator-timeout, or a Hello unanswered for 2 s. A Welcome whose term is below one the worker followed (a
  deposed leader that has not noticed) is not followed. The core picks the address; this shell disconnects its
  DEALER from the old one and connects it to the new (same routing identity, same CURVE server key: the
  coordinators of a cluster share one key pair). Running requests keep going, and direct streams with them.
- SIGTERM / SIGINT: drain (new Dispatches get an error delta "worker is draining"; running requests finish, or
  with --kv-transfer-config move to other workers with their KV; the rest is aborted after --drain-timeout), exit 0.
  A second signal ends the drain at once. The coordinator's DrainWorker (an administrator's scale-down) starts the
  same drain. In an EP group the drain of one rank is the whole group's: the rounds carry it, and a rank that hears a
  mate drains drains too. A peer that leaves while this rank drains ends the group's rounds, not the drain: the
  moves finish shipping, what would need a step is given back, exit 0.
- Control "stop": abort everything, exit 0. Bad options: exit 2. Any other fatal error: exit 1.
Nothing from the wire can end the worker except Refused and "stop": a bad frame gets an Error back.
"""

from __future__ import annotations

import logging
import math
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from infer.protocol.keys import CurveKeys
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.outputs import RequestOutput
from infer.protocol.tracing import open_sink
from infer.protocol.transport import HANDSHAKE_EVENTS, KeyGate, frames_for, handshake_failure, make_socket
from infer.worker.distributed.group_sync import GroupBroken
from infer.worker.service.core import EXIT_OK, EngineLike, WorkerCore, WorkerExit
from infer.worker.service.kv_links import KvLinks
from infer.worker.service.options import WorkerOptions

if TYPE_CHECKING:
    from infer.worker.distributed.group_sync import GroupSync
    from infer.worker.engine.engine import Engine

log = logging.getLogger("infer.worker")

_CLOSE_LINGER_MS = 2000  # how long the final frames may take to leave on exit
_MAX_FRAMES_PER_TURN = 4096  # frames handled between two engine steps, so a flood cannot starve the engine
_CONNECTION_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
# how often the heartbeat thread reads the KV links during a step while transfers are under way (each of a hand-off's
# two round trips waits at most this for the producer, not for its step's end), and the loop's longest poll while KV
# frames wait for room in their link's queue
_KV_ANSWER_POLL_S = 0.01


class Worker:
    """Runs `engine` for the coordinator at `options.coordinator` until told to stop (see the module doc):
    polls, reads signals, steps the engine, wakes the EP group, and sends what the core queued."""

    def __init__(
        self,
        engine: EngineLike,
        options: WorkerOptions,
        ctx: zmq.Context,
        group: GroupSync | None = None,
        group_lost: Callable[[], str | None] | None = None,
    ) -> None:
        """`group_lost`: why this TP rank 0's group is broken (a follower gone), else None; checked every turn."""
        self.engine, self.options, self.group, self._group_lost = engine, options, group, group_lost
        self.core = WorkerCore(
            engine, options, time.monotonic(), wall_offset=time.time() - time.monotonic(), busy=self._socket_handed_over
        )
        self.sock = make_socket(ctx, zmq.DEALER, identity=secrets.token_hex(16).encode(), curve=options.curve)
        self.spans = open_sink("infer-worker", options.otlp_traces_endpoint)
        several = len(self.core.coordinators) > 1  # a broken connection moves it to another coordinator
        self.handshakes = self.sock.get_monitor_socket(HANDSHAKE_EVENTS | (_CONNECTION_EVENTS if several else 0))
        self._endpoint = self.core.coordinator  # where the socket is connected
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.handshakes, zmq.POLLIN)
        if group is not None:
            self.poller.register(group.wake_socket, zmq.POLLIN)
        self._leaving: str | None = None  # why this rank leaves its EP group (said in the next round)
        self._last_round = time.monotonic()
        self._wakeup: socket.socket | None = None
        self._wakeup_writer: socket.socket | None = None
        self._warn = RateLimitedLog(log)
        self._socket_lock = threading.Lock()  # held by the loop's thread except inside an engine step
        self._step_started: float | None = None
        self._beats_stop = threading.Event()
        self.stream_sock: zmq.Socket | None = None
        self._stream_ctx: zmq.Context | None = None
        self._stream_gate: KeyGate | None = None
        if options.stream_port >= 0:
            self._open_stream_socket(options)
        self.kv: KvLinks | None = None  # a KV role's sockets (worker/service/kv_links.py)
        if options.kv_port_open:
            self.kv = KvLinks(self.core, options.curve, _advertised_host(options), self.poller)

    def _open_stream_socket(self, options: WorkerOptions) -> None:
        """The stream socket clients read their direct streams from (docs/architecture.md, "Direct streams"): a
        ROUTER of its own context; with keys a CURVE server under this worker's own key pair, letting in any key
        (each stream is authorized by its owner's key and token, worker/service/streams.py)."""
        ctx = self._stream_ctx = zmq.Context()
        curve = None
        if options.curve is not None:
            curve = CurveKeys(options.curve.public_key, options.curve.secret_key)
            self._stream_gate = KeyGate(ctx, lambda _key: True, logger=log, peers="stream client")
        sock = self.stream_sock = make_socket(ctx, zmq.ROUTER, curve=curve)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.bind(f"tcp://*:{options.stream_port}" if options.stream_port else "tcp://*:0")
        port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.core.stream_address = f"tcp://{_advertised_host(options)}:{port}"
        self.poller.register(sock, zmq.POLLIN)
        log.info("stream socket at %s", self.core.stream_address)

    # ---- running -------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGINT start a drain; a wakeup fd in the poller makes a blocked poll return at once."""
        self._wakeup, writer = socket.socketpair()
        self._wakeup.setblocking(False)
        writer.setblocking(False)
        self._wakeup_writer = writer  # kept open for as long as the fd is installed
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self.poller.register(self._wakeup, zmq.POLLIN)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.request_drain()

    def request_drain(self) -> None:
        """What SIGTERM does (safe from a signal handler or another thread): the loop starts the drain."""
        self.core.signals += 1

    @property
    def last_heard(self) -> float:
        """When (time.monotonic) the coordinator was last heard from."""
        return self.core.last_heard

    def run(self) -> int:
        """Serve until the end; returns the exit code. The socket is closed on return."""
        self._socket_lock.acquire()
        beats = threading.Thread(target=self._beat_during_steps, name="infer-worker-heartbeat", daemon=True)
        beats.start()
        try:
            self.sock.connect(self._endpoint)
            self.core.start(time.monotonic())
            return self._loop()
        except WorkerExit as e:
            self._flush()
            if e.leave_group is not None and self.group is not None:
                self._leave_group(self.group, e.leave_group)
            (log.info if e.code == EXIT_OK else log.error)("%s", safe(e, 2000))
            return e.code
        finally:  # let the last frames leave, unless no coordinator ever answered
            self._beats_stop.set()
            self._socket_lock.release()
            beats.join(timeout=5)
            self.sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS if self.core.ever_welcomed else 0)
            self.sock.disable_monitor()
            self.handshakes.close(0)
            self.sock.close()
            if self.group is not None:
                self.group.close()
            if self.spans is not None:
                self.spans.close()
            if self.stream_sock is not None:
                self.stream_sock.close(0)
            if self._stream_gate is not None:
                self._stream_gate.close()
            if self._stream_ctx is not None:
                self._stream_ctx.term()
            if self.kv is not None:
                self.kv.close()

    def _loop(self) -> int:
        core = self.core
        while True:
            self._flush()
            self._receive(self._poll_timeout())
            core.check_signals(time.monotonic())
            # the timers run on what the sockets held, never right after a step: a step can outlast a timer
            # (a long prefill's chunk, seconds), and what came meanwhile (a Dispatch that a parked Subscribe
            # waits for) is read first
            now = time.monotonic()
            core.tick(now, inbox_empty=not (core.silence_due(now) and self.sock.poll(0, zmq.POLLIN)))
            self._advance()
            if core.drained(time.monotonic()) and not self._mates_need_steps():
                self._flush()
                if self.group is not None:  # the group cannot step without this rank: it leaves too
                    self._leave_group(self.group, "drained")
                log.info("drained; exiting")
                return EXIT_OK

    def _mates_need_steps(self) -> bool:
        """An EP rank whose own drain is over stays in its group while the group's rounds have work: its mates'
        requests that did not move (no worker could take them) cannot step without it, and finish within their
        drain timeout instead of being given back and computed again elsewhere."""
        group = self.group
        return group is not None and not self.core.group_gone and group.active

    def _flush(self) -> None:
        """The coordinator's frames, then the stream sockets': a step's StepBatch (the ends of its requests) leaves
        before their last deltas reach the clients, so a client that asks for stats once its stream ended finds
        it counted (a race of two sockets otherwise)."""
        target = self.core.take_reconnect()
        if target is not None:
            self._reconnect(target)
        for msg in self.core.take_outgoing():
            try:
                self.sock.send_multipart(frames_for(msg), zmq.NOBLOCK)
            except zmq.Again:  # the coordinator is away and the queue is full: the frame is lost
                self._warn.warning("send queue to the coordinator is full; dropped a %r frame", msg.TYPE)
        if self.stream_sock is not None:
            self._flush_streams(self.stream_sock)
        if self.kv is not None:
            self.kv.flush()
        if self.spans is not None:
            self.spans.export(self.core.take_spans())

    def _reconnect(self, target: str) -> None:
        """Another coordinator (the core chose it): the same DEALER leaves the old endpoint for `target`."""
        try:
            self.sock.disconnect(self._endpoint)
        except zmq.ZMQError:  # not connected there any more
            pass
        self.sock.connect(target)
        self._endpoint = target

    def _flush_streams(self, sock: zmq.Socket) -> None:
        for peer, msg in self.core.take_stream_outgoing():
            try:
                sock.send_multipart(frames_for(msg, peer), zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):  # gone (unroutable) or not reading: its subscriptions lapse
                self.core.streams.drop_peer(peer)

    def _receive_streams(self, sock: zmq.Socket) -> None:
        for _ in range(_MAX_FRAMES_PER_TURN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            user = str(frames[-1].get("User-Id") or "") if self._stream_gate is not None else ""
            self.core.on_stream_frame(frames[0].bytes, user, [f.bytes for f in frames[1:]], time.monotonic())

    def _poll_timeout(self) -> float:
        """Seconds to block in poll: 0 while there is work, else until the next timer is due (the core's)."""
        if self.kv is not None and self.kv.backlogged:  # KV frames wait for room in their link's queue
            return min(_KV_ANSWER_POLL_S, self._core_poll_timeout())
        return self._core_poll_timeout()

    def _core_poll_timeout(self) -> float:
        group = self.group
        if group is None or self.core.group_gone:
            return self.core.poll_timeout(time.monotonic())
        # an idle group checks its members once per heartbeat interval
        return self.core.poll_timeout(
            time.monotonic(),
            group_busy=group.active or self._leaving is not None,
            group_check_due=self._last_round + self.options.heartbeat_interval,
        )

    def _receive(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a frame, then hand every frame already queued to the core."""
        events = dict(self.poller.poll(math.ceil(timeout_s * 1000)))
        # zmq.Poller reports a plain socket by its fd number, not by the object it was registered with
        if self._wakeup is not None and (self._wakeup.fileno() in events or self._wakeup in events):
            self._wakeup.recv(4096)
        if self.handshakes in events:
            self._on_handshake_events()
        if self.stream_sock is not None and self.stream_sock in events:
            self._receive_streams(self.stream_sock)
        if self.kv is not None:
            self.kv.receive(events)
        for _ in range(_MAX_FRAMES_PER_TURN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.core.on_frame(frames, time.monotonic())
            self._flush()

    def _on_handshake_events(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.handshakes, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] & _CONNECTION_EVENTS:
                endpoint = event["endpoint"].decode(errors="replace")
                self.core.on_connection_lost(endpoint, time.monotonic(), event["event"] == zmq.EVENT_DISCONNECTED)
                continue
            problem = handshake_failure(event, self.options.curve is not None, ("--curve-key", "--coordinator-key"))
            if problem is not None:
                self.core.on_handshake_failure(problem, event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def _advance(self) -> None:
        """One engine step (unless paused), then one StepBatch with its deltas and any rejections."""
        lost = self._group_lost() if self._group_lost is not None else None
        if lost is not None:  # a TP follower died while the group was idle
            self.core.group_broken(lost, time.monotonic())
        self.core.shed_overdue(time.monotonic())
        if self.group is not None:
            return self._advance_group(self.group)
        outputs = self._engine_step(self.engine.step) if self.core.wants_step() else self.engine.take_pending()
        self.core.after_step(outputs, time.monotonic())
        self._flush()

    # Both handlers raise WorkerExit (the core's methods are NoReturn), which mypy cannot see: it takes infer.*
    # imports for Any under this repository's settings.
    def _engine_step(self, step: Callable[[], list[RequestOutput]]) -> list[RequestOutput]:  # type: ignore[return]
        try:
            with self._socket_handed_over():
                return step()
        except GroupBroken as e:  # raised by a MoE layer's exchange: a member of the group is gone
            self._group_broke(str(e))
            return self.engine.take_pending()
        except Exception as e:  # the engine fails single requests itself; this is the engine broken: exit 1
            log.exception("engine step failed")
            self.core.engine_broken(e, time.monotonic())

    @contextmanager
    def _socket_handed_over(self) -> Iterator[None]:
        """The socket belongs to the heartbeat thread for the length of the block (an engine step, or an
        add_request that tokenizes a prompt); what the core queued so far goes out first."""
        self._flush()
        self._step_started = time.monotonic()
        self._socket_lock.release()
        try:
            yield
        finally:
            self._socket_lock.acquire()
            self._step_started = None

    def _beat_during_steps(self) -> None:
        """The heartbeat thread: while an engine step runs, a Heartbeat each interval to the coordinator and to each
        direct stream's reader, and the stream socket's Subscribes taken (a client that subscribes during a long
        step is a reader at once), so that a step longer than a client's silence timeout (a long prefill chunk on
        a CPU) sets off no re-attach (see the module doc). The loop's thread is inside engine code meanwhile,
        which touches neither the core's streams nor the sockets."""
        interval = self.options.heartbeat_interval
        wait = interval / 4
        while not self._beats_stop.wait(wait):
            wait = interval / 4
            if self._step_started is None or not self._socket_lock.acquire(blocking=False):
                continue
            try:
                started = self._step_started
                if started is not None:
                    if self.stream_sock is not None:
                        self._receive_streams(self.stream_sock)
                    if self.kv is not None:  # a hand-off's exchange goes on beside the step (a long prefill chunk)
                        self.kv.receive_answers(during_step=True)
                        if self.core.kv_transfers_during_step(time.monotonic()):
                            wait = min(wait, _KV_ANSWER_POLL_S)
                    self.core.beat_during_step(time.monotonic(), started)
                    self._flush()
            finally:
                self._socket_lock.release()

    # ---- EP group lockstep (see infer.worker.distributed.group_sync) -------------------------------------------

    def _advance_group(self, group: GroupSync) -> None:
        """Enter the group's next round when anyone may have work (or to check the members while idle),
        then run this rank's step, or a dummy forward, if anyone has work. A member that drains drains the group:
        this rank drains too (WorkerCore.group_drains). A member that leaves ends the group: this rank too, unless
        it drains (then its drain goes on without rounds: WorkerCore.group_left)."""
        now, core = time.monotonic(), self.core
        if core.group_gone:
            core.after_step(self.engine.take_pending(), now, refit=False)
            return self._flush()
        has_work = core.wants_step()
        woken = group.woken()
        check_due = now - self._last_round >= self.options.heartbeat_interval
        if not (group.active or has_work or woken or check_due or self._leaving is not None):
            core.after_step(self.engine.take_pending(), now, refit=False)
            return self._flush()
        if not (group.active or woken):
            group.wake_peers()  # the peers are idle in their polls: bring them into this round
        try:
            agreed = group.agree(has_work, self._leaving is not None, core.draining)
        except GroupBroken as e:
            self._group_broke(str(e))
            core.after_step(self.engine.take_pending(), time.monotonic(), refit=False)
            return self._flush()
        self._last_round = time.monotonic()
        if agreed.draining and self._leaving is None:  # a mate drains (or this rank): the whole group drains
            core.group_drains(time.monotonic())
        if agreed.leaving:
            if self._leaving is not None:
                return
            self._group_left(group, f"a member of EP group {core.group_id!r} left")
            return self._flush()
        if agreed.work:
            # an EP group's engine is a real Engine (WorkerOptions refuses --benchmark-mode with --ep-size)
            engine = cast("Engine", self.engine)
            outputs = self._engine_step(engine.step if has_work else engine.dummy_step)
        else:
            outputs = self.engine.take_pending()
        core.after_step(outputs, time.monotonic(), refit=False)
        self._flush()

    def _group_broke(self, reason: str) -> None:
        """A member of the EP group is gone (killed, or its link broke). Not draining, this rank gives its requests
        back and exits 1 (WorkerCore.group_broken); draining, as when a member leaves in order: its moves under way
        go on shipping KV, the requests that would need a step are given back, and it exits 0 once drained."""
        if self.group is not None and self.core.draining and not self.core.group_gone:
            return self._group_left(self.group, f"EP group {self.core.group_id!r} broke ({reason})")
        self.core.group_broken(reason, time.monotonic())

    def _group_left(self, group: GroupSync, reason: str) -> None:
        """The group steps no more (WorkerCore.group_left: this rank exits 1 unless it drains); no peer wakes this
        rank again."""
        self.core.group_left(reason, time.monotonic())
        self.poller.unregister(group.wake_socket)

    def _leave_group(self, group: GroupSync, reason: str) -> None:
        """Tell the group this rank is leaving (one last round), so the others leave too instead of hanging
        in a collective; nothing to tell when the group left first."""
        if self.core.group_gone:
            return
        self._leaving = reason
        try:
            self._advance_group(group)
        except WorkerExit:
            self._flush()


def _advertised_host(options: WorkerOptions) -> str:
    """--advertise-host, else 127.0.0.1 for a coordinator on loopback, else the address of this machine's interface
    toward the coordinator (the source address the kernel picks for it: a network the coordinator's clients reach
    too), else this machine's host name. The host name alone failed where nodes' names resolve only on the nodes
    (the Slurm sandbox's namespaces, many clusters' compute nodes)."""
    if options.advertise_host:
        return options.advertise_host
    coordinator = options.coordinators[0]  # several: one network (they share the address list)
    address = coordinator.removeprefix("tcp://")
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host in ("localhost", "::1") or host.startswith("127.") or coordinator.startswith("ipc://"):
        return "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing: a route lookup
            probe.connect((host, int(port)))
            return str(probe.getsockname()[0])
    except (OSError, ValueError):
        return socket.getfqdn()


if __name__ == "__main__":
    from infer.worker.service.cli import main

    main()
