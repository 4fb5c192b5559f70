"""The coordinator's logic: one handler per message type, routing, failover, lifecycle, stats. No sockets.

The daemon (daemon.py) feeds it frames (`handle`), timer ticks (`tick`) and peers found unroutable
(`peer_gone`), and sends what it queued (`take_outgoing`). Time is passed in, so tests drive it directly.

A request's path: Submit -> held (paused, or no healthy worker) or routed -> Dispatch to a worker ->
the worker's StepBatch deltas are relayed to the client (gathered per client into one DeltaBatch per
cycle) and `delivered` grows -> the finished delta removes it. If its worker dies, hangs, or aborts it on
its own (a draining worker), the request is held again at the front of the queue and re-dispatched as
prompt + delivered tokens with the remaining budget, so the client's stream goes on without a gap or a
repeat. Deltas from a worker that does not own the request are dropped and the request aborted there.

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

import heapq
import logging
import math
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from infer.coordinator.access import WORKER_ROLES, AccessControl, Denial
from infer.coordinator.barriers import WorkerBarrier
from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.lifecycle import Action, ClusterState, Refusal, commands_to_reach, transition
from infer.coordinator.orphans import Orphan, OrphanTable
from infer.coordinator.routing import make_policy
from infer.coordinator.state import ClientRecord, RequestRecord, RequestTable, WorkerRecord, WorkerTable
from infer.protocol.messages import (
    PROTOCOL_VERSION, Abort, ClusterStats, Control, ControlAck, Delta, DeltaBatch, Error, Heartbeat, Hello,
    Message, ProtocolError, Refused, StatsRequest, StepBatch, Submit, TokenIds, UpdateWeights, Welcome,
    WeightsUpdated, WorkerStats, decode
)
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.roles import CLIENT_ROLES, KeyRoles, Role
from infer.protocol.sampling import SamplingParams

log = logging.getLogger("infer.coordinator")

_DEFAULTS = SamplingParams()
QUARANTINE_DEATHS = 2            # worker deaths while it ran that fail a request as a likely poison
MAX_STATS_WAITERS = 1024
MAX_STATS_WAITERS_PER_CLIENT = 8
MAX_STATS_PER_CLIENT_S = 100     # StatsRequests one client may send per second; past it: Error "overloaded"
CLIENT_IDLE_PRUNE_S = 300.0      # a client with nothing in flight, silent this long, is forgotten
MAX_REJECTION_CHARS = 2000       # of the text answering a bad frame (which may quote the frame)
MAX_LOST_CLIENTS = 4096          # tombstones of clients declared lost, kept until they come back ...
LOST_CLIENT_TTL_S = 600.0        # ... or this long
ACK_TIMEOUT_S = 300.0            # suspend / resume: how long the client's answer waits for every worker's


@dataclass
class Counters:
    requests_submitted: int = 0
    requests_completed: int = 0
    requests_failed: int = 0
    requests_aborted: int = 0
    requests_redispatched: int = 0
    frames_rejected: int = 0
    requests_rejected: int = 0
    requests_timed_out: int = 0
    requests_reattached: int = 0
    clients_lost: int = 0
    clients_too_slow: int = 0


@dataclass
class _LostClient:
    """A client declared lost, until it comes back (a Hello) or the tombstone ages out: every other frame from
    it is answered with `notice` (at most once per heartbeat interval) and dropped."""

    notice: Error
    at: float
    noticed_at: float = -math.inf


@dataclass
class _StatsWaiter:
    identity: bytes
    min_healthy_workers: int
    deadline: float


class Coordinator:
    """All coordinator state and every decision; see the module docstring for the request path."""

    def __init__(self, config: CoordinatorConfig, now: float, keys: KeyRoles | None = None) -> None:
        """`keys`: the roles of the authenticated keys (CurveZMQ); None: no keys, every peer trusted."""
        self.config = config
        self.access = AccessControl(keys)
        self.state = ClusterState.RUNNING
        self.policy = make_policy(config.policy)
        self.workers = WorkerTable()
        self.clients: dict[bytes, ClientRecord] = {}
        self._lost: OrderedDict[bytes, _LostClient] = OrderedDict()   # oldest first
        self.requests = RequestTable()
        self.instance = uuid.uuid4().hex[:16]      # this process; peers notice a restart when it changes
        self.orphans = OrphanTable()
        self._seeds = random.Random()                # seeds for sampled requests that come without one
        self._reattaching: dict[str, RequestRecord] = {}   # re-attached, waiting (restart_grace) for their worker
        self.model_id = config.model_id
        self.counters = Counters()
        self._out: list[tuple[bytes, Message]] = []
        self._client_deltas: dict[bytes, list[Delta]] = {}
        self._stats_waiters: list[_StatsWaiter] = []
        self._routable_cache: list[WorkerRecord] | None = None
        self._started = now
        self._next_tick = now
        self._stop_pending: set[str] | None = None     # workers yet to acknowledge STOP
        self._stop_deadline = math.inf
        self._drain: tuple[str, float] | None = None     # (why, deadline) of a drain before STOP
        self._barrier: WorkerBarrier | None = None       # suspend / resume / update_weights awaiting the workers
        self.weight_version = 0                          # the weights every worker serves (update_weights)
        self._rejected_logged = 0
        self._deadlines: list[tuple[float, str]] = []   # heap (deadline, request id); stale entries popped lazily
        self._overload_logged = 0
        self._peer_warnings = RateLimitedLog(log)   # warnings a peer can trigger at will
        self._handlers: dict[type[Message], Callable[[bytes, Message, float], None]] = {
            Hello: self._on_hello, Submit: self._on_submit, Abort: self._on_abort, Control: self._on_control,
            StatsRequest: self._on_stats_request, Heartbeat: self._on_heartbeat, StepBatch: self._on_step_batch,
            ControlAck: self._on_control_ack, Error: self._on_error, UpdateWeights: self._on_update_weights,
            WeightsUpdated: self._on_weights_updated,
        }

    # ---- inputs ---------------------------------------------------------------------------------

    def handle(self, identity: bytes, payload: list[bytes], now: float, key: bytes | None = None) -> None:
        """One multipart message from the ROUTER (identity stripped), authenticated as `key` (the public key
        of its CURVE connection; None without keys). Never raises."""
        if len(payload) != 1:
            self._reject(identity, f"expected exactly one frame after the routing identity, got {len(payload)}")
            return
        try:
            msg = decode(payload[0])
        except ProtocolError as e:
            self._reject(identity, f"bad frame: {e}", refuse=e.message_type == "hello")
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._reject(identity, f"the coordinator does not accept {msg.TYPE!r} messages")
            return
        denial = self.access.check(identity, key, msg)
        if denial is not None:
            self._deny(identity, msg, denial, now)
            return
        if identity in self._lost and self._remind_lost(identity, msg, now):
            return
        try:
            handler(identity, msg, now)
        except Exception as e:   # a bug must cost one message, never the loop
            log.exception("internal error handling %r from %s", msg.TYPE, safe(identity))
            self._send(identity, Error(message=f"internal error handling {msg.TYPE!r}: {type(e).__name__}: {e}"))
        self._check_drain(now)   # the last request of a drain may just have finished

    def tick(self, now: float) -> None:
        """Timers: request deadlines; every heartbeat interval: heartbeats to workers, worker / client / queue
        timeouts, stats waiters, the drain."""
        self._expire_deadlines(now)
        self._check_barrier(now)
        if now < self._next_tick:
            return
        self._next_tick = now + self.config.heartbeat_interval
        self._check_keys(now)
        self._check_workers(now)
        self._check_clients(now)
        self._check_reattaching(now)
        self._check_held(now)
        self._answer_stats_waiters(now)
        self._log_rejections()
        self._check_drain(now)

    def peer_gone(self, identity: bytes, now: float) -> None:
        """A send to `identity` was unroutable: its connection is gone (the process died or closed)."""
        worker = self.workers.by_identity.get(identity)
        if worker is not None and worker.healthy:
            self._mark_dead(worker, "its connection is gone", now)
            return
        client = self.clients.get(identity)
        if client is not None:
            self._client_lost(client, "its connection is gone", now)

    def peer_too_slow(self, identity: bytes, now: float) -> None:
        """A send to `identity` found its queue at the high-water mark: the peer does not read what it is sent.
        A client has its requests aborted (error code "client_too_slow", told when it reads again); a worker
        is declared dead (its requests move)."""
        worker = self.workers.by_identity.get(identity)
        if worker is not None:
            if worker.healthy:
                self._mark_dead(worker, "it reads nothing: its send queue is full (high-water mark)", now)
            return
        client = self.clients.get(identity)
        if client is not None:
            self._client_lost(client, "it does not read what it is sent: its send queue is full (high-water "
                                      "mark)", now, code="client_too_slow")

    def shutdown(self, reason: str, now: float) -> None:
        """STOP without a requesting client (a signal)."""
        if self.state is not ClusterState.STOPPED:
            self._apply_command("stop", reason, now)

    def on_signal(self, reason: str, now: float) -> None:
        """SIGTERM / SIGINT: drain for at most config.drain_timeout (new requests refused, accepted ones run
        on), then STOP; STOP at once without a drain timeout, or on a second signal."""
        if self._drain is not None or self.config.drain_timeout <= 0:
            return self.shutdown(reason, now)
        self._drain = (reason, now + self.config.drain_timeout)
        log.info("%s: draining %d request(s) for at most %g s (new requests are refused), then STOP", reason,
                 len(self.requests.by_id), self.config.drain_timeout)
        self._check_drain(now)

    def _check_drain(self, now: float) -> None:
        if self._drain is not None and self.state is not ClusterState.STOPPED:
            reason, deadline = self._drain
            if not self.requests.by_id or now >= deadline:
                self.shutdown(f"{reason} ({'drain timeout' if self.requests.by_id else 'drained'})", now)

    def next_deadline(self) -> float:
        drain_deadline = self._drain[1] if self._drain is not None else math.inf
        request_deadline = self._deadlines[0][0] if self._deadlines else math.inf
        barrier_deadline = self._barrier.deadline if self._barrier is not None else math.inf
        return min(self._next_tick, self._stop_deadline, drain_deadline, request_deadline, barrier_deadline)

    def done(self, now: float) -> bool:
        """STOP ran and every worker acknowledged it, or the stop timeout passed: the daemon may exit."""
        return self._stop_pending is not None and (not self._stop_pending or now >= self._stop_deadline)

    # ---- outputs --------------------------------------------------------------------------------

    def take_outgoing(self) -> list[tuple[bytes, Message]]:
        """Everything queued since the last call: each client's deltas as one DeltaBatch, then the rest
        in the order it was queued."""
        out = [(identity, DeltaBatch(deltas=deltas)) for identity, deltas in self._client_deltas.items()]
        out.extend(self._out)
        self._client_deltas = {}
        self._out = []
        return out

    def _send(self, identity: bytes, msg: Message) -> None:
        self._out.append((identity, msg))

    def _to_client(self, request: RequestRecord, delta: Delta) -> None:
        deltas = self._client_deltas.get(request.client)
        if deltas is None:
            self._client_deltas[request.client] = [delta]
        else:
            deltas.append(delta)

    def _reject(self, identity: bytes, text: str, refuse: bool = False) -> None:
        """Answer a bad frame. The text may quote the frame: bounded, so junk cannot make big answers."""
        self.counters.frames_rejected += 1
        text = safe(text, MAX_REJECTION_CHARS)
        self._send(identity, Refused(reason=text) if refuse else Error(message=text))

    # ---- access (key roles) ---------------------------------------------------------------------

    def _deny(self, identity: bytes, msg: Message, denial: Denial, now: float) -> None:
        """A frame its key may not send: Refused for a Hello, Error otherwise; a cut-off peer loses all."""
        self.counters.frames_rejected += 1
        if denial.silent:
            return
        self.access.log_denial(identity, msg, denial, now)
        if denial.cut_off:
            self._cut_off(identity, denial.reason, now)
        elif isinstance(msg, Hello):
            self._send(identity, Refused(reason=denial.reason))
        elif isinstance(msg, Submit):
            self._send(identity, Error(message=f"request {msg.request_id!r} not accepted: {denial.reason}",
                                       request_id=msg.request_id, code="invalid_request"))
        else:
            self._send(identity, Error(message=denial.reason))

    def _cut_off(self, identity: bytes, reason: str, now: float) -> None:
        """The peer behind `identity` may do nothing more (its key was revoked, or its routing id now
        belongs to another key): its requests are aborted (a worker's move elsewhere), nothing queued for
        it leaves, it gets one Refused, and its later frames are dropped unanswered."""
        self.access.cut_off(identity)
        worker = self.workers.by_identity.get(identity)
        if worker is not None and worker.healthy:
            self._mark_dead(worker, f"cut off: {reason}", now)
        client = self.clients.get(identity)
        if client is not None:
            self._client_lost(client, f"cut off: {reason}", now)
        self._stats_waiters = [w for w in self._stats_waiters if w.identity != identity]
        self._client_deltas.pop(identity, None)
        self._out = [(i, m) for i, m in self._out if i != identity]
        self._send(identity, Refused(reason=f"the coordinator cut this connection off: {reason}"))

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

    # ---- handshake ------------------------------------------------------------------------------

    def _on_hello(self, identity: bytes, hello: Hello, now: float) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            self._refuse(identity, hello, f"protocol version differs: the coordinator speaks {PROTOCOL_VERSION}, "
                                          f"{hello.role} {hello.peer_id!r} speaks {hello.protocol_version}")
            return
        if self.state is ClusterState.STOPPED:
            self._refuse(identity, hello, "the coordinator is stopping")
            return
        if hello.role == "client":
            client = self._client(identity, now)
            if client is not None:
                client.peer_id = hello.peer_id
                self._send(identity, self._welcome())
            return
        problem = self._admission_problem(hello)
        if problem is not None:
            self._refuse(identity, hello, problem)
            return
        self._register_worker(identity, hello, now)

    def _refuse(self, identity: bytes, hello: Hello, reason: str) -> None:
        self._peer_warnings.warning("refused %s %s: %s", hello.role, safe(hello.peer_id), safe(reason, 600))
        self._send(identity, Refused(reason=reason))

    def _welcome(self) -> Welcome:
        return Welcome(coordinator_id=self.config.coordinator_id, state=self.state.value, model_id=self.model_id,
                       instance=self.instance)

    def _admission_problem(self, hello: Hello) -> str | None:
        if self.model_id is not None and hello.model_id != self.model_id:
            source = "--model-id" if self.config.model_id is not None else "the first worker"
            return (f"model id differs: the cluster serves {self.model_id!r} (from {source}), worker "
                    f"{hello.peer_id!r} has {hello.model_id!r}")
        other = None if hello.dp_rank is None else self.workers.live_with_rank(hello.dp_rank)
        if other is not None and other.worker_id != hello.peer_id:
            return (f"duplicate dp_rank {hello.dp_rank}: live worker {other.worker_id!r} already serves it "
                    f"(give each worker its own --dp-rank, or leave it out to have one assigned)")
        return None

    def _register_worker(self, identity: bytes, hello: Hello, now: float) -> None:
        old = self.workers.by_id.get(hello.peer_id)
        rank = self.workers.rank_for(hello)
        worker = WorkerRecord(worker_id=hello.peer_id, identity=identity, hello=hello, last_seen=now,
                              dp_rank=rank, group_id=hello.group_id or f"dp{rank}")
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
            for request in [r for r in map(self.requests.get, list(old.requests)) if r is not None]:
                if request.request_id in running or request.dispatch_seq > seen:
                    worker.requests.add(request.request_id)
                    worker.cost_in_flight += request.charged
                else:
                    self._failover(request, f"worker {old.worker_id!r} re-registered without it", now)
        for superseded in [w for w in self.workers if not w.healthy and w.dp_rank == rank
                           and w.worker_id != hello.peer_id]:
            self.workers.remove(superseded)
        self.workers.add(worker)
        self._routable_cache = None
        if self.model_id is None:
            self.model_id = hello.model_id
        stale = self._take_back(worker, hello, now)
        if stale:
            self._send(identity, Abort(request_ids=stale))
        self._send(identity, replace(self._welcome(), dp_rank=rank, group_id=worker.group_id))
        for command in commands_to_reach(self.state):
            self._send(identity, Control(command=command))
        log.info("worker %s: %s%s", "re-registered" if old is not None else "joined", worker.describe(),
                 f"; aborting {len(stale)} request(s) it still ran that moved elsewhere" if stale else "")
        if len(self.orphans):
            log.info("%d request(s) of workers that registered again wait for their clients to re-attach",
                     len(self.orphans))
        self._dispatch_held(now)
        self._answer_stats_waiters(now)

    def _take_back(self, worker: WorkerRecord, hello: Hello, now: float) -> list[str]:
        """The requests `worker` still runs that this coordinator does not place on it: a re-attached one
        waiting for it is handed back, one no client claimed yet becomes an orphan (its client will), the
        rest (moved elsewhere, or with no snapshot) are returned to be aborted there."""
        snapshots = {s.request_id: s for s in hello.snapshots}
        stale = []
        for rid in hello.running:
            if rid in worker.requests:
                continue
            snapshot = snapshots.get(rid)
            waiting = self._reattaching.pop(rid, None)
            if snapshot is not None and waiting is not None:
                if self._adopt(waiting, Orphan.from_snapshot(worker.worker_id, snapshot, now), now):
                    continue
                self.requests.hold(waiting, now)
            elif snapshot is not None and self.requests.get(rid) is None:
                self.orphans.add(Orphan.from_snapshot(worker.worker_id, snapshot, now))
                continue
            stale.append(rid)
        return stale

    def _adopt(self, request: RequestRecord, orphan: Orphan, now: float) -> bool:
        """Hand `orphan` (its worker runs it) back to `request`'s client: send what the client lacks, then
        relay as usual. False when the client's copy does not fit the worker's (resume it instead)."""
        worker = self.workers.by_id.get(orphan.worker_id)
        catch_up = orphan.catch_up(request.delivered) if worker is not None and worker.healthy else None
        if catch_up is None:
            if worker is not None and worker.healthy and orphan.final is None:
                self._send(worker.identity, Abort(request_ids=[orphan.request_id]))
            return False
        tokens, text = catch_up
        self.counters.requests_reattached += 1
        if request.prompt_token_ids is None:
            request.prompt_token_ids = orphan.prompt_token_ids
        if orphan.seed is not None:         # what the worker runs with (the client may not have heard it yet)
            request.sampling = {**request.sampling, "seed": orphan.seed}
        final = orphan.final
        first = not request.sent_prompt_ids
        delta = Delta(request_id=request.request_id, token_ids=tokens, text=text,
                      num_prompt_tokens=len(request.prompt_token_ids),
                      prompt_token_ids=request.prompt_token_ids if first else None,
                      finished=final is not None, finish_reason=None if final is None else final.finish_reason,
                      error=None if final is None else final.error,
                      error_code=None if final is None else final.error_code,
                      seed=request.sampling.get("seed") if first else None)
        request.sent_prompt_ids = True
        request.delivered.extend(tokens)
        if request.delivered_text_len is not None:
            request.delivered_text_len += len(text)
        request.dispatch_seq = 0        # every Hello of that worker lists it (no Dispatch of ours to cross)
        if final is not None:
            self.counters.requests_failed += final.finish_reason == "error"
            self.counters.requests_completed += final.finish_reason != "error"
            self._finish(request, delta, {})
            return True
        if tokens or text or delta.prompt_token_ids is not None:
            self._to_client(request, delta)
        self._place(request, worker)
        log.debug("request %s re-attached on worker %s after %d token(s)", safe(request.request_id),
                  safe(worker.worker_id), len(request.delivered))
        return True

    def _reattach(self, client: ClientRecord, submit: Submit, now: float) -> None:
        """A client sends an unfinished request again after this coordinator (re)started: take over the
        worker's copy if one registered, wait for it during restart_grace, else resume from the client's."""
        rid = submit.request_id
        request = self._new_record(client.identity, submit, now)
        request.delivered = TokenIds(submit.delivered_token_ids)
        request.delivered_text_len = submit.delivered_text_len if request.delivered else 0
        request.sent_prompt_ids = bool(request.delivered)
        self.requests.add(request)
        client.requests.add(rid)
        orphan = self.orphans.take(rid)
        if orphan is not None and self._adopt(request, orphan, now):
            return
        if orphan is None and now < self._started + self.config.restart_grace:
            self._reattaching[rid] = request
            return
        self._admit(request, now)

    def _check_reattaching(self, now: float) -> None:
        """After restart_grace, re-attached requests whose worker never came back are resumed elsewhere;
        orphans no client claimed are aborted on their workers."""
        if self._reattaching and now >= self._started + self.config.restart_grace:
            waiting, self._reattaching = list(self._reattaching.values()), {}
            log.info("%d re-attached request(s) found no worker running them: resuming them from the clients' "
                     "tokens", len(waiting))
            for request in waiting:
                self._admit(request, now)
        to_workers: dict[str, list[str]] = {}
        for orphan in self.orphans.expired(now, self.config.client_timeout + self.config.restart_grace):
            if orphan.final is None:
                to_workers.setdefault(orphan.worker_id, []).append(orphan.request_id)
        if to_workers:
            log.warning("aborting %d request(s) no client re-attached", sum(map(len, to_workers.values())))
            self._send_aborts(to_workers)

    # ---- requests -------------------------------------------------------------------------------

    def _client(self, identity: bytes, now: float) -> ClientRecord | None:
        """The client behind `identity` (registered on first contact); None (and an Error) if it is a worker."""
        client = self.clients.get(identity)
        if client is None:
            if identity in self.workers.by_identity:
                self._reject(identity, "this peer registered as a worker and may not act as a client")
                return None
            client = self.clients[identity] = ClientRecord(identity=identity, last_seen=now)
        client.last_seen = now
        return client

    def _on_submit(self, identity: bytes, submit: Submit, now: float) -> None:
        client = self._client(identity, now)
        if client is None:
            return
        rid = submit.request_id
        if self.state is ClusterState.STOPPED or self._drain is not None:
            self._send(identity, Error(message=f"request {rid!r} not accepted: the cluster is "
                                               f"{'stopping' if self._drain is None else 'draining to stop'}",
                                       request_id=rid, code="unavailable"))
            return
        existing = self.requests.get(rid)
        if existing is not None and submit.reattach and existing.client == identity:
            return      # it got here before the client noticed the restart: nothing to re-attach
        if existing is not None:
            self._send(identity, Error(message=f"request id {rid!r} is already in flight", request_id=rid,
                                         code="invalid_request"))
            return
        if submit.reattach:
            self._reattach(client, submit, now)
            return
        overloaded = self._admission_refusal(submit)
        if overloaded is not None:
            self.counters.requests_rejected += 1
            self._send(identity, Error(message=f"request {rid!r} not accepted: {overloaded}", request_id=rid,
                                       code="overloaded"))
            return
        request = self._new_record(identity, submit, now)
        self.requests.add(request)
        client.requests.add(rid)
        self.counters.requests_submitted += 1
        self._admit(request, now)

    def _new_record(self, identity: bytes, submit: Submit, now: float) -> RequestRecord:
        sampling = self._seeded(submit.sampling)
        request = RequestRecord(
            request_id=submit.request_id, client=identity, prompt=submit.prompt,
            prompt_token_ids=submit.prompt_token_ids, sampling=sampling,
            max_tokens=sampling.get("max_tokens", _DEFAULTS.max_tokens),
            min_tokens=sampling.get("min_tokens", _DEFAULTS.min_tokens), pin_rank=submit.pin_rank,
            priority=submit.priority,
            submitted_at=now, deadline=None if submit.timeout_s is None else now + submit.timeout_s)
        if request.deadline is not None:
            self._add_deadline(request)
        return request

    def _seeded(self, sampling: dict) -> dict:
        """`sampling` with a seed of its own if it samples (temperature > 0) and has none: a re-dispatch then
        continues the same random stream, and the client can replay it (the first delta reports it)."""
        if sampling.get("seed") is not None or sampling.get("temperature", _DEFAULTS.temperature) <= 0:
            return sampling
        return {**sampling, "seed": self._seeds.getrandbits(63)}

    def _admit(self, request: RequestRecord, now: float) -> None:
        """Dispatch an accepted request now, or hold it behind the ones already waiting."""
        if self._dispatching and not self.requests.held:
            self._dispatch(request, now)
        else:
            self.requests.hold(request, now)

    def _admission_refusal(self, submit: Submit) -> str | None:
        """Why a new request must be refused at once as overloaded (its queues are full), or None.

        Priority (lower first) decides who is shed: with every worker at its limit, a request of a better
        priority than some request in flight is held (first in line for the next free seat, and its worker
        ranks it first) instead of refused; with the held queue full, a newcomer of a better priority
        takes the place of the worst held request that has not started, which fails as "overloaded"."""
        if self.state is not ClusterState.RUNNING or not self._routable():
            return self._held_room(submit)
        if submit.pin_rank is not None:
            pinned = [w for w in self._routable() if w.dp_rank == submit.pin_rank]
            if pinned and not self._has_room(pinned[0]):
                return (f"the cluster is overloaded: dp_rank {submit.pin_rank} already has "
                        f"{pinned[0].num_in_flight} requests, its limit; retry later")
            return None
        if not any(self._has_room(w) for w in self._routable()):
            if submit.priority < self._worst_priority_in_flight():
                return self._held_room(submit)
            busiest = max(self._routable(), key=lambda w: w.num_in_flight)
            return (f"the cluster is overloaded: every worker has its limit of requests (dp_rank "
                    f"{busiest.dp_rank}: {busiest.num_in_flight}); retry later")
        return None

    def _held_room(self, submit: Submit) -> str | None:
        """None if `submit` may wait in the coordinator, shedding a held request of a worse priority to make room
        when the queue is full; else why it is refused."""
        limit = self.config.max_held_requests
        if len(self.requests.held) < limit:
            return None
        fresh = [r for r in self.requests.held.values() if not r.delivered]
        victim = max(reversed(fresh), key=lambda r: r.priority, default=None)   # the newest of the worst
        if victim is not None and victim.priority > submit.priority:
            self._fail(victim, f"request {victim.request_id!r} was shed from the coordinator's full queue for a "
                               f"request of a better priority ({submit.priority} < {victim.priority}); retry "
                               f"later", code="overloaded")
            return None
        return (f"the cluster is overloaded: {len(self.requests.held)} requests already wait in the "
                f"coordinator (the limit, --max-held-requests {limit}); retry later")

    def _worst_priority_in_flight(self) -> int:
        """The largest priority among the requests on workers (so the least urgent); on the refusal path only."""
        return max((r.priority for r in self.requests.by_id.values() if r.worker_id is not None),
                   default=-2**63)

    def _has_room(self, worker: WorkerRecord) -> bool:
        limit = worker.request_limit(self.config.max_requests_per_worker)
        return limit is None or worker.num_in_flight < limit

    def _dispatch(self, request: RequestRecord, now: float) -> bool:
        """Route and send `request`; False (it stays or becomes held) if no worker can take it now."""
        routable = self._routable()
        candidates = [w for w in routable if self._has_room(w)]
        if not candidates:
            self.requests.hold(request, now)
            return False
        if request.pin_rank is not None and request.retries == 0:
            worker = next((w for w in candidates if w.dp_rank == request.pin_rank), None)
            if worker is None and any(w.dp_rank == request.pin_rank for w in routable):
                self.requests.hold(request, now)     # its rank is full: it waits for room there
                return False
            if worker is None:
                ranks = ", ".join(str(w.dp_rank) for w in sorted(routable, key=lambda w: w.dp_rank))
                self._fail(request, f"request {request.request_id!r} is pinned to dp_rank {request.pin_rank}, "
                                    f"which is not available (healthy ranks: {ranks})")
                return True
        else:
            worker = self.policy.choose(request.routing_prompt, self._for_suspect(request, candidates))
        if request.delivered and request.prompt_token_ids is None:
            self._fail(request, f"request {request.request_id!r} cannot be resumed: its worker never reported "
                                f"the prompt's token ids")
            return True
        if request.remaining_budget() == 0:      # every token is out; only the final delta was lost
            self.counters.requests_completed += 1
            self._finish(request, Delta(request_id=request.request_id, token_ids=TokenIds(), text="",
                                        finished=True, finish_reason="length"), {})
            return True
        self._place(request, worker)
        worker.requests_routed += 1
        worker.dispatches_sent += 1
        request.dispatch_seq = worker.dispatches_sent
        self._send(worker.identity, request.dispatch())
        return True

    def _for_suspect(self, request: RequestRecord, candidates: list[WorkerRecord]) -> list[WorkerRecord]:
        """A suspect goes where no other suspect runs, when such a worker can take it: should one of them be a
        poison, the next death then hits it alone, not the bystanders that died with it once."""
        if not request.suspect:
            return candidates
        clear = [w for w in candidates
                 if not any(r is not None and r.suspect for r in map(self.requests.get, w.requests))]
        return clear or candidates

    def _place(self, request: RequestRecord, worker: WorkerRecord) -> None:
        """Put `request` on `worker`'s books (it runs there from now on), charged at its estimated cost."""
        self.requests.unhold(request)
        request.worker_id = worker.worker_id
        request.charged = request.cost
        worker.requests.add(request.request_id)
        worker.cost_in_flight += request.charged

    @property
    def _dispatching(self) -> bool:
        """New work goes to the workers: running, and no weight update under way (it holds new requests)."""
        return self.state is ClusterState.RUNNING and (self._barrier is None or self._barrier.version == 0)

    def _dispatch_held(self, now: float) -> None:
        if not self._dispatching or not self.requests.held or not self._routable():
            return
        for request in self._held_in_order():
            if not self._dispatch(request, now):
                return

    def _held_in_order(self) -> list[RequestRecord]:
        """Held requests in dispatch order: resumed ones (a failover) first, then by priority, each in the order
        they were held."""
        held = list(self.requests.held.values())
        if all(r.priority == held[0].priority for r in held):
            return held
        return sorted(held, key=lambda r: (r.retries == 0, r.priority))

    def _routable(self) -> list[WorkerRecord]:
        """Healthy workers whose whole group is healthy (a dead member stalls an EP group's collectives)."""
        if self._routable_cache is None:
            dead_groups = {w.group_id for w in self.workers if not w.healthy}
            self._routable_cache = [w for w in self.workers
                                    if w.healthy and not w.draining and w.group_id not in dead_groups]
        return self._routable_cache

    def _on_abort(self, identity: bytes, abort: Abort, now: float) -> None:
        client = self._client(identity, now)
        if client is None:
            return
        to_workers: dict[str, list[str]] = {}
        for rid in abort.request_ids:
            request = self.requests.get(rid)
            if request is None or request.client != identity:
                continue   # finished already, or not this client's
            self._finish(request, Delta(request_id=rid, token_ids=TokenIds(), text="", finished=True,
                                        finish_reason="abort"), to_workers)
            self.counters.requests_aborted += 1
        self._send_aborts(to_workers)
        self._dispatch_held(now)     # the aborted ones made room

    def _finish(self, request: RequestRecord, final: Delta | None, to_workers: dict[str, list[str]]) -> None:
        """Forget `request`; send `final` to its client; note an abort for its worker if it runs on one."""
        if request.worker_id is not None:
            to_workers.setdefault(request.worker_id, []).append(request.request_id)
        self._detach(request)
        self.requests.remove(request)
        client = self.clients.get(request.client)
        if client is not None:
            client.requests.discard(request.request_id)
            if final is not None:
                self._to_client(request, final)

    def _send_aborts(self, to_workers: dict[str, list[str]]) -> None:
        for worker_id, rids in to_workers.items():
            worker = self.workers.by_id.get(worker_id)
            if worker is not None and worker.healthy:
                self._send(worker.identity, Abort(request_ids=rids))

    def _detach(self, request: RequestRecord) -> None:
        """Take `request` off its worker's books (the worker is not told)."""
        worker = self.workers.by_id.get(request.worker_id) if request.worker_id is not None else None
        if worker is not None:
            worker.requests.discard(request.request_id)
            worker.cost_in_flight -= request.charged
        request.charged = 0
        request.worker_id = None

    def _fail(self, request: RequestRecord, message: str, code: str = "unavailable") -> None:
        self.counters.requests_failed += 1
        to_workers: dict[str, list[str]] = {}
        self._finish(request, Delta(request_id=request.request_id, token_ids=TokenIds(), text="", finished=True,
                                    finish_reason="error", error=message, error_code=code), to_workers)
        self._send_aborts(to_workers)

    def _add_deadline(self, request: RequestRecord) -> None:
        heapq.heappush(self._deadlines, (request.deadline, request.request_id))
        if len(self._deadlines) > 2 * len(self.requests) + 64:   # mostly finished requests' entries: compact
            self._deadlines = [(r.deadline, r.request_id) for r in self.requests.by_id.values()
                               if r.deadline is not None]
            if request.request_id not in self.requests.by_id:
                self._deadlines.append((request.deadline, request.request_id))
            heapq.heapify(self._deadlines)

    def _expire_deadlines(self, now: float) -> None:
        """Fail every request past its deadline with error code "timeout"; its worker aborts it (KV freed)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            deadline, rid = heapq.heappop(deadlines)
            request = self.requests.get(rid)
            if request is None or request.deadline != deadline:
                continue    # finished already (the entry is stale)
            self.counters.requests_timed_out += 1
            waited = now - request.submitted_at
            self._fail(request, f"request {rid!r} did not finish within its timeout ({waited:.1f} s); it was "
                                f"aborted after {len(request.delivered)} token(s)", "timeout")
            self._dispatch_held(now)

    # ---- worker output --------------------------------------------------------------------------

    def _on_step_batch(self, identity: bytes, batch: StepBatch, now: float) -> None:
        worker = self.workers.by_identity.get(identity)
        if worker is None or not worker.healthy:
            self._unknown_worker(identity, worker, [d.request_id for d in batch.deltas if not d.finished])
            return
        worker.last_seen = now
        worker.load = batch.load
        stray = []
        for delta in batch.deltas:
            request = self.requests.get(delta.request_id)
            if request is None or request.worker_id != worker.worker_id:
                orphan = self.orphans.get(delta.request_id)
                if orphan is not None and orphan.worker_id == worker.worker_id:
                    orphan.extend(delta)
                elif not delta.finished:
                    stray.append(delta.request_id)
                continue
            self._relay(request, worker, delta, now)
        if stray:
            self._send(identity, Abort(request_ids=stray))
        if self.requests.held:      # finished requests made room
            self._dispatch_held(now)

    def _unknown_worker(self, identity: bytes, worker: WorkerRecord | None, running: list[str]) -> None:
        """A worker frame from a peer that is not a registered, live worker: ask it to register again. One
        declared dead also aborts what it runs (moved elsewhere); one never seen (this coordinator restarted)
        keeps running: its Hello will bring those requests back."""
        who = f"{worker.worker_id!r}, declared dead" if worker is not None else f"with identity {identity.hex()}"
        self._send(identity, Error(message=f"unknown worker ({who}): send hello to register again"))
        if running and worker is not None:
            self._send(identity, Abort(request_ids=running))

    def _relay(self, request: RequestRecord, worker: WorkerRecord, delta: Delta, now: float) -> None:
        if request.prompt_token_ids is None:    # a string prompt: keep the ids its first worker made
            request.prompt_token_ids = delta.prompt_token_ids
        if delta.finish_reason == "abort":   # not asked for by us (we forget a request before aborting it)
            self._worker_gave_up(request, worker, delta, now)
            return
        if delta.finish_reason == "error" and delta.error_code == "draining":
            self._worker_draining(request, worker, now)
            return
        if delta.finish_reason == "error" and delta.error_code == "overloaded" and delta.queue_time_s is None:
            # its queue was full: another worker may have room. (One that waited past the worker's
            # --max-queue-time carries queue_time_s: the cluster is overloaded, and the client hears it.)
            self._failover(request, f"worker {worker.worker_id!r} was full ({delta.error})", now)
            self._dispatch_held(now)
            return
        if request.retries or request.sent_prompt_ids:
            delta = self._continuation(request, delta)
        request.sent_prompt_ids = True
        request.delivered.extend(delta.token_ids)
        if request.delivered_text_len is not None:
            request.delivered_text_len += len(delta.text)
        if delta.finished:
            if delta.finish_reason == "error":
                self.counters.requests_failed += 1
            else:
                self.counters.requests_completed += 1
            self._finish(request, delta, {})
        else:
            self._to_client(request, delta)

    def _continuation(self, request: RequestRecord, delta: Delta) -> Delta:
        """`delta` as the client should see it: the prompt ids and the seed only once, counted from the
        original prompt."""
        prompt_ids = None if request.sent_prompt_ids else request.prompt_token_ids
        if delta.prompt_token_ids is None and prompt_ids is None and delta.seed is None:
            return delta
        return Delta(request_id=delta.request_id, token_ids=delta.token_ids, text=delta.text,
                     finished=delta.finished, finish_reason=delta.finish_reason, error=delta.error,
                     logprobs=delta.logprobs, num_prompt_tokens=len(request.prompt_token_ids or ()),
                     num_cached_tokens=delta.num_cached_tokens, prompt_token_ids=prompt_ids,
                     error_code=delta.error_code, queue_time_s=delta.queue_time_s,
                     seed=None if prompt_ids is None else request.sampling.get("seed"),
                     prompt_logprobs=delta.prompt_logprobs)

    def _worker_gave_up(self, request: RequestRecord, worker: WorkerRecord, delta: Delta, now: float) -> None:
        """The worker aborted a request on its own (draining): relay its last tokens, then move it."""
        if delta.token_ids or delta.text:
            self._relay(request, worker, Delta(request_id=delta.request_id, token_ids=delta.token_ids,
                                               text=delta.text, logprobs=delta.logprobs,
                                               num_prompt_tokens=delta.num_prompt_tokens,
                                               num_cached_tokens=delta.num_cached_tokens,
                                               prompt_token_ids=delta.prompt_token_ids, seed=delta.seed,
                                               prompt_logprobs=delta.prompt_logprobs), now)
        self._failover(request, f"worker {worker.worker_id!r} aborted it", now)
        self._dispatch_held(now)

    def _worker_draining(self, request: RequestRecord, worker: WorkerRecord, now: float) -> None:
        """The worker refused a dispatch because it drains (SIGTERM): route nothing more to it."""
        if not worker.draining:
            worker.draining = True
            self._routable_cache = None
            log.info("worker %s (dp_rank %d) is draining: no new requests go to it", safe(worker.worker_id),
                     worker.dp_rank)
        self._failover(request, f"worker {worker.worker_id!r} is draining", now)
        self._dispatch_held(now)

    def _on_error(self, identity: bytes, error: Error, now: float) -> None:
        worker = self.workers.by_identity.get(identity)
        if worker is None or not worker.healthy:
            client = self.clients.get(identity)
            if client is not None:
                client.last_seen = now
            self._peer_warnings.warning("error reported by peer %s: %s", safe(identity), safe(error.message))
            return
        worker.last_seen = now
        request = self.requests.get(error.request_id) if error.request_id is not None else None
        if request is not None and request.worker_id == worker.worker_id:
            self._fail(request, f"worker {worker.worker_id!r} failed request {request.request_id!r}: {error.message}",
                       error.code or "internal")
        else:
            self._peer_warnings.warning("error reported by worker %s: %s", safe(worker.worker_id),
                                        safe(error.message))

    # ---- liveness and failover ------------------------------------------------------------------

    def _on_heartbeat(self, identity: bytes, heartbeat: Heartbeat, now: float) -> None:
        worker = self.workers.by_identity.get(identity)
        if worker is not None:
            if not worker.healthy:
                self._unknown_worker(identity, worker, [])
                return
            worker.last_seen = now
            if heartbeat.load is not None:
                worker.load = heartbeat.load
            age = heartbeat.step_age_s
            if age is not None and age > self.config.max_step_time:
                self._mark_dead(worker, f"its engine step has run for {age:.0f} s (--max-step-time "
                                        f"{self.config.max_step_time:g} s): the engine is stuck", now)
            return
        if heartbeat.load is not None:      # only workers report load: one this coordinator does not know yet
            self._unknown_worker(identity, None, [])
        elif self._client(identity, now) is not None:
            self._send(identity, Heartbeat(sent_at=time.time(), instance=self.instance))

    def _check_workers(self, now: float) -> None:
        beat = Heartbeat(sent_at=time.time(), instance=self.instance)
        for worker in [w for w in self.workers if w.healthy]:
            silent = now - worker.last_seen
            if silent > self.config.worker_timeout:
                self._mark_dead(worker, f"silent for {silent:.1f} s (worker timeout {self.config.worker_timeout} s)",
                                now)
            else:
                self._send(worker.identity, beat)

    def _mark_dead(self, worker: WorkerRecord, reason: str, now: float) -> None:
        worker.healthy = False
        self._routable_cache = None
        self.policy.forget_rank(worker.dp_rank)
        if self._stop_pending is not None:
            self._stop_pending.discard(worker.worker_id)
        self.orphans.drop_worker(worker.worker_id)
        mates = [w for w in self.workers if w.healthy and w.group_id == worker.group_id]
        log.warning("worker left: %s: %s; moving its %d request(s)%s", worker.describe(), safe(reason, 600),
                    len(worker.requests), f"; its group {safe(worker.group_id)} is unhealthy until it returns"
                    if mates else "")
        for w in [worker, *mates]:
            moved = [r for r in map(self.requests.get, list(w.requests)) if r is not None]
            # The dead worker too: if it only hung, the Abort waits ahead of its next step, so a request
            # never runs on two workers at once (an unroutable send is ignored: it is dead already).
            if moved:
                self._send(w.identity, Abort(request_ids=[r.request_id for r in moved]))
            for request in moved:
                if w is worker:
                    request.worker_deaths.append(worker.worker_id)
                self._failover(request, f"worker {worker.worker_id!r} (dp_rank {worker.dp_rank}) {reason}", now)
        self._dispatch_held(now)

    def _failover(self, request: RequestRecord, reason: str, now: float) -> None:
        """Move `request` off its worker and queue it (first in line) to resume where its stream stands."""
        self._detach(request)
        if request.retries >= self.config.max_retries:
            self._fail(request, f"request {request.request_id!r} failed: {reason}; it was already re-dispatched "
                                f"{request.retries} time(s), the limit (--max-retries)")
            return
        if len(request.worker_deaths) >= QUARANTINE_DEATHS:
            self._quarantine(request, reason)
            return
        request.retries += 1
        self.counters.requests_redispatched += 1
        self.requests.hold(request, now)
        self.requests.held.move_to_end(request.request_id, last=False)

    def _quarantine(self, request: RequestRecord, reason: str) -> None:
        """Fail a request that was running on QUARANTINE_DEATHS workers when they died: a likely poison."""
        workers = ", ".join(repr(w) for w in request.worker_deaths)
        log.warning("request %r quarantined: running on %d workers that died (%s)", request.request_id,
                    len(request.worker_deaths), workers)
        self._fail(request, f"request {request.request_id!r} failed: it was running on two workers that died "
                            f"({workers}; last: {reason}), so it is quarantined as their likely cause instead "
                            f"of being moved to another worker", "internal")

    def _check_clients(self, now: float) -> None:
        for client in list(self.clients.values()):
            silent = now - client.last_seen
            if client.requests and silent > self.config.client_timeout:
                self._client_lost(client, f"silent for {silent:.1f} s (client timeout "
                                          f"{self.config.client_timeout} s)", now)
            elif not client.requests and silent > max(CLIENT_IDLE_PRUNE_S, self.config.client_timeout):
                del self.clients[client.identity]
        while self._lost and now - next(iter(self._lost.values())).at > LOST_CLIENT_TTL_S:
            self._lost.popitem(last=False)

    def _client_lost(self, client: ClientRecord, reason: str, now: float, code: str = "client_lost") -> None:
        """Abort `client`'s requests on their workers and keep a tombstone, so that the client is told when
        it comes back (see _LostClient): "client_lost" asks it to re-attach them, "client_too_slow" ends them."""
        to_workers: dict[str, list[str]] = {}
        requests = [r for r in map(self.requests.get, list(client.requests)) if r is not None]
        for request in requests:
            self._finish(request, None, to_workers)
        self.counters.requests_aborted += len(requests)
        self._send_aborts(to_workers)
        del self.clients[client.identity]
        self._stats_waiters = [w for w in self._stats_waiters if w.identity != client.identity]
        if requests or code == "client_too_slow":    # an idle client lost nothing: nothing to tell it
            self._tombstone(client.identity, self._lost_notice(code, reason, len(requests)), now)
        self._dispatch_held(now)     # the aborted requests made room
        self._peer_warnings.warning("client %s: %s (identity %s): %s; aborted its %d request(s)",
                                    "too slow" if code == "client_too_slow" else "lost", safe(client.peer_id),
                                    safe(client.identity), reason, len(requests))

    def _lost_notice(self, code: str, reason: str, num_requests: int) -> Error:
        if code == "client_too_slow":
            self.counters.clients_too_slow += 1
            return Error(code=code, message=f"this client was too slow: {reason}; the coordinator aborted its "
                                            f"{num_requests} request(s) in flight")
        self.counters.clients_lost += 1
        return Error(code=code, message=f"this client was declared lost: {reason}; the coordinator aborted its "
                                        f"{num_requests} request(s) on the workers: send them again with "
                                        f"reattach to resume them from the tokens received")

    def _tombstone(self, identity: bytes, notice: Error, now: float) -> None:
        self._lost.pop(identity, None)
        self._lost[identity] = _LostClient(notice, now)
        while len(self._lost) > MAX_LOST_CLIENTS:
            self._lost.popitem(last=False)

    def _remind_lost(self, identity: bytes, msg: Message, now: float) -> bool:
        """A frame from a client declared lost. A Hello is its return: the tombstone goes and the frame is
        handled (False). Any other frame is dropped (True), answered with the notice at most once per
        heartbeat interval (a flood of frames costs no flood of answers)."""
        if isinstance(msg, Hello):
            del self._lost[identity]
            return False
        lost = self._lost[identity]
        if now - lost.noticed_at >= self.config.heartbeat_interval:
            lost.noticed_at = now
            self._send(identity, lost.notice)
        return True

    def _check_held(self, now: float) -> None:
        self._dispatch_held(now)
        if self.state is not ClusterState.RUNNING:
            return   # paused requests wait as long as the pause lasts
        limit = self.config.queue_timeout
        for request in [r for r in self.requests.held.values() if now - r.held_since > limit]:
            self._fail(request, f"request {request.request_id!r} waited {now - request.held_since:.1f} s for a "
                                f"healthy worker (queue timeout {limit} s)")

    # ---- lifecycle ------------------------------------------------------------------------------

    def _on_control(self, identity: bytes, control: Control, now: float) -> None:
        client = self._client(identity, now)
        if client is None:
            return
        if self._barrier is not None and control.command != "stop":
            self._send(identity, Error(message=f"{control.command} refused: {self._barrier.what} is still waiting for "
                                               f"the workers"))
            return
        before = self.state
        refusal = self._apply_command(control.command, f"client {client.peer_id or identity.hex()}", now)
        if refusal is not None:
            self._send(identity, Error(message=refusal))
            return
        workers = {w.worker_id for w in self.workers if w.healthy}
        if control.command in ("suspend", "resume") and self.state is not before and workers:
            self._barrier = WorkerBarrier(control.command, identity, workers, now + ACK_TIMEOUT_S)
        else:
            self._send(identity, ControlAck(command=control.command, state=self.state.value))

    def _apply_command(self, command: str, source: str, now: float) -> str | None:
        """Run the lifecycle table's transition; the refusal's reason, or None."""
        step = transition(self.state, command)
        if isinstance(step, Refusal):
            log.warning("lifecycle: %s refused (%s): %s", command, safe(source), step.reason)
            return step.reason
        before, self.state = self.state, step.state
        log.info("lifecycle: %s: %s -> %s (from %s)", command, before.value, step.state.value, safe(source))
        for action in step.actions:
            if action is Action.TELL_WORKERS:
                for worker in [w for w in self.workers if w.healthy]:
                    self._send(worker.identity, Control(command=command))
            elif action is Action.RELEASE_HELD:
                self._dispatch_held(now)
            elif action is Action.FAIL_PENDING:
                for request in list(self.requests.by_id.values()):
                    self._fail(request, f"the cluster was stopped ({source}) before request "
                                        f"{request.request_id!r} finished")
            elif action is Action.EXIT:
                self._stop_pending = {w.worker_id for w in self.workers if w.healthy}
                self._stop_deadline = now + self.config.stop_timeout
                self._answer_stats_waiters(now, force=True)
        return None

    def _worker_frame(self, identity: bytes, kind: str, now: float) -> WorkerRecord | None:
        """The registered worker that sent a `kind` frame, now seen; None (the sender refused) for any other."""
        worker = self.workers.by_identity.get(identity)
        if worker is None:
            self._reject(identity, f"only workers send {kind}")
            return None
        worker.last_seen = now
        return worker

    def _on_control_ack(self, identity: bytes, ack: ControlAck, now: float) -> None:
        worker = self._worker_frame(identity, "control_ack", now)
        if worker is None:
            return
        if ack.command == "stop" and self._stop_pending is not None:
            self._stop_pending.discard(worker.worker_id)
        barrier = self._barrier
        if barrier is not None and barrier.version == 0 and ack.command == barrier.what:
            barrier.answer(worker.worker_id, ack.error, ack.bytes_released, ack.bytes_restored)
            self._check_barrier(now)
        log.debug("worker %s acknowledged %s (state %s)", safe(worker.worker_id), safe(ack.command), safe(ack.state))

    # ---- commands every worker must carry out: suspend, resume, update_weights ---------------------

    def _on_update_weights(self, identity: bytes, msg: UpdateWeights, now: float) -> None:
        """Send the new weights' source to every healthy worker (a weight-sync group gets one rank each) and
        answer WeightsUpdated once all serve them. New requests wait meanwhile; requests in flight finish on
        the old weights (drain: each worker applies once its last one is done) or are aborted now."""
        client = self._client(identity, now)
        if client is None:
            return
        workers = sorted((w for w in self._routable()), key=lambda w: w.dp_rank)
        refusal = self._refit_refusal(msg, len(workers))
        if refusal is not None:
            self._send(identity, Error(message=f"update_weights refused: {refusal}"))
            return
        version = self.weight_version + 1
        if msg.on_running == "abort":
            self._abort_in_flight(f"aborted: the weights are being updated to version {version} "
                                  f"(update_weights with on_running='abort')")
        self._barrier = WorkerBarrier(f"update_weights to version {version}", identity,
                                      {w.worker_id for w in workers}, now + msg.timeout_s + 30.0, version=version)
        for rank, worker in enumerate(workers, start=1):
            sync = None if msg.sync is None else replace(msg.sync, rank=rank)
            self._send(worker.identity, replace(msg, sync=sync, version=version))
        log.info("update_weights to version %d: sent to %d worker(s) (%s, on_running=%s)", version, len(workers),
                 "a trainer's broadcast" if msg.sync is not None else f"directory {safe(msg.path)}", msg.on_running)

    def _refit_refusal(self, msg: UpdateWeights, num_workers: int) -> str | None:
        if self.state in (ClusterState.STOPPED, ClusterState.SUSPENDED) or self._drain is not None:
            return f"the cluster is {'draining to stop' if self._drain is not None else self.state.value}" + (
                "; resume it first" if self.state is ClusterState.SUSPENDED else "")
        if self._barrier is not None:
            return f"{self._barrier.what} is still waiting for the workers"
        if not num_workers:
            return "no healthy worker"
        if msg.sync is not None and msg.sync.world_size != num_workers + 1:
            return (f"the weight-sync group has world_size {msg.sync.world_size}, but {num_workers} worker(s) are "
                    f"healthy (world_size = workers + the trainer = {num_workers + 1}); ask again")
        if (msg.on_running == "drain" and self.state is ClusterState.PAUSED and self.requests.num_in_flight):
            return (f"{self.requests.num_in_flight} request(s) in flight cannot drain while the cluster is "
                    f"paused: unpause it, or use on_running='abort'")
        return None

    def _abort_in_flight(self, reason: str) -> None:
        """End every request running on a worker with finish_reason "abort" and `reason`; the workers free
        their KV blocks. Held requests stay held."""
        to_workers: dict[str, list[str]] = {}
        for request in [r for r in self.requests.by_id.values() if r.worker_id is not None]:
            self._finish(request, Delta(request_id=request.request_id, token_ids=TokenIds(), text="", finished=True,
                                        finish_reason="abort", error=reason), to_workers)
            self.counters.requests_aborted += 1
        self._send_aborts(to_workers)

    def _on_weights_updated(self, identity: bytes, msg: WeightsUpdated, now: float) -> None:
        worker = self._worker_frame(identity, "weights_updated", now)
        if worker is None:
            return
        barrier = self._barrier
        if barrier is not None and barrier.version and msg.version == barrier.version:
            barrier.answer(worker.worker_id, msg.error)
            self._check_barrier(now)

    def _check_barrier(self, now: float) -> None:
        """Answer the client of the pending suspend / resume / update_weights once every worker answered (or
        the deadline passed)."""
        barrier = self._barrier
        if barrier is None:
            return
        barrier.forget({w.worker_id for w in self.workers if w.healthy})
        if not barrier.done() and not barrier.expired(now):
            return
        self._barrier = None
        failure = barrier.failure()
        if barrier.version:
            if failure is None:
                self.weight_version = barrier.version
                log.info("update_weights: every worker serves version %d", barrier.version)
                self._send(barrier.client, WeightsUpdated(version=barrier.version))
            else:
                log.warning("%s", safe(failure, 2000))
                self._send(barrier.client, Error(message=failure))
            self._dispatch_held(now)
            return
        if failure is not None:
            log.warning("%s", safe(failure, 2000))
        self._send(barrier.client, ControlAck(command=barrier.what, state=self.state.value,
                                              bytes_released=barrier.bytes_released,
                                              bytes_restored=barrier.bytes_restored, error=failure))

    # ---- stats ----------------------------------------------------------------------------------

    def _on_stats_request(self, identity: bytes, request: StatsRequest, now: float) -> None:
        client = self._client(identity, now)
        if client is None:
            return
        if not self._stats_budget_left(client, now):
            self._send(identity, Error(message=f"too many stats requests from this client (at most "
                                               f"{MAX_STATS_PER_CLIENT_S} per second); retry later", code="overloaded"))
            return
        if (request.min_healthy_workers <= len(self._routable()) or request.timeout_s <= 0
                or len(self._stats_waiters) >= MAX_STATS_WAITERS or self.state is ClusterState.STOPPED
                or client.stats_waiting >= MAX_STATS_WAITERS_PER_CLIENT):
            self._send(identity, self.stats(now))
        else:
            client.stats_waiting += 1
            self._stats_waiters.append(_StatsWaiter(identity, request.min_healthy_workers, now + request.timeout_s))

    @staticmethod
    def _stats_budget_left(client: ClientRecord, now: float) -> bool:
        """Count one StatsRequest against the client's budget (MAX_STATS_PER_CLIENT_S per one-second window)."""
        if now - client.stats_window >= 1.0:
            client.stats_window, client.stats_in_window = now, 0
        client.stats_in_window += 1
        return client.stats_in_window <= MAX_STATS_PER_CLIENT_S

    def _answer_stats_waiters(self, now: float, force: bool = False) -> None:
        if not self._stats_waiters:
            return
        healthy = len(self._routable())
        waiting = []
        for waiter in self._stats_waiters:
            if force or healthy >= waiter.min_healthy_workers or now >= waiter.deadline:
                self._send(waiter.identity, self.stats(now))
                client = self.clients.get(waiter.identity)
                if client is not None and client.stats_waiting > 0:
                    client.stats_waiting -= 1
            else:
                waiting.append(waiter)
        self._stats_waiters = waiting

    def stats(self, now: float) -> ClusterStats:
        routable = {w.worker_id for w in self._routable()}
        workers = [WorkerStats(worker_id=w.worker_id, dp_rank=w.dp_rank, group_id=w.group_id,
                               healthy=w.worker_id in routable, num_kv_blocks=w.hello.num_kv_blocks,
                               block_size=w.hello.block_size, max_num_seqs=w.hello.max_num_seqs,
                               max_model_len=w.hello.max_model_len, requests_routed=w.requests_routed,
                               num_in_flight=w.num_in_flight, seconds_since_heard=round(now - w.last_seen, 3),
                               registrations=w.registrations, load=w.load)
                   for w in sorted(self.workers, key=lambda w: (w.dp_rank, w.worker_id))]
        c = self.counters
        return ClusterStats(
            coordinator_id=self.config.coordinator_id, state=self.state.value, policy=self.policy.name,
            model_id=self.model_id, workers=workers, num_clients=len(self.clients),
            num_in_flight=self.requests.num_in_flight, num_held=len(self.requests.held),
            requests_submitted=c.requests_submitted, requests_completed=c.requests_completed,
            requests_failed=c.requests_failed, requests_aborted=c.requests_aborted,
            requests_redispatched=c.requests_redispatched, frames_rejected=c.frames_rejected,
            uptime_s=round(now - self._started, 3), requests_rejected=c.requests_rejected,
            requests_timed_out=c.requests_timed_out, requests_reattached=c.requests_reattached,
            clients_lost=c.clients_lost, clients_too_slow=c.clients_too_slow, weight_version=self.weight_version)

    def _log_rejections(self) -> None:
        rejected = self.counters.frames_rejected
        if rejected != self._rejected_logged:
            log.warning("rejected %d malformed or unexpected frame(s) since the last report (%d in all)",
                        rejected - self._rejected_logged, rejected)
            self._rejected_logged = rejected
        overloaded = self.counters.requests_rejected
        if overloaded != self._overload_logged:
            log.warning("overloaded: refused %d request(s) since the last report (%d in all)",
                        overloaded - self._overload_logged, overloaded)
            self._overload_logged = overloaded
