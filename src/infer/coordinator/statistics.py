"""Statistics: ClusterStats snapshots of the counters and tables, StatsRequests answered at once or once enough
workers are healthy (bounded per client), the rate-limited reports of rejected frames. No I/O: a job the
Coordinator (core.py) builds; it reads the books and asks admission which workers are routable."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass

from infer.coordinator.admission import Admission
from infer.coordinator.books import Books
from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.kv_index import KvAware
from infer.coordinator.lifecycle import ClusterState
from infer.coordinator.loras import Loras
from infer.coordinator.outbox import Send
from infer.coordinator.state import ClientRecord, ClusterStatus, ModelCounters, WorkerRecord
from infer.protocol.codes import ErrorCode
from infer.protocol.messages import (
    MAX_TOKENIZER_SOURCES,
    ClusterStats,
    Error,
    ModelStats,
    StatsRequest,
    WorkerStats,
)

log = logging.getLogger("infer.coordinator")

MAX_STATS_WAITERS = 1024
MAX_STATS_WAITERS_PER_CLIENT = 8
MAX_STATS_PER_CLIENT_S = 100  # StatsRequests one client may send per second; past it: Error "overloaded"


@dataclass
class _StatsWaiter:
    identity: bytes
    min_healthy_workers: int
    deadline: float


def tokenizer_sources(workers: list[WorkerRecord]) -> list[str]:
    """Where a model's workers read its tokenizer (Hello.tokenizer), distinct, the healthy and lowest ranks' first,
    at most MAX_TOKENIZER_SOURCES (a front tries them in turn: workers on hosts with the model at different paths)."""
    sources: list[str] = []
    for worker in sorted(workers, key=lambda w: (not w.healthy, w.dp_rank, w.worker_id)):
        source = worker.hello.tokenizer
        if source is not None and source not in sources and len(sources) < MAX_TOKENIZER_SOURCES:
            sources.append(source)
    return sources


class Statistics:
    """Counters, snapshots and the clients waiting for one. Reads the books, the cluster's status and which
    workers are routable (admission); owns the waiting StatsRequests."""

    def __init__(
        self,
        books: Books,
        send: Send,
        status: ClusterStatus,
        admission: Admission,
        loras: Loras,
        config: CoordinatorConfig,
        started: float,
    ) -> None:
        self.books = books
        self.send = send
        self.status = status
        self.admission = admission
        self.loras = loras
        self.config = config
        self.started = started
        self.stats_waiters: list[_StatsWaiter] = []
        self._rejected_logged = 0
        self._overload_logged = 0

    def forget_waiter(self, identity: bytes) -> None:
        """`identity` is gone: its StatsRequests waiting for healthy workers get no answer."""
        self.stats_waiters = [w for w in self.stats_waiters if w.identity != identity]

    def on_stats_request(self, identity: bytes, request: StatsRequest, now: float) -> None:
        client = self.books.client(identity, now)
        if client is None:
            return
        if not self._stats_budget_left(client, now):
            self.send(
                identity,
                Error(
                    message=f"too many stats requests from this client (at most "
                    f"{MAX_STATS_PER_CLIENT_S} per second); retry later",
                    code=ErrorCode.OVERLOADED,
                ),
            )
            return
        if (
            request.min_healthy_workers <= len(self.admission.routable())
            or request.timeout_s <= 0
            or len(self.stats_waiters) >= MAX_STATS_WAITERS
            or self.status.state is ClusterState.STOPPED
            or client.stats_waiting >= MAX_STATS_WAITERS_PER_CLIENT
        ):
            self.send(identity, self.snapshot(now))
        else:
            client.stats_waiting += 1
            self.stats_waiters.append(_StatsWaiter(identity, request.min_healthy_workers, now + request.timeout_s))

    @staticmethod
    def _stats_budget_left(client: ClientRecord, now: float) -> bool:
        """Count one StatsRequest against the client's budget (MAX_STATS_PER_CLIENT_S per one-second window)."""
        if now - client.stats_window >= 1.0:
            client.stats_window, client.stats_in_window = now, 0
        client.stats_in_window += 1
        return client.stats_in_window <= MAX_STATS_PER_CLIENT_S

    def answer_stats_waiters(self, now: float, force: bool = False) -> None:
        if not self.stats_waiters:
            return
        healthy = len(self.admission.routable())
        waiting = []
        for waiter in self.stats_waiters:
            if force or healthy >= waiter.min_healthy_workers or now >= waiter.deadline:
                self.send(waiter.identity, self.snapshot(now))
                client = self.books.clients.get(waiter.identity)
                if client is not None and client.stats_waiting > 0:
                    client.stats_waiting -= 1
            else:
                waiting.append(waiter)
        self.stats_waiters = waiting

    def snapshot(self, now: float) -> ClusterStats:
        routable = {w.worker_id for w in self.admission.routable()}
        workers = [
            WorkerStats(
                worker_id=w.worker_id,
                dp_rank=w.dp_rank,
                group_id=w.group_id,
                healthy=w.worker_id in routable,
                num_kv_blocks=w.hello.num_kv_blocks,
                block_size=w.hello.block_size,
                max_num_seqs=w.hello.max_num_seqs,
                max_model_len=w.hello.max_model_len,
                requests_routed=w.requests_routed,
                num_in_flight=w.num_in_flight,
                seconds_since_heard=round(now - w.last_seen, 3),
                registrations=w.registrations,
                load=w.load,
                model_id=w.model_id,
            )
            for w in sorted(self.books.workers, key=lambda w: (w.dp_rank, w.worker_id))
        ]
        return ClusterStats(
            coordinator_id=self.config.coordinator_id,
            state=self.status.state,
            policy=self.config.policy,
            model_id=self.status.model_id,
            workers=workers,
            num_clients=len(self.books.clients),
            num_in_flight=self.books.requests.num_in_flight,
            num_held=len(self.books.requests.held),
            uptime_s=round(now - self.started, 3),
            weight_version=self.status.weight_version,
            lora_adapters=self.loras.cluster_adapters(),
            models=self.model_stats(routable),
            **dataclasses.asdict(self.books.counters),
        )

    def model_stats(self, routable: set[str]) -> list[ModelStats]:
        """One ModelStats per model served (coordinator/models.py's order: --model-id's first, then by name)."""
        models = self.admission.models
        default = models.default
        in_flight: Counter[str | None] = Counter()
        held: Counter[str | None] = Counter()
        for r in self.books.requests.by_id.values():
            (held if r.worker_id is None else in_flight)[r.model or default] += 1
        stats = []
        for model in models.served():
            policy = self.admission.policies.get(model)
            kv = policy if isinstance(policy, KvAware) else None
            workers = [w for w in self.books.workers if w.model_id == model]
            counters = self.books.model_counters.get(model, ModelCounters())
            adapters: dict[str, str] = {}
            for worker in sorted((w for w in workers if w.healthy), key=lambda w: w.dp_rank):
                for name, path in worker.lora_adapters.items():
                    adapters.setdefault(name, path)
            stats.append(
                ModelStats(
                    model_id=model,
                    num_workers=len(workers),
                    num_healthy_workers=sum(w.worker_id in routable for w in workers),
                    num_in_flight=in_flight[model],
                    num_held=held[model],
                    requests_submitted=counters.submitted,
                    requests_completed=counters.completed,
                    requests_failed=counters.failed,
                    max_model_len=min((w.hello.max_model_len or 0 for w in workers), default=None),
                    lora_adapters=adapters,
                    default=model == default,
                    tokenizers=tokenizer_sources(workers),
                    kv_index_entries=0 if kv is None else kv.index.num_entries,
                    kv_index_resyncs=0 if kv is None else kv.index.num_resyncs,
                    kv_routed_prompt_tokens=0 if kv is None else kv.routed_prompt_tokens,
                    kv_routed_cached_tokens=0 if kv is None else kv.routed_cached_tokens,
                )
            )
        return stats

    def log_rejections(self) -> None:
        rejected = self.books.counters.frames_rejected
        if rejected != self._rejected_logged:
            log.warning(
                "rejected %d malformed or unexpected frame(s) since the last report (%d in all)",
                rejected - self._rejected_logged,
                rejected,
            )
            self._rejected_logged = rejected
        overloaded = self.books.counters.requests_rejected
        if overloaded != self._overload_logged:
            log.warning(
                "overloaded: refused %d request(s) since the last report (%d in all)",
                overloaded - self._overload_logged,
                overloaded,
            )
            self._overload_logged = overloaded
