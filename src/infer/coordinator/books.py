"""The books every job keeps together: which request runs where, at what cost, for which client; the steps that
keep them consistent when a request is placed, taken off its worker, or ends; a client's record on first contact.
No I/O, no jobs: the jobs (admission, relay, liveness, reattachment, commands, statistics) are given these.

Invariants (state.py): a request is held or on exactly one worker, in that worker's `requests`; a worker's
`cost_in_flight` is the sum of its requests' `charged`; a finished request is in no table."""

from __future__ import annotations

from collections.abc import Callable

from infer.coordinator.outbox import Outbox
from infer.coordinator.state import (
    ClientRecord,
    ModelCounters,
    RequestRecord,
    RequestTable,
    WorkerRecord,
    WorkerTable,
)
from infer.protocol.codes import ErrorCode, FinishReason
from infer.protocol.logsafe import safe
from infer.protocol.messages import Abort, Counters, Delta, Error, Refused
from infer.protocol.tracing import Attribute

MAX_REJECTION_CHARS = 2000  # of the text answering a bad frame (which may quote the frame)


class Books:
    """The request, worker and client tables, the counters, and the outbox their changes are told through."""

    def __init__(
        self,
        requests: RequestTable,
        workers: WorkerTable,
        clients: dict[bytes, ClientRecord],
        counters: Counters,
        outbox: Outbox,
    ) -> None:
        self.requests = requests
        self.workers = workers
        self.clients = clients
        self.counters = counters
        self.outbox = outbox
        self.model_counters: dict[str, ModelCounters] = {}  # per model: bounded by the models served
        # told when a request leaves a worker (its load falls): the routing index re-files it (admission.py)
        self.worker_unloaded: Callable[[WorkerRecord], None] = lambda worker: None

    def count_submitted(self, model: str | None) -> None:
        if model is not None:
            self.model_counters.setdefault(model, ModelCounters()).submitted += 1

    def client(self, identity: bytes, now: float) -> ClientRecord | None:
        """The client behind `identity` (registered on first contact); None (and an Error) if it is a worker."""
        client = self.clients.get(identity)
        if client is None:
            if identity in self.workers.by_identity:
                self.reject(identity, "this peer registered as a worker and may not act as a client")
                return None
            client = self.clients[identity] = ClientRecord(identity=identity, last_seen=now)
        client.last_seen = now
        return client

    def reject(self, identity: bytes, text: str, refuse: bool = False, request_id: str | None = None) -> None:
        """Answer a bad frame. The text may quote the frame: bounded, so junk cannot make big answers. A Submit
        whose request id could be read fails that request alone (its client hears "invalid_request")."""
        self.counters.frames_rejected += 1
        text = safe(text, MAX_REJECTION_CHARS)
        if refuse:
            self.outbox.send(identity, Refused(reason=text))
        elif request_id is not None:
            self.outbox.send(identity, Error(message=text, request_id=request_id, code=ErrorCode.INVALID_REQUEST))
        else:
            self.outbox.send(identity, Error(message=text))

    def place(self, request: RequestRecord, worker: WorkerRecord) -> None:
        """Put `request` on `worker`'s books (it runs there from now on), charged at its estimated cost."""
        self.requests.unhold(request)
        request.worker_id = worker.worker_id
        request.charged = request.cost
        worker.requests.add(request.request_id)
        worker.cost_in_flight += request.charged

    def detach(self, request: RequestRecord) -> None:
        """Take `request` off its worker's books (the worker is not told)."""
        worker = self.workers.by_id.get(request.worker_id) if request.worker_id is not None else None
        if worker is not None:
            worker.requests.discard(request.request_id)
            worker.cost_in_flight -= request.charged
            self.worker_unloaded(worker)
        request.charged = 0
        request.worker_id = None

    def finish(
        self, request: RequestRecord, final: Delta | None, to_workers: dict[str, list[str]], tell_client: bool = True
    ) -> None:
        """Forget `request`; send `final` to its client (unless a direct stream brings it: `tell_client` false);
        note an abort for its worker if it runs on one."""
        if request.worker_id is not None:
            to_workers.setdefault(request.worker_id, []).append(request.request_id)
        if request.trace is not None:
            attributes: dict[str, Attribute] = {
                "gen_ai.response.finish_reasons": str(final.finish_reason) if final else "client gone",
                "gen_ai.usage.completion_tokens": max(request.num_delivered, final.num_output_tokens if final else 0),
                "infer.redispatches": request.retries,
            }
            self.outbox.end_span(request.trace.finish(None, **attributes))
        if request.model is not None and final is not None and final.finish_reason != FinishReason.ABORT:
            counters = self.model_counters.setdefault(request.model, ModelCounters())
            if final.finish_reason == FinishReason.ERROR:
                counters.failed += 1
            else:
                counters.completed += 1
        self.detach(request)
        self.requests.remove(request)
        client = self.clients.get(request.client)
        if client is not None:
            client.requests.discard(request.request_id)
            if final is not None and tell_client:
                self.outbox.to_client(request.client, final)

    def fail(self, request: RequestRecord, message: str, code: str = "unavailable") -> None:
        self.counters.requests_failed += 1
        to_workers: dict[str, list[str]] = {}
        self.finish(request, Delta.final(request.request_id, "error", message, code), to_workers)
        self.send_aborts(to_workers)

    def send_aborts(self, to_workers: dict[str, list[str]]) -> None:
        for worker_id, rids in to_workers.items():
            worker = self.workers.by_id.get(worker_id)
            if worker is not None and worker.healthy:
                self.outbox.send(worker.identity, Abort(request_ids=rids))
