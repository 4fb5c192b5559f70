"""CoordinatorConfig: the coordinator's options, validated once (frozen)."""

from __future__ import annotations

from dataclasses import dataclass

from infer.coordinator.routing import POLICIES


@dataclass(frozen=True)
class CoordinatorConfig:
    """Options of one coordinator.

    heartbeat_interval: how often the coordinator sends each worker a Heartbeat (and runs its timers).
    worker_timeout: a worker silent this long is declared dead (a hang); a worker whose connection is
        gone (a send to it is unroutable) is declared dead at once.
    client_timeout: a client with requests in flight and silent this long is declared dead: its requests
        are aborted on the workers.
    max_retries: how many times one request may be re-dispatched after worker failures before it fails.
    queue_timeout: how long a request may wait for a healthy worker (while running) before it fails.
    stop_timeout: how long STOP waits for workers to acknowledge before the coordinator exits anyway.
    drain_timeout: on SIGTERM / SIGINT, how long requests already accepted get to finish (new ones are
        refused as "unavailable") before STOP; 0 runs STOP at once. A second signal runs STOP at once.
    model_id: the model every worker must serve; None takes the first worker's.
    """

    host: str = "127.0.0.1"
    port: int = 5555
    policy: str = "least-loaded"
    heartbeat_interval: float = 1.0
    worker_timeout: float = 10.0
    client_timeout: float = 10.0
    max_retries: int = 3
    queue_timeout: float = 120.0
    stop_timeout: float = 5.0
    drain_timeout: float = 0.0
    model_id: str | None = None
    coordinator_id: str = "coordinator"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("heartbeat_interval", "worker_timeout", "client_timeout", "queue_timeout", "stop_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(self.drain_timeout, (int, float)) or not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be a number of seconds >= 0, got {self.drain_timeout!r}")
        if self.worker_timeout <= self.heartbeat_interval or self.client_timeout <= self.heartbeat_interval:
            raise ValueError(f"worker_timeout ({self.worker_timeout}) and client_timeout ({self.client_timeout}) "
                             f"must exceed heartbeat_interval ({self.heartbeat_interval})")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"
