"""Real clusters for acceptance tests: infer-coordinator and infer-worker processes on loopback TCP.

Every process runs in its own session (process group) with its log in the test's tmp dir; whatever a
test leaves running is SIGKILLed (group-wide) and reaped at teardown. Heartbeats and timeouts are short. Workers are
forked from a process that imported torch once (tests/daemon_forkserver.py: the same module run with the same argv,
without ~2.5 s of CPU each); INFER_TEST_EXEC_DAEMONS=1 starts each in a fresh interpreter instead.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from daemon_forkserver import ForkedPopen, exec_daemon, popen_daemon
from ports import reserved_port

from infer.client.inference_client import InferenceClient, SyncInferenceClient

COORDINATOR_FLAGS = [
    "--heartbeat-interval",
    "0.2",
    "--worker-timeout",
    "5",
    # a client's silence: 5 s, not 1.5, since a 2-core machine running the whole suite starves the test process
    # (the client) for seconds; tests about a lost client set their own
    "--client-timeout",
    "5",
    "--stop-timeout",
    "3",
]
WORKER_FLAGS = ["--heartbeat-interval", "0.2", "--coordinator-timeout", "3", "--drain-timeout", "2"]
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1"]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | ForkedPopen
    log: Path
    worker_id: str | None = None  # a worker's --worker-id

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill9(self) -> None:
        _killpg(self.popen, signal.SIGKILL)
        self.popen.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)


def _killpg(popen: subprocess.Popen | ForkedPopen, sig: signal.Signals) -> None:
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Cluster:
    """Starts and tracks the processes of one test cluster (see the module docstring)."""

    logs: Path
    port: int = field(default_factory=reserved_port)
    procs: list[Proc] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def spawn(self, name: str, *argv: str, cwd: Path | None = None, fork: bool = False) -> Proc:
        """`python *argv` in a session of its own, its output in the logs; `fork`: forked from the test process's
        torch-imported server (tests/daemon_forkserver.py: the workers)."""
        log = self.logs / f"{name}-{len(self.procs)}.log"
        popen = (popen_daemon if fork else exec_daemon)(list(argv), log, cwd)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def coordinator(self, *flags: str) -> Proc:
        return self.spawn(
            "coordinator", "-m", "infer.coordinator.daemon", "--port", str(self.port), *COORDINATOR_FLAGS, *flags
        )

    def worker(
        self,
        index: int,
        *flags: str,
        model: str | Path | None = None,
        benchmark: bool = False,
        dp_rank: int | None = None,
        cwd: Path | None = None,
    ) -> Proc:
        """Worker `index` (its name, and its --worker-id w<index>-<n>), started as the README starts one:
        no --dp-rank (the coordinator assigns it) unless `dp_rank` is given; `cwd`: its working directory (a
        relative `model`)."""
        worker_id = f"w{index}-{len(self.procs)}"
        argv = [
            "-m",
            "infer.worker.service.daemon",
            "--coordinator",
            self.address,
            "--worker-id",
            worker_id,
            *WORKER_FLAGS,
        ]
        if dp_rank is not None:
            argv += ["--dp-rank", str(dp_rank)]
        if benchmark:
            argv.append("--benchmark-mode")
        if model is not None:
            argv += ["--model", str(model)]
        proc = self.spawn(f"worker{index}", *argv, *flags, cwd=cwd, fork=True)
        proc.worker_id = worker_id
        return proc

    async def ranks(self, client: InferenceClient, workers: dict[str, Proc], wait_until) -> dict[str, int]:
        """Once as many workers as `workers` are healthy: each one's DP rank (the coordinator assigns them), by the
        name it has in `workers`."""

        async def all_healthy() -> bool:
            return sum(w.healthy for w in (await client.stats()).workers) == len(workers)

        await wait_until(all_healthy, 120, "the workers")
        by_id = {w.worker_id: w.dp_rank for w in (await client.stats()).workers}
        return {name: by_id[proc.worker_id] for name, proc in workers.items()}

    def proc_of(self, worker_id: str) -> Proc:
        """The process of the worker the coordinator's stats call `worker_id`."""
        return next(p for p in self.procs if p.worker_id == worker_id)

    def client(self, **options) -> InferenceClient:
        options = {"heartbeat_interval": 0.2, "silence_timeout": 10.0, "connect_timeout": 10.0, **options}
        return InferenceClient(self.address, **options)

    def alive(self) -> list[Proc]:
        return [p for p in self.procs if p.popen.poll() is None]

    def dump(self) -> str:
        return "\n".join(
            f"==== {p.name} ({p.log.name}, exit {p.popen.poll()}) ====\n{p.text()[-4000:]}" for p in self.procs
        )

    def teardown(self) -> None:
        for proc in self.procs:
            _killpg(proc.popen, signal.SIGKILL)
        for proc in self.procs:
            proc.popen.wait(timeout=10)


