"""The worker's logic with no I/O: frames in, messages out, time passed in (the worker's twin of the
coordinator's `handle / tick / take_outgoing`; `tests/worker_harness.py` drives it frame by frame).

The shell (`worker/service/daemon.py`) owns the socket, the poller, the signal handlers, the heartbeat thread and the
EP group's collectives; it calls, in its loop:

    core.on_frame(frames, now)        each frame the coordinator sent (Dispatch -> Engine.add_request, ...)
    core.check_signals(now)           SIGTERM / SIGINT counted in `core.signals` start (or end) the drain
    core.after_step(outputs, now)     the engine step it ran when `core.wants_step()`: one StepBatch
    core.tick(now, inbox_empty)       liveness: first Welcome deadline, re-registration, heartbeat
    core.drained(now)                 the drain is over (its deadline gave the rest back): exit 0
    core.take_outgoing()              the messages to send, in order

and `core.poll_timeout(now)` says how long it may block. A decision that ends the worker raises `WorkerExit`
(after queuing what must still go out). Long engine calls (a prompt's tokenization, a refit) run inside
`busy()`, the shell's hook that lets the heartbeat thread send meanwhile (`beat_during_step`).

Invariant: `_requests` holds exactly the ids dispatched here whose finished delta has not been sent, each with
what its deltas carried so far (`_Sent`: a StreamJournal, protocol/journal.py): the Hello of a re-registration
(say, with a restarted coordinator) sends it, so the coordinator can hand each stream back to its client.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NoReturn, Protocol

import msgspec

from infer.protocol.codes import ErrorCode, FinishReason
from infer.protocol.journal import StreamJournal
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.messages import (
    MAX_MODEL_ID_LEN,
    Abort,
    CommitWeights,
    Control,
    ControlAck,
    Delta,
    Dispatch,
    DrainMoves,
    DrainWorker,
    Error,
    Heartbeat,
    Hello,
    KvEvents,
    KvResync,
    Load,
    LoraCommand,
    LoraDone,
    Message,
    MoveTargets,
    ProtocolError,
    Redirect,
    Refused,
    RequestSnapshot,
    StepBatch,
    Subscribe,
    TokenIds,
    UpdateWeights,
    WeightsUpdated,
    Welcome,
    decode,
    peek_request_id,
)
from infer.protocol.sampling import SamplingParams
from infer.protocol.tracing import Attribute, HopSpan
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.request import Request
from infer.worker.kv.transfer import KvBlocksPort, KvReceiver, KvSender
from infer.worker.service.lifecycle import Action, WorkerState, transition
from infer.worker.service.options import WorkerOptions
from infer.worker.service.streams import DirectStream, StreamTable

log = logging.getLogger("infer.worker")

EXIT_OK, EXIT_FATAL, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3
_SHED_CHECK_S = 0.25  # how often the queue is checked for requests past --max-queue-time
# The prefix cache's changes (KvEvents) ride on every StepBatch that goes anyway; changes that no StepBatch carries
# (steps of direct streams only) go in one of their own at most this often (each frame costs the coordinator a turn).
KV_EVENT_FLUSH_S = 0.05
# Several coordinators (docs/architecture.md, "Several coordinators"): after a Redirect or a lost connection the
# worker registers elsewhere this much later (a new leader is elected meanwhile); a Hello one of them leaves
# unanswered this long (capped by --coordinator-timeout) moves it on to the next address.
SWITCH_BACKOFF_S = 0.2
ATTEMPT_S = 2.0


class WorkerExit(Exception):
    """Ends the worker with exit `code` once its message is logged; `leave_group`: the reason this rank tells
    its EP group it leaves (None: the group is gone, or there is none)."""

    def __init__(self, code: int, message: str, leave_group: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.leave_group = leave_group


class EngineLike(Protocol):
    """What the worker needs of an engine: the real Engine, or BenchmarkEngine."""

    config: EngineConfig
    model_id: str
    block_size: int
    max_model_len: int

    @property
    def num_kv_blocks(self) -> int: ...
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        resumed_token_ids: Sequence[int] = (),
        resumed_text_len: int | None = None,
        priority: int = 0,
        client: str | None = None,
        images: Sequence[object] = (),
        decoder_prompt: str | Sequence[int] | None = None,
        audio: bytes | None = None,
    ) -> Request: ...
    def step(self) -> list[Delta]: ...
    def take_pending(self) -> list[Delta]: ...
    def shed_overdue(self, max_queue_time: float) -> int: ...
    def abort(self, request_id: str, release_text: bool = True) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def load(self) -> Load: ...
    def publish_kv_events(self, on: bool) -> None: ...
    def take_kv_events(self) -> KvEvents | None: ...
    def suspend(self) -> int: ...
    def resume(self) -> int: ...
    def prepare_update(self, msg: UpdateWeights) -> object: ...
    # `update`: what this engine's prepare_update returned (its own type, opaque to the worker)
    def check_prepared(self, update: Any) -> None: ...
    def update_weights(self, source: object, version: int | None = None) -> int: ...
    @property
    def weight_version(self) -> int: ...
    def add_lora(self, name: str, path: str, int_id: int | None = None) -> dict[str, object]: ...
    def remove_lora(self, name: str) -> bool: ...
    def list_loras(self) -> list[dict[str, object]]: ...


@dataclass
class _PendingRefit:
    """An UpdateWeights whose tensors are staged and checked: waiting for the engine's requests to finish (a
    drain), then, once `prepared` was answered, for the coordinator's CommitWeights (until `deadline`)."""

    msg: UpdateWeights
    update: object  # the engine's WeightUpdate, staged
    deadline: float
    prepared: bool = False


