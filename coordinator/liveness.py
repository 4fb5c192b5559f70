"""Liveness and failover: heartbeats both ways, silent or stuck workers declared dead (their requests, and their
EP group mates', moved to resume elsewhere; a request on two dying workers quarantined), silent or slow clients
declared lost (their requests aborted, a tombstone tells them when they come back). No I/O: a job of the
Coordinator (core.py)."""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infer.coordinator.state import ClientRecord, RequestRecord, WorkerRecord
from infer.protocol.codes import ErrorCode
from infer.protocol.logsafe import safe
from infer.protocol.messages import (
    Abort, Error, Heartbeat, Hello, Message
)

if TYPE_CHECKING:
    from infer.coordinator.core import Coordinator

log = logging.getLogger("infer.coordinator")

QUARANTINE_DEATHS = 2            # worker deaths while it ran that fail a request as a likely poison
CLIENT_IDLE_PRUNE_S = 300.0      # a client with nothing in flight, silent this long, is forgotten
MAX_LOST_CLIENTS = 4096          # tombstones of clients declared lost, kept until they come back ...
LOST_CLIENT_TTL_S = 600.0        # ... or this long


@dataclass
class _LostClient:
    """A client declared lost, until it comes back (a Hello) or the tombstone ages out: every other frame from
    it is answered with `notice` (at most once per heartbeat interval) and dropped."""

    notice: Error
    at: float
    noticed_at: float = -math.inf


