"""Requests a worker still runs that this coordinator has no record of: after the coordinator restarted, its
workers register again with every running request as it stands (a RequestSnapshot), and the clients re-attach
(Submit with `reattach`) a moment later. Until then, or until they expire, those requests are orphans: their
later deltas are kept here, so the stream can be handed back from wherever the client's copy stops. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.protocol.journal import StreamJournal
from infer.protocol.messages import Delta, RequestSnapshot, TokenIds


@dataclass(eq=False)
class Orphan:
    """One request a worker runs for a client the coordinator does not know yet: the worker's snapshot and the
    deltas after it, in one stream journal; `latest` is the last of those deltas (its weight version, and
    whether it ended before the client came back: `final`)."""

    worker_id: str
    request_id: str
    prompt_token_ids: list[int]
    since: float
    journal: StreamJournal = field(default_factory=StreamJournal)
    latest: Delta | None = None
    seed: int | None = None  # the sampling seed it runs with
    stream_owner: str | None = None  # a direct stream's owner (its client's key, "" without keys) and token
    stream_token: str | None = None

    @property
    def final(self) -> Delta | None:
        """Its finished delta, when it ended before the client came back."""
        return self.latest if self.latest is not None and self.latest.finished else None

    @classmethod
    def from_snapshot(cls, worker_id: str, snapshot: RequestSnapshot, now: float) -> Orphan:
        return cls(
            worker_id=worker_id,
            request_id=snapshot.request_id,
            prompt_token_ids=snapshot.prompt_token_ids,
            since=now,
            journal=StreamJournal.from_snapshot(snapshot),
            seed=snapshot.seed,
            stream_owner=snapshot.stream_owner,
            stream_token=snapshot.stream_token,
        )

    def extend(self, delta: Delta) -> None:
        """A later delta of this request from its worker."""
        self.journal.record(delta.token_ids, delta.text)
        self.latest = delta

    def catch_up(self, held: TokenIds) -> tuple[TokenIds, str] | None:
        """What a client holding the output tokens `held` still lacks (tokens, text), or None when its copy
        does not match this one or stops inside a delta (the request must then be resumed from `held`)."""
        return self.journal.catch_up(held)


class OrphanTable:
    """Orphans by request id."""

    def __init__(self) -> None:
        self.by_id: dict[str, Orphan] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def add(self, orphan: Orphan) -> None:
        self.by_id[orphan.request_id] = orphan

    def get(self, request_id: str) -> Orphan | None:
        return self.by_id.get(request_id)

    def take(self, request_id: str) -> Orphan | None:
        return self.by_id.pop(request_id, None)

    def drop_worker(self, worker_id: str) -> list[Orphan]:
        """Forget the orphans of a worker that died (their clients will resume them from their own copy)."""
        dropped = [o for o in self.by_id.values() if o.worker_id == worker_id]
        for orphan in dropped:
            del self.by_id[orphan.request_id]
        return dropped

    def expired(self, now: float, ttl: float) -> list[Orphan]:
        """Remove and return the orphans no client claimed within `ttl` seconds."""
        old = [o for o in self.by_id.values() if now - o.since > ttl]
        for orphan in old:
            del self.by_id[orphan.request_id]
        return old
