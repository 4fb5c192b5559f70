"""infer-serve: a whole cluster on one machine: a coordinator, N workers and the HTTP front, shut down cleanly.

`infer-serve [--model M] [--workers N] [--tp-size T | --pp-size P] [--threads T] [--host H] [--port 8000]
[--api-key K] [--keys-dir D] [--coordinators C] [engine options] [-- extra worker flags]` starts `infer-coordinator`
(C of them, electing a leader, with --coordinators C: docs/architecture.md, "Several coordinators") and N
`infer-worker`s (the coordinator assigns their dp ranks), each in its own process group, waits until the coordinator
reports N healthy workers (ClusterStats, answered by the coordinator when ready: no polling), starts the
OpenAI-compatible HTTP front (`infer-api`, a child too, serving on a socket this process binds and keeps),
prints both addresses, and serves until Ctrl-C / SIGTERM or until the cluster is stopped
(InferenceClient.stop()).
Self-healing (client/supervisor.py): a child that dies (a worker or its TP group, the coordinator, the front)
is restarted with exponential backoff, up to `--max-restarts` times within `--restart-window` seconds
(client/restarts.py); past that a worker is given up (the log says why) and the others serve on, while the
coordinator or the front given up ends the service (exit code 1).
Shutdown: no more restarts; the front stops, then SIGTERM to every process group, wait, SIGKILL what is left.

Security: with `--keys-dir D` (`infer-keygen --cluster --dir D`) every ZeroMQ link runs CurveZMQ, each key
in its role: the workers hold the worker key, the HTTP front a client key (it can submit, never pause or
stop), this launcher the admin key; `--authorized-keys D` gives the coordinator the role folders. A
non-loopback `--coordinator-host` needs keys, and a non-loopback `--host` an API key, unless
`--trusted-network`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import signal
import socket
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from infer.client.api.server import add_front_arguments, check_front_exposure, front_argv, front_config, listen_socket
from infer.client.inference_client import ClusterError, InferenceClient
from infer.client.restarts import RestartPolicy, how_it_ended
from infer.client.supervisor import ChildProcess, Supervisor
from infer.client.worker_forks import WorkerForks
from infer.coordinator.config import CoordinatorConfig
from infer.protocol import env
from infer.protocol.keys import ClientKeyOptions, ClusterKeyDir, refuse_open_bind
from infer.protocol.logs import add_logging_args, logging_flags, setup_logging
from infer.protocol.logsafe import safe
from infer.protocol.messages import KV_ROLES, MAX_COORDINATORS, ClusterStats
from infer.protocol.options import add_options, add_vllm_flags, flag_names, given, to_argv
from infer.protocol.ports import bound_port, listening_socket
from infer.worker.engine.config import EngineConfig
from infer.worker.service.options import WorkerFlags, WorkerOptions

log = logging.getLogger("infer.serve")


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
    worker_roles: list[str] = field(default_factory=list)  # each worker's KV role (infer-serve --kv-roles), or none
    num_coordinators: int = 1  # several: they elect a leader (docs/architecture.md, "Several coordinators")
    coordinators: list[asyncio.subprocess.Process] = field(default_factory=list)
    workers: list[ChildProcess] = field(default_factory=list)
    # the coordinators' ports, held from `start` on, by coordinator index (a launcher may place some elsewhere)
    listeners: dict[int, socket.socket] = field(default_factory=dict)
    ports: list[int] = field(default_factory=list)
    # workers are forked from one process that imported torch (client/worker_forks.py), unless INFER_FORK_WORKERS=0
    fork_workers: bool = True
    _forks: WorkerForks | None = field(default=None, init=False, repr=False)
    _forks_failed: bool = field(default=False, init=False, repr=False)  # one that cannot start is not tried again

    @property
    def address(self) -> str:
        """The coordinators' addresses, comma-separated (what workers, the front and clients are given)."""
        return ",".join(f"tcp://{self.host}:{port}" for port in (self.ports or [self.port]))

    @property
    def coordinator(self) -> asyncio.subprocess.Process | None:
        """The first coordinator (the only one, unless num_coordinators > 1)."""
        return self.coordinators[0] if self.coordinators else None

    @property
    def listener(self) -> socket.socket | None:
        return self.listeners.get(0)

    @property
    def client_options(self) -> ClientKeyOptions:
        """InferenceClient's key options for this cluster's clients, the HTTP front (none without keys)."""
        return {} if self.keys is None else self.keys.client_options()

    @property
    def admin_options(self) -> ClientKeyOptions:
        """InferenceClient's key options for the launcher itself: the administrator key (none without keys)."""
        return {} if self.keys is None else self.keys.admin_options()

    def security_args(self, role: str) -> list[str]:
        """The key flags of the coordinator (`role` "coordinator") or of a worker."""
        if role == "coordinator":
            flags = [] if self.keys is None else self.keys.coordinator_flags()
            return flags + (["--trusted-network"] if self.trusted_network else [])
        return [] if self.keys is None else self.keys.worker_flags()

    async def start(self) -> None:
        """Bind the coordinators' ports here (0: ones the OS chooses) and keep them: each coordinator, a restarted
        one too, serves on its socket (`--listen-fd`), so no other process can take a port in between."""
        self.listen()
        for index in range(self.num_coordinators):
            self.coordinators.append(await self.spawn_coordinator(index))
        for _ in range(self.num_workers):
            self.workers.append(await self.spawn_worker())

    def listen(self) -> None:
        """The coordinators' sockets, bound once (port 0: ones the OS chooses, read back into `ports`; `port` is
        the first)."""
        if self.num_coordinators == 2 or not 1 <= self.num_coordinators <= MAX_COORDINATORS:
            raise ValueError(
                f"--coordinators must be 1, or 3 to {MAX_COORDINATORS} (two cannot tell a dead peer from a cut "
                f"cable, so neither could take over safely), got {self.num_coordinators}"
            )
        if not self.listeners:
            # a port given: the first's, and the ones after it (a Slurm job's other nodes count on them)
            count = self.num_coordinators
            ports = [self.port + i for i in range(count)] if self.port else [0] * count
            self.listeners = {
                i: listening_socket(self.host, p, backlog=1024, inheritable=True) for i, p in enumerate(ports)
            }
            self.ports = [bound_port(listener) for listener in self.listeners.values()]
            self.port = self.ports[0]

    async def spawn_coordinator(self, index: int = 0) -> asyncio.subprocess.Process:
        """Coordinator `index` on its address (a restarted one too: workers and clients re-attach), serving on the
        socket `start` bound; with several, each is told all of them and its place."""
        if not self.listeners:
            raise RuntimeError("LocalCluster.start() binds the coordinators' ports before a coordinator starts")
        fd = self.listeners[index].fileno()
        peers = ["--peers", self.address, "--peer-index", str(index)] if self.num_coordinators > 1 else []
        return await self._spawn(
            "infer.coordinator.daemon",
            "--host",
            self.host,
            "--port",
            str(self.ports[index]),
            "--listen-fd",
            str(fd),
            *peers,
            *self.security_args("coordinator"),
            *self.coordinator_args,
            pass_fds=(fd,),
        )

    async def spawn_worker(self, index: int | None = None) -> ChildProcess:
        """Worker `index` (default: the next; with --tp-size, its TP group's supervisor): the coordinator gives it a
        free DP rank; with `worker_roles`, its KV role. Forked from this cluster's fork server (client/worker_forks.py)
        where it can be, else a new interpreter."""
        index = len(self.workers) if index is None else index
        role = []
        if self.worker_roles:
            role = ["--kv-transfer-config", json.dumps({"kv_role": self.worker_roles[index]})]
        args = ["--coordinator", self.address, *self.security_args("worker"), *self.worker_args, *role]
        forks = await self._worker_forks()
        if forks is not None and (forked := await forks.spawn(["-m", "infer.worker.service.daemon", *args])):
            return forked
        return await self._spawn("infer.worker.service.daemon", *args)

    async def _worker_forks(self) -> WorkerForks | None:
        """The fork server, started on the first worker's spawn (and again after it died); None: new interpreters."""
        if not self.fork_workers or env.read(env.FORK_WORKERS) == "0":
            return None
        if self._forks is not None and not self._forks.alive:
            await self._forks.close()
            self._forks = None
        if self._forks is None and not self._forks_failed:
            self._forks = await WorkerForks.start(self.python)
            self._forks_failed = self._forks is None
        return self._forks

    async def respawn_coordinator(self, index: int = 0) -> asyncio.subprocess.Process:
        self.coordinators[index] = await self.spawn_coordinator(index)
        return self.coordinators[index]

    async def respawn_worker(self, index: int) -> ChildProcess:
        self.workers[index] = await self.spawn_worker(index)
        return self.workers[index]

    async def _spawn(self, module: str, *args: str, pass_fds: tuple[int, ...] = ()) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            self.python, "-m", module, *args, start_new_session=True, pass_fds=pass_fds
        )

    @property
    def processes(self) -> list[ChildProcess]:
        return [*self.coordinators, *self.workers]

    async def wait_ready(self, timeout: float, trouble: asyncio.Future[str] | None = None) -> ClusterStats:
        """ClusterStats once every worker is healthy; ClusterError if time runs out, or if a child exits first
        (unsupervised) or `trouble` completes (supervised: children that exit are restarted; `trouble` says
        why one will not be)."""
        async with InferenceClient(self.address, connect_timeout=timeout, **self.admin_options) as client:
            ready = asyncio.create_task(client.wait_for_workers(self.num_workers, timeout))
            exits = {} if trouble is not None else {asyncio.create_task(p.wait()): p for p in self.processes}
            waiting: list[asyncio.Future[typing.Any]] = [ready, *exits, *([trouble] if trouble else [])]
            try:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in [ready, *exits]:
                    task.cancel()
                # wait for them before the client closes under them (the wait would fail with "client closed", and
                # that error, never retrieved, would be logged beside the real reason)
                await asyncio.gather(ready, *exits, return_exceptions=True)
            if ready in done:
                return ready.result()
            if trouble is not None and trouble in done:
                raise ClusterError(f"{trouble.result()}; the cluster is not ready")
            exited = next(exits[t] for t in done if t in exits)
            raise ClusterError(
                f"{self._name(exited)} exited with code {exited.returncode} before the cluster was ready"
            )

    def _name(self, proc: ChildProcess) -> str:
        if proc in self.coordinators:
            return "the coordinator" if len(self.coordinators) == 1 else f"coordinator {self.coordinators.index(proc)}"
        return f"worker {self.workers.index(proc)} (pid {proc.pid})"

    async def shutdown(self, timeout: float = 30.0) -> None:
        """SIGTERM to the coordinator and every worker (workers drain), wait up to `timeout`, then SIGKILL
        the process groups left. Returns when every child has been reaped."""
        for proc in self.processes:
            _signal_group(proc, signal.SIGTERM)
        waits = [asyncio.create_task(p.wait()) for p in self.processes]
        _, pending = await asyncio.wait(waits, timeout=timeout) if waits else (set(), set())
        for proc in self.processes:
            _signal_group(proc, signal.SIGKILL)  # stragglers, and anything a child left in its group
        if pending:
            await asyncio.wait(pending, timeout=10)
        for listener in self.listeners.values():  # the coordinators' ports, held until now
            listener.close()
        self.listeners = {}
        forks, self._forks = self._forks, None
        if forks is not None:
            await forks.close()


