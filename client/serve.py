"""infer-serve: a whole cluster on one machine: a coordinator, N workers and the HTTP front, shut down cleanly.

`infer-serve [--model M] [--workers N] [--tp-size T] [--threads T] [--host H] [--port 8000] [--api-key K] [--keys-dir D]
[engine options] [-- extra worker flags]` starts `infer-coordinator` and N `infer-worker`s (the
coordinator assigns their dp ranks), each in its own process group, waits until the coordinator reports N
healthy workers (ClusterStats, answered by the coordinator when ready: no polling), starts the
OpenAI-compatible HTTP front in this process, prints both addresses, and serves until Ctrl-C / SIGTERM or
until the cluster is stopped (InferenceClient.stop()).
Shutdown: the front stops, then SIGTERM to every process group, wait, SIGKILL what is left.

Security: with `--keys-dir D` (`infer-keygen --cluster --dir D`) every ZeroMQ link runs CurveZMQ, each key
in its role: the workers hold the worker key, the HTTP front a client key (it can submit, never pause or
stop), this launcher the admin key; `--authorized-keys D` gives the coordinator the role folders. A
non-loopback `--coordinator-host` needs keys, and a non-loopback `--host` an API key, unless
`--trusted-network`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field

from infer.client.api.server import (
    HttpFront,
    add_front_arguments,
    check_front_exposure,
    front_config,
    load_front_tokenizer,
)
from infer.client.inference_client import ClusterError, InferenceClient
from infer.coordinator.config import CoordinatorConfig
from infer.protocol.keys import ClusterKeyDir, refuse_open_bind
from infer.protocol.logs import add_logging_args, logging_flags, setup_logging
from infer.protocol.logsafe import safe
from infer.protocol.messages import ClusterStats
from infer.protocol.options import add_options, given, to_argv
from infer.worker.config import EngineConfig
from infer.worker.options import WorkerFlags, WorkerOptions

log = logging.getLogger("infer.serve")



def free_port(host: str) -> int:
    """A TCP port nothing listens on right now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class LocalCluster:
    """A coordinator and `num_workers` workers as child processes of this one.

    `worker_args` are passed to every worker (engine options as flags); `coordinator_args` to the
    coordinator. Each child runs in its own session (process group), so a signal to this process does not
    reach them and shutdown can take the whole group, grandchildren included. `keys`: CurveZMQ on every
    link (the coordinator, the workers and `client_options` get their key files); `trusted_network`: the
    coordinator may bind a non-loopback host without keys.
    """

    num_workers: int
    host: str = "127.0.0.1"
    port: int = 0
    worker_args: list[str] = field(default_factory=list)
    coordinator_args: list[str] = field(default_factory=list)
    keys: ClusterKeyDir | None = None
    trusted_network: bool = False
    python: str = sys.executable
    coordinator: asyncio.subprocess.Process | None = None
    workers: list[asyncio.subprocess.Process] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def client_options(self) -> dict[str, str]:
        """InferenceClient's key options for this cluster's clients, the HTTP front (none without keys)."""
        return {} if self.keys is None else self.keys.client_options()

    @property
    def admin_options(self) -> dict[str, str]:
        """InferenceClient's key options for the launcher itself: the administrator key (none without keys)."""
        return {} if self.keys is None else self.keys.admin_options()

    def security_args(self, role: str) -> list[str]:
        """The key flags of the coordinator (`role` "coordinator") or of a worker."""
        if role == "coordinator":
            flags = [] if self.keys is None else self.keys.coordinator_flags()
            return flags + (["--trusted-network"] if self.trusted_network else [])
        return [] if self.keys is None else self.keys.worker_flags()

    async def start(self) -> None:
        if self.port == 0:
            self.port = free_port(self.host)
        self.coordinator = await self._spawn("infer.coordinator.daemon", "--host", self.host, "--port",
                                             str(self.port), *self.security_args("coordinator"),
                                             *self.coordinator_args)
        for _ in range(self.num_workers):
            self.workers.append(await self._spawn("infer.worker.daemon", "--coordinator", self.address,
                                                  *self.security_args("worker"),
                                                  *self.worker_args))

    async def _spawn(self, module: str, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(self.python, "-m", module, *args, start_new_session=True)

    @property
    def processes(self) -> list[asyncio.subprocess.Process]:
        return [p for p in [self.coordinator, *self.workers] if p is not None]

    async def wait_ready(self, timeout: float) -> ClusterStats:
        """ClusterStats once every worker is healthy; ClusterError if a child exits first or time runs out."""
        async with InferenceClient(self.address, connect_timeout=timeout, **self.admin_options) as client:
            ready = asyncio.create_task(client.wait_for_workers(self.num_workers, timeout))
            exits = {asyncio.create_task(p.wait()): p for p in self.processes}
            try:
                done, _ = await asyncio.wait([ready, *exits], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in [ready, *exits]:
                    task.cancel()
            if ready in done:
                return ready.result()
            exited = next(exits[t] for t in done if t in exits)
            raise ClusterError(f"{self._name(exited)} exited with code {exited.returncode} before the cluster "
                               f"was ready")

    def _name(self, proc: asyncio.subprocess.Process) -> str:
        if proc is self.coordinator:
            return "the coordinator"
        return f"worker {self.workers.index(proc)} (pid {proc.pid})"

    async def wait_any_exit(self) -> asyncio.subprocess.Process:
        exits = {asyncio.create_task(p.wait()): p for p in self.processes}
        try:
            done, _ = await asyncio.wait(exits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in exits:
                task.cancel()
        return exits[next(iter(done))]

    async def shutdown(self, timeout: float = 30.0) -> None:
        """SIGTERM to the coordinator and every worker (workers drain), wait up to `timeout`, then SIGKILL
        the process groups left. Returns when every child has been reaped."""
        for proc in self.processes:
            _signal_group(proc, signal.SIGTERM)
        waits = [asyncio.create_task(p.wait()) for p in self.processes]
        _, pending = await asyncio.wait(waits, timeout=timeout) if waits else (set(), set())
        for proc in self.processes:
            _signal_group(proc, signal.SIGKILL)   # stragglers, and anything a child left in its group
        if pending:
            await asyncio.wait(pending, timeout=10)


def check_cluster_security(coordinator_host: str, keys_dir: str | None,
                           trusted_network: bool) -> ClusterKeyDir | None:
    """The cluster's keys (`--keys-dir`), checked; ValueError for unusable key files, or for a non-loopback
    coordinator without keys unless the network is declared trusted."""
    if keys_dir is not None:
        return ClusterKeyDir(keys_dir)
    if not trusted_network:
        refuse_open_bind(coordinator_host, what="the coordinator", remedy="pass --keys-dir DIR (made by "
                         "`infer-keygen --cluster --dir DIR`)")
    return None


def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)   # start_new_session: the child leads its own group
    except (ProcessLookupError, PermissionError):
        pass


# ---- command line ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infer-serve", description=__doc__.split("\n\n")[0],
                                epilog="Arguments after `--` go to every worker unchanged.")
    p.add_argument("--model", help="safetensors dir or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--workers", type=int, default=1, help="number of workers (DP ranks) (default 1)")
    p.add_argument("--threads", type=int, help="torch threads per worker")
    p.add_argument("--tp-size", type=int, help="processes per worker (tensor parallelism; default 1): each "
                   "worker starts and supervises its TP group, each process holding 1/T of every layer")
    add_front_arguments(p)
    p.add_argument("--coordinator-host", default="127.0.0.1",
                   help="the coordinator's bind address (default 127.0.0.1)")
    p.add_argument("--coordinator-port", type=int, default=0, help="the coordinator's port (default: a free one)")
    p.add_argument("--keys-dir", metavar="DIR", help="CurveZMQ on every link, with the key pairs in DIR made "
                   "by `infer-keygen --cluster --dir DIR` (workers/worker for the workers, clients/client for "
                   "the HTTP front, admins/admin for this launcher; needed for a non-loopback "
                   "--coordinator-host unless --trusted-network)")
    engine = p.add_argument_group("engine options (passed to every worker)")
    add_options(engine, EngineConfig, exclude=_TOP_LEVEL_ENGINE_OPTIONS)
    add_options(engine, WorkerOptions, names=("benchmark_mode",))
    add_options(p.add_argument_group("coordinator options"), CoordinatorConfig, names=_COORDINATOR_OPTIONS)
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the workers (default 300)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds the children get to exit after SIGTERM before SIGKILL (default 30)")
    add_logging_args(p)
    return p


_TOP_LEVEL_ENGINE_OPTIONS = ("model", "num_threads")   # --model and --threads, among the launcher's own flags
_COORDINATOR_OPTIONS = ("policy", "heartbeat_interval", "worker_timeout", "client_timeout", "max_retries")


def coordinator_args(args: argparse.Namespace) -> list[str]:
    """The coordinator's flags: its options given here (infer-serve takes a few of them)."""
    return to_argv(CoordinatorConfig, given(CoordinatorConfig, args, names=_COORDINATOR_OPTIONS))


def worker_args(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """Every worker's flags: the engine options, the TP size, benchmark mode and the heartbeat interval given here
    (the coordinator's too), then `extra` (after `--`)."""
    engine = dict(given(EngineConfig, args, exclude=_TOP_LEVEL_ENGINE_OPTIONS), model=args.model,
                  num_threads=args.threads)
    worker = {"benchmark_mode": args.benchmark_mode, "heartbeat_interval": args.heartbeat_interval}
    return (to_argv(EngineConfig, engine) + to_argv(WorkerFlags, {"tp_size": args.tp_size})
            + to_argv(WorkerOptions, worker) + extra)


async def serve(cluster: LocalCluster, args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await cluster.start()
        stats = await cluster.wait_ready(args.ready_timeout)
        async with InferenceClient(cluster.address, **cluster.client_options) as client:
            front = HttpFront(client, load_front_tokenizer(args.model, client.model_id),
                              front_config(args, client.model_id), args.host, args.port,
                              graceful_timeout=getattr(args, "drain_timeout", None) or 5.0)
            front.bind()
            print(f"infer-serve: ready: {stats.num_healthy_workers} worker(s) serving {stats.model_id!r}; "
                  f"HTTP at {front.url}; clients connect to {cluster.address}", flush=True)
            await _serve_until_stopped(cluster, front, stop)
        return 0
    except (ClusterError, ValueError, OSError) as e:
        log.error("%s", safe(e, 2000))     # may quote the coordinator
        return 1
    finally:
        log.info("shutting down")
        await cluster.shutdown(args.shutdown_timeout)


async def _serve_until_stopped(cluster: LocalCluster, front: HttpFront, stop: asyncio.Event) -> None:
    """Until a signal, the coordinator's exit (a STOP) or the front failing; then the front stops first."""
    tasks = [asyncio.create_task(stop.wait()), asyncio.create_task(_watch(cluster)),
             serving := asyncio.create_task(front.serve())]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    front.shutdown()
    for task in tasks[:2]:
        task.cancel()
    await asyncio.wait([serving], timeout=front.graceful_timeout + 5)
    if serving.done() and not serving.cancelled() and serving.exception() is not None:
        raise serving.exception()


async def _watch(cluster: LocalCluster) -> None:
    """Returns when the coordinator exits (a STOP); worker exits are logged and serving goes on."""
    while True:
        proc = await cluster.wait_any_exit()
        if proc is cluster.coordinator:
            log.info("the coordinator exited (code %s)", proc.returncode)
            return
        log.warning("worker %d (pid %d) exited with code %s", cluster.workers.index(proc), proc.pid, proc.returncode)
        cluster.workers.remove(proc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    if args.workers < 1:
        print("infer-serve: --workers must be >= 1", file=sys.stderr)
        return 2
    try:
        check_front_exposure(args.host, front_config(args, None), args.trusted_network)
        keys = check_cluster_security(args.coordinator_host, args.keys_dir, args.trusted_network)
    except ValueError as e:
        print(f"infer-serve: {e}", file=sys.stderr)
        return 2
    log_level = logging_flags(args)
    cluster = LocalCluster(num_workers=args.workers, host=args.coordinator_host, port=args.coordinator_port,
                           worker_args=worker_args(args, extra) + log_level,
                           coordinator_args=coordinator_args(args) + log_level,
                           keys=keys, trusted_network=args.trusted_network)
    return asyncio.run(serve(cluster, args))


if __name__ == "__main__":
    sys.exit(main())
