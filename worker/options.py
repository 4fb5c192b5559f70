"""The worker's own options (the engine's are EngineConfig): what the coordinator is, who this rank is, its
timers and limits."""

from __future__ import annotations

from dataclasses import dataclass

from infer.protocol.keys import CurveKeys
from infer.protocol.messages import MAX_DP_RANK, MAX_ID_LEN
from infer.worker.group_sync import EpOptions
from infer.worker.tp_group import TpOptions

MAX_QUEUE_TIME_S = 86400.0   # the largest --max-queue-time


@dataclass(frozen=True)
class WorkerOptions:
    """The worker's own options (the engine's are EngineConfig). Times are seconds."""

    coordinator: str
    worker_id: str
    dp_rank: int | None = None          # None: the coordinator assigns one (the lowest free rank)
    group_id: str | None = None         # None: "dp<rank>" (an EP group's members name their group)
    heartbeat_interval: float = 1.0
    coordinator_timeout: float = 10.0   # silence after which the worker says Hello again
    drain_timeout: float = 30.0
    connect_timeout: float = 60.0       # for the first Welcome
    benchmark_mode: bool = False
    benchmark_step_time: float = 0.0    # with benchmark_mode: seconds each step lasts
    ep: EpOptions | None = None         # this rank's EP group (None: a group of one)
    tp: TpOptions | None = None         # this DP rank's TP group (None: one process)
    max_waiting_requests: int = 1024    # beyond max_num_seqs running: a Dispatch past it is "overloaded"
    max_queue_time: float = 60.0        # a request not started this long after it came fails "overloaded"; 0: never
    curve: CurveKeys | None = None      # CurveZMQ towards the coordinator (and the EP group's wake channel)

    def __post_init__(self) -> None:
        if not self.coordinator.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--coordinator must be tcp://HOST:PORT (or ipc://PATH), got {self.coordinator!r}")
        for name in ("worker_id", "group_id"):
            value = getattr(self, name)
            if value is not None and not 0 < len(value) <= MAX_ID_LEN:
                raise ValueError(f"{name} must be 1..{MAX_ID_LEN} characters, got {value!r}")
        if self.dp_rank is not None and not 0 <= self.dp_rank <= MAX_DP_RANK:
            raise ValueError(f"dp_rank must be in [0, {MAX_DP_RANK}], got {self.dp_rank}")
        for name in ("heartbeat_interval", "coordinator_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if not 0 <= self.max_queue_time <= MAX_QUEUE_TIME_S:
            raise ValueError(f"max_queue_time must be in [0, {MAX_QUEUE_TIME_S:g}] s (0: no bound), got "
                             f"{self.max_queue_time}")
        if not 0 <= self.benchmark_step_time <= 3600 or (self.benchmark_step_time and not self.benchmark_mode):
            raise ValueError(f"--benchmark-step-time must be in [0, 3600] s and needs --benchmark-mode, got "
                             f"{self.benchmark_step_time}")
        if self.ep is not None and self.benchmark_mode:
            raise ValueError("--benchmark-mode has no model, so no EP group: leave out --ep-size")
        if self.tp is not None and self.benchmark_mode:
            raise ValueError("--benchmark-mode has no model, so no TP group: leave out --tp-size")
        if self.coordinator_timeout <= self.heartbeat_interval:
            raise ValueError(f"coordinator_timeout ({self.coordinator_timeout}) must exceed heartbeat_interval "
                             f"({self.heartbeat_interval})")