def check_cluster_security(coordinator_host: str, keys_dir: str | None, trusted_network: bool) -> ClusterKeyDir | None:
    """The cluster's keys (`--keys-dir`), checked; ValueError for unusable key files, or for a non-loopback
    coordinator without keys unless the network is declared trusted."""
    if keys_dir is not None:
        return ClusterKeyDir(Path(keys_dir))
    if not trusted_network:
        refuse_open_bind(
            coordinator_host,
            what="the coordinator",
            remedy="pass --keys-dir DIR (made by `infer-keygen --cluster --dir DIR`)",
        )
    return None


def _signal_group(proc: ChildProcess, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the child leads its own group
    except (ProcessLookupError, PermissionError):
        pass


# ---- command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer-serve",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after `--` go to every worker unchanged.",
    )
    p.add_argument("--model", help="safetensors dir or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument(*flag_names("--workers"), type=int, default=1, help="number of workers (DP ranks) (default 1)")
    p.add_argument("--threads", type=int, help="torch threads per worker")
    p.add_argument(
        "--kv-roles",
        metavar="ROLE,...",
        help="disaggregated prefill and decode: each worker's KV role, comma-separated, one per worker (kv_producer, "
        "kv_consumer or kv_both; e.g. --workers 2 --kv-roles kv_producer,kv_consumer); default: kv_both",
    )
    p.add_argument(
        *flag_names("--tp-size"),
        type=int,
        help="processes per worker (tensor parallelism; default 1): "
        "each worker starts and supervises its TP group, each process holding 1/T of every layer",
    )
    p.add_argument(
        *flag_names("--pp-size"),
        dest="pp_size",
        type=int,
        help="pipeline stages per worker (pipeline parallelism; default 1): each worker starts and "
        "supervises its P stage processes, each holding a contiguous range of the layers (capacity, not "
        "speed: one batch at a time through the stages)",
    )
    add_front_arguments(p)
    p.add_argument("--coordinator-host", default="127.0.0.1", help="the coordinator's bind address (default 127.0.0.1)")
    p.add_argument("--coordinator-port", type=int, default=0, help="the coordinator's port (default: a free one)")
    p.add_argument(
        "--coordinators",
        type=int,
        default=1,
        metavar="N",
        help="coordinator processes (default 1): 1, or 3 or more; they elect a leader under a lease a majority grants "
        "and another takes over within about a lease when it dies, losing no request (docs/architecture.md, "
        "'Several coordinators'); with --coordinator-port P they take P and the ports after it",
    )
    p.add_argument(
        "--keys-dir",
        metavar="DIR",
        help="CurveZMQ on every link, with the key pairs in DIR made "
        "by `infer-keygen --cluster --dir DIR` (workers/worker for the workers, clients/client for "
        "the HTTP front, admins/admin for this launcher; needed for a non-loopback "
        "--coordinator-host unless --trusted-network)",
    )
    engine = p.add_argument_group("engine options (passed to every worker)")
    add_options(engine, EngineConfig, exclude=_TOP_LEVEL_ENGINE_OPTIONS)
    add_options(engine, WorkerOptions, names=("benchmark_mode",))
    add_options(p.add_argument_group("coordinator options"), CoordinatorConfig, names=_COORDINATOR_OPTIONS)
    add_options(
        p.add_argument_group("restarts (of a worker, the coordinator or the HTTP front that dies)"), RestartPolicy
    )
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the workers (default 300)")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds the children get to exit after SIGTERM before SIGKILL (default 30)",
    )
    add_logging_args(p)
    add_vllm_flags(p)
    return p


