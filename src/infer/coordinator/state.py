"""What the coordinator remembers: in-flight requests, workers (DP ranks) and clients, and the cluster-wide status
(its counters are protocol/messages.py's Counters, which ClusterStats carries). No I/O.

Invariants (kept by coordinator/books.py):
- a request is either held (worker_id is None, it sits in RequestTable.held) or runs on exactly one
  worker (worker_id set, the id is in that worker's `requests`);
- `journal` holds every token id already relayed to the client, in order, and the number of characters of text
  relayed with them (a StreamJournal that keeps lengths only: protocol/journal.py); with the prompt token ids
  and the seed in `spec` they are what a re-dispatch resumes from (the worker rebuilds its detokenizer from
  them);
- a worker's `cost_in_flight` is the sum of its requests' `charged` (their estimated cost when dispatched);
- `worker_deaths` names the workers that died while running the request, in order: one makes it a suspect,
  two quarantine it (admission.py `failover`).
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

import msgspec

from infer.protocol.codes import ClusterState
from infer.protocol.journal import StreamJournal
from infer.protocol.logsafe import safe
from infer.protocol.messages import Dispatch, Hello, Load, Placement, RankHold, RequestSpec, TokenIds
from infer.protocol.sampling import SamplingParams
from infer.protocol.tracing import HopSpan

CHARS_PER_TOKEN = 4  # rough prompt-length estimate for routing, before a worker tokenized it
UNBOUNDED_OUTPUT_ESTIMATE = 256  # routing cost of a request with max_tokens=None


@dataclass(eq=False)
class RequestRecord:
    """One request the coordinator is responsible for, from Submit until its final delta."""

    request_id: str
    client: bytes  # the client's ROUTER identity
    # what it asks (its Submit's, the adapter a `model` naming one set in its sampling): replaced, never edited, when
    # it is given a seed (`take_seed`) and when its text prompt's ids are learnt (`learn_prompt_ids`)
    spec: RequestSpec
    pin_rank: int | None
    submitted_at: float
    model: str | None = None  # the model it runs on (coordinator/models.py); None: the default, none known yet
    worker_id: str | None = None  # where it runs now; None while held
    held_since: float | None = None
    journal: StreamJournal = field(default_factory=StreamJournal.lengths_only)  # what the client was relayed
    charged: int = 0  # its estimated cost when dispatched, counted in its worker's cost_in_flight
    sent_prompt_ids: bool = False  # the client has had the prompt token ids
    retries: int = 0
    deadline: float | None = None  # monotonic time by which it must finish (Submit.timeout_s)
    dispatch_seq: int = 0  # its Dispatch was the n-th sent to its worker (0: none sent there)
    worker_deaths: list[str] = field(default_factory=list)  # workers that died while running it
    traceparent: str | None = None  # the caller's span (Submit.traceparent)
    trace: HopSpan | None = None  # this hop's span, when the coordinator traces (protocol/tracing.py)
    direct: bool = False  # its current worker streams its deltas to the client directly (not relayed)
    awaiting_client: float | None = None  # detached from its worker: since when its client's copy is awaited
    placement: Placement | None = None  # where its client reads its direct stream (when `direct`)
    session_id: str | None = None  # the conversation it belongs to (Submit.session_id: coordinator/sessions.py)
    # disaggregated prefill and decode: the kv_consumer its producer sends its KV to (worker id), and whether the
    # producer handed it off (it then continues on a consumer: admission._by_kv_role)
    kv_consumer: str | None = None
    handed_off: bool = False

    # what routing, admission and the relay read of the spec
    @property
    def sampling(self) -> SamplingParams:
        return self.spec.sampling

    @property
    def prompt_token_ids(self) -> list[int] | None:
        return self.spec.prompt_token_ids

    @property
    def priority(self) -> int:
        return self.spec.priority

    def learn_prompt_ids(self, token_ids: list[int] | None) -> None:
        """A text prompt's token ids as a worker tokenized them (its first delta, an orphan, a client's copy): every
        later Dispatch sends them in the text's place, so that a failover runs the same tokens."""
        if token_ids is not None and self.spec.prompt_token_ids is None:
            self.spec = msgspec.structs.replace(self.spec, prompt=None, prompt_token_ids=TokenIds(token_ids))

    def take_seed(self, seed: int | None) -> None:
        """Run with `seed` (what a worker or the client reported it runs with); None leaves the spec as it is."""
        if seed is not None:
            self.spec = msgspec.structs.replace(self.spec, sampling=self.spec.sampling.with_seed(seed))

    @property
    def suspect(self) -> bool:
        """A worker died while running it: it may be what killed that worker."""
        return bool(self.worker_deaths)

    @property
    def cost(self) -> int:
        """Estimated tokens this request adds to a rank: prompt (not yet computed) + output still to come."""
        if self.prompt_token_ids is not None:
            prompt = len(self.prompt_token_ids) + self.num_delivered
        else:
            prompt = len(self.spec.prompt or "") // CHARS_PER_TOKEN + 1
        max_tokens = self.sampling.max_tokens
        output = UNBOUNDED_OUTPUT_ESTIMATE if max_tokens is None else max(0, max_tokens - self.num_delivered)
        return prompt + output

    @property
    def num_delivered(self) -> int:
        """Output tokens relayed to the client so far."""
        return len(self.journal.token_ids)

    @property
    def routing_prompt(self) -> str | list[int]:
        return self.spec.routing_prompt

    def remaining_budget(self) -> int | None:
        """max_tokens left after what was delivered (None: up to the context length); for routing and for a
        request whose every token is out. A Dispatch carries max_tokens as submitted: the engine counts."""
        max_tokens = self.sampling.max_tokens
        return None if max_tokens is None else max_tokens - self.num_delivered

    def dispatch(self) -> Dispatch:
        """The Dispatch that (re)starts this request where the client's stream stands: its spec as it is, and the
        tokens already delivered, which the engine counts toward max_tokens / min_tokens."""
        delivered = self.journal.token_ids
        return Dispatch(
            request_id=self.request_id,
            spec=self.spec,
            resumed_token_ids=TokenIds(delivered) if delivered else TokenIds(),
            resumed_text_len=self.journal.text_len if delivered else None,
            client=self.client_tag,
            traceparent=self.dispatch_traceparent,
        )

    @property
    def dispatch_traceparent(self) -> str | None:
        """The worker's hop's parent: this hop when traced here, else the caller's span (passed through)."""
        return self.trace.traceparent if self.trace is not None else self.traceparent

    @property
    def client_tag(self) -> str | None:
        """Dispatch.client: a structured-output request's client, by a hash of its identity (None otherwise:
        nothing else needs it)."""
        if self.sampling.structured_outputs is None:
            return None
        return hashlib.blake2b(self.client, digest_size=8).hexdigest()


