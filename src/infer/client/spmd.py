"""SPMD ranks: one engine in every process of a multi-process program (torchrun, srun), one coordinator.

Every rank constructs `LLM(..., use_coordinator=True)`. Global rank 0 starts the coordinator (a child process,
on $MASTER_ADDR, port $INFER_COORDINATOR_PORT or $MASTER_PORT + 1); every rank, rank 0 included, builds its
engine in this process (from the model path, or around an in-memory model) and runs an `InProcessWorker`: the
worker loop of `infer-worker` on a thread, joined to that coordinator as DP rank = global rank. Rank 0 feeds
prompts and reads outputs (its `is_primary_rank`); the others only serve. `close()` on rank 0 stops the
cluster; on the other ranks it waits for that (or for the coordinator to vanish).

An in-memory model in coordinator mode outside torchrun is the same with a world of one rank.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from infer.protocol import env
from infer.worker.service.core import EXIT_OK
from infer.worker.service.daemon import Worker
from infer.worker.service.options import WorkerOptions

if TYPE_CHECKING:
    from infer.worker.engine.engine import Engine

log = logging.getLogger("infer.spmd")

DEFAULT_MASTER_PORT = 29500
COORDINATOR_SILENCE_S = 30.0  # a non-primary rank's close() stops waiting once the coordinator is this silent


def _int_env(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise ValueError(f"environment variable {name}={value!r} is not a non-negative integer")
            return int(value)
    return None


@dataclass(frozen=True)
class SpmdWorld:
    """This process's place in the program: rank, world size, and where rank 0's coordinator listens."""

    rank: int
    world_size: int
    host: str
    port: int

    @classmethod
    def from_env(cls) -> SpmdWorld:
        """$RANK / $SLURM_PROCID, $WORLD_SIZE / $SLURM_NTASKS, $MASTER_ADDR, $INFER_COORDINATOR_PORT or
        $MASTER_PORT + 1; a single process (rank 0 of 1 on loopback, port 0: its coordinator binds one the OS
        chooses, and `LLM` reads it back) when they are not set.
        ValueError for values that cannot be right."""
        rank = _int_env("RANK", "SLURM_PROCID") or 0
        world_size = _int_env("WORLD_SIZE", "SLURM_NTASKS") or 1
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} process(es) (RANK / WORLD_SIZE)")
        host = os.environ.get("MASTER_ADDR", "").strip()
        if world_size > 1 and not host:
            raise ValueError(
                f"{world_size} ranks need MASTER_ADDR (the host of rank 0, where the coordinator "
                f"listens); torchrun sets it"
            )
        port = _int_env(env.COORDINATOR_PORT.name)
        if port is None:
            master_port = _int_env("MASTER_PORT")
            port = (master_port or DEFAULT_MASTER_PORT) + 1 if world_size > 1 or master_port else 0
        if not 0 < port < 65536 and not (port == 0 and world_size == 1):
            raise ValueError(f"the coordinator port {port} is not a TCP port")
        return cls(rank, world_size, host or "127.0.0.1", port)

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        try:
            return self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


class InProcessWorker:
    """The `infer-worker` loop around an engine of this process, on a thread of its own (one DP rank)."""

    def __init__(self, engine: Engine, coordinator: str, dp_rank: int, connect_timeout: float) -> None:
        self.context = zmq.Context()
        worker_id = f"{socket.gethostname()}-rank{dp_rank}-{os.getpid()}"
        options = WorkerOptions(
            coordinator=coordinator, worker_id=worker_id, dp_rank=dp_rank, connect_timeout=connect_timeout
        )
        self.worker = Worker(engine, options, self.context)
        self.engine = engine
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name=f"infer-worker-rank{dp_rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        threads = getattr(getattr(self.engine, "config", None), "num_threads", None)
        if threads is not None:  # torch's intra-op thread count is per thread: set it where the engine steps
            import torch

            torch.set_num_threads(threads)
        try:
            self.exit_code = self.worker.run()
        finally:
            self.context.term()
        report = log.info if self.exit_code == EXIT_OK else log.error
        report("the in-process worker ended (exit %s)", self.exit_code)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Drain and leave (as SIGTERM does to infer-worker): running requests finish, within its drain timeout."""
        self.worker.request_drain()

    def wait(self, timeout: float) -> bool:
        """Wait for the worker to end: told to stop by the coordinator (rank 0 closed), or the coordinator silent
        for COORDINATOR_SILENCE_S (then it is stopped here). False if it still runs after `timeout`."""
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(1.0)
            if time.monotonic() - self.worker.last_heard > COORDINATOR_SILENCE_S:
                log.warning("the coordinator has been silent for %.0f s; leaving", COORDINATOR_SILENCE_S)
                self.stop()
        return not self._thread.is_alive()
