"""Routing by what the workers hold: KvIndex (which worker holds which prefix-cache block, fed by the workers'
KvEvents) and the `kv-aware` policy that routes on it. Pure Python, no I/O, time passed in.

The index. Each worker publishes its prefix cache's changes (protocol/messages.py KvEvents on its StepBatch: the
block hashes it started or stopped holding, the cache's own keys, protocol/prefix_hash.py). The index applies them
per worker, in order: `seq` counts a worker's frames since its last snapshot (`reset`), so a lost or rejected frame
is a gap, never drift: on a gap, or a worker claiming more hashes than its pool has blocks, its entries are dropped
and `apply` says why, which the caller sends the worker as KvResync (at most once per RESYNC_INTERVAL_S while it is
stale); the worker answers with a snapshot. Entries are kept per worker *record* (a worker that registers again is a
new record: its old entries are ignored at once and replaced by the snapshot its Welcome asks for), and dropped
when it dies or drains (`forget_rank`). Memory is bounded: at most `max_entries` (hash, worker) pairs, the hashes
stored least recently evicted first (a forgotten entry costs a hit, never correctness: the worker checks tokens).

The policy. Dynamo's KV router scores a worker `overlap_score_weight * prefill_blocks + decode_blocks` (blocks to
prefill given its cached overlap, plus the blocks its active requests hold) and takes the lowest; llm-d's scheduler
adds normalized scorers (prefix-cache hit fraction, queue depth, KV utilization) with weights (3 prefix : 2 queue by
default) and takes the highest. We take Dynamo's form, in tokens, on the load the coordinator already keeps:

    cost(rank) = load_tokens(rank) + overlap_weight * (prompt_tokens - cached_tokens(rank))

`load_tokens` is the routing score (queued + running tokens from the rank's last Load, plus the unreported
requests sent since: routing.py) times its KV capacity, taken at the busiest rank of its EP group as least_loaded
does; `cached_tokens` is the leading run of the prompt's full blocks the index says the rank holds (at most
`(len - 1) // block_size` blocks: the last token is always computed). Why this form: it is a sum of two counts in
the same unit (tokens), so the weight has a plain meaning (W: a token not to prefill is worth W tokens of load
elsewhere), it needs no normalization across ranks (llm-d's min-max scaling makes a 1-token difference
look like the whole range when two ranks are close), and an idle rank with nothing cached still wins against a
rank whose queue is longer than the prompt it would save (SGLang's cache-aware router piles onto the rank that
holds the prefix however long its queue; here the queue pays for itself). A rank whose pool is full (score >= 1)
is left out while another can take the request. No overlap anywhere, or a text prompt (the coordinator has no
tokenizer: the worker tokenizes text, and a direct stream's ids never come back to it): least_loaded, exactly.

The default weight is 8, not Dynamo's 1, because the two counts are not the same work here: a running request's
whole context counts in `load_tokens` (it holds that much KV), though a decode step adds one token of compute for
it, while an uncached prompt token is a token of prefill. At 1, load differences of one request's context (a few
hundred tokens, common whenever conversations run at once) outweighed a whole conversation's cached history, and
kv-aware hit little more than least-loaded; at 8 it reached 97-99% of the hit rate of one worker holding
everything, with the busiest worker's queue at most 1.2x the mean (benchmarks/kv_routing.py, the README's table).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast

from infer.coordinator.routing import Prompt, R, RankLoad, least_loaded
from infer.protocol.messages import KvEvents
from infer.protocol.prefix_hash import adapter_salt, prompt_block_hashes

RESYNC_INTERVAL_S = 1.0  # a stale worker is asked for a snapshot again at most this often
DEFAULT_OVERLAP_WEIGHT = 8.0  # measured: benchmarks/kv_routing.py, the README's table (why not 1: the module doc)
DEFAULT_MAX_ENTRIES = 1 << 21  # (hash, worker) pairs: ~2M, some 300 MiB at most; 64 workers of 32k blocks fit


class KvRank(RankLoad, Protocol):
    """What the kv-aware policy reads about a routable rank, beyond its load: which worker it is and its KV
    geometry (coordinator/state.py WorkerRecord)."""

    @property
    def worker_id(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def capacity_tokens(self) -> int: ...


K = TypeVar("K", bound=KvRank)


@dataclass(eq=False)
class _WorkerView:
    """What the index knows of one worker: the record its entries came from, its event stream's position, and the
    hashes it holds. `stale`: entries dropped after a gap; its events are ignored until a reset."""

    owner: object
    dp_rank: int
    epoch: int = -1
    next_seq: int = 0
    stale: bool = True
    resync_at: float | None = None  # when a KvResync was last asked for (None: not since it went stale)
    hashes: set[int] = field(default_factory=set)


class KvIndex:
    """Block hash -> the workers holding it, from their KvEvents; bounded (see the module doc)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._holders: OrderedDict[int, set[str]] = OrderedDict()  # hash -> worker ids; least recently stored first
        self._views: dict[str, _WorkerView] = {}
        self.num_entries = 0  # (hash, worker) pairs
        self.num_resyncs = 0  # snapshots asked for (gaps, bounds broken)

    def __len__(self) -> int:
        return len(self._holders)

    def holds(self, worker_id: str) -> int:
        """How many hashes the index has for `worker_id`."""
        view = self._views.get(worker_id)
        return 0 if view is None else len(view.hashes)

    def apply(
        self, worker_id: str, owner: object, dp_rank: int, events: KvEvents, max_hashes: int, now: float
    ) -> str | None:
        """Apply one worker's KvEvents (`owner`: its current record; `max_hashes`: its pool's blocks, the most
        distinct hashes it can hold). Returns why the worker must send a snapshot (KvResync), or None."""
        view = self._views.get(worker_id)
        if view is None or view.owner is not owner:
            self.drop(worker_id)
            view = self._views[worker_id] = _WorkerView(owner, dp_rank)
        view.dp_rank = dp_rank
        if events.reset:
            self._clear(worker_id, view)
            view.epoch, view.next_seq, view.stale, view.resync_at = events.epoch, 0, False, None
        elif view.stale:
            return self._resync(view, "no snapshot yet", now)
        elif (events.epoch, events.seq) != (view.epoch, view.next_seq):
            where = f"epoch {events.epoch} seq {events.seq}, expected epoch {view.epoch} seq {view.next_seq}"
            return self._stale(worker_id, view, f"a gap in its KV events ({where})", now)
        view.next_seq += 1
        for block_hash in events.removed:
            self._remove(worker_id, view, block_hash)
        for block_hash in events.stored:
            self._store(worker_id, view, block_hash)
        if len(view.hashes) > max_hashes:
            return self._stale(
                worker_id, view, f"it reported {len(view.hashes)} cached blocks, more than its {max_hashes}", now
            )
        self._evict()
        return None

    def drop(self, worker_id: str) -> None:
        """Forget everything of `worker_id` (it died, drains, or registered again)."""
        view = self._views.pop(worker_id, None)
        if view is not None:
            self._clear(worker_id, view)

    def drop_rank(self, dp_rank: int) -> None:
        for worker_id in [w for w, view in self._views.items() if view.dp_rank == dp_rank]:
            self.drop(worker_id)

    def cached_blocks(self, hashes: Sequence[int], ranks: Sequence[K]) -> list[int]:
        """For each of `ranks`, how many of `hashes` (a prompt's leading blocks, in order) it holds as a leading run;
        0 for a rank whose entries came from an earlier record of its worker."""
        views = self._views
        counts = [0] * len(ranks)
        alive: dict[str, int] = {}
        for i, rank in enumerate(ranks):
            view = views.get(rank.worker_id)
            if view is not None and view.owner is rank and not view.stale:
                alive[rank.worker_id] = i
        for depth, block_hash in enumerate(hashes):
            if not alive:
                break
            holders = self._holders.get(block_hash, ())
            for worker_id in [w for w in alive if w not in holders]:
                counts[alive.pop(worker_id)] = depth
        for i in alive.values():
            counts[i] = len(hashes)
        return counts

    def _stale(self, worker_id: str, view: _WorkerView, reason: str, now: float) -> str | None:
        self._clear(worker_id, view)
        view.stale, view.resync_at = True, None
        return self._resync(view, reason, now)

    def _resync(self, view: _WorkerView, reason: str, now: float) -> str | None:
        if view.resync_at is not None and now - view.resync_at < RESYNC_INTERVAL_S:
            return None
        view.resync_at = now
        self.num_resyncs += 1
        return reason

    def _clear(self, worker_id: str, view: _WorkerView) -> None:
        for block_hash in view.hashes:
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[block_hash]
        self.num_entries -= len(view.hashes)
        view.hashes = set()

    def _store(self, worker_id: str, view: _WorkerView, block_hash: int) -> None:
        holders = self._holders.get(block_hash)
        if holders is None:
            holders = self._holders[block_hash] = set()
        else:
            self._holders.move_to_end(block_hash)
        if worker_id not in holders:
            holders.add(worker_id)
            view.hashes.add(block_hash)
            self.num_entries += 1

    def _remove(self, worker_id: str, view: _WorkerView, block_hash: int) -> None:
        if block_hash not in view.hashes:
            return
        view.hashes.discard(block_hash)
        self.num_entries -= 1
        holders = self._holders[block_hash]
        holders.discard(worker_id)
        if not holders:
            del self._holders[block_hash]

    def _evict(self) -> None:
        while self.num_entries > self.max_entries:
            block_hash, holders = self._holders.popitem(last=False)
            for worker_id in holders:
                self._views[worker_id].hashes.discard(block_hash)
            self.num_entries -= len(holders)