@dataclass(eq=False)
class WorkerRecord:
    """One DP rank: what it said in its Hello, its last load report, and the coordinator's own counts."""

    worker_id: str
    identity: bytes
    hello: Hello
    last_seen: float
    dp_rank: int  # as the Hello gave it, or as the coordinator assigned it
    group_id: str
    healthy: bool = True  # alive: heard from within the timeout, connection present
    draining: bool = False  # refused a dispatch while draining: alive, but routed nothing new
    load: Load | None = None
    requests: set[str] = field(default_factory=set)
    cost_in_flight: int = 0
    requests_routed: int = 0
    registrations: int = 1
    dispatches_sent: int = 0  # Dispatch frames sent to this worker process (see Hello.dispatches_seen)
    weight_version: int = 0  # the weights it serves (Hello, its loads, its refit answers)
    lora_adapters: dict[str, str] = field(default_factory=dict)  # its LoRA adapters (Hello, its LoraDone answers)
    key: str | None = None  # its authenticated public key (z85): its stream socket's server key

    # A worker's Hello always carries its KV geometry and batch bound (Hello.__post_init__ requires them of the
    # role "worker", the only role a WorkerRecord is made for): typed optional only for the other roles. They are
    # copied here once (a record's Hello never changes: a new Hello makes a new record) since routing reads them
    # for every candidate of every request.
    model_id: str = field(init=False)
    num_kv_blocks: int = field(init=False)
    block_size: int = field(init=False)
    max_num_seqs: int = field(init=False)
    capacity_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        hello = self.hello
        self.model_id = cast(str, hello.model_id)
        self.num_kv_blocks = cast(int, hello.num_kv_blocks)
        self.block_size = cast(int, hello.block_size)
        self.max_num_seqs = cast(int, hello.max_num_seqs)
        self.capacity_tokens = max(1, self.num_kv_blocks * self.block_size)

    @property
    def kv_role(self) -> str:
        """kv_both (prefill and decode), kv_producer (prefill, then hand off) or kv_consumer (decode handed-off
        requests; new ones only when no other worker can take them)."""
        return self.hello.kv_role

    @property
    def group_key(self) -> tuple[str, str]:
        """Its EP group across the cluster: group ids are each model's own."""
        return (self.model_id, self.group_id)

    @property
    def num_in_flight(self) -> int:
        return len(self.requests)

    def request_limit(self, configured: int | None) -> int | None:
        """How many requests this worker may have at a time: the coordinator's bound, capped by what the
        worker says it holds (max_num_seqs running + max_waiting queued); None: unbounded."""
        own = None if self.hello.max_waiting is None else self.max_num_seqs + self.hello.max_waiting
        if configured is None or own is None:
            return own if configured is None else configured
        return min(configured, own)

    @property
    def score(self) -> float:
        """Load as a fraction of KV capacity, in tokens: queued + running tokens from the last report, plus
        the requests the coordinator has here that the report does not count yet (dispatched after it was
        made), each at the mean estimated cost of this worker's in-flight requests."""
        in_flight = len(self.requests)
        load = self.load
        if load is None:
            return self.cost_in_flight / self.capacity_tokens
        used_blocks = max(0, load.num_total_blocks - load.num_free_blocks)
        reported = load.num_queued_tokens + used_blocks * self.block_size
        unreported = in_flight - load.num_waiting - load.num_running
        if unreported > 0:
            reported += unreported * self.cost_in_flight // in_flight
        return reported / self.capacity_tokens

    def describe(self) -> str:
        return (
            f"worker {safe(self.worker_id)} (model {safe(self.model_id)}, dp_rank {self.dp_rank}, group "
            f"{safe(self.group_id)}, "
            f"{self.hello.num_kv_blocks} KV blocks x {self.hello.block_size}, max_num_seqs "
            f"{self.hello.max_num_seqs}, max_model_len {self.hello.max_model_len})"
        )


