"""Relaying worker output: each StepBatch's deltas go to their clients (continued from the original prompt after
a failover), a worker's own abort or drain moves the request, stray deltas are aborted at their worker, a
worker's Error fails its request. No I/O: a job the Coordinator (core.py) builds. It reads the books and the orphan
table (reattachment's: an orphan's deltas are kept there), and hands requests its worker gave up to admission."""

from __future__ import annotations

import logging

import msgspec

from infer.coordinator.admission import Admission
from infer.coordinator.books import Books
from infer.coordinator.orphans import OrphanTable
from infer.coordinator.outbox import Outbox
from infer.coordinator.state import RequestRecord, WorkerRecord
from infer.protocol.codes import ErrorCode, FinishReason
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.messages import Abort, Delta, DrainMoves, DrainStarted, DrainWorker, Error, MoveTargets, StepBatch

log = logging.getLogger("infer.coordinator")


class Relay:
    """Worker output to the clients."""

    def __init__(
        self, books: Books, outbox: Outbox, admission: Admission, orphans: OrphanTable, peer_warnings: RateLimitedLog
    ) -> None:
        self.books = books
        self.outbox = outbox
        self.admission = admission
        self.orphans = orphans
        self.peer_warnings = peer_warnings

    def on_step_batch(self, identity: bytes, batch: StepBatch, now: float) -> None:
        worker = self.books.workers.by_identity.get(identity)
        if worker is None or not worker.healthy:
            self.unknown_worker(identity, worker, [d.request_id for d in batch.deltas if not d.finished])
            return
        worker.last_seen = now
        worker.load = batch.load
        self.admission.note_load(worker)
        if batch.kv_events is not None:
            self.admission.on_kv_events(worker, batch.kv_events, now)
        stray = []
        for delta in batch.deltas:
            request = self.books.requests.get(delta.request_id)
            if request is None or request.worker_id != worker.worker_id:
                orphan = self.orphans.get(delta.request_id)
                if orphan is not None and orphan.worker_id == worker.worker_id:
                    orphan.extend(delta)
                elif not delta.finished:
                    stray.append(delta.request_id)
                continue
            self._relay(request, worker, delta, now)
        if stray:
            self.outbox.send(identity, Abort(request_ids=stray))
        if self.books.requests.held:  # finished requests made room
            self.admission.dispatch_held(now)

    def unknown_worker(self, identity: bytes, worker: WorkerRecord | None, running: list[str]) -> None:
        """A worker frame from a peer that is not a registered, live worker: ask it to register again. One
        declared dead also aborts what it runs (moved elsewhere); one never seen (this coordinator restarted)
        keeps running: its Hello will bring those requests back."""
        who = f"{worker.worker_id!r}, declared dead" if worker is not None else f"with identity {identity.hex()}"
        self.outbox.send(identity, Error(message=f"unknown worker ({who}): send hello to register again"))
        if running and worker is not None:
            self.outbox.send(identity, Abort(request_ids=running))

    def _relay(self, request: RequestRecord, worker: WorkerRecord, delta: Delta, now: float) -> None:
        request.learn_prompt_ids(delta.prompt_token_ids)  # a string prompt: keep the ids its first worker made
        if delta.finish_reason == FinishReason.ABORT and delta.error_code == ErrorCode.KV_HANDOFF:
            self._handed_off(request, worker, delta, now)
            return
        if delta.finish_reason == FinishReason.ABORT:  # not asked for by us (we forget a request before aborting it)
            self._worker_gave_up(request, worker, delta, now)
            return
        if delta.finish_reason == FinishReason.ERROR and delta.error_code == ErrorCode.DRAINING:
            self._worker_draining(request, worker, now)
            return
        if (
            delta.finish_reason == FinishReason.ERROR
            and delta.error_code == ErrorCode.OVERLOADED
            and delta.queue_time_s is None
        ):
            # its queue was full: another worker may have room. (One that waited past the worker's
            # --max-queue-time carries queue_time_s: the cluster is overloaded, and the client hears it.)
            self.admission.failover(request, f"worker {worker.worker_id!r} was full ({delta.error})", now)
            self.admission.dispatch_held(now)
            return
        if request.direct:  # its tokens went to the client from the worker: this is its end only
            self._direct_end(request, delta)
            return
        if request.retries or request.sent_prompt_ids:
            delta = self._continuation(request, delta)
        request.sent_prompt_ids = True
        request.journal.record(delta.token_ids, delta.text)
        if delta.finished:
            if delta.finish_reason == FinishReason.ERROR:
                self.books.counters.requests_failed += 1
            else:
                self.books.counters.requests_completed += 1
            self.books.finish(request, delta, {})
        else:
            self.outbox.to_client(request.client, delta)

    def _direct_end(self, request: RequestRecord, delta: Delta) -> None:
        """A direct stream's end (its worker sends nothing else of it here): the books, not the client (its
        worker's stream socket brings the final delta)."""
        if not delta.finished:
            return
        if delta.finish_reason == FinishReason.ERROR:
            self.books.counters.requests_failed += 1
        else:
            self.books.counters.requests_completed += 1
        # an error may come from a worker that never streamed it (a rejected Dispatch): the client hears it here
        self.books.finish(request, delta, {}, tell_client=delta.finish_reason == FinishReason.ERROR)

    def _continuation(self, request: RequestRecord, delta: Delta) -> Delta:
        """`delta` as the client should see it: the prompt ids and the seed only once, counted from the
        original prompt; the rest (tokens, weight version, ...) as the worker sent it."""
        prompt_ids = None if request.sent_prompt_ids else request.prompt_token_ids
        if delta.prompt_token_ids is None and prompt_ids is None and delta.seed is None:
            return delta
        return msgspec.structs.replace(
            delta,
            num_prompt_tokens=len(request.prompt_token_ids or ()),
            prompt_token_ids=prompt_ids,
            seed=None if prompt_ids is None else request.sampling.seed,
        )

    def _worker_gave_up(self, request: RequestRecord, worker: WorkerRecord, delta: Delta, now: float) -> None:
        """The worker aborted a request on its own (draining): relay its last tokens, then move it."""
        if delta.token_ids or delta.text:
            unfinished = msgspec.structs.replace(delta, finished=False, finish_reason=None, error=None, error_code=None)
            self._relay(request, worker, unfinished, now)
        self.admission.failover(request, f"worker {worker.worker_id!r} aborted it", now)
        self.admission.dispatch_held(now)

    def _handed_off(self, request: RequestRecord, worker: WorkerRecord, delta: Delta, now: float) -> None:
        """A kv_producer prefilled it and sent its KV to the consumer named: relay its last tokens, continue it
        there."""
        if delta.token_ids or delta.text:
            unfinished = msgspec.structs.replace(delta, finished=False, finish_reason=None, error=None, error_code=None)
            self._relay(request, worker, unfinished, now)
        self.admission.handoff(request, worker, now)
        self.admission.dispatch_held(now)

    def _worker_draining(self, request: RequestRecord, worker: WorkerRecord, now: float) -> None:
        """The worker refused a dispatch because it drains (SIGTERM): route nothing more to it."""
        self._mark_draining(worker)
        self.admission.failover(request, f"worker {worker.worker_id!r} is draining", now)
        self.admission.dispatch_held(now)

    def _mark_draining(self, worker: WorkerRecord) -> None:
        if not worker.draining:
            worker.draining = True
            self.admission.worker_draining(worker)
            log.info(
                "worker %s (dp_rank %d) is draining: no new requests go to it", safe(worker.worker_id), worker.dp_rank
            )

    def on_drain_moves(self, identity: bytes, msg: DrainMoves, now: float) -> None:
        """A worker drains and, with a KV port, asks where its running requests go (docs/architecture.md, "A drain
        that moves KV"): out of routing now; each of its requests that another worker can take gets a target (one
        without a KV port names none: it only says it drains)."""
        worker = self.books.workers.by_identity.get(identity)
        if worker is None or not worker.healthy:
            self.unknown_worker(identity, worker, [])
            return
        worker.last_seen = now
        self._mark_draining(worker)
        moves = []
        for request_id in msg.request_ids:
            request = self.books.requests.get(request_id)
            if request is None or request.worker_id != worker.worker_id:
                continue  # ended, or moved already
            move = self.admission.move_target(request, worker)
            if move is not None:
                moves.append(move)
        if msg.request_ids:
            log.info(
                "worker %s drains: %d of %d request(s) move with their KV",
                safe(worker.worker_id),
                len(moves),
                len(msg.request_ids),
            )
        self.outbox.send(identity, MoveTargets(moves=moves))

    def on_drain_worker(self, identity: bytes, msg: DrainWorker, now: float) -> None:
        """An administrator scales one worker down: out of routing now, and told to drain as on SIGTERM (with a KV
        port it then asks where its requests go, on_drain_moves). A worker already draining is answered again."""
        if self.books.client(identity, now) is None:
            return
        worker = self.books.workers.by_id.get(msg.worker_id)
        if worker is None or not worker.healthy:
            names = sorted(w.worker_id for w in self.books.workers if w.healthy)
            shown = ", ".join(map(repr, names[:20])) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
            self.outbox.send(
                identity,
                Error(message=f"drain_worker: no worker {msg.worker_id!r} in this cluster; it has {shown or 'none'}"),
            )
            return
        if not worker.draining:
            log.info("drain of worker %s asked by an administrator", safe(worker.worker_id))
            self.outbox.send(worker.identity, DrainWorker(worker_id=worker.worker_id))
        self._mark_draining(worker)
        self.admission.dispatch_held(now)  # what waited for room may go elsewhere
        self.outbox.send(identity, DrainStarted(worker_id=worker.worker_id, num_requests=worker.num_in_flight))

    def on_error(self, identity: bytes, error: Error, now: float) -> None:
        worker = self.books.workers.by_identity.get(identity)
        if worker is None or not worker.healthy:
            client = self.books.clients.get(identity)
            if client is not None:
                client.last_seen = now
            self.peer_warnings.warning("error reported by peer %s: %s", safe(identity), safe(error.message))
            return
        worker.last_seen = now
        request = self.books.requests.get(error.request_id) if error.request_id is not None else None
        if request is not None and request.worker_id == worker.worker_id:
            self.books.fail(
                request,
                f"worker {worker.worker_id!r} failed request {request.request_id!r}: {error.message}",
                error.code or "internal",
            )
        else:
            self.peer_warnings.warning("error reported by worker %s: %s", safe(worker.worker_id), safe(error.message))
