"""Re-attachment after a coordinator restart: the requests workers still run when they register again (their
RequestSnapshots) wait in the orphan table until their clients re-attach (Submit with `reattach`), and a client's
re-attached request waits for its worker during restart_grace; then each stream is handed back from wherever the
client's copy stops, or resumed from the client's tokens. No I/O: a job the Coordinator (core.py) builds. It owns
the orphan table (the relay extends orphans, liveness drops a dead worker's) and hands requests to admission."""

from __future__ import annotations

import hmac
import logging
from typing import cast

import msgspec

from infer.coordinator.admission import Admission
from infer.coordinator.books import Books
from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.models import Refusal
from infer.coordinator.orphans import Orphan, OrphanTable
from infer.coordinator.outbox import Outbox
from infer.coordinator.state import ClientRecord, RequestRecord, WorkerRecord
from infer.protocol.codes import FinishReason
from infer.protocol.journal import StreamJournal
from infer.protocol.logsafe import safe
from infer.protocol.messages import Abort, Delta, Hello, Placement, Submit, TokenIds

log = logging.getLogger("infer.coordinator")


class Reattachment:
    """The orphan table and the re-attached requests waiting for their worker."""

    def __init__(
        self, books: Books, outbox: Outbox, admission: Admission, config: CoordinatorConfig, started: float
    ) -> None:
        self.books = books
        self.outbox = outbox
        self.admission = admission
        self.config = config
        self.started = started
        self.orphans = OrphanTable()
        self._reattaching: dict[str, RequestRecord] = {}  # re-attached, waiting (restart_grace) for their worker

    def take_back(self, worker: WorkerRecord, hello: Hello, now: float) -> list[str]:
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
                self.books.requests.hold(waiting, now)
            elif snapshot is not None and self.books.requests.get(rid) is None:
                self.orphans.add(Orphan.from_snapshot(worker.worker_id, snapshot, now))
                continue
            stale.append(rid)
        return stale

    def _adopt(self, request: RequestRecord, orphan: Orphan, now: float) -> bool:
        """Hand `orphan` (its worker runs it) back to `request`'s client: send what the client lacks, then
        relay as usual. False when the client's copy does not fit the worker's (resume it instead)."""
        worker = self.books.workers.by_id.get(orphan.worker_id)
        if worker is None or not worker.healthy:
            return False
        if orphan.stream_token is not None:
            return self._adopt_direct(request, orphan, worker)
        catch_up = orphan.catch_up(request.journal.token_ids)
        if catch_up is None:
            if orphan.final is None:
                self.outbox.send(worker.identity, Abort(request_ids=[orphan.request_id]))
            return False
        tokens, text = catch_up
        self.books.counters.requests_reattached += 1
        request.model = worker.model_id  # where it runs: a failover later stays on its model
        request.learn_prompt_ids(orphan.prompt_token_ids)
        request.take_seed(orphan.seed)  # what the worker runs with (the client may not have heard it yet)
        final = orphan.final
        first = not request.sent_prompt_ids
        # the worker's latest delta (its final one, if it ended), carrying all the client lacks; no logprobs:
        # the journal does not keep them
        latest = orphan.latest or Delta(request_id=request.request_id, token_ids=TokenIds(), text="")
        delta = msgspec.structs.replace(
            latest,
            token_ids=tokens,
            text=text,
            logprobs=None,
            num_prompt_tokens=len(request.prompt_token_ids or ()),
            prompt_token_ids=request.prompt_token_ids if first else None,
            seed=request.sampling.seed if first else None,
        )
        request.sent_prompt_ids = True
        request.journal.record(tokens, text)
        request.dispatch_seq = 0  # every Hello of that worker lists it (no Dispatch of ours to cross)
        if final is not None:
            self.books.counters.requests_failed += final.finish_reason == FinishReason.ERROR
            self.books.counters.requests_completed += final.finish_reason != FinishReason.ERROR
            self.books.finish(request, delta, {})
            return True
        if tokens or text or delta.prompt_token_ids is not None:
            self.outbox.to_client(request.client, delta)
        self.books.place(request, worker)
        log.debug(
            "request %s re-attached on worker %s after %d token(s)",
            safe(request.request_id),
            safe(worker.worker_id),
            request.num_delivered,
        )
        return True

    def _adopt_direct(self, request: RequestRecord, orphan: Orphan, worker: WorkerRecord) -> bool:
        """Hand a direct stream back to its owner: a Placement at its worker under the same token, where the client
        subscribes from its copy (the worker sends what it lacks; nothing passes through here). False (resume it
        from the client's copy) unless the client is the stream's owner and reads direct streams."""
        client = self.books.clients.get(request.client)
        address = worker.hello.stream_address
        owner = cast(str, orphan.stream_owner)
        if (
            client is None
            or not client.streams
            or address is None
            or self.config.relay_streams
            or not hmac.compare_digest(client.key.encode(), owner.encode())
        ):
            if orphan.final is None:
                self.outbox.send(worker.identity, Abort(request_ids=[orphan.request_id]))
            return False
        self.books.counters.requests_reattached += 1
        request.model = worker.model_id
        request.learn_prompt_ids(orphan.prompt_token_ids)
        request.take_seed(orphan.seed)
        request.direct, request.dispatch_seq = True, 0
        request.placement = Placement(
            request_id=request.request_id,
            stream_address=address,
            worker_key=worker.key,
            stream_token=orphan.stream_token,
        )
        self.outbox.send(request.client, request.placement)
        final = orphan.final
        if final is not None:  # it ended while this coordinator was away: its worker keeps the end for the client
            self.books.counters.requests_failed += final.finish_reason == FinishReason.ERROR
            self.books.counters.requests_completed += final.finish_reason != FinishReason.ERROR
            self.books.finish(request, final, {}, tell_client=False)
            return True
        self.books.place(request, worker)
        log.debug("direct stream %s handed back at worker %s", safe(request.request_id), safe(worker.worker_id))
        return True

    def reattach(self, client: ClientRecord, submit: Submit, now: float) -> None:
        """A client sends an unfinished request again after this coordinator (re)started: take over the
        worker's copy if one registered, wait for it during restart_grace, else resume from the client's."""
        rid = submit.request_id
        target = self.admission.models.resolve(submit.model, submit.spec.sampling.lora_name)
        # (a model no worker has registered with yet after the restart: kept as named, it waits for one)
        request = self.admission.new_record(
            client.identity, submit, now, None if isinstance(target, Refusal) else target
        )
        delivered = submit.delivered_token_ids
        request.journal = StreamJournal.lengths_only(delivered, submit.delivered_text_len if delivered else 0)
        request.sent_prompt_ids = bool(delivered)
        self.books.requests.add(request)
        client.requests.add(rid)
        orphan = self.orphans.take(rid)
        if orphan is not None and self._adopt(request, orphan, now):
            return
        if orphan is None and now < self.started + self.config.restart_grace:
            self._reattaching[rid] = request
            return
        self.admission.admit(request, now)

    def check_reattaching(self, now: float) -> None:
        """After restart_grace, re-attached requests whose worker never came back are resumed elsewhere;
        orphans no client claimed are aborted on their workers."""
        if self._reattaching and now >= self.started + self.config.restart_grace:
            waiting, self._reattaching = list(self._reattaching.values()), {}
            log.info(
                "%d re-attached request(s) found no worker running them: resuming them from the clients' tokens",
                len(waiting),
            )
            for request in waiting:
                self.admission.admit(request, now)
        to_workers: dict[str, list[str]] = {}
        for orphan in self.orphans.expired(now, self.config.client_timeout + self.config.restart_grace):
            if orphan.final is None:
                to_workers.setdefault(orphan.worker_id, []).append(orphan.request_id)
        if to_workers:
            log.warning("aborting %d request(s) no client re-attached", sum(map(len, to_workers.values())))
            self.books.send_aborts(to_workers)
