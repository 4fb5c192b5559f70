"""Liveness and failover: heartbeats both ways, silent or stuck workers declared dead (their requests, and their
EP group mates', moved to resume elsewhere; a request on two dying workers quarantined), silent or slow clients
declared lost (their requests aborted, a tombstone tells them when they come back). No I/O: a job the Coordinator
(core.py) builds. It owns the tombstones of lost clients; admission moves a dead worker's requests (failover);
the relay answers a frame of a worker it does not know; who else must hear of a death (commands, the orphans) or of a
lost client (statistics) the Coordinator wires as `on_worker_dead` / `on_client_gone`."""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from infer.coordinator.admission import Admission
from infer.coordinator.books import Books
from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.outbox import Send
from infer.coordinator.relay import Relay
from infer.coordinator.state import ClientRecord, WorkerRecord
from infer.protocol.codes import ErrorCode
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.messages import Abort, Error, Heartbeat, Hello, Message

log = logging.getLogger("infer.coordinator")

CLIENT_IDLE_PRUNE_S = 300.0  # a client with nothing in flight, silent this long, is forgotten
MAX_LOST_CLIENTS = 4096  # tombstones of clients declared lost, kept until they come back ...
LOST_CLIENT_TTL_S = 600.0  # ... or this long


@dataclass
class _LostClient:
    """A client declared lost, until it comes back (a Hello) or the tombstone ages out: every other frame from
    it is answered with `notice` (at most once per heartbeat interval) and dropped."""

    notice: Error
    at: float
    noticed_at: float = -math.inf