@dataclass(eq=False)
class ClientRecord:
    identity: bytes
    last_seen: float
    peer_id: str | None = None
    requests: set[str] = field(default_factory=set)
    stats_window: float = -1.0  # start of the current one-second window of its StatsRequests
    stats_in_window: int = 0  # StatsRequests in that window (a per-client budget)
    stats_waiting: int = 0  # its StatsRequests waiting for workers (wait_for_workers)
    streams: bool = False  # it reads direct streams from workers (Hello.streams)
    key: str = ""  # its authenticated public key (z85), "" without keys: a direct stream's owner


class WorkerTable:
    """Workers by id and by ROUTER identity. Dead workers stay (unhealthy) until they re-register or a new
    worker takes their rank; the identity of a removed worker keeps pointing at its (dead) record, so its
    late frames are answered "unknown worker" rather than mistaken for a client's."""

    def __init__(self) -> None:
        self.by_id: dict[str, WorkerRecord] = {}
        self.by_identity: dict[bytes, WorkerRecord] = {}
        # DP ranks the last leader gave out (several coordinators), held for their workers until they register
        # again or `_reserved_until` passes: (worker id, model id) -> its hold
        self.reserved: dict[tuple[str, str], RankHold] = {}
        self._reserved_until = 0.0
        self._model_ids: frozenset[str] | None = None  # model_ids(), until a worker or a hold comes or goes

    def model_ids(self) -> frozenset[str]:
        """The model of every worker here (healthy or not) and of every held rank. Every request asks (which
        models are served): kept until `add`, `remove` or a change of the holds."""
        if self._model_ids is None:
            self._model_ids = frozenset(w.model_id for w in self.by_id.values()) | {
                hold.model_id for hold in self.reserved.values()
            }
        return self._model_ids

    def __iter__(self):
        return iter(self.by_id.values())

    def reserve(self, ranks: Iterable[RankHold], until: float) -> None:
        self.reserved = {(r.worker_id, r.model_id): r for r in ranks}
        self._reserved_until = until
        self._model_ids = None

    def expire_reservations(self, now: float) -> None:
        if self.reserved and now >= self._reserved_until:
            self.reserved = {}
            self._model_ids = None

    def healthy(self) -> list[WorkerRecord]:
        return [w for w in self.by_id.values() if w.healthy]

    def live_with_rank(self, dp_rank: int, model_id: str | None) -> WorkerRecord | None:
        """The live worker of `model_id` at `dp_rank` (each model has its own ranks)."""
        return next(
            (w for w in self.by_id.values() if w.healthy and w.dp_rank == dp_rank and w.model_id == model_id), None
        )

    def rank_for(self, hello: Hello) -> int:
        """The DP rank a worker serves among its model's: the one its Hello names; else the one it already has
        here (it registers again after a partition, same model); else its hint (the rank an earlier coordinator
        process gave it) when no live worker of its model holds that; else the lowest rank none holds."""
        if hello.dp_rank is not None:
            return hello.dp_rank
        hold = self.reserved.pop((hello.peer_id, hello.model_id or ""), None)
        self._model_ids = None
        old = self.by_id.get(hello.peer_id)
        if old is not None and old.model_id != hello.model_id:
            old = None  # it came back serving another model: a new rank among that model's
        held = {
            w.dp_rank
            for w in self.by_id.values()
            if w.healthy and w.worker_id != hello.peer_id and w.model_id == hello.model_id
        }
        held |= {r.dp_rank for r in self.reserved.values() if r.model_id == hello.model_id}  # others' holds
        for wanted in (hold.dp_rank if hold is not None else None, old.dp_rank if old is not None else None):
            if wanted is not None and wanted not in held:
                return wanted
        if hello.rank_hint is not None and hello.rank_hint not in held:
            return hello.rank_hint
        return next(rank for rank in range(len(held) + 1) if rank not in held)

    def add(self, worker: WorkerRecord) -> None:
        old = self.by_id.get(worker.worker_id)
        if old is not None:
            self.by_identity.pop(old.identity, None)
        self.by_id[worker.worker_id] = worker
        self.by_identity[worker.identity] = worker
        self._model_ids = None

    def remove(self, worker: WorkerRecord) -> None:
        self.by_id.pop(worker.worker_id, None)
        self._model_ids = None


