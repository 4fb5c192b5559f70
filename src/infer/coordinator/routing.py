"""Routing policies: which DP rank runs a request. Pure Python (no sockets, no torch).

A policy sees the routable ranks as `RankLoad`s: the rank, a load score (a fraction of the rank's KV
capacity, in tokens: queued + running tokens from the rank's last report plus the estimated tokens of
requests the coordinator sent it that the report does not count yet), and the coordinator's own in-flight
count. The unreported part is what spreads a burst before the next report arrives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

Prompt = str | Sequence[int]

POLICIES = ("least-loaded", "round-robin", "prefix-affinity", "kv-aware")


class RankLoad(Protocol):
    """What a policy may read about a routable rank."""

    @property
    def dp_rank(self) -> int: ...

    @property
    def score(self) -> float:
        """Load as a fraction of capacity (0 = idle, >= 1 = more work than the KV pool holds)."""
        ...

    @property
    def num_in_flight(self) -> int: ...

    @property
    def group_id(self) -> str:
        """Its EP group (a DP-only rank is a group of one): a group steps at its busiest rank's pace."""
        ...


# A policy returns one of the candidates it was given, so the caller gets its own rank type back.
R = TypeVar("R", bound=RankLoad)


class RoutingPolicy(Protocol):
    """Chooses one of `candidates` (never empty, all healthy) for a request."""

    name: str

    def choose(self, prompt: Prompt, candidates: Sequence[R]) -> R: ...

    def forget_rank(self, dp_rank: int) -> None:
        """The rank left the cluster: drop whatever the policy remembers about it."""
        ...


def least_loaded(candidates: Sequence[R]) -> R:
    """The least loaded rank of the group whose busiest rank is least loaded (the ranks of an EP group step
    together, so a group's step costs what its busiest rank's costs); within it the lowest score, then fewer
    in-flight requests, then the lower rank. With groups of one rank: simply the lowest score."""
    if len(candidates) == 1:
        return candidates[0]
    scores = [rank.score for rank in candidates]  # once each: it is most of a choice's cost at many ranks
    busiest: dict[str, float] = {}
    for rank, score in zip(candidates, scores):
        if score > busiest.get(rank.group_id, -1.0):
            busiest[rank.group_id] = score
    keys = [
        (busiest[r.group_id], score, r.num_in_flight, r.dp_rank, i)
        for i, (r, score) in enumerate(zip(candidates, scores))
    ]
    return candidates[min(keys)[-1]]


class LeastLoaded:
    """See `least_loaded`."""

    name = "least-loaded"

    def choose(self, prompt: Prompt, candidates: Sequence[R]) -> R:
        return least_loaded(candidates)

    def forget_rank(self, dp_rank: int) -> None:
        pass


class RoundRobin:
    """Ranks in ascending order, wrapping around; stable when ranks join or leave."""

    name = "round-robin"

    def __init__(self) -> None:
        self._last = -1

    def choose(self, prompt: Prompt, candidates: Sequence[R]) -> R:
        after = [c for c in candidates if c.dp_rank > self._last]
        chosen = min(after or candidates, key=lambda c: c.dp_rank)
        self._last = chosen.dp_rank
        return chosen

    def forget_rank(self, dp_rank: int) -> None:
        pass


class PrefixAffinity:
    """Send a prompt where its longest known prefix went before (its KV blocks are likely cached there).

    The map from prefix hashes to ranks is bounded (`max_entries`, least recently used evicted first)
    and pruned of ranks that left. It yields to load: when the affine rank's score exceeds the least
    loaded rank's by more than `overload_margin`, or reaches 1 (its pool is full), the least loaded
    rank is taken instead (and becomes the prefix's new home).
    """

    name = "prefix-affinity"

    def __init__(
        self,
        max_entries: int = 100_000,
        chunk_chars: int = 64,
        chunk_tokens: int = 16,
        max_chunks: int = 64,
        overload_margin: float = 0.25,
    ) -> None:
        if max_entries < 1 or chunk_chars < 1 or chunk_tokens < 1 or max_chunks < 1:
            raise ValueError("max_entries, chunk_chars, chunk_tokens and max_chunks must be >= 1")
        if overload_margin < 0:
            raise ValueError(f"overload_margin must be >= 0, got {overload_margin}")
        self.max_entries = max_entries
        self.chunk_chars = chunk_chars
        self.chunk_tokens = chunk_tokens
        self.max_chunks = max_chunks
        self.overload_margin = overload_margin
        self._table: OrderedDict[int, int] = OrderedDict()  # prefix hash -> dp rank

    def __len__(self) -> int:
        return len(self._table)

    def choose(self, prompt: Prompt, candidates: Sequence[R]) -> R:
        hashes = self.prefix_hashes(prompt)
        best = least_loaded(candidates)
        home = self._lookup(hashes, {c.dp_rank: c for c in candidates})
        chosen = best if home is None or self._overloaded(home, best) else home
        self._remember(hashes, chosen.dp_rank)
        return chosen

    def forget_rank(self, dp_rank: int) -> None:
        for h in [h for h, rank in self._table.items() if rank == dp_rank]:
            del self._table[h]

    def prefix_hashes(self, prompt: Prompt) -> list[int]:
        """A hash chain over the prompt's full chunks (chars of a string, tokens of an id list)."""
        size = self.chunk_chars if isinstance(prompt, str) else self.chunk_tokens
        n = min(len(prompt) // size, self.max_chunks)
        hashes, h = [], 0
        for i in range(n):
            chunk = prompt[i * size : (i + 1) * size]
            h = hash((h, chunk if isinstance(chunk, str) else tuple(chunk)))
            hashes.append(h)
        return hashes

    def _lookup(self, hashes: list[int], by_rank: dict[int, R]) -> R | None:
        for h in reversed(hashes):  # longest known prefix first
            rank = self._table.get(h)
            if rank is None:
                continue
            if rank in by_rank:
                return by_rank[rank]
            del self._table[h]  # points at a rank that is gone or unhealthy
        return None

    def _overloaded(self, home: RankLoad, best: RankLoad) -> bool:
        return home.score >= 1.0 or home.score - best.score > self.overload_margin

    def _remember(self, hashes: list[int], dp_rank: int) -> None:
        table = self._table
        for h in hashes:
            table[h] = dp_rank
            table.move_to_end(h)
        while len(table) > self.max_entries:
            table.popitem(last=False)