class Liveness:
    """Who is alive; what moves when a peer is not."""

    def __init__(
        self,
        books: Books,
        send: Send,
        admission: Admission,
        relay: Relay,
        config: CoordinatorConfig,
        beat: Callable[[float], Heartbeat],
        peer_warnings: RateLimitedLog,
        on_worker_dead: Callable[[WorkerRecord], None],
        on_client_gone: Callable[[bytes], None],
    ) -> None:
        """`beat(now)`: the Heartbeat this coordinator sends (its instance, the wall-clock time)."""
        self.books = books
        self.send = send
        self.admission = admission
        self.relay = relay
        self.config = config
        self.beat = beat
        self.peer_warnings = peer_warnings
        self.on_worker_dead = on_worker_dead
        self.on_client_gone = on_client_gone
        self.lost: OrderedDict[bytes, _LostClient] = OrderedDict()  # oldest first

    def on_heartbeat(self, identity: bytes, heartbeat: Heartbeat, now: float) -> None:
        worker = self.books.workers.by_identity.get(identity)
        if worker is not None:
            if not worker.healthy:
                self.relay.unknown_worker(identity, worker, [])
                return
            worker.last_seen = now
            if heartbeat.load is not None:
                worker.load = heartbeat.load
                self.admission.note_load(worker)
            age = heartbeat.step_age_s
            if age is not None and age > self.config.max_step_time:
                self.mark_dead(
                    worker,
                    f"its engine step has run for {age:.0f} s (--max-step-time "
                    f"{self.config.max_step_time:g} s): the engine is stuck",
                    now,
                )
            return
        if heartbeat.load is not None:  # only workers report load: one this coordinator does not know yet
            self.relay.unknown_worker(identity, None, [])
        elif self.books.client(identity, now) is not None:
            self.send(identity, self.beat(now))

    def check_workers(self, now: float) -> None:
        beat = self.beat(now)
        for worker in [w for w in self.books.workers if w.healthy]:
            silent = now - worker.last_seen
            if silent > self.config.worker_timeout:
                timeout = self.config.worker_timeout
                self.mark_dead(worker, f"silent for {silent:.1f} s (worker timeout {timeout} s)", now)
            else:
                self.send(worker.identity, beat)

    def mark_dead(self, worker: WorkerRecord, reason: str, now: float) -> None:
        """`worker` is gone: its requests move, and so do those of its EP group's mates (the group cannot step
        without it), except in a group that drains (`worker` or a mate drains: every rank drains then, told in the
        group's rounds): each mate hands its requests over itself, with their KV where it moves them, or gives them
        back (docs/architecture.md, "A drain that moves KV"); if it dies too, its own death moves them."""
        worker.healthy = False
        self.admission.worker_died(worker)
        self.on_worker_dead(worker)
        mates = [w for w in self.books.workers if w.healthy and w.group_key == worker.group_key]
        log.warning(
            "worker left: %s: %s; moving its %d request(s)%s",
            worker.describe(),
            safe(reason, 600),
            len(worker.requests),
            f"; its group {safe(worker.group_id)} is unhealthy until it returns" if mates else "",
        )
        drains = worker.draining or any(m.draining for m in mates)
        for w in [worker, *(m for m in mates if not drains)]:
            moved = [r for r in map(self.books.requests.get, list(w.requests)) if r is not None]
            # The dead worker too: if it only hung, the Abort waits ahead of its next step, so a request
            # never runs on two workers at once (an unroutable send is ignored: it is dead already).
            if moved:
                self.send(w.identity, Abort(request_ids=[r.request_id for r in moved]))
            for request in moved:
                if w is worker:
                    request.worker_deaths.append(worker.worker_id)
                self.admission.failover(
                    request, f"worker {worker.worker_id!r} (dp_rank {worker.dp_rank}) {reason}", now
                )
        self.admission.dispatch_held(now)

    def check_clients(self, now: float) -> None:
        for client in list(self.books.clients.values()):
            silent = now - client.last_seen
            if client.requests and silent > self.config.client_timeout:
                self.client_lost(
                    client, f"silent for {silent:.1f} s (client timeout {self.config.client_timeout} s)", now
                )
            elif not client.requests and silent > max(CLIENT_IDLE_PRUNE_S, self.config.client_timeout):
                del self.books.clients[client.identity]
        while self.lost and now - next(iter(self.lost.values())).at > LOST_CLIENT_TTL_S:
            self.lost.popitem(last=False)

    def client_lost(
        self, client: ClientRecord, reason: str, now: float, code: ErrorCode = ErrorCode.CLIENT_LOST
    ) -> None:
        """Abort `client`'s requests on their workers and keep a tombstone, so that the client is told when
        it comes back (see _LostClient): "client_lost" asks it to re-attach them, "client_too_slow" ends them."""
        to_workers: dict[str, list[str]] = {}
        requests = [r for r in map(self.books.requests.get, list(client.requests)) if r is not None]
        for request in requests:
            self.books.finish(request, None, to_workers)
        self.books.counters.requests_aborted += len(requests)
        self.books.send_aborts(to_workers)
        del self.books.clients[client.identity]
        self.on_client_gone(client.identity)
        if requests or code == ErrorCode.CLIENT_TOO_SLOW:  # an idle client lost nothing: nothing to tell it
            self._tombstone(client.identity, self._lost_notice(code, reason, len(requests)), now)
        self.admission.dispatch_held(now)  # the aborted requests made room
        self.peer_warnings.warning(
            "client %s: %s (identity %s): %s; aborted its %d request(s)",
            "too slow" if code == ErrorCode.CLIENT_TOO_SLOW else "lost",
            safe(client.peer_id),
            safe(client.identity),
            reason,
            len(requests),
        )

    def _lost_notice(self, code: ErrorCode, reason: str, num_requests: int) -> Error:
        if code == ErrorCode.CLIENT_TOO_SLOW:
            self.books.counters.clients_too_slow += 1
            return Error(
                code=code,
                message=f"this client was too slow: {reason}; the coordinator aborted its "
                f"{num_requests} request(s) in flight",
            )
        self.books.counters.clients_lost += 1
        return Error(
            code=code,
            message=f"this client was declared lost: {reason}; the coordinator aborted its "
            f"{num_requests} request(s) on the workers: send them again with "
            f"reattach to resume them from the tokens received",
        )

    def _tombstone(self, identity: bytes, notice: Error, now: float) -> None:
        self.lost.pop(identity, None)
        self.lost[identity] = _LostClient(notice, now)
        while len(self.lost) > MAX_LOST_CLIENTS:
            self.lost.popitem(last=False)

    def remind_lost(self, identity: bytes, msg: Message, now: float) -> bool:
        """A frame from a client declared lost. A Hello is its return: the tombstone goes and the frame is
        handled (False). Any other frame is dropped (True), answered with the notice at most once per
        heartbeat interval (a flood of frames costs no flood of answers)."""
        if isinstance(msg, Hello):
            del self.lost[identity]
            return False
        lost = self.lost[identity]
        if now - lost.noticed_at >= self.config.heartbeat_interval:
            lost.noticed_at = now
            self.send(identity, lost.notice)
        return True
