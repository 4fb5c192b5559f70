"""Commands the coordinator answers only once every worker has carried them out (no I/O, no torch).

`suspend` and `resume` (the caller wants the memory freed / back when the call returns) and `update_weights`
(the call returns when every worker serves the new weights) are sent to every healthy worker; a
`WorkerBarrier` collects their answers. It completes when each worker answered or is gone (a dead worker
counts as a failure: it never confirmed), or fails at its deadline naming the workers still silent.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerBarrier:
    """One command waiting for the workers' answers. `what` names it in messages ("suspend", "update_weights
    to version 3"); `client` is the identity to answer; `version` is a refit's weight version."""

    what: str
    client: bytes
    pending: set[str]
    deadline: float
    version: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    bytes_released: int = 0
    bytes_restored: int = 0
    workers: frozenset[str] = frozenset()  # every worker asked (`pending` at the start)

    def __post_init__(self) -> None:
        self.workers = frozenset(self.pending)

    def answer(
        self, worker_id: str, error: str | None = None, bytes_released: int = 0, bytes_restored: int = 0
    ) -> None:
        """A worker's answer; answers from workers not (or no longer) waited for are ignored."""
        if worker_id not in self.pending:
            return
        self.pending.discard(worker_id)
        if error is not None:
            self.errors[worker_id] = error
        self.bytes_released += bytes_released
        self.bytes_restored += bytes_restored

    def forget(self, alive: set[str]) -> None:
        """Workers no longer alive fail their part: they never confirmed."""
        for worker_id in sorted(self.pending - alive):
            self.answer(worker_id, error="the worker died before it answered")

    def done(self) -> bool:
        return not self.pending

    def expired(self, now: float) -> bool:
        return now >= self.deadline and bool(self.pending)

    def failure(self) -> str | None:
        """Why the command failed (every worker's error, and who is still silent), or None when it did not."""
        parts = [f"worker {wid}: {error}" for wid, error in sorted(self.errors.items())]
        if self.pending:
            parts.append(f"no answer in time from {', '.join(sorted(self.pending))}")
        return f"{self.what} failed: " + "; ".join(parts) if parts else None