class Liveness:
    """Who is alive; what moves when a peer is not."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core
        self.lost: OrderedDict[bytes, _LostClient] = OrderedDict()   # oldest first

    def on_heartbeat(self, identity: bytes, heartbeat: Heartbeat, now: float) -> None:
        worker = self.core.workers.by_identity.get(identity)
        if worker is not None:
            if not worker.healthy:
                self.core.relay.unknown_worker(identity, worker, [])
                return
            worker.last_seen = now
            if heartbeat.load is not None:
                worker.load = heartbeat.load
                self.core.commands.note_version(worker, heartbeat.load.weight_version)
            age = heartbeat.step_age_s
            if age is not None and age > self.core.config.max_step_time:
                self.mark_dead(worker, f"its engine step has run for {age:.0f} s (--max-step-time "
                                        f"{self.core.config.max_step_time:g} s): the engine is stuck", now)
            return
        if heartbeat.load is not None:      # only workers report load: one this coordinator does not know yet
            self.core.relay.unknown_worker(identity, None, [])
        elif self.core.client(identity, now) is not None:
            self.core.send(identity, Heartbeat(sent_at=now + self.core.wall_offset, instance=self.core.instance))

    def check_workers(self, now: float) -> None:
        beat = Heartbeat(sent_at=now + self.core.wall_offset, instance=self.core.instance)
        for worker in [w for w in self.core.workers if w.healthy]:
            silent = now - worker.last_seen
            if silent > self.core.config.worker_timeout:
                timeout = self.core.config.worker_timeout
                self.mark_dead(worker, f"silent for {silent:.1f} s (worker timeout {timeout} s)",
                                now)
            else:
                self.core.send(worker.identity, beat)

    def mark_dead(self, worker: WorkerRecord, reason: str, now: float) -> None:
        worker.healthy = False
        self.core.admission.routes_changed()
        self.core.policy.forget_rank(worker.dp_rank)
        if self.core.commands.stop_pending is not None:
            self.core.commands.stop_pending.discard(worker.worker_id)
        self.core.reattachment.orphans.drop_worker(worker.worker_id)
        mates = [w for w in self.core.workers if w.healthy and w.group_id == worker.group_id]
        log.warning("worker left: %s: %s; moving its %d request(s)%s", worker.describe(), safe(reason, 600),
                    len(worker.requests), f"; its group {safe(worker.group_id)} is unhealthy until it returns"
                    if mates else "")
        for w in [worker, *mates]:
            moved = [r for r in map(self.core.requests.get, list(w.requests)) if r is not None]
            # The dead worker too: if it only hung, the Abort waits ahead of its next step, so a request
            # never runs on two workers at once (an unroutable send is ignored: it is dead already).
            if moved:
                self.core.send(w.identity, Abort(request_ids=[r.request_id for r in moved]))
            for request in moved:
                if w is worker:
                    request.worker_deaths.append(worker.worker_id)
                self.failover(request, f"worker {worker.worker_id!r} (dp_rank {worker.dp_rank}) {reason}", now)
        self.core.admission.dispatch_held(now)

    def failover(self, request: RequestRecord, reason: str, now: float) -> None:
        """Move `request` off its worker and queue it (first in line) to resume where its stream stands."""
        self.core.detach(request)
        if request.retries >= self.core.config.max_retries:
            self.core.fail(request, f"request {request.request_id!r} failed: {reason}; it was already re-dispatched "
                                f"{request.retries} time(s), the limit (--max-retries)")
            return
        if len(request.worker_deaths) >= QUARANTINE_DEATHS:
            self._quarantine(request, reason)
            return
        request.retries += 1
        self.core.counters.requests_redispatched += 1
        self.core.requests.hold(request, now)
        self.core.requests.held.move_to_end(request.request_id, last=False)

    def _quarantine(self, request: RequestRecord, reason: str) -> None:
        """Fail a request that was running on QUARANTINE_DEATHS workers when they died: a likely poison."""
        workers = ", ".join(repr(w) for w in request.worker_deaths)
        log.warning("request %r quarantined: running on %d workers that died (%s)", request.request_id,
                    len(request.worker_deaths), workers)
        self.core.fail(request, f"request {request.request_id!r} failed: it was running on two workers that died "
                            f"({workers}; last: {reason}), so it is quarantined as their likely cause instead "
                            f"of being moved to another worker", "internal")

    def check_clients(self, now: float) -> None:
        for client in list(self.core.clients.values()):
            silent = now - client.last_seen
            if client.requests and silent > self.core.config.client_timeout:
                self.client_lost(client, f"silent for {silent:.1f} s (client timeout "
                                          f"{self.core.config.client_timeout} s)", now)
            elif not client.requests and silent > max(CLIENT_IDLE_PRUNE_S, self.core.config.client_timeout):
                del self.core.clients[client.identity]
        while self.lost and now - next(iter(self.lost.values())).at > LOST_CLIENT_TTL_S:
            self.lost.popitem(last=False)

    def client_lost(self, client: ClientRecord, reason: str, now: float,
                    code: ErrorCode = ErrorCode.CLIENT_LOST) -> None:
        """Abort `client`'s requests on their workers and keep a tombstone, so that the client is told when
        it comes back (see _LostClient): "client_lost" asks it to re-attach them, "client_too_slow" ends them."""
        to_workers: dict[str, list[str]] = {}
        requests = [r for r in map(self.core.requests.get, list(client.requests)) if r is not None]
        for request in requests:
            self.core.finish(request, None, to_workers)
        self.core.counters.requests_aborted += len(requests)
        self.core.send_aborts(to_workers)
        del self.core.clients[client.identity]
        self.core.statistics.forget_waiter(client.identity)
        if requests or code == "client_too_slow":    # an idle client lost nothing: nothing to tell it
            self._tombstone(client.identity, self._lost_notice(code, reason, len(requests)), now)
        self.core.admission.dispatch_held(now)     # the aborted requests made room
        self.core.peer_warnings.warning("client %s: %s (identity %s): %s; aborted its %d request(s)",
                                    "too slow" if code == "client_too_slow" else "lost", safe(client.peer_id),
                                    safe(client.identity), reason, len(requests))

    def _lost_notice(self, code: ErrorCode, reason: str, num_requests: int) -> Error:
        if code == "client_too_slow":
            self.core.counters.clients_too_slow += 1
            return Error(code=code, message=f"this client was too slow: {reason}; the coordinator aborted its "
                                            f"{num_requests} request(s) in flight")
        self.core.counters.clients_lost += 1
        return Error(code=code, message=f"this client was declared lost: {reason}; the coordinator aborted its "
                                        f"{num_requests} request(s) on the workers: send them again with "
                                        f"reattach to resume them from the tokens received")

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
        if now - lost.noticed_at >= self.core.config.heartbeat_interval:
            lost.noticed_at = now
            self.core.send(identity, lost.notice)
        return True