@pytest.fixture
def cluster_factory(tmp_path_factory, request) -> Callable[[], Cluster]:
    """Factory of clusters torn down (SIGKILL + reap) after the test; logs are printed if it failed."""
    made: list[Cluster] = []

    def make() -> Cluster:
        cluster = Cluster(logs=tmp_path_factory.mktemp("cluster"))
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            print(cluster.dump())
        cluster.teardown()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


async def _wait_until(predicate, timeout: float, what: str):
    """Re-check an async predicate until it holds (returns its value) or `timeout` passes (AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="session")
def wait_until():
    return _wait_until


def start_model_cluster(
    cluster: Cluster,
    model: Path,
    workers: int = 2,
    coordinator_flags: tuple[str, ...] = (),
    engine_flags: tuple[str, ...] = tuple(ENGINE_FLAGS),
) -> Cluster:
    cluster.coordinator(*coordinator_flags)
    for rank in range(workers):
        cluster.worker(rank, *engine_flags, model=model)
    try:
        with SyncInferenceClient(cluster.address, connect_timeout=30) as client:
            client.wait_for_workers(workers, timeout=120)
    except BaseException:
        print(cluster.dump())
        raise
    return cluster


def start_ep_groups(
    cluster: Cluster,
    model: Path,
    groups: int,
    coordinator_flags: tuple[str, ...] = (),
    engine_flags: tuple[str, ...] = tuple(ENGINE_FLAGS),
) -> list[list[Proc]]:
    """A coordinator and `groups` EP groups of 2 ranks on `model` (an MoE model), ready, started as the
    README starts them (no --dp-rank: the coordinator assigns them); returns each group's [ep rank 0, ep rank
    1] processes."""
    cluster.coordinator(*coordinator_flags)
    members = []
    for g in range(groups):
        dist_init = f"tcp://127.0.0.1:{reserved_port()}"
        members.append(
            [
                cluster.worker(
                    2 * g + r,
                    *engine_flags,
                    "--ep-size",
                    "2",
                    "--ep-rank",
                    str(r),
                    "--dist-init",
                    dist_init,
                    "--ep-timeout",
                    "20",
                    model=model,
                )
                for r in range(2)
            ]
        )
    try:
        with SyncInferenceClient(cluster.address, connect_timeout=30) as client:
            client.wait_for_workers(2 * groups, timeout=120)
    except BaseException:
        print(cluster.dump())
        raise
    return members


@pytest.fixture
def ep_groups(cluster_factory) -> Callable[..., tuple[Cluster, list[list[Proc]]]]:
    """Factory: (cluster, members) of `groups` ready EP groups of 2 ranks on an MoE model (see
    start_ep_groups), torn down after the test."""

    def make(
        model: Path,
        groups: int,
        coordinator_flags: tuple[str, ...] = (),
        engine_flags: tuple[str, ...] = tuple(ENGINE_FLAGS),
    ):
        cluster = cluster_factory()
        return cluster, start_ep_groups(cluster, model, groups, coordinator_flags, engine_flags)

    return make


@pytest.fixture
def model_cluster(cluster_factory, tiny_llama) -> Callable[..., Cluster]:
    """Factory: a started, ready cluster of `workers` workers on the tiny Llama, or on `model` (torn down after
    the test)."""

    def make(
        workers: int = 2,
        coordinator_flags: tuple[str, ...] = (),
        engine_flags: tuple[str, ...] = tuple(ENGINE_FLAGS),
        model: Path | None = None,
    ) -> Cluster:
        return start_model_cluster(cluster_factory(), model or tiny_llama, workers, coordinator_flags, engine_flags)

    return make


@pytest.fixture(scope="module")
def serving_cluster(tmp_path_factory, tiny_llama) -> Cluster:
    """A coordinator and two workers on the tiny Llama, shared by one test module."""
    cluster = Cluster(logs=tmp_path_factory.mktemp("serving"))
    try:
        yield start_model_cluster(cluster, tiny_llama)
    finally:
        cluster.teardown()
