"""Commands the cluster carries out: the lifecycle (coordinator/lifecycle.py's table applied: pause / unpause /
suspend / resume / stop) and weight updates; suspend, resume and update_weights answer their client once every
worker did (barriers.py). No I/O: a job the Coordinator (core.py) builds. It writes the cluster's status (its
lifecycle state, weight version, whether a refit holds new requests), tells admission when routes or held requests
change, and statistics when STOP answers the StatsRequests still waiting.

A weight update is all or nothing, cluster-wide, in two phases. Prepare: every routable worker reads, checks and
stages the new weights and drains (UpdateWeights -> WeightsUpdated(prepared)); if any cannot (a bad tensor, a
path it cannot read, files changed during the drain, death, timeout), every worker drops them (CommitWeights
with commit false) and nothing changed anywhere. Commit: each applies them (a worker that fails puts its old
values back). The version is the cluster's once any worker serves it; the update then reports success, and
a worker that does not serve it (failed, died, restarted, or joined later: its Hello and loads say its
version) is out of routing (admission.routable) until it is brought to the version: the directory refits it
lacks are sent to it in order; a worker that cannot be caught up (a trainer's broadcast it missed) stays out."""

from __future__ import annotations

import logging
import math

from msgspec.structs import replace

from infer.coordinator.admission import Admission
from infer.coordinator.barriers import WorkerBarrier
from infer.coordinator.books import Books
from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.lifecycle import Action, ClusterState, Refusal, transition
from infer.coordinator.outbox import Send
from infer.coordinator.state import ClusterStatus, WorkerRecord
from infer.coordinator.statistics import Statistics
from infer.protocol.codes import Command
from infer.protocol.logsafe import safe
from infer.protocol.messages import CommitWeights, Control, ControlAck, Delta, Error, UpdateWeights, WeightsUpdated

log = logging.getLogger("infer.coordinator")

ACK_TIMEOUT_S = 300.0  # suspend / resume: how long the client's answer waits for every worker's


