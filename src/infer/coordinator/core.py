"""The coordinator's logic: one handler per message type, routing, failover, lifecycle, stats. No sockets.

The daemon (daemon.py) feeds it frames (`handle`), timer ticks (`tick`) and peers found unroutable
(`peer_gone`), and sends what it queued (`take_outgoing`). Time is passed in, so tests drive it directly.

`Coordinator` here builds the jobs and wires them, and keeps the handler table, the handshake (Hello,
registration), Submit / Abort, the drain before STOP and the key roles. What the jobs share is passed to each
explicitly: the books (books.py: the request / worker / client tables with place, detach, finish, fail), `send`
(outbox.py), the cluster status (state.py) and the config. Each job is a module of its own and knows only the jobs
below it (no cycles; tests/coordinator/test_job_graph.py checks it):

    admission     refusal, holding, routing, dispatch, failover, the deadline heap       calls no job
    reattachment  restart re-attachment, the orphan table                                -> admission
    relay         worker output to clients                                               -> admission, orphans
    loras         LoRA adapter load / unload on every worker, the cluster's adapters     calls no job
    statistics    snapshots, StatsRequests                                               -> admission, loras
    commands      lifecycle and weight updates, with their barriers                      -> admission, statistics
    liveness      heartbeats, dead workers, lost clients                                 -> admission, relay

A worker's death reaches commands and the orphan table, a lost client statistics, through callbacks wired here.

A request's path: Submit -> held (paused, or no healthy worker) or routed -> Dispatch to a worker ->
the worker's StepBatch deltas are relayed to the client (gathered per client into one DeltaBatch per
cycle) and recorded in its journal (the tokens and the length of their text) -> the finished delta removes
it. If its worker dies, hangs, or aborts it on its own (a draining worker), the request is held again at the
front of the queue and re-dispatched as prompt + delivered tokens with the remaining budget, so the client's
stream goes on without a gap or a repeat. Deltas from a worker that does not own the request are dropped and
the request aborted there.

Poison quarantine: a request that may kill its worker must not walk through the fleet. Every request
running on a worker when it dies (connection gone, or silent past the timeout) records that death and is a
suspect: it is re-dispatched to one worker, preferably one running no other suspect. A second worker dying
while running it fails it with code "internal" (quarantined). Requests on a dying worker alongside it fail
over as usual: one death proves nothing. Group mates aborted because a member died, drains and full queues
are not deaths.

Exactly once: every sampled request gets a seed on Submit when it has none (reported to the client with the
first delta), and a re-dispatch carries it with the delivered tokens and how much of their text the client
has, so the new worker continues the same random stream and the same text (its detokenizer and stop-string
state rebuilt from those tokens): tokens and text equal a run without the fault, greedy, seeded or not.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable
from typing import Any

from msgspec.structs import replace

from infer.coordinator.access import WORKER_ROLES, AccessControl, Denial
from infer.coordinator.admission import Admission
from infer.coordinator.books import Books
from infer.coordinator.commands import Commands
from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.election import PEER_MESSAGES, Election
from infer.coordinator.lifecycle import ClusterState, commands_to_reach
from infer.coordinator.liveness import Liveness
from infer.coordinator.loras import Loras
from infer.coordinator.models import Models, Refusal
from infer.coordinator.orphans import OrphanTable
from infer.coordinator.outbox import Outbox
from infer.coordinator.reattachment import Reattachment
from infer.coordinator.relay import Relay
from infer.coordinator.state import ClientRecord, ClusterStatus, RequestTable, WorkerRecord, WorkerTable
from infer.coordinator.statistics import Statistics
from infer.protocol.codes import Command, ErrorCode
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    ClusterStats,
    Control,
    ControlAck,
    Counters,
    Delta,
    DrainMoves,
    DrainWorker,
    Error,
    Heartbeat,
    Hello,
    LoraCommand,
    LoraDone,
    Message,
    ProtocolError,
    RankHold,
    Redirect,
    Refused,
    Replica,
    StatsRequest,
    StepBatch,
    Submit,
    UpdateWeights,
    WeightsUpdated,
    Welcome,
    decode,
    peek_request_id,
)
from infer.protocol.roles import CLIENT_ROLES, KeyRoles, Role
from infer.protocol.tracing import HopSpan

log = logging.getLogger("infer.coordinator")


class Coordinator:
    """The front: builds the jobs on the shared books and wires them (see the module doc); `handle`, `tick`,
    `peer_gone`, `take_outgoing`; the handshake, Submit / Abort, the drain and the key roles."""

    def __init__(
        self,
        config: CoordinatorConfig,
        now: float,
        keys: KeyRoles | None = None,
        wall_offset: float = 0.0,
        election: Election | None = None,
        peer_key: bytes | None = None,
    ) -> None:
        """`keys`: the roles of the authenticated keys (CurveZMQ); None: no keys, every peer trusted.
        `wall_offset`: added to `now` gives the wall-clock time heartbeats carry. `election`: one of several
        coordinators (coordinator/election.py): it serves only while it leads, from the election's newest
        Replica; `peer_key`: with keys, the key the other coordinators authenticate with (this one's own)."""
        self.config = config
        self.election = election
        self.access = AccessControl(keys, peer_key)
        self.status = ClusterStatus(model_id=config.model_ids[0] if config.model_ids else None)
        self.workers = WorkerTable()
        self.models = Models(self.workers, config.model_ids)
        self.clients: dict[bytes, ClientRecord] = {}
        self.requests = RequestTable()
        self.instance = uuid.uuid4().hex[:16]  # this process; peers notice a restart when it changes
        self._frame_key = ""  # the authenticated key of the frame being handled ("" without keys)
        self.counters = Counters()
        self.wall_offset = wall_offset
        self.outbox = Outbox()
        self.books = Books(self.requests, self.workers, self.clients, self.counters, self.outbox)
        self.started = now
        self._next_tick = now
        self.peer_warnings = RateLimitedLog(log)  # warnings a peer can trigger at will
        # the jobs, each after the ones it calls
        send = self.outbox.send
        self.admission = Admission(self.books, send, self.status, self.models, config)
        self.reattachment = Reattachment(self.books, self.outbox, self.admission, config, now)
        self.relay = Relay(self.books, self.outbox, self.admission, self.reattachment.orphans, self.peer_warnings)
        self.loras = Loras(self.books, send, self.status, self.models)
        self.statistics = Statistics(self.books, send, self.status, self.admission, self.loras, config, now)
        self.commands = Commands(self.books, send, self.status, self.admission, self.statistics, config)
        self.liveness = Liveness(
            self.books,
            send,
            self.admission,
            self.relay,
            config,
            self._heartbeat,
            self.peer_warnings,
            on_worker_dead=self._worker_died,
            on_client_gone=self.statistics.forget_waiter,
        )
        self._handlers: dict[type[Message], Callable[[bytes, Any, float], None]] = {
            Hello: self._on_hello,
            Submit: self._on_submit,
            Abort: self._on_abort,
            StepBatch: self.relay.on_step_batch,
            DrainMoves: self.relay.on_drain_moves,
            DrainWorker: self.relay.on_drain_worker,
            Error: self.relay.on_error,
            Heartbeat: self.liveness.on_heartbeat,
            Control: self.commands.on_control,
            ControlAck: self.commands.on_control_ack,
            UpdateWeights: self.commands.on_update_weights,
            WeightsUpdated: self.commands.on_weights_updated,
            StatsRequest: self.statistics.on_stats_request,
            LoraCommand: self.loras.on_command,
            LoraDone: self.loras.on_done,
        }
        for peer_message in PEER_MESSAGES:
            self._handlers[peer_message] = self._on_peer
        if election is not None and election.replica is not None:
            self._restore(election.replica, now)

    @property
    def orphans(self) -> OrphanTable:
        return self.reattachment.orphans

    @property
    def state(self) -> ClusterState:
        return self.status.state

    def stats(self, now: float) -> ClusterStats:
        return self.statistics.snapshot(now)

    # ---- inputs ---------------------------------------------------------------------------------

    def handle(self, identity: bytes, payload: list[bytes], now: float, key: bytes | None = None) -> None:
        """One multipart message from the ROUTER (identity stripped), authenticated as `key` (the public key
        of its CURVE connection; None without keys). Never raises: whatever a peer sends costs at most its own
        frame (answered with an Error, or dropped with a rate-limited log line)."""
        try:
            self._handle(identity, payload, now, key)
        except Exception as e:  # noqa: BLE001 - a bug a peer's frame found: it costs that frame, never the loop
            self.peer_warnings.exception("internal error on a frame from %s; frame dropped", safe(identity))
            self.send(identity, Error(message=f"internal error on this frame: {type(e).__name__}"))

    def _handle(self, identity: bytes, payload: list[bytes], now: float, key: bytes | None) -> None:
        if len(payload) != 1:
            self.books.reject(identity, f"expected exactly one frame after the routing identity, got {len(payload)}")
            return
        try:
            msg = decode(payload[0])
        except ProtocolError as e:
            request_id = peek_request_id(payload[0]) if e.message_type == Submit.TYPE else None
            self.books.reject(identity, f"bad frame: {e}", refuse=e.message_type == "hello", request_id=request_id)
            return
        except Exception as e:  # noqa: BLE001 - decode raises ProtocolError only; anything else is a bug
            self.peer_warnings.exception("decoding a frame from %s failed", safe(identity))
            self.books.reject(identity, f"bad frame: it could not be read ({type(e).__name__})")
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.books.reject(identity, f"the coordinator does not accept {msg.TYPE!r} messages")
            return
        self._frame_key = key.decode() if key is not None else ""  # the sender's key, for the handler
        denial = self.access.check(identity, key, msg)
        if denial is not None:
            self._deny(identity, msg, denial, now)
            return
        if self.election is not None and not isinstance(msg, PEER_MESSAGES) and not self.election.leading(now):
            self._redirect(identity, now)
            return
        if identity in self.liveness.lost and self.liveness.remind_lost(identity, msg, now):
            return
        try:
            handler(identity, msg, now)
        except Exception as e:  # a bug must cost one message, never the loop
            self.peer_warnings.exception("internal error handling %r from %s", msg.TYPE, safe(identity))
            self.send(identity, Error(message=f"internal error handling {msg.TYPE!r}: {type(e).__name__}: {e}"))
        self._check_drain(now)  # the last request of a drain may just have finished

    def tick(self, now: float) -> None:
        """Timers: request deadlines; every heartbeat interval: heartbeats to workers, worker / client / queue
        timeouts, stats waiters, the drain."""
        self.admission.expire_deadlines(now)
        self.commands.check_barrier(now)
        self.loras.check(now)
        if now < self._next_tick:
            return
        self._next_tick = now + self.config.heartbeat_interval
        self._check_keys(now)
        self.workers.expire_reservations(now)
        self.liveness.check_workers(now)
        self.liveness.check_clients(now)
        self.reattachment.check_reattaching(now)
        self.admission.check_held(now)
        self.statistics.answer_stats_waiters(now)
        self.statistics.log_rejections()
        self._check_drain(now)

    def peer_gone(self, identity: bytes, now: float) -> None:
        """A send to `identity` was unroutable: its connection is gone (the process died or closed)."""
        worker = self.workers.by_identity.get(identity)
        if worker is not None and worker.healthy:
            self.liveness.mark_dead(worker, "its connection is gone", now)
            return
        client = self.clients.get(identity)
        if client is not None:
            self.liveness.client_lost(client, "its connection is gone", now)

    def peer_too_slow(self, identity: bytes, now: float) -> None:
        """A send to `identity` found its queue at the high-water mark: the peer does not read what it is sent.
        A client has its requests aborted (error code "client_too_slow", told when it reads again); a worker
        is declared dead (its requests move)."""
        worker = self.workers.by_identity.get(identity)
        if worker is not None:
            if worker.healthy:
                self.liveness.mark_dead(worker, "it reads nothing: its send queue is full (high-water mark)", now)
            return
        client = self.clients.get(identity)
        if client is not None:
            self.liveness.client_lost(
                client,
                "it does not read what it is sent: its send queue is full (high-water mark)",
                now,
                code=ErrorCode.CLIENT_TOO_SLOW,
            )

    def shutdown(self, reason: str, now: float) -> None:
        """STOP without a requesting client (a signal)."""
        if self.state is not ClusterState.STOPPED:
            self.commands.apply_command(Command.STOP, reason, now)

    def on_signal(self, reason: str, now: float) -> None:
        """SIGTERM / SIGINT: drain for at most config.drain_timeout (new requests refused, accepted ones run
        on), then STOP; STOP at once without a drain timeout, or on a second signal."""
        if self.status.drain is not None or self.config.drain_timeout <= 0:
            return self.shutdown(reason, now)
        self.status.drain = (reason, now + self.config.drain_timeout)
        log.info(
            "%s: draining %d request(s) for at most %g s (new requests are refused), then STOP",
            reason,
            len(self.requests.by_id),
            self.config.drain_timeout,
        )
        self._check_drain(now)

    def _check_drain(self, now: float) -> None:
        if self.status.drain is not None and self.state is not ClusterState.STOPPED:
            reason, deadline = self.status.drain
            if not self.requests.by_id or now >= deadline:
                self.shutdown(f"{reason} ({'drain timeout' if self.requests.by_id else 'drained'})", now)

    def next_deadline(self) -> float:
        drain_deadline = self.status.drain[1] if self.status.drain is not None else math.inf
        request_deadline = self.admission.deadlines.next_deadline()
        barrier_deadline = self.commands.barrier.deadline if self.commands.barrier is not None else math.inf
        return min(self._next_tick, self.commands.stop_deadline, drain_deadline, request_deadline, barrier_deadline)

    def done(self, now: float) -> bool:
        """STOP ran and every worker acknowledged it, or the stop timeout passed: the daemon may exit."""
        return self.commands.done(now)

    def take_outgoing(self) -> list[tuple[bytes, Message]]:
        """Everything queued since the last call: each client's deltas as one DeltaBatch, then the rest
        in the order it was queued."""
        return self.outbox.take()

    def take_spans(self, now: float) -> list[HopSpan]:
        """The traced requests' hops that ended since the last call (with --otlp-traces-endpoint), ended at `now`."""
        return self.outbox.take_spans(now)

    def send(self, identity: bytes, msg: Message) -> None:
        self.outbox.send(identity, msg)

    def _deny(self, identity: bytes, msg: Message, denial: Denial, now: float) -> None:
        """A frame its key may not send: Refused for a Hello, Error otherwise; a cut-off peer loses all."""
        self.counters.frames_rejected += 1
        if denial.silent:
            return
        self.access.log_denial(identity, msg, denial, now)
        if denial.cut_off:
            self._cut_off(identity, denial.reason, now)
        elif isinstance(msg, Hello):
            self.send(identity, Refused(reason=denial.reason))
        elif isinstance(msg, Submit):
            self.send(
                identity,
                Error(
                    message=f"request {msg.request_id!r} not accepted: {denial.reason}",
                    request_id=msg.request_id,
                    code=ErrorCode.INVALID_REQUEST,
                ),
            )
        else:
            self.send(identity, Error(message=denial.reason))

    def _cut_off(self, identity: bytes, reason: str, now: float) -> None:
        """The peer behind `identity` may do nothing more (its key was revoked, or its routing id now
        belongs to another key): its requests are aborted (a worker's move elsewhere), nothing queued for
        it leaves, it gets one Refused, and its later frames are dropped unanswered."""
        self.access.cut_off(identity)
        worker = self.workers.by_identity.get(identity)
        if worker is not None and worker.healthy:
            self.liveness.mark_dead(worker, f"cut off: {reason}", now)
        client = self.clients.get(identity)
        if client is not None:
            self.liveness.client_lost(client, f"cut off: {reason}", now)
        self.statistics.forget_waiter(identity)
        self.outbox.drop(identity)
        self.send(identity, Refused(reason=f"the coordinator cut this connection off: {reason}"))

    def _heartbeat(self, now: float) -> Heartbeat:
        return Heartbeat(sent_at=now + self.wall_offset, instance=self.instance)

    def _worker_died(self, worker: WorkerRecord) -> None:
        """Liveness declared `worker` dead (admission already took it out of routing): STOP waits for it no
        more; its orphans go (their clients resume them from their own copy)."""
        self.commands.worker_died(worker)
        self.reattachment.orphans.drop_worker(worker.worker_id)

    def _check_keys(self, now: float) -> None:
        """After the authorized keys changed: cut off the peers whose key lost the role they act in."""
        for identity, reason in self.access.lost_roles(self._acting_as):
            log.warning("peer %s: %s; cutting it off", identity.hex()[:16], reason)
            self._cut_off(identity, reason, now)
        self.access.prune(lambda i: i in self.clients or i in self.workers.by_identity)

    def _acting_as(self, identity: bytes) -> frozenset[Role] | None:
        """The roles `identity` needs for what it is to this coordinator: a worker, a client, or nothing yet."""
        if identity in self.workers.by_identity:
            return WORKER_ROLES
        return CLIENT_ROLES if identity in self.clients else None

    def _on_hello(self, identity: bytes, hello: Hello, now: float) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            self._refuse(
                identity,
                hello,
                f"protocol version differs: the coordinator speaks {PROTOCOL_VERSION}, "
                f"{hello.role} {hello.peer_id!r} speaks {hello.protocol_version}",
            )
            return
        if self.state is ClusterState.STOPPED:
            self._refuse(identity, hello, "the coordinator is stopping")
            return
        if hello.role == "client":
            client = self.books.client(identity, now)
            if client is not None:
                client.peer_id = hello.peer_id
                client.streams, client.key = hello.streams, self._frame_key
                self.send(identity, self._welcome())
            return
        problem = self._admission_problem(hello)
        if problem is not None:
            self._refuse(identity, hello, problem)
            return
        self._register_worker(identity, hello, now)

    def _refuse(self, identity: bytes, hello: Hello, reason: str) -> None:
        self.peer_warnings.warning("refused %s %s: %s", hello.role, safe(hello.peer_id), safe(reason, 600))
        self.send(identity, Refused(reason=reason))

    def _welcome(self) -> Welcome:
        return Welcome(
            coordinator_id=self.config.coordinator_id,
            state=self.state,
            model_id=self.status.model_id,
            instance=self.instance,
            term=0 if self.election is None else self.election.term,
        )

    # ---- several coordinators (coordinator/election.py) ------------------------------------------

    def _on_peer(self, identity: bytes, msg: Message, now: float) -> None:
        if self.election is not None:
            self.election.on_message(msg, now)

    def _redirect(self, identity: bytes, now: float) -> None:
        """A frame this coordinator may not serve (it does not lead): where to go instead (the leader it trusts
        now; none while it trusts none, so that no one is sent to a leader that died a moment ago)."""
        election = self.election
        assert election is not None
        leader = election.trusted_leader(now)
        self.send(
            identity,
            Redirect(
                reason=f"coordinator {self.config.index} of {election.count} does not lead the cluster"
                + (f"; coordinator {leader} does" if leader is not None else "; no leader yet: try the next"),
                leader=None if leader is None else self.config.peer_addresses[leader],
            ),
        )

    def replica(self) -> Replica:
        """What a successor needs that no worker can tell it (coordinator/election.py); the version is the
        election's."""
        ranks = [
            RankHold(worker_id=w.worker_id, model_id=w.model_id, dp_rank=w.dp_rank, group_id=w.group_id)
            for w in self.workers
            if w.healthy
        ]
        held = {(r.worker_id, r.model_id) for r in ranks}
        ranks += [r for r in self.workers.reserved.values() if (r.worker_id, r.model_id) not in held]
        return Replica(
            version=0,
            state=self.state,
            weight_version=self.status.weight_version,
            lora_adapters=dict(self.loras.adapters),
            lora_models=dict(self.loras.adapter_models),
            ranks=ranks,
        )

    def _restore(self, replica: Replica, now: float) -> None:
        """Start from the last leader's Replica: its lifecycle state (every worker that registers is brought to
        it), weight version, adapters, and its DP ranks held for their workers for a worker timeout."""
        self.status.state = replica.state
        self.status.weight_version = replica.weight_version
        self.loras.adapters.update(replica.lora_adapters)
        self.loras.adapter_models.update(replica.lora_models)
        self.workers.reserve(replica.ranks, now + self.config.worker_timeout)
        log.info(
            "leading from the last leader's state: %s, weight version %d, %d LoRA adapter(s), %d DP rank(s) held",
            replica.state.value,
            replica.weight_version,
            len(replica.lora_adapters),
            len(replica.ranks),
        )

    def step_down(self, now: float) -> None:
        """It no longer leads: tell every worker and client to go to the leader (nothing else leaves)."""
        self.outbox.drop_all()
        for identity in [*self.workers.by_identity, *self.clients]:
            self._redirect(identity, now)

    def _admission_problem(self, hello: Hello) -> str | None:
        problem = self.models.join_problem(hello)
        if problem is not None:
            return problem
        other = None if hello.dp_rank is None else self.workers.live_with_rank(hello.dp_rank, hello.model_id)
        if other is not None and other.worker_id != hello.peer_id:
            of_model = f" of model {hello.model_id!r}" if len(self.models.served()) > 1 else ""
            return (
                f"duplicate dp_rank {hello.dp_rank}{of_model}: live worker {other.worker_id!r} already serves it "
                f"(give each worker its own --dp-rank, or leave it out to have one assigned)"
            )
        return None

    def _register_worker(self, identity: bytes, hello: Hello, now: float) -> None:
        old = self.workers.by_id.get(hello.peer_id)
        rank = self.workers.rank_for(hello)
        worker = WorkerRecord(
            worker_id=hello.peer_id,
            identity=identity,
            hello=hello,
            last_seen=now,
            dp_rank=rank,
            group_id=hello.group_id or f"dp{rank}",
            weight_version=hello.weight_version,
            key=self._frame_key or None,
        )
        if old is not None:
            worker.requests_routed = old.requests_routed
            worker.registrations = old.registrations + 1
            # It registered again (it lost contact, or restarted): keep what it still runs, and what was
            # dispatched after it sent this Hello (a Hello queued during a partition arrives late); move the rest.
            same_process = hello.incarnation is not None and hello.incarnation == old.hello.incarnation
            if same_process:
                worker.dispatches_sent = old.dispatches_sent
            running = set(hello.running)
            seen = hello.dispatches_seen if same_process and hello.dispatches_seen is not None else math.inf
            same_model = old.model_id == worker.model_id
            for request in [r for r in map(self.requests.get, list(old.requests)) if r is not None]:
                if same_model and (request.request_id in running or request.dispatch_seq > seen):
                    worker.requests.add(request.request_id)
                    worker.cost_in_flight += request.charged
                else:
                    self.admission.failover(request, f"worker {old.worker_id!r} re-registered without it", now)
        for superseded in [
            w
            for w in self.workers
            if not w.healthy and w.dp_rank == rank and w.model_id == worker.model_id and w.worker_id != hello.peer_id
        ]:
            self.workers.remove(superseded)
        self.workers.add(worker)
        self.admission.routes_changed()
        if self.status.model_id is None:
            self.status.model_id = hello.model_id
        stale = self.reattachment.take_back(worker, hello, now)
        if stale:
            self.send(identity, Abort(request_ids=stale))
        kv_events = self.config.policy == "kv-aware"  # coordinator/kv_index.py: the worker publishes its cache
        self.send(identity, replace(self._welcome(), dp_rank=rank, group_id=worker.group_id, kv_events=kv_events))
        for command in commands_to_reach(self.state):
            self.send(identity, Control(command=command))
        self.commands.on_worker_registered(worker, now)
        self.loras.on_worker_registered(worker)
        log.info(
            "worker %s: %s%s",
            "re-registered" if old is not None else "joined",
            worker.describe(),
            f"; aborting {len(stale)} request(s) it still ran that moved elsewhere" if stale else "",
        )
        if len(self.reattachment.orphans):
            log.info(
                "%d request(s) of workers that registered again wait for their clients to re-attach",
                len(self.reattachment.orphans),
            )
        self.admission.dispatch_held(now)
        self.statistics.answer_stats_waiters(now)

    def _on_submit(self, identity: bytes, submit: Submit, now: float) -> None:
        client = self.books.client(identity, now)
        if client is None:
            return
        rid = submit.request_id
        if self.state is ClusterState.STOPPED or self.status.drain is not None:
            self.send(
                identity,
                Error(
                    message=f"request {rid!r} not accepted: the cluster is "
                    f"{'stopping' if self.status.drain is None else 'draining to stop'}",
                    request_id=rid,
                    code=ErrorCode.UNAVAILABLE,
                ),
            )
            return
        existing = self.requests.get(rid)
        if existing is not None and submit.reattach and existing.client == identity:
            # a direct stream's client sends its copy: it was told its worker is gone, or its worker did not serve
            # its subscription, or its stream fell silent: resume from the copy; else (relayed) it got here before
            # the client noticed a restart
            if existing.awaiting_client is not None:
                self.admission.resume_from(existing, submit, now)
            elif existing.direct:
                self.admission.move_to_copy(existing, submit, now)
            return
        if existing is not None:
            self.send(
                identity,
                Error(
                    message=f"request id {rid!r} is already in flight", request_id=rid, code=ErrorCode.INVALID_REQUEST
                ),
            )
            return
        if submit.reattach:
            self.reattachment.reattach(client, submit, now)
            return
        target = self.models.resolve(submit.model, submit.spec.sampling.lora_name)
        if isinstance(target, Refusal):
            self.send(
                identity,
                Error(message=f"request {rid!r} not accepted: {target.message}", request_id=rid, code=target.code),
            )
            return
        overloaded = self.admission.admission_refusal(submit, target.model_id)
        if overloaded is not None:
            self.counters.requests_rejected += 1
            self.send(
                identity,
                Error(message=f"request {rid!r} not accepted: {overloaded}", request_id=rid, code=ErrorCode.OVERLOADED),
            )
            return
        request = self.admission.new_record(identity, submit, now, target)
        self.requests.add(request)
        client.requests.add(rid)
        self.counters.requests_submitted += 1
        self.books.count_submitted(request.model or self.models.default)
        self.admission.admit(request, now)

    def _on_abort(self, identity: bytes, abort: Abort, now: float) -> None:
        client = self.books.client(identity, now)
        if client is None:
            return
        to_workers: dict[str, list[str]] = {}
        for rid in abort.request_ids:
            request = self.requests.get(rid)
            if request is None or request.client != identity:
                continue  # finished already, or not this client's
            self.books.finish(request, Delta.final(rid, "abort"), to_workers)
            self.counters.requests_aborted += 1
        self.books.send_aborts(to_workers)
        self.admission.dispatch_held(now)  # the aborted ones made room