class RequestTable:
    """Every request from Submit to its final delta; `held` keeps the waiting ones in arrival order."""

    def __init__(self) -> None:
        self.by_id: dict[str, RequestRecord] = {}
        self.held: OrderedDict[str, RequestRecord] = OrderedDict()
        self._held_priorities: Counter[int] = Counter()  # how many held requests have each priority (fixed per request)

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, request_id: str) -> RequestRecord | None:
        return self.by_id.get(request_id)

    def add(self, request: RequestRecord) -> None:
        self.by_id[request.request_id] = request

    def hold(self, request: RequestRecord, now: float) -> None:
        request.worker_id = None
        if request.held_since is None:
            request.held_since = now
        if request.request_id not in self.held:
            self._held_priorities[request.priority] += 1
        self.held[request.request_id] = request

    def unhold(self, request: RequestRecord) -> None:
        self._release(request.request_id)
        request.held_since = None

    def remove(self, request: RequestRecord) -> None:
        self.by_id.pop(request.request_id, None)
        self._release(request.request_id)

    def worst_held_priority(self) -> int | None:
        """The largest priority (the least urgent) among the held requests, None when none is held: O(distinct
        priorities), so that a full queue refuses a newcomer that could shed nobody without a scan of the queue."""
        return max(self._held_priorities, default=None)

    def _release(self, rid: str) -> None:
        request = self.held.pop(rid, None)
        if request is not None:
            self._held_priorities[request.priority] -= 1
            if not self._held_priorities[request.priority]:
                del self._held_priorities[request.priority]

    @property
    def num_in_flight(self) -> int:
        return len(self.by_id) - len(self.held)


@dataclass
class ModelCounters:
    """What one model's requests came to (ModelStats): submitted, finished without an error (aborts not counted),
    failed."""

    submitted: int = 0
    completed: int = 0
    failed: int = 0


@dataclass
class ClusterStatus:
    """The cluster-wide facts: one part writes each, the jobs read them. `state`: the lifecycle (commands.py
    applies the table); `weight_version`: the weights every routable worker serves, and `refit_pending`: a weight
    update waits for the workers, holding new requests (commands.py); `model_id`: the model Welcome names (the
    default model: --model-id's first, else the first worker's; coordinator/models.py serves the others);
    `drain`: (why, deadline) of a drain before STOP (core.py)."""

    model_id: str | None
    state: ClusterState = ClusterState.RUNNING
    weight_version: int = 0
    refit_pending: bool = False
    drain: tuple[str, float] | None = None