class Commands:
    """The lifecycle and weight updates, with their barriers."""

    def __init__(
        self,
        books: Books,
        send: Send,
        status: ClusterStatus,
        admission: Admission,
        statistics: Statistics,
        config: CoordinatorConfig,
    ) -> None:
        self.books = books
        self.send = send
        self.status = status
        self.admission = admission
        self.statistics = statistics
        self.config = config
        self.stop_pending: set[str] | None = None  # workers yet to acknowledge STOP
        self.stop_deadline = math.inf
        self._barrier: WorkerBarrier | None = None  # suspend / resume / update_weights awaiting the workers
        self.version_known = False  # set by a refit, or by the first worker's Hello
        self.refit_paths: dict[int, str | None] = {}  # version -> its directory (None: a trainer's broadcast)
        self.committing = False  # the barrier is a refit's commit phase
        self.refit_path: str | None = None  # the pending refit's directory
        self.catch_ups: dict[str, int] = {}  # worker id -> the version being sent to it

    @property
    def barrier(self) -> WorkerBarrier | None:
        return self._barrier

    @barrier.setter
    def barrier(self, barrier: WorkerBarrier | None) -> None:
        """A weight update's barrier holds new requests (ClusterStatus.refit_pending) while it waits."""
        self._barrier = barrier
        self.status.refit_pending = barrier is not None and barrier.version != 0

    @property
    def draining(self) -> bool:
        """SIGTERM started a drain before STOP (core.py): no weight update starts."""
        return self.status.drain is not None

    def done(self, now: float) -> bool:
        """STOP ran and every worker acknowledged it, or the stop timeout passed."""
        return self.stop_pending is not None and (not self.stop_pending or now >= self.stop_deadline)

    def on_control(self, identity: bytes, control: Control, now: float) -> None:
        client = self.books.client(identity, now)
        if client is None:
            return
        if self.barrier is not None and control.command != Command.STOP:
            self.send(
                identity,
                Error(message=f"{control.command} refused: {self.barrier.what} is still waiting for the workers"),
            )
            return
        before = self.status.state
        refusal = self.apply_command(control.command, f"client {client.peer_id or identity.hex()}", now)
        if refusal is not None:
            self.send(identity, Error(message=refusal))
            return
        workers = {w.worker_id for w in self.books.workers if w.healthy}
        if control.command in (Command.SUSPEND, Command.RESUME) and self.status.state is not before and workers:
            self.barrier = WorkerBarrier(control.command, identity, workers, now + ACK_TIMEOUT_S)
        else:
            self.send(identity, ControlAck(command=control.command, state=self.status.state))

    def apply_command(self, command: Command, source: str, now: float) -> str | None:
        """Run the lifecycle table's transition; the refusal's reason, or None."""
        step = transition(self.status.state, command)
        if isinstance(step, Refusal):
            log.warning("lifecycle: %s refused (%s): %s", command, safe(source), step.reason)
            return step.reason
        before, self.status.state = self.status.state, step.state
        log.info("lifecycle: %s: %s -> %s (from %s)", command, before.value, step.state.value, safe(source))
        for action in step.actions:
            if action is Action.TELL_WORKERS:
                for worker in [w for w in self.books.workers if w.healthy]:
                    self.send(worker.identity, Control(command=command))
            elif action is Action.RELEASE_HELD:
                self.admission.dispatch_held(now)
            elif action is Action.FAIL_PENDING:
                for request in list(self.books.requests.by_id.values()):
                    self.books.fail(
                        request, f"the cluster was stopped ({source}) before request {request.request_id!r} finished"
                    )
            elif action is Action.EXIT:
                self.stop_pending = {w.worker_id for w in self.books.workers if w.healthy}
                self.stop_deadline = now + self.config.stop_timeout
                self.statistics.answer_stats_waiters(now, force=True)
        return None

    def worker_died(self, worker: WorkerRecord) -> None:
        """A dead worker acknowledges no STOP."""
        if self.stop_pending is not None:
            self.stop_pending.discard(worker.worker_id)

    def _worker_frame(self, identity: bytes, kind: str, now: float) -> WorkerRecord | None:
        """The registered worker that sent a `kind` frame, now seen; None (the sender refused) for any other."""
        worker = self.books.workers.by_identity.get(identity)
        if worker is None:
            self.books.reject(identity, f"only workers send {kind}")
            return None
        worker.last_seen = now
        return worker

    def on_control_ack(self, identity: bytes, ack: ControlAck, now: float) -> None:
        worker = self._worker_frame(identity, "control_ack", now)
        if worker is None:
            return
        if ack.command == Command.STOP and self.stop_pending is not None:
            self.stop_pending.discard(worker.worker_id)
        barrier = self.barrier
        if barrier is not None and barrier.version == 0 and ack.command == barrier.what:
            barrier.answer(worker.worker_id, ack.error, ack.bytes_released, ack.bytes_restored)
            self.check_barrier(now)
        log.debug("worker %s acknowledged %s (state %s)", safe(worker.worker_id), safe(ack.command), safe(ack.state))

    def on_update_weights(self, identity: bytes, msg: UpdateWeights, now: float) -> None:
        """Send the new weights' source to every routable worker (a weight-sync group gets one rank each): the
        prepare phase (see the module doc); WeightsUpdated answers once the version is committed. New requests
        wait meanwhile; requests in flight finish on the old weights (drain: each worker is prepared once its
        last one is done) or are aborted now."""
        client = self.books.client(identity, now)
        if client is None:
            return
        workers = sorted((w for w in self.admission.routable()), key=lambda w: w.dp_rank)
        refusal = self._refit_refusal(msg, len(workers))
        if refusal is not None:
            self.send(identity, Error(message=f"update_weights refused: {refusal}"))
            return
        version = self.status.weight_version + 1
        if msg.on_running == "abort":
            self._abort_in_flight(
                f"aborted: the weights are being updated to version {version} (update_weights with on_running='abort')"
            )
        self.barrier = WorkerBarrier(
            f"update_weights to version {version}",
            identity,
            {w.worker_id for w in workers},
            now + msg.timeout_s + 30.0,
            version=version,
        )
        self.committing, self.refit_path = False, msg.path
        for rank, worker in enumerate(workers, start=1):
            sync = None if msg.sync is None else replace(msg.sync, rank=rank)
            self.send(worker.identity, replace(msg, sync=sync, version=version))
        log.info(
            "update_weights to version %d: sent to %d worker(s) (%s, on_running=%s)",
            version,
            len(workers),
            "a trainer's broadcast" if msg.sync is not None else f"directory {safe(msg.path)}",
            msg.on_running,
        )

    def _refit_refusal(self, msg: UpdateWeights, num_workers: int) -> str | None:
        if self.status.state in (ClusterState.STOPPED, ClusterState.SUSPENDED) or self.draining:
            return f"the cluster is {'draining to stop' if self.draining else self.status.state.value}" + (
                "; resume it first" if self.status.state is ClusterState.SUSPENDED else ""
            )
        if self.barrier is not None:
            return f"{self.barrier.what} is still waiting for the workers"
        if not num_workers:
            return "no healthy worker"
        served = self.admission.models.served()
        if len(served) > 1:
            return (
                f"the cluster serves {len(served)} models and update_weights sends one model's weights to every "
                f"worker: refit a cluster of one model"
            )
        if msg.sync is not None and msg.sync.world_size != num_workers + 1:
            return (
                f"the weight-sync group has world_size {msg.sync.world_size}, but {num_workers} worker(s) are "
                f"healthy (world_size = workers + the trainer = {num_workers + 1}); ask again"
            )
        if msg.on_running == "drain" and self.status.state is ClusterState.PAUSED and self.books.requests.num_in_flight:
            return (
                f"{self.books.requests.num_in_flight} request(s) in flight cannot drain while the cluster is "
                f"paused: unpause it, or use on_running='abort'"
            )
        return None

    def _abort_in_flight(self, reason: str) -> None:
        """End every request running on a worker with finish_reason "abort" and `reason`; the workers free
        their KV blocks. Held requests stay held."""
        to_workers: dict[str, list[str]] = {}
        for request in [r for r in self.books.requests.by_id.values() if r.worker_id is not None]:
            self.books.finish(request, Delta.final(request.request_id, "abort", reason), to_workers)
            self.books.counters.requests_aborted += 1
        self.books.send_aborts(to_workers)

    def on_weights_updated(self, identity: bytes, msg: WeightsUpdated, now: float) -> None:
        worker = self._worker_frame(identity, "weights_updated", now)
        if worker is None:
            return
        if not msg.prepared and msg.error is None:
            self.admission.note_version(worker, msg.version)
        if worker.worker_id in self.catch_ups:
            return self._on_catch_up_answer(worker, msg, now)
        barrier = self.barrier
        if (
            barrier is not None
            and barrier.version
            and msg.version == barrier.version
            and (msg.error is not None or msg.prepared != self.committing)
        ):
            barrier.answer(worker.worker_id, msg.error)
            self.check_barrier(now)

    def check_barrier(self, now: float) -> None:
        """Answer the client of the pending suspend / resume / update_weights once every worker answered (or
        the deadline passed); a refit's prepare phase goes on to its commit."""
        barrier = self.barrier
        if barrier is None:
            return
        barrier.forget({w.worker_id for w in self.books.workers if w.healthy})
        if not barrier.done() and not barrier.expired(now):
            return
        self.barrier = None
        failure = barrier.failure()
        if barrier.version:
            return self._prepared(barrier, failure, now) if not self.committing else self._committed(barrier, now)
        if failure is not None:
            log.warning("%s", safe(failure, 2000))
        self.send(
            barrier.client,
            ControlAck(
                command=Command(barrier.what),
                state=self.status.state,
                bytes_released=barrier.bytes_released,
                bytes_restored=barrier.bytes_restored,
                error=failure,
            ),
        )

    def _prepared(self, barrier: WorkerBarrier, failure: str | None, now: float) -> None:
        """Every worker prepared: commit. Else every worker drops what it staged and the update fails."""
        workers = [w for w in self.books.workers if w.healthy and w.worker_id in barrier.workers]
        if failure is None:
            self.committing = True
            self.barrier = WorkerBarrier(
                barrier.what,
                barrier.client,
                {w.worker_id for w in workers},
                now + ACK_TIMEOUT_S,
                version=barrier.version,
            )
            for worker in workers:
                self.send(worker.identity, CommitWeights(version=barrier.version))
            return
        for worker in workers:
            self.send(worker.identity, CommitWeights(version=barrier.version, commit=False))
        log.warning("%s; no worker changed its weights", safe(failure, 2000))
        self.send(barrier.client, Error(message=f"{failure}; no worker changed its weights"))
        self.admission.dispatch_held(now)

    def _committed(self, barrier: WorkerBarrier, now: float) -> None:
        """The version is the cluster's once any worker serves it (the others are out of routing until they
        are brought to it); the update fails only if none does."""
        self.committing = False
        version = barrier.version
        serving = sorted(w.worker_id for w in self.books.workers if w.weight_version == version)
        failure = barrier.failure()
        if not serving:
            log.warning("%s", safe(failure or f"{barrier.what} failed", 2000))
            self.send(barrier.client, Error(message=f"{failure}; no worker changed its weights"))
        else:
            self.status.weight_version, self.version_known = version, True
            self.refit_paths[version] = self.refit_path
            self.admission.routes_changed()
            if failure is not None:
                log.warning(
                    "%s; version %d is the cluster's (served by %s): the others are out of routing until they have it",
                    safe(failure, 2000),
                    version,
                    ", ".join(map(safe, serving)),
                )
            log.info("update_weights: version %d committed", version)
            self.send(barrier.client, WeightsUpdated(version=version))
            for worker in [w for w in self.books.workers if w.healthy]:
                self.catch_up(worker, now)
        self.admission.dispatch_held(now)

    # ---- every worker at the cluster's version ----------------------------------------------------

    def on_worker_registered(self, worker: WorkerRecord, now: float) -> None:
        """A worker (re)joined saying which weights it serves: the first one tells a coordinator that never
        committed a refit (a restarted one) the cluster's version; one at another version is brought to it."""
        self.catch_ups.pop(worker.worker_id, None)
        others = [w for w in self.books.workers if w.healthy and w is not worker]
        if not self.version_known and not others:
            self.status.weight_version = worker.weight_version
        self.version_known = True
        self.admission.routes_changed()
        self.catch_up(worker, now)

    def catch_up(self, worker: WorkerRecord, now: float) -> None:
        """Send a worker behind the cluster the next directory refit it lacks (two phases, as a refit); it
        stays out of routing meanwhile, and for good if a refit it lacks was a trainer's broadcast."""
        have, want = worker.weight_version, self.status.weight_version
        if have == want or worker.worker_id in self.catch_ups or not worker.healthy:
            return
        missing = [self.refit_paths.get(v) for v in range(have + 1, want + 1)]
        if have > want or None in missing:
            log.warning(
                "worker %s serves weight version %d, the cluster %d, and cannot be brought to it (%s): it "
                "gets no requests",
                safe(worker.worker_id),
                have,
                want,
                "a refit this coordinator did not see"
                if have > want or not self.refit_paths
                else "a trainer's broadcast it missed",
            )
            return
        self.catch_ups[worker.worker_id] = have + 1
        log.info(
            "worker %s serves weight version %d, the cluster %d: sending it version %d (out of routing "
            "until it has %d)",
            safe(worker.worker_id),
            have,
            want,
            have + 1,
            want,
        )
        self.send(worker.identity, UpdateWeights(path=missing[0], version=have + 1))

    def _on_catch_up_answer(self, worker: WorkerRecord, msg: WeightsUpdated, now: float) -> None:
        version = self.catch_ups[worker.worker_id]
        if msg.version != version:
            return
        if msg.error is not None:
            del self.catch_ups[worker.worker_id]
            log.warning(
                "worker %s could not be brought to weight version %d: %s; it gets no requests",
                safe(worker.worker_id),
                version,
                safe(msg.error, 2000),
            )
        elif msg.prepared:
            self.send(worker.identity, CommitWeights(version=version))
        else:
            del self.catch_ups[worker.worker_id]
            if worker.weight_version == self.status.weight_version:
                log.info("worker %s serves weight version %d: routed again", safe(worker.worker_id), version)
                self.admission.dispatch_held(now)
            else:
                self.catch_up(worker, now)
