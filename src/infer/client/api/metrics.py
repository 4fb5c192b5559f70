"""GET /metrics: Prometheus text format, vLLM's metric names under an `infer:` prefix.

Two sources:
- Request metrics (token counters, latency histograms, finished requests) are observed by this front for
  the requests it served. Several fronts on one cluster each report their own; sum them in Prometheus.
  They count engine work: a request with n choices is n engine requests (n x its prompt tokens).
- Cluster metrics (running / waiting requests, KV usage, prefix-cache and preemption counters) come from
  the workers' latest load reports, fetched with a fresh stats round trip at every scrape. Worker counters
  restart from 0 when a worker restarts; the front keeps a per-worker last value so the exported counters
  never go down.
- The coordinator's counters (protocol/messages.py's `Counters`: frames rejected, requests admitted, refused,
  failed over, re-attached, ...) come from the same stats answer, each as `infer:coordinator_<name>`; kept
  from going down across a coordinator restart the same way.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from infer.protocol.codes import ClusterState
from infer.protocol.messages import ClusterStats, Counters
from infer.protocol.outputs import RequestOutput

# vLLM's bucket boundaries, so dashboards built for it read ours the same way.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

disable_created_metrics()  # no `_created` series: vLLM does not export them and scrapers do not need them


class FrontMetrics:
    """The metrics of one HTTP front, in its own registry (two fronts in one process do not collide)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._gauges = {
            "running": Gauge("infer:num_requests_running", "Requests running on the workers.", labels, registry=r),
            "waiting": Gauge(
                "infer:num_requests_waiting",
                "Requests waiting: in the workers' queues and held by the coordinator.",
                labels,
                registry=r,
            ),
            "kv": Gauge(
                "infer:kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0..1) over healthy workers.",
                labels,
                registry=r,
            ),
            "workers": Gauge("infer:num_healthy_workers", "Workers the coordinator can route to.", labels, registry=r),
            "weight_version": Gauge(
                "infer:weight_version",
                "The weights the cluster serves (update_weights counts versions; 0: as loaded).",
                labels,
                registry=r,
            ),
            "kv_index_entries": Gauge(
                "infer:kv_index_entries",
                "kv-aware routing: (block hash, worker) pairs in the coordinator's index of what the workers hold.",
                labels,
                registry=r,
            ),
            "released": Gauge(
                "infer:suspended_bytes",
                "Bytes of KV pool and weights the workers released while suspended.",
                labels,
                registry=r,
            ),
        }
        self._state = Gauge(
            "infer:cluster_state",
            "1 for the cluster's lifecycle state (running, paused, suspended, stopped), 0 for the others.",
            labels + ["state"],
            registry=r,
        )
        self._worker_counters = {
            "num_preemptions": Counter(
                "infer:num_preemptions",
                "Preemptions (requests that lost their KV blocks and recompute).",
                labels,
                registry=r,
            ),
            "prefix_cache_queries": Counter(
                "infer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r
            ),
            "prefix_cache_hits": Counter(
                "infer:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=r
            ),
            "kv_offload_spilled_blocks": Counter(
                "infer:kv_offload_spilled_blocks", "KV disk tier: blocks written to disk.", labels, registry=r
            ),
            "kv_offload_loaded_blocks": Counter(
                "infer:kv_offload_loaded_blocks",
                "KV tier: blocks read back from disk instead of prefilled.",
                labels,
                registry=r,
            ),
            "kv_offload_dropped_blocks": Counter(
                "infer:kv_offload_dropped_blocks",
                "KV tier: evicted blocks not written (writer queue full, write error).",
                labels,
                registry=r,
            ),
            "kv_offload_corrupt_blocks": Counter(
                "infer:kv_offload_corrupt_blocks",
                "KV tier: spilled files rejected (corrupt, truncated, foreign) and recomputed.",
                labels,
                registry=r,
            ),
            "kv_offload_host_spilled_blocks": Counter(
                "infer:kv_offload_host_spilled_blocks",
                "KV host-memory tier: evicted blocks copied into host memory.",
                labels,
                registry=r,
            ),
            "kv_offload_host_loaded_blocks": Counter(
                "infer:kv_offload_host_loaded_blocks",
                "KV host-memory tier: blocks read back from host memory instead of prefilled.",
                labels,
                registry=r,
            ),
            "kv_offload_host_dropped_blocks": Counter(
                "infer:kv_offload_host_dropped_blocks",
                "KV host-memory tier: blocks let go with no disk tier below (or no slot free).",
                labels,
                registry=r,
            ),
            "kv_offload_host_corrupt_blocks": Counter(
                "infer:kv_offload_host_corrupt_blocks",
                "KV host-memory tier: entries rejected (checksum or prefix mismatch) and recomputed.",
                labels,
                registry=r,
            ),
            "kv_transfer_sent_blocks": Counter(
                "infer:kv_transfer_sent_blocks", "KV blocks a kv_producer sent to consumers.", labels, registry=r
            ),
            "kv_transfer_received_blocks": Counter(
                "infer:kv_transfer_received_blocks",
                "KV blocks a kv_consumer received and cached instead of prefilling.",
                labels,
                registry=r,
            ),
            "kv_transfer_dropped_blocks": Counter(
                "infer:kv_transfer_dropped_blocks",
                "KV blocks a kv_consumer received but could not cache (no free block, bad checksum).",
                labels,
                registry=r,
            ),
            "mm_images_encoded": Counter(
                "infer:mm_images_encoded", "Images run through the vision encoder.", labels, registry=r
            ),
            "mm_encoder_cache_hits": Counter(
                "infer:mm_encoder_cache_hits",
                "Images whose vision-encoder features came from the encoder cache instead.",
                labels,
                registry=r,
            ),
            "spec_decode_num_drafts": Counter(
                "infer:spec_decode_num_drafts",
                "Speculative decoding: verifications (a request's drafts checked in one step).",
                labels,
                registry=r,
            ),
            "spec_decode_num_draft_tokens": Counter(
                "infer:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed.", labels, registry=r
            ),
            "spec_decode_num_accepted_tokens": Counter(
                "infer:spec_decode_num_accepted_tokens",
                "Speculative decoding: draft tokens accepted.",
                labels,
                registry=r,
            ),
        }
        self._kv_counters = {
            "kv_index_resyncs": Counter(
                "infer:kv_index_resyncs",
                "kv-aware routing: snapshots the coordinator asked workers for (a gap in their KV events).",
                labels,
                registry=r,
            ),
            "kv_routed_prompt_tokens": Counter(
                "infer:kv_routed_prompt_tokens",
                "kv-aware routing: prompt tokens of the requests routed by what a worker holds.",
                labels,
                registry=r,
            ),
            "kv_routed_cached_tokens": Counter(
                "infer:kv_routed_cached_tokens",
                "kv-aware routing: of those, the tokens the chosen worker held by the index (the hits expected).",
                labels,
                registry=r,
            ),
        }
        self._accepted_per_pos = Counter(
            "infer:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by position in the drafts (0: the first).",
            labels + ["position"],
            registry=r,
        )
        self._coordinator_counters = {
            f.name: Counter(f"infer:coordinator_{f.name}", f.metadata["help"], labels, registry=r)
            for f in dataclasses.fields(Counters)
        }
        self._prompt_tokens = Counter("infer:prompt_tokens", "Prompt tokens of served requests.", labels, registry=r)
        self._generation_tokens = Counter(
            "infer:generation_tokens", "Generated tokens of served requests.", labels, registry=r
        )
        self._success = Counter(
            "infer:request_success", "Finished requests by finish reason.", labels + ["finished_reason"], registry=r
        )
        self._ttft = Histogram(
            "infer:time_to_first_token_seconds", "Time to first token.", labels, buckets=TTFT_BUCKETS, registry=r
        )
        self._itl = Histogram(
            "infer:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self._e2e = Histogram(
            "infer:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._queue_time = Histogram(
            "infer:request_queue_time_seconds",
            "Time a request waited in its worker before it was first scheduled.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.model_name = model_name
        self._series: dict[str, ModelSeries] = {}
        self._last_totals: dict[tuple[str, str], int] = {}
        self._labelled(model_name)

    def _labelled(self, model: str) -> ModelSeries:
        """`model`'s request series; on first use, every series of the model made (at 0, before its first change)."""
        series = self._series.get(model)
        if series is None:
            for metric in [
                *self._gauges.values(),
                *self._worker_counters.values(),
                *self._coordinator_counters.values(),
                *self._kv_counters.values(),
            ]:
                metric.labels(model)
            series = self._series[model] = ModelSeries(
                model,
                self._prompt_tokens.labels(model),
                self._generation_tokens.labels(model),
                self._ttft.labels(model),
                self._itl.labels(model),
                self._e2e.labels(model),
                self._queue_time.labels(model),
                self._success,
            )
        return series

    def tracker(self, model_name: str | None = None) -> RequestTracker:
        """A tracker of one request of `model_name` (the label of the base model it runs on; None: the front's)."""
        return RequestTracker(self._labelled(model_name or self.model_name))

    def exposition(self, stats: ClusterStats | None, served_name: Callable[[str], str] | None = None) -> bytes:
        """The text to answer a scrape with; `stats` None (cluster unreachable) leaves the gauges at 0. On a cluster
        of several models each model's series carry its name (`served_name(model_id)`, default: the id)."""
        self._update_cluster(stats, served_name)
        return generate_latest(self.registry)

    def _update_cluster(self, stats: ClusterStats | None, served_name: Callable[[str], str] | None = None) -> None:
        """The cluster gauges and counters, each model's under its name (`served_name` of its id) on a cluster of
        several models; the coordinator's own counters and lifecycle state under the front's model."""
        models = [] if stats is None or len(stats.models) <= 1 else [m.model_id for m in stats.models]
        if not models:
            self._update_model(stats, self.model_name, None)
        for model in models:
            self._update_model(stats, served_name(model) if served_name is not None else model, model)
        name = self.model_name
        for state in ClusterState:
            self._state.labels(name, state).set(1 if stats is not None and stats.state == state else 0)
        if stats is not None:
            for attr, total in dataclasses.asdict(stats.counters).items():
                self._add_total(
                    self._coordinator_counters[attr].labels(name), f"coordinator {stats.coordinator_id}", attr, total
                )

    def _update_model(self, stats: ClusterStats | None, name: str, model: str | None) -> None:
        """The series of `model`'s workers (None: all) under the label `name`."""
        self._labelled(name)
        workers = [] if stats is None else [w for w in stats.workers if model is None or w.model_id == model]
        healthy = [w for w in workers if w.healthy]
        loads = [w.load for w in healthy if w.load is not None]
        self._gauges["running"].labels(name).set(sum(load.num_running for load in loads))
        if stats is None:
            held = 0
        elif model is None:
            held = stats.num_held
        else:
            held = next((m.num_held for m in stats.models if m.model_id == model), 0)
        self._gauges["waiting"].labels(name).set(sum(load.num_waiting for load in loads) + held)
        total = sum(load.num_total_blocks for load in loads)
        used = sum(load.num_total_blocks - load.num_free_blocks for load in loads)
        self._gauges["kv"].labels(name).set(used / total if total else 0.0)
        self._gauges["workers"].labels(name).set(len(healthy))
        self._gauges["weight_version"].labels(name).set(0 if stats is None else stats.weight_version)
        kv_models = [] if stats is None else [m for m in stats.models if model is None or m.model_id == model]
        self._gauges["kv_index_entries"].labels(name).set(sum(m.kv_index_entries for m in kv_models))
        if stats is not None:
            for m in kv_models:
                source = f"coordinator {stats.coordinator_id} model {m.model_id}"
                for attr, counter in self._kv_counters.items():
                    self._add_total(counter.labels(name), source, attr, getattr(m, attr))
        every = [w.load for w in workers if w.load is not None]
        self._gauges["released"].labels(name).set(sum(load.bytes_released for load in every))
        for worker in workers:
            if worker.load is not None:
                for attr, counter in self._worker_counters.items():
                    self._add_total(
                        counter.labels(name), f"worker {worker.worker_id}", attr, getattr(worker.load, attr)
                    )
                for position, total in enumerate(worker.load.spec_decode_num_accepted_tokens_per_pos):
                    self._add_total(
                        self._accepted_per_pos.labels(name, str(position)),
                        f"worker {worker.worker_id}",
                        f"accepted_pos_{position}",
                        total,
                    )

    def _add_total(self, counter, source: str, attr: str, total: int) -> None:
        """Add to `counter` (a labelled series) what `source`'s counter `attr` gained since its last report."""
        last = self._last_totals.get((source, attr), 0)
        increase = total - last if total >= last else total  # below the last value: the source restarted
        self._last_totals[(source, attr)] = total
        if increase:
            counter.inc(increase)


@dataclass(frozen=True)
class ModelSeries:
    """One model's request series (its `model_name` label's children)."""

    model_name: str
    prompt_tokens: Any
    generation_tokens: Any
    ttft: Any
    itl: Any
    e2e: Any
    queue_time: Any
    success: Counter

    def finished(self, reason: str) -> None:
        self.success.labels(self.model_name, reason).inc()


@dataclass
class RequestTracker:
    """Observes one engine request's deltas into its model's histograms and counters."""

    metrics: ModelSeries
    start: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    prompt_counted: bool = False

    def on_delta(self, delta: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        if not self.prompt_counted and delta.num_prompt_tokens:
            self.prompt_counted = True
            m.prompt_tokens.inc(delta.num_prompt_tokens)
        if delta.queue_time_s is not None:
            m.queue_time.observe(delta.queue_time_s)
        if delta.token_ids:
            m.generation_tokens.inc(len(delta.token_ids))
            if self.last_token_at is None:
                m.ttft.observe(now - self.start)
                gaps = len(delta.token_ids) - 1
                gap = 0.0
            else:
                gaps = len(delta.token_ids)
                gap = (now - self.last_token_at) / gaps
            for _ in range(gaps):  # tokens that came together share the gap since the previous delta
                m.itl.observe(gap)
            self.last_token_at = now
        if delta.finished:
            m.e2e.observe(now - self.start)
            m.finished(delta.finish_reason or "error")