class WorkerCore:
    """Decides everything one DP rank does on the wire (see the module doc); `now` is monotonic seconds and
    `wall_offset` turns it into the wall-clock time heartbeats carry."""

    def __init__(
        self,
        engine: EngineLike,
        options: WorkerOptions,
        now: float,
        *,
        wall_offset: float = 0.0,
        busy: Callable[[], AbstractContextManager[object]] = nullcontext,
    ) -> None:
        self.engine, self.options = engine, options
        self.busy = busy
        self.wall_offset = wall_offset
        self.state = WorkerState.RUNNING  # by Control (worker/service/lifecycle.py)
        self.signals = 0  # SIGTERM / SIGINT received (the shell's handler counts them)
        self._outgoing: list[Message] = []
        self._requests: dict[str, _Sent] = {}
        # aborted at the coordinator's request: how many of their final deltas are dropped (the same id may be
        # aborted, dispatched again and aborted again before a step: each abort's delta is dropped, and no other)
        self._silenced: dict[str, int] = {}
        self._instance: str | None = None  # the coordinator process that welcomed us (a change: it restarted)
        # Several coordinators: the address in use (the shell connects there: take_reconnect), the highest term a
        # Welcome we followed carried, and a move to another address planned (at _switch_due, after a Redirect or
        # a lost connection)
        self.coordinators = options.coordinators
        self.coordinator = self.coordinators[0]
        self.term = 0
        self._switch: tuple[float, str] | None = None
        self._reconnect: str | None = None
        self._incarnation = uuid.uuid4().hex[:16]  # this process, as the coordinator tells it from another
        self._dispatches_seen = 0  # Dispatch frames received since that coordinator's Welcome
        self.rank = options.dp_rank  # the DP rank and group the coordinator's Welcome gave us
        self.group_id = options.group_id
        self._outbox: list[Delta] = []  # deltas made outside a step (rejected Dispatches)
        self._spans: list[HopSpan] = []  # traced requests' hops ended since take_spans
        self._last_sent = self.last_heard = self._hello_sent_at = now
        self._connect_deadline = now + options.connect_timeout
        self._welcomed = False  # a Welcome answered the latest Hello
        self.ever_welcomed = False
        self._signals_seen = 0
        self._drain_deadline: float | None = None
        self._warn = RateLimitedLog(log)
        self.last_load: Load = engine.load()  # what a heartbeat sent during a step reports
        self._refit: _PendingRefit | None = None  # an UpdateWeights waiting for a drain, then its commit
        self._last_shed_check = -_SHED_CHECK_S
        # direct streams (worker/service/streams.py); the shell sets the address once its stream socket is bound
        self.streams = StreamTable(options.stream_linger, options.coordinator_timeout, options.heartbeat_interval)
        self.stream_address: str | None = None
        # KV events (Welcome.kv_events): publishing, when the last went out, and whether some may wait
        self._kv_events = False
        self._kv_sent_at = now
        self._kv_maybe_pending = False
        # KV transfers (worker/kv/transfer.py), with --kv-transfer-config: a producer's hand-offs and a drain's moves
        # send, every KV socket answers; the shell sets `kv_address` once the KV socket is bound
        port: KvBlocksPort | None = getattr(engine, "kv_port", None) if options.kv_port_open else None
        self.kv_port = port
        self.kv_sender = KvSender(options.kv.kv_transfer_timeout) if port is not None else None
        self.kv_receiver = KvReceiver(port) if port is not None else None
        self.kv_address: str | None = None
        self._kv_targets: dict[str, tuple[str, str]] = {}  # dispatched with a consumer: (its KV address, its key)
        self._kv_transferring: set[str] = set()  # handed off in this step: their abort delta is on its way
        self._kv_handed: dict[str, Delta] = {}  # given back, waiting for their transfer to end: the delta that says so
        self._kv_replies: list[tuple[bytes, Message]] = []  # a consumer's answers: (producer's peer id, message)
        self._moves_asked = False  # the drain's DrainMoves went out and no MoveTargets answered it yet
        self._group_gone = False  # the EP group left during the drain (group_left): no more steps here

    # ---- the shell's surface -------------------------------------------------------------------

    def start(self, now: float) -> None:
        """The first Hello (the shell has connected)."""
        self._send_hello(now)

    def on_frame(self, frames: list[bytes], now: float) -> None:
        """One multipart message from the coordinator. Raises only WorkerExit (the worker's own decision: a
        Refused, a stop); any other failure on a frame is answered with an Error and logged (rate-limited)."""
        self.last_heard = now
        if len(frames) != 1:
            return self._bad_frame(f"expected one frame per message, got {len(frames)}", frames[0][:64], now)
        try:
            msg = decode(frames[0])
        except ProtocolError as e:
            return self._bad_frame(e, frames[0], now)
        except Exception as e:  # noqa: BLE001 - decode raises ProtocolError only; anything else is a bug
            self._warn.exception("decoding a frame from the coordinator failed")
            return self._bad_frame(f"the frame could not be read ({type(e).__name__})", frames[0], now)
        handler = self._HANDLERS.get(type(msg))
        if handler is None:
            return self._send(Error(message=f"a worker does not handle {msg.TYPE!r} messages"), now)
        try:
            handler(self, msg, now)
        except WorkerExit:
            raise
        except Exception as e:  # noqa: BLE001 - a bug a frame found costs that frame, never the worker
            self._warn.exception("internal error handling %r from the coordinator", msg.TYPE)
            self._send(Error(message=f"internal error handling {msg.TYPE!r}: {type(e).__name__}: {safe(e)}"), now)

    def on_stream_frame(self, peer: bytes, user_id: str, frames: list[bytes], now: float) -> None:
        """One message on the stream socket from `peer` (authenticated as `user_id`: its z85 key, "" without
        keys): a Subscribe, or a client's Heartbeat. Anything else gets an Error; nothing ends the worker."""
        if len(frames) != 1:
            return self.streams.reply_error(peer, f"expected one frame per message, got {len(frames)}")
        try:
            msg = decode(frames[0])
        except ProtocolError as e:
            return self.streams.reply_error(peer, str(e))
        except Exception as e:  # noqa: BLE001 - decode raises ProtocolError only; anything else is a bug
            return self.streams.reply_error(peer, f"the frame could not be read ({type(e).__name__})")
        if isinstance(msg, Subscribe):
            self.streams.subscribe(peer, user_id, msg, now)
        elif not isinstance(msg, Heartbeat):
            self.streams.reply_error(peer, f"a worker's stream socket does not handle {msg.TYPE!r} messages")

    def take_stream_outgoing(self) -> list[tuple[bytes, Message]]:
        """(peer, message) to send on the stream socket."""
        return self.streams.take()

    def wants_step(self) -> bool:
        """The engine has work and the lifecycle lets it step (and, in an EP group, the group is still there)."""
        return self.state is WorkerState.RUNNING and not self._group_gone and self.engine.has_unfinished()

    def shed_overdue(self, now: float) -> None:
        """Before each step, at most once per _SHED_CHECK_S: fail the requests that waited past --max-queue-time
        without starting (the cluster is overloaded: the client hears it now instead of waiting without end).
        Not while paused: a pause holds requests on purpose. Their final deltas go out with the step's."""
        limit = self.options.max_queue_time
        if not limit or self.state is not WorkerState.RUNNING or now - self._last_shed_check < _SHED_CHECK_S:
            return
        self._last_shed_check = now
        self.engine.shed_overdue(limit)

    def after_step(self, outputs: list[Delta], now: float, refit: bool = True) -> None:
        """The outputs of the step the shell ran (or of `take_pending` when it did not step): one StepBatch with
        their deltas and any rejections; then a pending refit is applied if the engine has emptied (`refit`;
        an EP group's rank never applies one here)."""
        if self.kv_sender is not None and self._kv_targets:
            outputs = self._hand_off(outputs, now)
        self._send_step_batch(outputs, now)
        if self.kv_sender is not None:
            self._finish_transfers(now)
        if refit and self._refit is not None:
            self._apply_refit(now)

    # ---- disaggregated prefill and decode (worker/kv/transfer.py) -------------------------------------------

    def _hand_off(self, outputs: list[Delta], now: float) -> list[Delta]:
        """A producer's requests that made their first token in this step: their KV copied out, their transfer
        started, the request aborted here (its abort delta goes to the coordinator once the transfer ends). One
        without a full block of KV decodes here: a hand-off would move nothing."""
        sender, port = self.kv_sender, self.kv_port
        if sender is None or port is None:
            return outputs
        handed = False
        for out in outputs:
            target = self._kv_targets.get(out.request_id)
            if target is None:
                continue
            if out.finished:  # done with its first token (EOS, max_tokens 1): nothing to continue
                del self._kv_targets[out.request_id]
                continue
            if not out.token_ids:
                continue
            del self._kv_targets[out.request_id]
            exported = port.export(out.request_id)
            if exported is None:  # no full block to send (a short prompt): it decodes here
                continue
            self.engine.abort(out.request_id, release_text=False)
            self._kv_transferring.add(out.request_id)
            sender.start(
                out.request_id, target[0], target[1], exported, port.fingerprint(self.engine.weight_version), now
            )
            handed = True
        return outputs + self.engine.take_pending() if handed else outputs

    def _held_for_transfer(self, delta: Delta) -> bool:
        """A handed-off request's abort delta waits for its transfer's end (`_finish_transfers`)."""
        sender = self.kv_sender
        if sender is None or delta.finish_reason != FinishReason.ABORT:
            return False
        if delta.request_id not in self._kv_transferring:
            return False
        self._kv_transferring.discard(delta.request_id)
        self._kv_handed[delta.request_id] = delta
        return True

    def _finish_transfers(self, now: float, during_step: bool = False) -> None:
        """Transfers that ended: their requests go back to the coordinator, which continues each on its consumer.
        `during_step`: called by the shell's heartbeat thread while the engine steps on the loop's thread, so the
        engine is not touched: the frame carries the load the last step reported."""
        sender = self.kv_sender
        if sender is None:
            return
        ended = []
        for transfer in sender.take_done():
            delta = self._kv_handed.pop(transfer.request_id, None)
            if delta is None:
                continue  # aborted by the coordinator meanwhile
            ended.append(
                msgspec.structs.replace(
                    delta, error_code=ErrorCode.KV_HANDOFF, error=f"KV transfer: {transfer.outcome}"
                )
            )
        if not ended:
            return
        if during_step:
            self._send(StepBatch(deltas=ended, load=self.last_load), now)
        else:
            self._outbox.extend(ended)
            self._send_step_batch([], now)

    def on_kv_answer(self, frames: list[bytes], now: float, during_step: bool = False) -> None:
        """A consumer's answer on a producer's KV link; `during_step`: read by the shell's heartbeat thread while an
        engine step runs (a hand-off's exchange then goes on beside a long prefill chunk instead of waiting for its
        end: `_finish_transfers`)."""
        if self.kv_sender is None or len(frames) != 1:
            return
        try:
            msg = decode(frames[0])
        except ProtocolError as e:
            self._warn.warning("a bad frame from a KV consumer: %s", e)
            return
        self.kv_sender.on_message(msg)
        self._finish_transfers(now, during_step)

    def kv_transfers_during_step(self, now: float) -> bool:
        """Called by the shell's heartbeat thread while an engine step runs: transfers past their deadline end (their
        requests go back as in `tick`); whether any is still under way (the thread then looks at the KV links
        often)."""
        if self.kv_sender is None:
            return False
        self.kv_sender.tick(now)
        self._finish_transfers(now, during_step=True)
        return bool(self.kv_sender.transfers)

    def on_kv_frame(self, peer: bytes, frames: list[bytes], now: float) -> None:
        """A producer's frame on this consumer's KV socket: answered (take_kv_replies)."""
        if self.kv_receiver is None or len(frames) != 1:
            return
        try:
            msg = decode(frames[0])
        except ProtocolError as e:
            self._warn.warning("a bad frame from a KV producer: %s", e)
            return
        with self.busy():  # a large transfer's copy into the pool: heartbeats go on meanwhile
            reply = self.kv_receiver.on_message(msg, self.kv_fingerprint())
        if reply is not None:
            self._kv_replies.append((peer, reply))

    def kv_fingerprint(self) -> bytes:
        return b"" if self.kv_port is None else self.kv_port.fingerprint(self.engine.weight_version)

    def take_kv_outgoing(self) -> list[tuple[str, str, Message]]:
        """A producer's frames to consumers: (KV address, the consumer's key, message)."""
        return [] if self.kv_sender is None else self.kv_sender.take_outgoing()

    def take_kv_replies(self) -> list[tuple[bytes, Message]]:
        replies, self._kv_replies = self._kv_replies, []
        return replies

    # ---- a drain that moves requests with their KV (docs/architecture.md, "A drain that moves KV") ----------

    def _ask_moves(self, now: float) -> None:
        """The drain starts: a worker with a KV port asks the coordinator where its requests go on (DrainMoves).
        Until MoveTargets answers (and for the requests it names no target for) they run here, as in any drain. With
        nothing to move, or no KV port, it sends DrainMoves with no request: the coordinator then knows it drains
        (and its EP group with it) and routes nothing more to it or its group, instead of hearing it at its first
        refusal."""
        if not self.ever_welcomed:
            return
        if self.kv_sender is None:  # nothing can move: it only says it drains (its EP group with it)
            self._send(DrainMoves(request_ids=[]), now)
            return
        movable = [rid for rid in self._requests if rid not in self._kv_transferring]
        self._send(DrainMoves(request_ids=movable), now)
        self._moves_asked = bool(movable)

    def _on_move_targets(self, msg: MoveTargets, now: float) -> None:
        """Each named request still running here: its full blocks copied out, the request aborted here and its
        transfer started to its target (as a producer's hand-off: `_finish_transfers` gives it back once the
        target stored the blocks, or the transfer ended otherwise)."""
        sender, port = self.kv_sender, self.kv_port
        if sender is None or port is None or self._drain_deadline is None:
            return
        self._moves_asked = False
        fingerprint = port.fingerprint(self.engine.weight_version)
        moved = 0
        for move in msg.moves:
            rid = move.request_id
            if rid not in self._requests or rid in self._kv_transferring or rid in sender.transfers:
                continue  # finished meanwhile, or on its way already
            self._kv_targets.pop(rid, None)  # a producer's request before its first token: the move replaces it
            exported = port.export(rid)
            if not self.engine.abort(rid, release_text=False):
                continue
            self._kv_transferring.add(rid)
            sender.start(rid, move.kv_address, move.kv_key, exported, fingerprint, now)
            moved += 1
        if moved:
            log.info("drain: moving %d request(s) with their KV", moved)
            self._send_step_batch(self.engine.take_pending(), now)
            self._finish_transfers(now)
        if self._group_gone:
            self._give_back_unmoved(now)

    def _end_moves(self, now: float) -> None:
        """The drain's deadline: every transfer still under way ends now, and its request goes back as it stands."""
        if self.kv_sender is not None:
            self.kv_sender.end_all(f"the drain timeout ({self.options.drain_timeout:g} s) passed")
        self._finish_transfers(now)
        left = [
            msgspec.structs.replace(delta, error_code=ErrorCode.KV_HANDOFF, error="KV transfer: the drain ended")
            for delta in self._kv_handed.values()
        ]
        self._kv_handed.clear()
        if left:
            self._outbox.extend(left)
            self._send_step_batch([], now)

    def engine_broken(self, error: Exception, now: float) -> NoReturn:
        """The engine step raised (the engine fails single requests itself, so this is the engine broken)."""
        self._send(Error(message=f"worker {self.options.worker_id} failed: engine step: {error!r}"), now)
        raise WorkerExit(EXIT_FATAL, f"fatal: engine step failed: {error!r}")

    def group_broken(self, reason: str, now: float) -> NoReturn:
        """The EP group cannot step any more: give every request back (the coordinator moves them to another
        group, resuming each stream where it stands) and exit."""
        log.error("%s; giving back %d request(s) and exiting", reason, len(self._requests))
        self._abort_all(now)
        raise WorkerExit(EXIT_FATAL, f"fatal: {reason}")

    def group_drains(self, now: float) -> None:
        """A round of the EP group said a member drains (maybe this rank): the group cannot step once that member
        leaves, so it drains as a whole; this rank drains as on SIGTERM (its requests move out of the group with
        their KV), unless it drains already."""
        if self._drain_deadline is None:
            self._start_drain(f"a member of EP group {self.group_id!r} drains", now)

    def group_left(self, reason: str, now: float) -> None:
        """A member of the EP group left it in order (it drained, or was stopped): the group steps no more. Not
        draining (the member was stopped), this rank ends as on `group_broken`. Draining (the whole group drains: a
        member's drain reached every rank, `group_drains`, at the latest in the round it left), the departure is part
        of the drain: the moves under way go on shipping their KV, the requests that would need a step are given back
        (the coordinator resumes them elsewhere) at once or, while DrainMoves waits for its answer, once MoveTargets
        came (some of them move then), and `drained` ends the process, exit 0."""
        if self._drain_deadline is None:
            self.group_broken(reason, now)
        if self._group_gone:
            return
        self._group_gone = True
        log.info(
            "%s during the drain: no more steps here; %d request(s) still shipping their KV",
            reason,
            len(self._kv_handed),
        )
        if not self._moves_asked:
            self._give_back_unmoved(now)

    @property
    def group_gone(self) -> bool:
        """The EP group left during the drain (`group_left`): no more rounds, no more steps."""
        return self._group_gone

    def _give_back_unmoved(self, now: float) -> None:
        """The group is gone: the requests that did not move with their KV cannot step here any more."""
        if self._requests:
            log.info("drain: giving back %d request(s) that cannot step without the EP group", len(self._requests))
            self._abort_all(now)

    def check_signals(self, now: float) -> None:
        """The first signal starts the drain (deadline --drain-timeout); a second ends it at once."""
        if self.signals == self._signals_seen:
            return
        self._signals_seen = self.signals
        if self._drain_deadline is None:
            self._start_drain("signal received", now)
        elif self.signals > 1 and self._drain_deadline > now:
            log.info("second signal: aborting the %d requests left", len(self._requests))
            self._drain_deadline = now

    def _start_drain(self, why: str, now: float) -> None:
        """New Dispatches are refused from now on; the running requests finish here or, with a KV port, move with
        their KV; whatever is left at --drain-timeout is given back. `drained` then ends the process (exit 0)."""
        self._drain_deadline = now + self.options.drain_timeout
        log.info("%s: draining %d requests (at most %g s)", why, len(self._requests), self.options.drain_timeout)
        self._ask_moves(now)

    def _on_drain_worker(self, msg: DrainWorker, now: float) -> None:
        """The coordinator scales this worker down (an administrator's DrainWorker): the drain SIGTERM starts. A
        frame naming another worker (a coordinator confused about who is who) is refused, not obeyed."""
        if msg.worker_id != self.options.worker_id:
            self._send(Error(message=f"drain_worker names {msg.worker_id!r}; this is {self.options.worker_id!r}"), now)
        elif self._drain_deadline is None:
            self._start_drain("drain asked by the coordinator", now)

    def silence_due(self, now: float) -> bool:
        """The coordinator has been silent for --coordinator-timeout (since it was heard, or since our Hello)."""
        return now - max(self.last_heard, self._hello_sent_at) >= self.options.coordinator_timeout

    def tick(self, now: float, inbox_empty: bool = True) -> None:
        """Liveness: no first Welcome by --connect-timeout ends the worker; coordinator silence (`silence_due`,
        with nothing waiting in the inbox: frames that came during a long step are not silence) registers
        again; otherwise a heartbeat each interval."""
        self.streams.tick(now)
        if self.kv_sender is not None:
            self.kv_sender.tick(now)
            self._finish_transfers(now)
        if self._kv_events and self._welcomed:
            self._flush_kv_events(now)
        if not self.ever_welcomed and now >= self._connect_deadline:
            raise WorkerExit(
                EXIT_FATAL,
                f"fatal: no Welcome from the coordinator at {self.options.coordinator} "
                f"within {self.options.connect_timeout:g} s",
            )
        if self._switch is not None and now >= self._switch[0]:
            self._move(self._switch[1], now)
        elif self.silence_due(now) and inbox_empty:
            if len(self.coordinators) > 1:
                log.warning(
                    "nothing heard from the coordinator at %s for %.1f s; registering at %s",
                    self.coordinator,
                    now - self.last_heard,
                    self._next_address(),
                )
                return self._move(self._next_address(), now)
            log.warning("nothing heard from the coordinator for %.1f s; registering again", now - self.last_heard)
            self._send_hello(now)
        elif self._attempt_over(now) and inbox_empty:
            log.info("no answer from the coordinator at %s; registering at %s", self.coordinator, self._next_address())
            self._move(self._next_address(), now)
        elif self.ever_welcomed and now - self._last_sent >= self.options.heartbeat_interval:
            self._heartbeat(now)

    def beat_during_step(self, now: float, step_started: float) -> None:
        """Called by the shell's heartbeat thread while an engine call runs: a Heartbeat (the last load and the
        step's age) when an interval passed since the last frame out, and one to each direct stream's reader."""
        if self.ever_welcomed and now - self._last_sent >= self.options.heartbeat_interval:
            self._send(
                Heartbeat(sent_at=now + self.wall_offset, load=self.last_load, step_age_s=round(now - step_started, 3)),
                now,
            )
        self.streams.beat(now)

    def drained(self, now: float) -> bool:
        """A drain is under way and over: every request finished or moved (those left at its deadline given back,
        the moves still shipping KV then handed back as they stand: their targets recompute what they lack)."""
        if self._drain_deadline is None:
            return False
        if now >= self._drain_deadline:
            if self._requests:
                log.warning("drain timeout: aborting %d requests", len(self._requests))
                self._abort_all(now)
            if self._kv_handed:
                self._end_moves(now)
        return not self._requests and not self.engine.has_unfinished() and not self._kv_handed

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def poll_timeout(self, now: float, group_busy: bool = False, group_check_due: float | None = None) -> float:
        """Seconds the shell may block in poll: 0 while the engine has work (or the EP group is in rounds:
        `group_busy`), else until the next timer is due (`group_check_due`: the idle group's member check)."""
        if self.wants_step():
            return 0.0
        if self._refit is not None and not self._refit.prepared and not self.engine.has_unfinished():
            return 0.0
        if group_busy:
            return 0.0
        due = [max(self.last_heard, self._hello_sent_at) + self.options.coordinator_timeout]
        if self._switch is not None:
            due.append(self._switch[0])
        elif len(self.coordinators) > 1 and not self._welcomed:
            due.append(self._hello_sent_at + self._attempt_s)
        due.append(self._last_sent + self.options.heartbeat_interval if self.ever_welcomed else self._connect_deadline)
        if self._drain_deadline is not None:
            due.append(self._drain_deadline)
        if self._refit is not None:
            due.append(self._refit.deadline)
        if group_check_due is not None:
            due.append(group_check_due)
        if self._kv_events and self._kv_maybe_pending:
            due.append(self._kv_sent_at + KV_EVENT_FLUSH_S)
        if self.kv_sender is not None and (transfer_due := self.kv_sender.next_deadline()) is not None:
            due.append(transfer_due)
        return max(0.0, min(due) - now)

    def on_handshake_failure(self, problem: str, refused_key: bool) -> None:
        """A failed CURVE handshake (`problem`, from transport.handshake_failure): before the first Welcome, or a
        key the coordinator refused (`refused_key`) at any time, it ends the worker saying why; after it, one
        that may be a restarting coordinator is only logged."""
        if self.ever_welcomed and not refused_key:
            self._warn.warning("a reconnection to the coordinator failed in the handshake: %s", problem)
            return
        raise WorkerExit(EXIT_REFUSED, f"fatal: cannot register with the coordinator at {self.coordinator}: {problem}")

    def on_connection_lost(self, endpoint: str, now: float, connected: bool) -> None:
        """The shell's socket monitor: the connection to `endpoint` broke (`connected`: it was up; else a connect
        attempt failed). With several coordinators, one to the coordinator in use moves this worker to the next
        address SWITCH_BACKOFF_S later (a killed leader is noticed at once, not after --coordinator-timeout); a
        failed attempt does so only while the Hello there waits for its answer."""
        if len(self.coordinators) < 2 or endpoint != self.coordinator or self._switch is not None:
            return
        if not connected and self._welcomed:
            return
        target = self._next_address()
        log.warning(
            "%s the coordinator at %s; registering at %s",
            "lost the connection to" if connected else "cannot reach",
            self.coordinator,
            target,
        )
        self._switch = (now + SWITCH_BACKOFF_S, target)

    def take_reconnect(self) -> str | None:
        """The address the shell connects its socket to now, instead of the one before (before sending what
        take_outgoing returns: the Hello for that coordinator is among it); None: stay."""
        target, self._reconnect = self._reconnect, None
        return target

    def take_outgoing(self) -> list[Message]:
        out, self._outgoing = self._outgoing, []
        return out

    def take_spans(self) -> list[HopSpan]:
        """The traced requests' hops that ended since the last call (with --otlp-traces-endpoint)."""
        spans, self._spans = self._spans, []
        return spans

    def state_name(self) -> WorkerState:
        """The state this worker reports: its table state, or DRAINING for a running worker after SIGTERM."""
        return (
            WorkerState.DRAINING
            if self._drain_deadline is not None and self.state is WorkerState.RUNNING
            else self.state
        )

    # ---- out -----------------------------------------------------------------------------------

    def _send(self, msg: Message, now: float) -> None:
        self._outgoing.append(msg)
        self._last_sent = now

    def _heartbeat(self, now: float) -> None:
        self.last_load = self.engine.load()
        self._send(Heartbeat(sent_at=now + self.wall_offset, load=self.last_load), now)

    def _send_step_batch(self, outputs: list[Delta], now: float) -> None:
        silenced = 0
        if self._silenced:
            kept = [out for out in outputs if not self._silence(out)]
            silenced, outputs = len(outputs) - len(kept), kept
        deltas, self._outbox = self._outbox + [d for out in outputs if (d := self._delta(out, now)) is not None], []
        if self._kv_transferring:
            deltas = [d for d in deltas if not self._held_for_transfer(d)]
        self._kv_maybe_pending = self._kv_events
        load: Load | None = None
        if deltas or silenced:  # an abort freed blocks: the coordinator hears of it at once
            load = self.engine.load()
        elif outputs:
            # Only direct deltas: the coordinator still hears of this worker's load, at once when the step admitted or
            # ended a request (the counts admission and routing read; an end comes with its delta), else with the
            # next heartbeat. Not every step: each frame costs the coordinator a turn of its loop (~100 us here,
            # which at one frame per 50 ms step made 64 workers' direct streams cost 21 us of its CPU per delta
            # instead of 4.6: benchmarks/coordinator_scale.py, 2026-11-29).
            counts, sent = self.engine.load(), self.last_load
            if (counts.num_running, counts.num_waiting) != (sent.num_running, sent.num_waiting):
                load = counts
        if load is not None:
            self.last_load = load
            self._send(StepBatch(deltas=deltas, load=load, kv_events=self._take_kv_events(now, due=True)), now)
        else:
            self._flush_kv_events(now)

    def _take_kv_events(self, now: float, due: bool) -> KvEvents | None:
        """The prefix cache's next KvEvents when publishing and a frame goes anyway (`due`) or KV_EVENT_FLUSH_S
        passed since the last."""
        if not self._kv_events or not self._kv_maybe_pending or (not due and now - self._kv_sent_at < KV_EVENT_FLUSH_S):
            return None
        events = self.engine.take_kv_events()
        if events is None:
            self._kv_maybe_pending = False
        else:
            self._kv_sent_at = now
        return events

    def _flush_kv_events(self, now: float) -> None:
        """KvEvents no StepBatch carried, in one of their own (with the load) once KV_EVENT_FLUSH_S passed."""
        events = self._take_kv_events(now, due=False)
        if events is not None:
            self.last_load = self.engine.load()
            self._send(StepBatch(deltas=[], load=self.last_load, kv_events=events), now)

    def _on_kv_resync(self, msg: KvResync, now: float) -> None:
        """The coordinator lost track of this worker's prefix cache: start over from a snapshot."""
        if self._kv_events:
            log.info("the coordinator asked for a snapshot of the prefix cache: %s", safe(msg.reason))
            self._publish_kv_events(True)

    def _publish_kv_events(self, on: bool) -> None:
        self._kv_events = on
        self.engine.publish_kv_events(on)
        self._kv_maybe_pending = on

    def _silence(self, out: Delta) -> bool:
        left = self._silenced.get(out.request_id, 0) if out.finish_reason == FinishReason.ABORT else 0
        if not left:
            return False
        if left == 1:
            del self._silenced[out.request_id]
        else:
            self._silenced[out.request_id] = left - 1
        return True

    def _delta(self, out: Delta, now: float) -> Delta | None:
        """An engine output as it goes out: recorded in its request's journal (and its trace), the first of a text
        prompt echoing the prompt ids. A direct stream's goes to its reader (worker/service/streams.py); the coordinator
        gets only its end, without tokens or text (None: nothing for the coordinator)."""
        sent = self._requests.pop(out.request_id, None) if out.finished else self._requests.get(out.request_id)
        if sent is None:
            return out
        token_start, text_start = len(sent.journal.token_ids), sent.journal.text_len or 0
        sent.journal.record(out.token_ids, out.text)
        if sent.trace is not None:
            sent.trace.record(out, now)
            if out.finished:
                self._spans.append(sent.trace.span)
        if sent.echo_prompt:
            sent.echo_prompt = False
            out = msgspec.structs.replace(out, prompt_token_ids=sent.prompt_token_ids)
        if out.request_id not in self.streams:
            return out
        return self._direct(out, token_start, text_start, now)

    def _direct(self, out: Delta, token_start: int, text_start: int, now: float) -> Delta | None:
        if out.finish_reason == FinishReason.ABORT:  # given back (drain, group failure): its reader is moved
            if out.token_ids or out.text:
                last = msgspec.structs.replace(out, finished=False, finish_reason=None, error=None, error_code=None)
                self.streams.push(last, token_start, text_start, now)
            self.streams.remove(out.request_id)
        else:
            self.streams.push(out, token_start, text_start, now)
        if not out.finished:
            return None
        return msgspec.structs.replace(
            out,
            token_ids=TokenIds(),
            text="",
            logprobs=None,
            prompt_token_ids=None,
            num_output_tokens=token_start + len(out.token_ids),
        )

    # ---- registration ----------------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        """The model this worker serves to the cluster: --served-model-name, else its engine's model id."""
        return self.options.served_model_name or self.engine.model_id

    @property
    def tokenizer_source(self) -> str | None:
        """Where a front reads this worker's tokenizer (Hello.tokenizer): its model directory, absolute, when the
        id it serves under is not that model's path (--served-model-name); None otherwise (and for a model built
        in memory, which has no directory)."""
        path = getattr(self.engine, "model_path", None)
        if path is None or self.model_id == self.engine.model_id:
            return None
        source = str(Path(path).resolve())
        return source if len(source) <= MAX_MODEL_ID_LEN else None  # longer than any path the OS resolves

    # ---- several coordinators --------------------------------------------------------------------

    @property
    def _attempt_s(self) -> float:
        return min(ATTEMPT_S, self.options.coordinator_timeout)

    def _attempt_over(self, now: float) -> bool:
        """With several coordinators: the latest Hello went unanswered for ATTEMPT_S."""
        return len(self.coordinators) > 1 and not self._welcomed and now - self._hello_sent_at >= self._attempt_s

    def _next_address(self) -> str:
        """The address after the one in use, in the order given (the first, if a Redirect led outside the list)."""
        if self.coordinator not in self.coordinators:
            return self.coordinators[0]
        return self.coordinators[(self.coordinators.index(self.coordinator) + 1) % len(self.coordinators)]

    def _move(self, target: str, now: float) -> None:
        """Register at `target` now: the shell connects there, then sends the Hello (with the running requests)."""
        self._switch = None
        if target != self.coordinator:
            self.coordinator = self._reconnect = target
        self._send_hello(now)

    def _on_redirect(self, msg: Redirect, now: float) -> None:
        """The coordinator in use does not lead: register at the leader it names, else (none known yet) at the next
        address, SWITCH_BACKOFF_S from now. The requests running here go on meanwhile."""
        if self._switch is not None or (msg.leader is not None and msg.leader == self.coordinator):
            # the frames sent before the move are answered too: one move; and one naming the coordinator in use came
            # from the one before (a coordinator never names itself), late
            return
        target = msg.leader if msg.leader is not None else self._next_address()
        log.info(
            "the coordinator at %s does not lead (%s); registering at %s", self.coordinator, safe(msg.reason), target
        )
        self._welcomed = False
        self._switch = (now + SWITCH_BACKOFF_S, target)

    def _send_hello(self, now: float) -> None:
        engine = self.engine
        self._send(
            Hello(
                role="worker",
                peer_id=self.options.worker_id,
                model_id=self.model_id,
                dp_rank=self.options.dp_rank,
                group_id=self.options.group_id,
                rank_hint=self.rank,
                num_kv_blocks=engine.num_kv_blocks,
                block_size=engine.block_size,
                max_num_seqs=engine.config.max_num_seqs,
                max_model_len=engine.max_model_len,
                running=list(self._requests),
                max_waiting=self.options.max_waiting_requests,
                incarnation=self._incarnation,
                dispatches_seen=self._dispatches_seen,
                weight_version=engine.weight_version,
                lora_adapters=self._lora_adapters(),
                snapshots=[self._snapshot(rid, sent) for rid, sent in self._requests.items()],
                tokenizer=self.tokenizer_source,
                stream_address=self.stream_address,
                kv_role=self.options.kv.kv_role,
                kv_address=self.kv_address,
            ),
            now,
        )
        self._welcomed = False
        self._hello_sent_at = now

    def _on_welcome(self, msg: Welcome, now: float) -> None:
        if self._welcomed:
            return
        if msg.term < self.term:  # a deposed leader that has not noticed yet: its successor has the requests
            if self._switch is None:
                log.warning(
                    "the coordinator at %s welcomed this worker in term %d, below term %d it followed; registering "
                    "at %s",
                    self.coordinator,
                    msg.term,
                    self.term,
                    self._next_address(),
                )
                self._switch = (now + SWITCH_BACKOFF_S, self._next_address())
            return
        self._welcomed = True
        self.term = msg.term
        self._publish_kv_events(msg.kv_events)  # a coordinator new to us (or that forgot us) starts from a snapshot
        if msg.instance != self._instance:  # a coordinator process new to us counts its Dispatches from 0
            self._instance, self._dispatches_seen = msg.instance, 0
        if msg.dp_rank is not None:
            if self.rank is not None and msg.dp_rank != self.rank:
                log.warning("the coordinator moved this worker from dp_rank %d to %d", self.rank, msg.dp_rank)
            self.rank, self.group_id = msg.dp_rank, msg.group_id or self.group_id
        if self.ever_welcomed:
            log.info(
                "re-registered with coordinator %s at %s, term %d (%d requests running)",
                safe(msg.coordinator_id),
                self.coordinator,
                msg.term,
                len(self._requests),
            )
            return
        self.ever_welcomed = True
        opts = self.options
        log.info(
            "worker ready: rank %s group %s id %s coordinator %s (%s, state %s) model %s, %d KV blocks of %d tokens",
            self.rank,
            safe(self.group_id),
            opts.worker_id,
            self.coordinator,
            safe(msg.coordinator_id),
            safe(msg.state),
            self.model_id,
            self.engine.num_kv_blocks,
            self.engine.block_size,
        )

    def _on_refused(self, msg: Refused, now: float) -> None:
        raise WorkerExit(EXIT_REFUSED, f"the coordinator refused this worker: {msg.reason}")

    def _on_error(self, msg: Error, now: float) -> None:
        self._warn.warning(
            "coordinator reports an error%s: %s",
            f" for request {safe(msg.request_id)}" if msg.request_id else "",
            safe(msg.message),
        )
        # Many frames may cross a coordinator restart: one Hello per heartbeat interval answers them all.
        recent_hello = not self._welcomed and now - self._hello_sent_at < self.options.heartbeat_interval
        if msg.message.startswith("unknown worker") and not recent_hello:
            self._send_hello(now)

    def _on_heartbeat(self, msg: Heartbeat, now: float) -> None:
        if self._welcomed and msg.instance is not None and self._instance not in (None, msg.instance):
            log.warning(
                "the coordinator restarted (instance %s -> %s); registering again with %d request(s)",
                safe(self._instance),
                safe(msg.instance),
                len(self._requests),
            )
            self._send_hello(now)

    # ---- requests ------------------------------------------------------------------------------

    def _on_dispatch(self, msg: Dispatch, now: float) -> None:
        self._dispatches_seen += 1
        self.check_signals(now)  # a signal that came while this frame was queued wins
        if self._drain_deadline is not None:
            return self._reject(msg.request_id, "worker is draining", "draining")
        if msg.request_id in self._requests:
            return self._reject(
                msg.request_id, f"request id {msg.request_id!r} is already running on this worker", "internal"
            )
        limit = self.engine.config.max_num_seqs + self.options.max_waiting_requests
        if len(self._requests) >= limit:
            return self._reject(
                msg.request_id,
                f"worker {self.options.worker_id} is full: "
                f"{len(self._requests)} requests (max_num_seqs + --max-waiting-requests = {limit})",
                "overloaded",
            )
        spec = msg.spec
        try:
            with self.busy():  # a huge prompt's tokenization: heartbeats go on meanwhile
                request = self.engine.add_request(
                    msg.request_id,
                    resumed_token_ids=msg.resumed_token_ids,
                    resumed_text_len=msg.resumed_text_len,
                    client=msg.client,
                    **spec.engine_args(),
                )
        except ValueError as e:
            return self._reject(msg.request_id, str(e), "invalid_request")
        sent = self._requests[msg.request_id] = _Sent(
            TokenIds(request.input_token_ids),  # an encoder-decoder model's: its encoder input, as given
            msg.resumed_token_ids,
            request.params.seed,
            # images: their tokens expanded here; audio: the decoder's ids, its start token put in front here
            echo_prompt=spec.prompt is not None or bool(spec.images) or bool(spec.audio),
        )
        if self.options.otlp_traces_endpoint is not None:
            sent.trace = WorkerTrace.start(msg, len(request.prompt_token_ids), now)
        if self.kv_sender is not None and msg.kv_consumer_address is not None and msg.kv_consumer_key is not None:
            self._kv_targets[msg.request_id] = (msg.kv_consumer_address, msg.kv_consumer_key)
        if msg.stream_token is not None and msg.stream_owner is not None and self.stream_address is not None:
            stream = DirectStream(
                msg.stream_owner, msg.stream_token, len(msg.resumed_token_ids or ()), msg.resumed_text_len or 0
            )
            self.streams.open(msg.request_id, stream, now)

    def _snapshot(self, request_id: str, sent: _Sent) -> RequestSnapshot:
        """A running request as it stands, for a (new) coordinator; a direct stream's with its owner and token."""
        snapshot = sent.snapshot(request_id)
        stream = self.streams.streams.get(request_id)
        if stream is None:
            return snapshot
        return msgspec.structs.replace(snapshot, stream_owner=stream.owner, stream_token=stream.token)

    def _reject(self, request_id: str, reason: str, code: str) -> None:
        """A final error delta; it echoes no prompt ids (a text prompt refused here was not tokenized)."""
        self._warn.warning("request %s rejected: %s", safe(request_id), safe(reason))
        self._outbox.append(Delta.final(request_id, "error", reason, code))

    def _on_abort(self, msg: Abort, now: float) -> None:
        """The coordinator forgot these requests before it asked: free their KV blocks now and send no final
        delta (so the same id may be dispatched here again at once). Unknown or finished ids: nothing to do."""
        for request_id in msg.request_ids:
            self.streams.remove(request_id)
            self._kv_targets.pop(request_id, None)
            self._kv_handed.pop(request_id, None)
            if self.kv_sender is not None:
                self.kv_sender.cancel(request_id)
            sent = self._requests.pop(request_id, None)
            if sent is None:
                continue
            if sent.trace is not None:
                self._spans.append(sent.trace.end("abort (by the coordinator)", now))
            if self.engine.abort(request_id):
                self._silenced[request_id] = self._silenced.get(request_id, 0) + 1

    def _abort_all(self, now: float) -> None:
        """Give every request back. Text held back stays out of the final deltas: whoever resumes a request
        from its delivered tokens produces it (a stop string may yet cut it)."""
        for request_id in list(self._requests):
            self.engine.abort(request_id, release_text=False)
        self._send_step_batch(self.engine.take_pending(), now)

    # ---- lifecycle (worker/service/lifecycle.py) ---------------------------------------------------------

    def _on_control(self, msg: Control, now: float) -> None:
        step = transition(self.state, msg.command)
        released = restored = 0
        try:
            if Action.SUSPEND_ENGINE in step.actions:
                released = self.engine.suspend()
            if Action.RESUME_ENGINE in step.actions:
                restored = self.engine.resume()
        except Exception as e:  # the engine could not release or restore: say so, keep the old state
            log.exception("%s failed", msg.command)
            return self._send(
                ControlAck(command=msg.command, state=self.state_name(), error=f"{type(e).__name__}: {e}"), now
            )
        if Action.ABORT_ALL in step.actions:
            self._abort_all(now)
        self.state = step.state
        if Action.EXIT in step.actions:
            self._send(ControlAck(command=msg.command, state=step.state), now)
            raise WorkerExit(EXIT_OK, "stopped by the coordinator", leave_group="stopped by the coordinator")
        log.info(
            "%s: now %s%s",
            msg.command,
            self.state.value,
            f" ({released} bytes released)" if released else f" ({restored} bytes restored)" if restored else "",
        )
        self._heartbeat(now)  # the new state, before the ack
        self._send(
            ControlAck(command=msg.command, state=self.state_name(), bytes_released=released, bytes_restored=restored),
            now,
        )

    # ---- LoRA adapters -------------------------------------------------------------------------

    def _on_lora_command(self, msg: LoraCommand, now: float) -> None:
        """Load or unload an adapter now (worker/engine/lora.py: requests holding an unloaded one finish with it); the
        answer carries this worker's adapters after it, or the error (nothing changed)."""
        error = None
        try:
            with self.busy():  # reading an adapter's files: heartbeats go on meanwhile
                if msg.action == "load":
                    self.engine.add_lora(msg.lora_name, str(msg.lora_path))
                elif not self.engine.remove_lora(msg.lora_name):
                    error = f"no LoRA adapter {msg.lora_name!r} is loaded"
        except Exception as e:  # noqa: BLE001 - a bad folder, LoRA not enabled: the worker keeps serving
            error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        if error is not None:
            log.warning("%s of LoRA adapter %r refused: %s", msg.action, msg.lora_name, error)
        self._send(
            LoraDone(action=msg.action, lora_name=msg.lora_name, error=error, lora_adapters=self._lora_adapters()), now
        )

    def _lora_adapters(self) -> dict[str, str]:
        return {str(a["name"]): str(a["path"]) for a in self.engine.list_loras()}

    # ---- weight refit --------------------------------------------------------------------------

    def _on_update_weights(self, msg: UpdateWeights, now: float) -> None:
        """A refit's first phase: receive (from a trainer) or read, check and stage the new weights now; once
        no request is left (the coordinator aborted them first, or holds new ones while these drain) answer
        WeightsUpdated(prepared) and wait for CommitWeights. Nothing changes in this phase."""
        if self._refit is not None:
            return self._send(
                WeightsUpdated(version=msg.version or 0, error="a weight update is already pending on this worker"), now
            )
        try:
            with self.busy():  # a broadcast of many tensors: heartbeats go on meanwhile
                update = self.engine.prepare_update(msg)
        except Exception as e:  # noqa: BLE001 - a bad tensor, a failed transfer: the old weights keep serving
            log.error("weight update to version %s refused: %s", msg.version, e)
            return self._send(WeightsUpdated(version=msg.version or 0, error=f"{type(e).__name__}: {e}"), now)
        self._refit = _PendingRefit(msg, update, now + msg.timeout_s)
        self._apply_refit(now)

    def _apply_refit(self, now: float) -> None:
        """Answer `prepared` once the drain is over (the files checked unchanged); drop a refit whose drain or
        commit did not come in time."""
        refit = self._refit
        if refit is None:
            return
        if now >= refit.deadline:
            self._refit = None
            if refit.prepared:
                log.warning("weight update to version %s: no commit came in time; dropped", refit.msg.version)
                return None
            return self._send(
                WeightsUpdated(
                    version=refit.msg.version or 0,
                    error=(
                        f"{len(self._requests)} request(s) did not finish within {refit.msg.timeout_s:g} s; the old "
                        f"weights keep serving"
                    ),
                ),
                now,
            )
        if refit.prepared or self.engine.has_unfinished():
            return None
        try:
            self.engine.check_prepared(refit.update)
        except Exception as e:  # noqa: BLE001 - the files changed during the drain: nothing applied
            self._refit = None
            log.error("weight update to version %s refused: %s", refit.msg.version, e)
            return self._send(WeightsUpdated(version=refit.msg.version or 0, error=f"{type(e).__name__}: {e}"), now)
        refit.prepared = True
        self._send(
            WeightsUpdated(
                version=refit.msg.version or 0, prepared=True, num_tensors=len(getattr(refit.update, "specs", ()))
            ),
            now,
        )

    def _on_commit_weights(self, msg: CommitWeights, now: float) -> None:
        """A refit's second phase: apply the prepared weights (the engine puts the old ones back if that fails)
        and answer WeightsUpdated, or drop them (`commit` false: no answer)."""
        refit = self._refit
        if refit is None or not refit.prepared or refit.msg.version != msg.version:
            if msg.commit:
                self._send(
                    WeightsUpdated(
                        version=msg.version, error=f"no prepared weight update of version {msg.version} on this worker"
                    ),
                    now,
                )
            return None
        self._refit = None
        if not msg.commit:
            log.info("weight update to version %d dropped: another worker could not prepare it", msg.version)
            return None
        try:
            with self.busy():
                version = self.engine.update_weights(refit.update, msg.version)
        except Exception as e:  # noqa: BLE001 - the engine restored the old values
            log.exception("applying the weight update failed")
            return self._send(WeightsUpdated(version=msg.version, error=f"{type(e).__name__}: {e}"), now)
        self._heartbeat(now)
        self._send(WeightsUpdated(version=version, num_tensors=len(getattr(refit.update, "specs", ()))), now)

    # ---- frames --------------------------------------------------------------------------------

    def _bad_frame(self, problem: str | ProtocolError, frame: bytes, now: float) -> None:
        """Answer an undecodable frame: an error delta when it is a Dispatch whose id can be read (so that
        request fails alone), else an Error naming the problem (and the request id when readable)."""
        self._warn.warning("bad frame from the coordinator (%d bytes): %s", len(frame), safe(problem))
        kind = problem.message_type if isinstance(problem, ProtocolError) else None
        problem, request_id = str(problem), peek_request_id(frame)
        if kind == Dispatch.TYPE and request_id is not None:
            self._reject(request_id, f"bad dispatch: {problem}", "invalid_request")
        else:
            self._send(Error(message=problem, request_id=request_id), now)

    _HANDLERS: ClassVar[dict[type[Message], Callable[[WorkerCore, Any, float], None]]] = {
        Welcome: _on_welcome,
        KvResync: _on_kv_resync,
        Refused: _on_refused,
        Redirect: _on_redirect,
        Error: _on_error,
        Dispatch: _on_dispatch,
        Abort: _on_abort,
        MoveTargets: _on_move_targets,
        DrainWorker: _on_drain_worker,
        Control: _on_control,
        Heartbeat: _on_heartbeat,
        UpdateWeights: _on_update_weights,
        CommitWeights: _on_commit_weights,
        LoraCommand: _on_lora_command,
    }


