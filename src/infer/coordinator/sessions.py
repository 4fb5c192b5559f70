"""Session pinning: a conversation (Submit.session_id, the HTTP front's X-Session-ID header: vLLM router's name)
goes back to the DP rank that ran its previous request, where its KV blocks are, while that rank can take it. Pure
Python, no I/O.

A session's home yields, as prefix affinity's does (routing.py), when the rank is not among the candidates (dead,
draining, out of routing, or at its request limit) or overloaded: its pool is full (score >= 1) or its score exceeds
the least loaded candidate's by more than `overload_margin`; the routing policy then chooses, and its choice is the
session's new home. Each routing policy runs behind it (the table is the same for all of them); under kv-aware the
pin also covers what the index cannot see: a text prompt (no token ids at the coordinator) and blocks whose
KvEvents have not arrived yet. Bounded: at most `max_sessions` sessions, the least recently routed forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeVar

from infer.coordinator.routing import RankLoad

R = TypeVar("R", bound=RankLoad)


class Sessions:
    """(model, session id) -> the DP rank of its last request."""

    def __init__(self, max_sessions: int = 100_000, overload_margin: float = 0.25) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if not overload_margin >= 0:
            raise ValueError(f"overload_margin must be >= 0, got {overload_margin}")
        self.max_sessions = max_sessions
        self.overload_margin = overload_margin
        self._homes: OrderedDict[tuple[str, str], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def home(self, model: str, session_id: str, candidates: Sequence[R]) -> R | None:
        """The session's rank among `candidates` when it may take the request, else None (the policy chooses)."""
        rank = self._homes.get((model, session_id))
        if rank is None:
            return None
        home = next((c for c in candidates if c.dp_rank == rank), None)
        if home is None:
            return None
        score, lowest = home.score, min(c.score for c in candidates)
        if score >= 1.0 or score - lowest > self.overload_margin:
            return None
        return home

    def remember(self, model: str, session_id: str, dp_rank: int) -> None:
        key = (model, session_id)
        self._homes[key] = dp_rank
        self._homes.move_to_end(key)
        while len(self._homes) > self.max_sessions:
            self._homes.popitem(last=False)

    def forget_rank(self, model: str, dp_rank: int) -> None:
        """The rank left (died, drains): its sessions find a new home (their KV is gone with it)."""
        for key in [k for k, rank in self._homes.items() if k[0] == model and rank == dp_rank]:
            del self._homes[key]