_TOP_LEVEL_ENGINE_OPTIONS = ("model", "num_threads")  # --model and --threads, among the launcher's own flags
_COORDINATOR_OPTIONS = (
    "policy",
    "kv_overlap_weight",
    "heartbeat_interval",
    "worker_timeout",
    "client_timeout",
    "max_retries",
)


def coordinator_args(args: argparse.Namespace) -> list[str]:
    """The coordinator's flags: its options given here (infer-serve takes a few of them)."""
    return to_argv(
        CoordinatorConfig,
        {
            **given(CoordinatorConfig, args, names=_COORDINATOR_OPTIONS),
            "otlp_traces_endpoint": args.otlp_traces_endpoint,
        },
    )


def worker_args(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """Every worker's flags: the engine options, the TP and PP sizes, benchmark mode and the heartbeat interval given
    here (the coordinator's too), then `extra` (after `--`)."""
    engine = dict(
        given(EngineConfig, args, exclude=_TOP_LEVEL_ENGINE_OPTIONS), model=args.model, num_threads=args.threads
    )
    worker = {
        "benchmark_mode": args.benchmark_mode,
        "heartbeat_interval": args.heartbeat_interval,
        "otlp_traces_endpoint": args.otlp_traces_endpoint,
    }
    return (
        to_argv(EngineConfig, engine)
        + to_argv(WorkerFlags, {"tp_size": args.tp_size, "pp_size": args.pp_size})
        + to_argv(WorkerOptions, worker)
        + extra
    )


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    """The restart flags given (a launcher without them: the defaults)."""
    return RestartPolicy(**given(RestartPolicy, args))


async def serve(cluster: LocalCluster, args: argparse.Namespace) -> int:
    """Start `cluster` and its HTTP front, keep every child running (client/supervisor.py), serve until a
    signal, a STOP or a child given up; then shut down without restarting anything. 0 for a signal or a STOP."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    supervisor = Supervisor(restart_policy(args))
    front: asyncio.subprocess.Process | None = None
    listener = None
    try:
        listener = listen_socket(args.host, args.port)  # before anything starts: a taken port fails at once
        await cluster.start()
        _watch_cluster(supervisor, cluster)
        stats = await cluster.wait_ready(args.ready_timeout, supervisor.trouble)
        front = await _start_front(cluster, args, listener, args.ready_timeout)
        supervisor.watch("the HTTP front", front, lambda: _spawn_front(cluster, args, listener), essential=True)
        print(
            f"infer-serve: ready: {stats.num_healthy_workers} worker(s) serving {stats.model_id!r}; "
            f"HTTP at {_url(listener)}; clients connect to {cluster.address}",
            flush=True,
        )
        return await _serve_until_stopped(supervisor, stop)
    except (ClusterError, ValueError, OSError) as e:
        log.error("%s", safe(e, 2000))  # may quote the coordinator
        return 1
    finally:
        log.info("shutting down")
        await supervisor.stop()
        await _stop_front(supervisor, _graceful_timeout(args) + 5)
        await cluster.shutdown(args.shutdown_timeout)
        if listener is not None:
            listener.close()


def _watch_cluster(supervisor: Supervisor, cluster: LocalCluster) -> None:
    """The coordinator and every worker under `supervisor` (restarted in place in `cluster`)."""
    several = len(cluster.coordinators) > 1
    for index, coordinator in enumerate(cluster.coordinators):
        # one of several given up: the others serve on (a majority of them must live)
        name = f"coordinator {index}" if several else "the coordinator"
        respawn = functools.partial(cluster.respawn_coordinator, index)
        supervisor.watch(name, coordinator, respawn, essential=not several)
    for index, worker in enumerate(cluster.workers):
        supervisor.watch(f"worker {index}", worker, functools.partial(cluster.respawn_worker, index))


async def _serve_until_stopped(supervisor: Supervisor, stop: asyncio.Event) -> int:
    """Until a signal (0), the coordinator's STOP (0) or an essential child given up (1)."""
    stopped = asyncio.create_task(stop.wait())
    waiting: list[asyncio.Future[typing.Any]] = [stopped, supervisor.ended]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not supervisor.ended.done():
        return 0
    ended = supervisor.ended.result()
    (log.info if ended.clean else log.error)("%s: shutting the cluster down", ended.reason)
    return 0 if ended.clean else 1


# ---- the HTTP front: an infer-api child on a socket this process keeps --------------------------------


def _graceful_timeout(args: argparse.Namespace) -> float:
    return getattr(args, "drain_timeout", None) or 5.0  # the Slurm launcher's --drain-timeout


def _url(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _spawn_front(
    cluster: LocalCluster, args: argparse.Namespace, listener: socket.socket
) -> asyncio.subprocess.Process:
    """infer-api on `listener` (inherited), a client of `cluster` with its client key; the API key goes in its
    environment, never on its command line. It prints one line on stdout once it serves."""
    key_flags = [f"--{name.replace('_', '-')}={path}" for name, path in cluster.client_options.items()]
    model = [] if getattr(args, "model", None) is None else ["--model", args.model]
    api_key = front_config(args, None).api_key
    environ = {k: v for k, v in os.environ.items() if k != env.API_KEY.name}
    if api_key is not None:
        environ[env.API_KEY.name] = api_key
    return await asyncio.create_subprocess_exec(
        cluster.python,
        "-m",
        "infer.client.api.server",
        "--coordinator",
        cluster.address,
        "--listen-fd",
        str(listener.fileno()),
        "--graceful-timeout",
        str(_graceful_timeout(args)),
        *model,
        *key_flags,
        *front_argv(args),
        *logging_flags(args),
        pass_fds=(listener.fileno(),),
        env=environ,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )


async def _start_front(
    cluster: LocalCluster, args: argparse.Namespace, listener: socket.socket, timeout: float
) -> asyncio.subprocess.Process:
    """The first front, once it serves; ClusterError if it exits or stays silent for `timeout` seconds."""
    front = await _spawn_front(cluster, args, listener)
    stdout = typing.cast(asyncio.StreamReader, front.stdout)
    try:
        line = await asyncio.wait_for(stdout.readline(), timeout)
    except asyncio.TimeoutError:
        line = b""
    if not line:
        _signal_group(front, signal.SIGKILL)
        code = await front.wait()
        raise ClusterError(f"the HTTP front {how_it_ended(code)} before it served (its log is above)")
    return front


async def _stop_front(supervisor: Supervisor, timeout: float) -> None:
    """SIGTERM to the front (it lets open requests finish), SIGKILL after `timeout` seconds."""
    front = next((c.proc for c in supervisor.children if c.name == "the HTTP front"), None)
    if front is None or front.returncode is not None:
        return
    _signal_group(front, signal.SIGTERM)
    try:
        await asyncio.wait_for(front.wait(), timeout)
    except asyncio.TimeoutError:
        log.warning("the HTTP front did not exit in %.0f s; killing it", timeout)
    _signal_group(front, signal.SIGKILL)
    await asyncio.wait_for(front.wait(), 10)


def check_launcher_args(args: argparse.Namespace) -> None:
    """ValueError naming the first of infer-serve's own sizes and times that cannot work, before anything starts
    (the TP and PP sizes through WorkerFlags, the same check infer-worker makes)."""
    WorkerFlags(
        tp_size=1 if args.tp_size is None else args.tp_size, pp_size=1 if args.pp_size is None else args.pp_size
    )
    if args.coordinators == 2 or not 1 <= args.coordinators <= MAX_COORDINATORS:
        raise ValueError(
            f"--coordinators must be 1, or 3 to {MAX_COORDINATORS} (two cannot tell a dead peer from a cut cable, so "
            f"neither could take over safely), got {args.coordinators}"
        )
    kv_roles(args)
    for flag, value in (("--workers", args.workers), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, seconds in (("--ready-timeout", args.ready_timeout), ("--shutdown-timeout", args.shutdown_timeout)):
        if not seconds > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {seconds}")


def kv_roles(args: argparse.Namespace) -> list[str]:
    """--kv-roles as a list, one role per worker (none given: []); ValueError naming what does not fit."""
    return parse_kv_roles(args.kv_roles, args.workers, "worker(s) (--workers)")


def parse_kv_roles(spec: str | None, count: int, what: str) -> list[str]:
    """A comma-separated --kv-roles list, one role for each of the `count` `what` (none given: []); ValueError
    naming what does not fit. infer-serve's and the Slurm launcher's."""
    if spec is None:
        return []
    roles = [r.strip() for r in spec.split(",")]
    for r in roles:
        if r not in KV_ROLES:
            raise ValueError(f"--kv-roles: {r!r:.80} is not one of {', '.join(KV_ROLES)}")
    if len(roles) != count:
        raise ValueError(f"--kv-roles names {len(roles)} role(s) for {count} {what}: one each")
    return roles


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        check_launcher_args(args)
        check_front_exposure(args.host, front_config(args, None), args.trusted_network)
        keys = check_cluster_security(args.coordinator_host, args.keys_dir, args.trusted_network)
    except ValueError as e:
        print(f"infer-serve: {e}", file=sys.stderr)
        return 2
    log_level = logging_flags(args)
    cluster = LocalCluster(
        num_workers=args.workers,
        worker_roles=kv_roles(args),
        host=args.coordinator_host,
        port=args.coordinator_port,
        num_coordinators=args.coordinators,
        worker_args=worker_args(args, extra) + log_level,
        coordinator_args=coordinator_args(args) + log_level,
        keys=keys,
        trusted_network=args.trusted_network,
    )
    return asyncio.run(serve(cluster, args))


if __name__ == "__main__":
    sys.exit(main())