class _Sent:
    """A request dispatched here: what its snapshot needs beside the stream journal of what its deltas carried
    (tokens resumed from a failover come first; their text is the client's already), and whether its next
    delta echoes the prompt ids."""

    __slots__ = ("prompt_token_ids", "seed", "journal", "echo_prompt", "trace")

    def __init__(
        self,
        prompt_token_ids: TokenIds,
        resumed_token_ids: Sequence[int],
        seed: int | None = None,
        echo_prompt: bool = False,
    ) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.seed = seed
        self.journal = StreamJournal(resumed_token_ids)
        # The next delta echoes the prompt ids: the first one, when the prompt was text (the client of a token-id
        # prompt has them; the coordinator keeps a text prompt's ids, for a re-dispatch)
        self.echo_prompt = echo_prompt
        self.trace: WorkerTrace | None = None

    def snapshot(self, request_id: str) -> RequestSnapshot:
        return self.journal.snapshot(request_id, self.prompt_token_ids, self.seed)


class WorkerTrace:
    """The worker's hop of a traced request (protocol/tracing.py): from its Dispatch to its final delta, with its
    queue time (reported by the engine with the first output), prefill (scheduled -> first token) and decode
    (first token -> end) times and its token counts, under vLLM's attribute names."""

    __slots__ = ("span", "first_token_at", "num_tokens")

    def __init__(self, span: HopSpan) -> None:
        self.span = span
        self.first_token_at: float | None = None
        self.num_tokens = 0

    @classmethod
    def start(cls, msg: Dispatch, num_prompt_tokens: int, now: float) -> WorkerTrace:
        attributes: dict[str, Attribute] = {
            "gen_ai.request.id": msg.request_id,
            "gen_ai.usage.prompt_tokens": num_prompt_tokens,
            "infer.resumed_tokens": len(msg.resumed_token_ids),
        }
        span = HopSpan.child_of("worker", msg.traceparent, now, **attributes)
        max_tokens = msg.spec.sampling.max_tokens
        if max_tokens is not None:
            span.attributes["gen_ai.request.max_tokens"] = max_tokens
        return cls(span)

    def record(self, out: Delta, now: float) -> None:
        span = self.span
        if out.queue_time_s is not None:
            span.attributes["gen_ai.latency.time_in_queue"] = out.queue_time_s
            span.event("scheduled", span.start + out.queue_time_s)
        self.num_tokens += len(out.token_ids)
        if out.token_ids and self.first_token_at is None:
            self.first_token_at = now
            span.event("first token", now)
        if out.finished:
            self.end(str(out.finish_reason), now)

    def end(self, finish_reason: str, now: float) -> HopSpan:
        """The span ended at `now`; the latencies that need a first token only when one came."""
        attributes: dict[str, Attribute] = {
            "gen_ai.response.finish_reasons": finish_reason,
            "gen_ai.usage.completion_tokens": self.num_tokens,
            "gen_ai.latency.e2e": now - self.span.start,
        }
        span = self.span.finish(now, **attributes)
        first = self.first_token_at
        if first is not None:
            scheduled = span.start + float(span.attributes.get("gen_ai.latency.time_in_queue", 0.0))
            span.attributes.update(
                {
                    "gen_ai.latency.time_to_first_token": first - span.start,
                    "gen_ai.latency.time_in_model_prefill": max(0.0, first - scheduled),
                    "gen_ai.latency.time_in_model_decode": now - first,
                }
            )
        return span
