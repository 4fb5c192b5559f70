"""Micro-batches in flight through a pipeline (worker/parallel/pp_group.py), torch-free: what the engine of stage 0 has
launched and not yet finished, and the rules for launching the next.

With P stages, stage 0 launches up to `depth` = P micro-batches before it finishes the oldest, so that while the
last stage computes batch k the first computes batch k + 1: in the steady state every engine step finishes one
micro-batch and launches one, and every stage works at once (vLLM's P batches in flight). The rules:

- a request is in at most one micro-batch in flight (`busy`: the scheduler neither schedules nor preempts it
  until its batch finished and its sampled token is appended);
- a step's batch takes at most its share of the unfinished requests (`seats`: ceil(unfinished / depth)), so that
  a batch of 32 decodes runs as P micro-batches rather than one batch and P - 1 empty ones;
- a batch that reads more than its logits from the last stage (prompt logprobs: "logits" commands over the last
  forward's hidden states) is `alone`: nothing is launched after it until it has finished (pipelines refuse pooling
  and beam searches, which would need the hidden states or KV copies on every stage);
- micro-batches finish in launch order (every stage hands them on in that order).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from infer.worker.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class InFlight:
    """One launched micro-batch: what the scheduler planned, and the runner's handle to finish it with."""

    scheduled: SchedulerOutput
    launched: Any  # worker/engine/model_runner.py's Launched
    alone: bool  # nothing may be launched after it before it finishes


def runs_alone(scheduled: SchedulerOutput) -> bool:
    """Whether a micro-batch must be the last in flight (see the module docstring)."""
    return any(c.request.prompt_logprobs is not None for c in scheduled.chunks)


class MicroBatches:
    """The engine's micro-batches in flight, oldest first (`depth` at most)."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"micro-batches in flight: the depth is at least 1, got {depth}")
        self.depth = depth
        self._flights: deque[InFlight] = deque()
        self.num_overlapped = 0  # launches made while another micro-batch was in flight

    def __len__(self) -> int:
        return len(self._flights)

    @property
    def busy(self) -> frozenset[str]:
        """The ids of the requests in a micro-batch in flight."""
        return frozenset(c.request.request_id for f in self._flights for c in f.scheduled.chunks)

    def must_finish(self) -> bool:
        """Whether the oldest must finish before the next launch: `depth` are in flight, or the newest runs alone."""
        return bool(self._flights) and (len(self._flights) >= self.depth or self._flights[-1].alone)

    def seats(self, num_unfinished: int) -> int:
        """The most requests the next micro-batch takes: its share of the `num_unfinished` requests."""
        return max(1, -(-num_unfinished // self.depth))

    def add(self, scheduled: SchedulerOutput, launched: Any) -> None:
        self.num_overlapped += bool(self._flights)
        self._flights.append(InFlight(scheduled, launched, runs_alone(scheduled)))

    def pop_oldest(self) -> InFlight:
        return self._flights.popleft()