class KvAware:
    """`--policy kv-aware`: the lowest `load + overlap_weight * tokens to prefill` (see the module doc)."""

    name = "kv-aware"

    def __init__(self, overlap_weight: float = DEFAULT_OVERLAP_WEIGHT, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if not overlap_weight >= 0:
            raise ValueError(f"overlap_weight must be >= 0, got {overlap_weight}")
        self.overlap_weight = overlap_weight
        self.index = KvIndex(max_entries)
        self.routed_prompt_tokens = 0  # of the requests routed by overlap (some rank held part of the prompt)
        self.routed_cached_tokens = 0  # of those, the tokens the chosen rank held by the index

    def choose(self, prompt: Prompt, candidates: Sequence[R]) -> R:
        """RoutingPolicy's entry (no adapter); the candidates must be KvRanks (the coordinator's WorkerRecords are):
        admission calls `choose_for`, which says so in its type."""
        return cast(R, self.choose_for(prompt, cast(Sequence[KvRank], candidates), None))

    def choose_for(self, prompt: Prompt, candidates: Sequence[K], lora_name: str | None) -> K:
        """The rank for `prompt` run with adapter `lora_name` (its blocks are keyed by it, as on the worker)."""
        if isinstance(prompt, str) or len(candidates) == 1 or not len(self.index):
            return least_loaded(candidates)
        cached = self._cached_tokens(prompt, candidates, adapter_salt(lora_name))
        if not any(cached):
            return least_loaded(candidates)
        scores = [rank.score for rank in candidates]
        busiest: dict[str, float] = {}
        for rank, score in zip(candidates, scores):
            busiest[rank.group_id] = max(score, busiest.get(rank.group_id, -1.0))
        room = [i for i, score in enumerate(scores) if score < 1.0] or list(range(len(candidates)))
        weight, num_tokens = self.overlap_weight, len(prompt)

        def cost(i: int) -> tuple[float, float, int, int]:
            rank = candidates[i]
            load = busiest[rank.group_id] * rank.capacity_tokens
            return (load + weight * (num_tokens - cached[i]), scores[i], rank.num_in_flight, rank.dp_rank)

        chosen = min(room, key=cost)
        self.routed_prompt_tokens += num_tokens
        self.routed_cached_tokens += cached[chosen]
        return candidates[chosen]

    def forget_rank(self, dp_rank: int) -> None:
        self.index.drop_rank(dp_rank)

    def _cached_tokens(self, prompt: Sequence[int], candidates: Sequence[K], salt: int | None) -> list[int]:
        """Prompt tokens each candidate holds in its prefix cache (by block size: workers may differ)."""
        cached = [0] * len(candidates)
        by_size: dict[int, list[int]] = {}
        for i, rank in enumerate(candidates):
            by_size.setdefault(rank.block_size, []).append(i)
        for block_size, members in by_size.items():
            hashes = prompt_block_hashes(prompt, block_size, salt, (len(prompt) - 1) // block_size)
            counts = self.index.cached_blocks(hashes, [candidates[i] for i in members])
            for i, count in zip(members, counts):
                cached[i] = count * block_size
        return cached
