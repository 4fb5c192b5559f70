#!/usr/bin/env python3
"""The launcher behind deploy/slurm/infer.sbatch: one infer cluster over the nodes of a Slurm job.

`launch.py head [options] [-- worker options]` is the batch step, on the job's first node. It starts
infer-coordinator there (with --coordinators N > 1, coordinator i on node i mod the job's nodes, the head first,
each other node's as an `srun` step of one task there; --no-spread-coordinators keeps them all on the head), then
the workers as one `srun` step over every node of the job (each task runs `launch.py worker`), waits until every
worker has joined, starts the OpenAI-compatible HTTP front, prints its address, and serves until the job ends
(infer-serve's loop: LocalCluster, with srun as the workers and as the other nodes' coordinators).
On `scancel` or the time limit Slurm sends SIGTERM to every process of the job at once, and everything
drains for at most --drain-timeout: the coordinator refuses new requests and lets accepted ones finish, then
runs STOP (what is still running ends with an error message); the workers finish theirs; the front refuses
new connections and lets open ones finish. Then the head SIGKILLs whatever still runs after
--shutdown-timeout (keep both under Slurm's KillWait), so nothing outlives the job.

`launch.py worker [options] [-- worker options]` is one srun task. It is given the coordinators' addresses (the
head's list); from Slurm's environment (SLURM_PROCID, the step's node list and tasks per node) it derives its DP
rank (the task's global index i) and, with --ep-size E > 1, its EP group
g = i // E, its rank in the group i % E, the group id `ep<g>` and the group's torch.distributed rendezvous
tcp://<node of the group's rank 0>:<--dist-port + g>; then it execs infer-worker. With --tp-size T > 1 each
task is one process of a TP group: tasks i..i+T-1 (adjacent, so on one node when T divides the tasks per
node; a group may span nodes) serve DP rank i // T, task i being TP rank i % T; the DP ranks then form
the EP groups as above, and one world of T x E tasks rendezvouses per EP group (per DP rank without EP).

**Self-healing.** Each task keeps its infer-worker running (`keep_running`): a worker that ends any other way than
exit 0 (a crash, kill -9, OOM, a broken group) is started again, with the same place, after the restart policy's
backoff (--restart-backoff, doubled per restart within --restart-window), and given up past --max-restarts within
the window, or at once when it exits 2 (its options or model refused: client/restarts.py); the task's output,
labelled with its number, says why, and the other tasks serve on. The restarted worker registers again under its
DP rank and gets the cluster's weight version before it serves. A TP or EP group is restarted whole: when one
member dies the others notice at once, even while idle (worker/parallel/tp_commands.py,
worker/distributed/group_sync.py), give their requests back and exit non-zero, so every task of the group restarts its
member and the group meets again at its rendezvous. A worker that exits 0 was told to stop (a STOP, the drain on
scancel) and is not restarted. The worker runs in the task's process group, so Slurm's signals reach it directly (the
task itself only stops restarting), and it dies with the task. The head restarts the coordinators (another node's: its
srun step) and the HTTP front as infer-serve does (client/supervisor.py), and the workers' whole srun step if every task
has ended.

Options that are not the launcher's own (engine options such as --dtype or --threads, worker options such as
--coordinator-timeout) go to every worker unchanged, as do the arguments after `--`.

Security: the head binds addresses the other nodes reach, so every ZeroMQ link runs CurveZMQ: with the key
pairs of `--keys-dir D` (`infer-keygen --cluster --dir D`, on a path every node reads), else with a fresh set
the head writes for this job into $SLURM_SUBMIT_DIR/.infer-keys-$SLURM_JOB_ID (mode 0700; the submit directory
is on the shared filesystem) and removes when the job ends. Each key has its role: the workers get the worker
key (workers/), the HTTP front and outside clients a client key (clients/: submit and stream, never pause or
stop), the head itself the admin key (admins/: also the lifecycle commands). The HTTP front needs an API key
(--api-key-file, $INFER_API_KEY or --api-key). `--trusted-network` drops both requirements: plaintext, no
keys, no API key needed. The EP groups' torch.distributed traffic is never encrypted (trusted fabric only).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infer.client.api.server import add_front_arguments, check_front_exposure, front_config
from infer.client.restarts import CrashLoop, GiveUp, RestartPolicy, how_it_ended
from infer.client.serve import LocalCluster, parse_kv_roles, serve
from infer.coordinator.config import CoordinatorConfig
from infer.protocol.keys import ClusterKeyDir
from infer.protocol.logs import add_logging_args, logging_flags, setup_logging
from infer.protocol.messages import MAX_COORDINATORS
from infer.protocol.options import add_options, given, option, to_argv
from infer.protocol.ports import listening_socket
from infer.worker.engine.config import EngineConfig
from infer.worker.parallel.tp_supervisor import die_with_parent
from infer.worker.service.options import WorkerFlags, WorkerOptions

DEFAULT_COORDINATOR_PORT = 5555
DEFAULT_HTTP_PORT = 8000
DEFAULT_DIST_PORT = 29500

log = logging.getLogger("infer.slurm")

Resolver = Callable[[str], str]  # a host name -> its address (socket.gethostbyname; tests give their own)


# ---- where each worker goes (pure) ------------------------------------------------------------------


def expand_counts(spec: str) -> list[int]:
    """Slurm's compressed per-node counts ("2(x3),1", as in SLURM_STEP_TASKS_PER_NODE) -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"cannot read the per-node count list {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def node_of(index: int, nodes: list[str], tasks_per_node: list[int]) -> str:
    """The node that runs global task `index` when tasks fill the nodes in order (srun --distribution=block)."""
    if len(tasks_per_node) != len(nodes):
        raise ValueError(f"{len(nodes)} nodes but {len(tasks_per_node)} per-node task counts")
    first = 0
    for node, count in zip(nodes, tasks_per_node):
        if index < first + count:
            return node
        first += count
    raise ValueError(f"task {index} is beyond the {first} tasks of the step")


@dataclass(frozen=True)
class WorkerPlan:
    """One srun task of the job: its global index, and from it its DP rank, its EP group (ep_size > 1), its TP
    rank (tp_size > 1: `index` is one process of DP rank index // tp_size) and its pipeline stage (pp_size > 1:
    tasks i .. i+P*T-1 are DP rank i // (P*T), stage by stage: the T adjacent tasks of a stage are its TP group, so a
    stage sits on one node when T divides the tasks per node and the stages spread over the nodes; one world per EP
    group, which rendezvouses on the node of its first task)."""

    index: int
    ep_size: int = 1
    group_master: str | None = None  # the node of the world's rank 0 (ep_size > 1 or tp_size > 1)
    dist_port: int = DEFAULT_DIST_PORT
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.index < 0 or self.ep_size < 1 or self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(
                f"bad worker index {self.index}, EP size {self.ep_size}, TP size {self.tp_size} or PP "
                f"size {self.pp_size}"
            )
        if (self.ep_size > 1 or self.tp_size > 1 or self.pp_size > 1) and self.group_master is None:
            raise ValueError("an EP or TP group, or a pipeline, needs the node of its rank 0")

    @property
    def dp_rank(self) -> int:
        return self.index // (self.tp_size * self.pp_size)

    @property
    def group(self) -> int:
        return self.dp_rank // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep_size

    @property
    def tp_rank(self) -> int:
        return self.index % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.index // self.tp_size % self.pp_size

    def flags(self) -> list[str]:
        """infer-worker's rank flags; the EP / TP ones only for a real group (size > 1)."""
        ep, tp, pp = self.ep_size > 1, self.tp_size > 1, self.pp_size > 1
        rank = {"dp_rank": self.dp_rank, "group_id": f"ep{self.group}" if ep else None}
        groups = {
            "ep_size": self.ep_size,
            "ep_rank": self.ep_rank if ep else None,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank if tp else None,
            "pp_size": self.pp_size,
            "pp_rank": self.pp_rank if pp else None,
            "dist_init": f"tcp://{self.group_master}:{self.dist_port + self.group}" if ep or tp or pp else None,
        }
        return to_argv(WorkerOptions, rank) + to_argv(WorkerFlags, groups)


def plan_worker(
    index: int,
    nodes: list[str],
    tasks_per_node: list[int],
    ep_size: int,
    dist_port: int = DEFAULT_DIST_PORT,
    tp_size: int = 1,
    pp_size: int = 1,
) -> WorkerPlan:
    total = sum(tasks_per_node)
    if pp_size > 1 and total % (pp_size * tp_size * ep_size):
        raise ValueError(
            f"{total} tasks do not split into pipelines of {pp_size} stages (x TP {tp_size} x EP {ep_size})"
        )
    if total % (ep_size * tp_size):
        raise ValueError(
            f"{total} tasks do not split into {'TP x EP groups' if tp_size > 1 else 'EP groups'} of "
            f"{tp_size * ep_size if tp_size > 1 else ep_size}"
        )
    world = ep_size * tp_size * pp_size
    master = node_of(index // world * world, nodes, tasks_per_node) if world > 1 else None
    return WorkerPlan(index, ep_size, master, dist_port, tp_size, pp_size)


# ---- Slurm's environment (read here only) ------------------------------------------------------------


@dataclass(frozen=True)
class SlurmEnv:
    job_id: str
    job_nodelist: str
    node_name: str | None  # SLURMD_NODENAME: the node this process runs on
    ntasks_per_node: int | None  # sbatch --ntasks-per-node
    procid: int | None  # the srun task's global index
    step_nodelist: str | None
    step_tasks_per_node: str | None
    submit_dir: str | None = None  # SLURM_SUBMIT_DIR: where sbatch ran (a shared filesystem)

    @classmethod
    def from_environ(cls, env: dict[str, str] | os._Environ = os.environ) -> SlurmEnv:
        if "SLURM_JOB_ID" not in env or "SLURM_JOB_NODELIST" not in env:
            raise ValueError(
                "not inside a Slurm job (SLURM_JOB_ID / SLURM_JOB_NODELIST unset): submit "
                "deploy/slurm/infer.sbatch with sbatch"
            )

        def integer(name: str) -> int | None:
            return int(env[name]) if env.get(name, "").isdigit() else None

        return cls(
            job_id=env["SLURM_JOB_ID"],
            job_nodelist=env["SLURM_JOB_NODELIST"],
            node_name=env.get("SLURMD_NODENAME"),
            ntasks_per_node=integer("SLURM_NTASKS_PER_NODE"),
            procid=integer("SLURM_PROCID"),
            step_nodelist=env.get("SLURM_STEP_NODELIST"),
            step_tasks_per_node=env.get("SLURM_STEP_TASKS_PER_NODE"),
            submit_dir=env.get("SLURM_SUBMIT_DIR"),
        )


def hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames`: Slurm's own expansion of a node list such as n[1-3,7]."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    if not out:
        raise ValueError(f"the node list {nodelist!r} names no node")
    return out


def reachable_address(node: str, nodes: list[str], resolve: Resolver = socket.gethostbyname) -> str:
    """The address to bind on `node` so the other nodes reach it: what `node` resolves to here, or every
    interface (0.0.0.0) when that is a loopback address (Debian maps the own hostname to 127.0.1.1)."""
    address = resolve(node)
    if ipaddress.ip_address(address).is_loopback and len(nodes) > 1:
        log.warning(
            "%s resolves to %s here: binding 0.0.0.0 instead (pass --coordinator-host / --host to choose an interface)",
            node,
            address,
        )
        return "0.0.0.0"
    return address


@dataclass(frozen=True)
class CoordinatorPlace:
    """Where coordinator `index` runs: its node, the address it binds there, and the host every other process
    (workers, clients, the HTTP front, its peers) reaches it at."""

    index: int
    node: str
    bind_host: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def place_coordinators(
    count: int,
    nodes: list[str],
    port: int,
    head_host: str,
    spread: bool,
    resolve: Resolver = socket.gethostbyname,
) -> list[CoordinatorPlace]:
    """Coordinator i on `port` + i; with `spread`, on node i mod len(nodes) (the head, nodes[0], first), else on
    the head. The head's bind `head_host` (--coordinator-host, or what reachable_address found); another node's,
    what its name resolves to here. Where that is every interface (0.0.0.0 / ::) the others reach it by its node's
    name."""
    places = []
    for index in range(count):
        node = nodes[index % len(nodes)] if spread else nodes[0]
        if node == nodes[0]:
            bind = head_host
        else:
            try:
                bind = reachable_address(node, nodes, resolve)
            except OSError as e:
                raise ValueError(
                    f"cannot resolve node {node} here to place coordinator {index} on it ({e}): "
                    f"pass --no-spread-coordinators to keep the coordinators on the head"
                ) from None
        host = node if bind in ("0.0.0.0", "::") else bind
        places.append(CoordinatorPlace(index, node, bind, host, port + index))
    return places


# ---- worker: one srun task ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskOptions:
    """`launch.py worker`'s own options: where the coordinators listen and how the job's tasks form groups. The
    head writes them into the srun command (`to_argv`), every task reads them back."""

    coordinator: str = option(
        f"tcp://localhost:{DEFAULT_COORDINATOR_PORT}", "the coordinators' addresses, comma-separated (the head's list)"
    )
    ep_size: int = option(1, "ranks per EP group")
    tp_size: int = option(1, "processes (srun tasks) per DP rank")
    pp_size: int = option(1, "pipeline stages (srun tasks) per DP rank")
    dist_port: int = option(DEFAULT_DIST_PORT, "EP group g rendezvouses on this port + g on the node of its rank 0")
    kv_roles: str | None = option(None, "DP rank i's KV role is the i-th of this comma-separated list (the head's)")


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch.py worker",
        allow_abbrev=False,
        description="One srun task: work out this worker's place, exec infer-worker.",
    )
    add_options(p, TaskOptions)
    add_options(p.add_argument_group("restarts (of this task's worker when it dies)"), RestartPolicy)
    return p


def worker_argv(
    args: argparse.Namespace,
    extra: list[str],
    index: int,
    step_nodes: list[str],
    tasks_per_node: list[int],
) -> list[str]:
    """The infer-worker command line of srun task `index`."""
    task = TaskOptions(**given(TaskOptions, args))
    plan = plan_worker(index, step_nodes, tasks_per_node, task.ep_size, task.dist_port, task.tp_size, task.pp_size)
    roles = task.kv_roles.split(",") if task.kv_roles else []
    if roles and plan.dp_rank >= len(roles):
        raise ValueError(f"--kv-roles names {len(roles)} role(s); this task is DP rank {plan.dp_rank}")
    role = ["--kv-transfer-config", json.dumps({"kv_role": roles[plan.dp_rank]})] if roles else []
    return [
        sys.executable,
        "-m",
        "infer.worker.service.daemon",
        "--coordinator",
        task.coordinator,
        *plan.flags(),
        *role,
        *extra,
    ]


def run_worker(argv: list[str]) -> int:
    own, extra = split_extra(argv)
    args, unknown = worker_parser().parse_known_args(own)
    try:
        env = SlurmEnv.from_environ()
        if env.procid is None or env.step_tasks_per_node is None:
            raise ValueError("not an srun task (SLURM_PROCID / SLURM_STEP_TASKS_PER_NODE unset)")
        command = worker_argv(
            args,
            unknown + extra,
            env.procid,
            hostnames(env.step_nodelist or env.job_nodelist),
            expand_counts(env.step_tasks_per_node),
        )
        policy = RestartPolicy(**given(RestartPolicy, args))
    except (ValueError, OSError, subprocess.SubprocessError) as e:
        print(f"launch.py worker: {e}", file=sys.stderr)
        return 2
    return keep_running(command, policy, f"launch.py worker (task {env.procid})")


def keep_running(command: list[str], policy: RestartPolicy, name: str) -> int:
    """Run `command` (this task's worker) until it exits 0, starting it again after any other end under `policy`
    (see the module doc); a SIGTERM / SIGINT to the task ends the restarts (the worker, in this process group,
    gets Slurm's signal itself and drains). Returns the worker's last exit code, as a shell reports it."""
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stopping.set())
    crash_loop = CrashLoop(policy)
    while True:
        worker = subprocess.Popen(command, preexec_fn=die_with_parent)
        code = worker.wait()
        if code == 0 or stopping.is_set():
            return _shell_code(code)
        verdict = crash_loop.on_exit(time.monotonic(), code)
        if isinstance(verdict, GiveUp):
            print(
                f"{name}: the worker (pid {worker.pid}) is not restarted: {verdict.reason}", file=sys.stderr, flush=True
            )
            return _shell_code(code)
        print(
            f"{name}: the worker (pid {worker.pid}) {how_it_ended(code)}; restarting it in {verdict.delay:.1f} s "
            f"(restart {verdict.attempt} of at most {policy.max_restarts} within {policy.restart_window:g} s)",
            file=sys.stderr,
            flush=True,
        )
        if stopping.wait(verdict.delay):
            return _shell_code(code)


def _shell_code(returncode: int) -> int:
    """A Popen return code as an exit status: 128 + N for a process killed by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


# ---- head: the batch step ----------------------------------------------------------------------------


@dataclass(frozen=True)
class JobOptions:
    """The head's own options (infer.sbatch's): the workers and their groups, the coordinator's address, how long
    the job's start and end may take, and its keys. --drain-timeout goes to the coordinator and every worker."""

    workers_per_node: int | None = option(
        None, "workers (DP ranks) per node (default: sbatch's --ntasks-per-node, else 1)"
    )
    ep_size: int = option(1, "ranks per EP group (1: dense, no groups)")
    tp_size: int = option(
        1,
        "processes (srun tasks) per DP rank, each holding 1/T of every layer; a group's tasks "
        "are adjacent: on one node when T divides the workers per node",
    )
    pp_size: int = option(
        1,
        "pipeline stages (srun tasks) per DP rank, each holding a contiguous range of the "
        "layers: tasks i..i+P-1 form DP rank i // P (on one node, or across nodes), and "
        "rendezvous on the node of its stage 0 (not with --tp-size / --ep-size yet)",
    )
    dist_port: int = option(DEFAULT_DIST_PORT, "EP group g's torch.distributed rendezvous port is this + g")
    kv_roles: str | None = option(
        None,
        "disaggregated prefill and decode: one KV role per DP rank, comma-separated, in DP rank order (kv_producer, "
        "kv_consumer or kv_both; ranks are numbered node by node: with 2 nodes x 1 worker, "
        "kv_producer,kv_consumer puts the producer on the first node). DP rank i is started with "
        "--kv-transfer-config '{\"kv_role\": ROLE i}'. Default: none (no KV sockets); not with --tp-size, --pp-size "
        "or --ep-size > 1",
        metavar="ROLES",
    )
    coordinator_host: str | None = option(None, "the coordinator's bind address (default: the first node's address)")
    coordinator_port: int = option(DEFAULT_COORDINATOR_PORT, "the coordinator's port")
    coordinators: int = option(
        1,
        "coordinator processes (1, or 3 or more), on --coordinator-port and the ports after it: they elect a leader, "
        "and another takes over within about a lease when it dies (docs/architecture.md, 'Several coordinators')",
    )
    spread_coordinators: bool = option(
        True,
        "coordinator i on node i mod the job's nodes (the head first; each other node's as an srun step there), "
        "so that a standby does not share the leader's node: its link, its load, its memory. Slurm ends the job "
        "when a node fails (unless sbatch --no-kill) and always when the head's does, so this is not against a dead "
        "node but against what does not end the job: a node cut off or flapping (the side with the majority serves "
        "on), or so loaded (the head also runs the HTTP front) that its coordinators miss their beats. Off: all on "
        "the head, where they survive each other's deaths only",
    )
    drain_timeout: float = option(
        15.0,
        "on scancel, seconds requests already accepted get to finish: the "
        "coordinator refuses new ones and waits for them, the workers and the HTTP "
        "front drain too (keep S + --shutdown-timeout under Slurm's KillWait)",
        metavar="S",
    )
    ready_timeout: float = option(600.0, "seconds for every worker to join", metavar="S")
    shutdown_timeout: float = option(
        20.0, "seconds the daemons get after SIGTERM before SIGKILL (keep it below Slurm's KillWait)", metavar="S"
    )
    keys_dir: str | None = option(
        None,
        "CurveZMQ key pairs from `infer-keygen --cluster --dir DIR` (role folders "
        "workers/, clients/, admins/), on a path every node reads (default: a fresh "
        "set for this job in $SLURM_SUBMIT_DIR/.infer-keys-<job id>, removed at the "
        "end; none with --trusted-network)",
        metavar="DIR",
    )


# The coordinator's options the head takes (its --drain-timeout is the job's: JobOptions).
COORDINATOR_OPTIONS = (
    "policy",
    "heartbeat_interval",
    "worker_timeout",
    "client_timeout",
    "queue_timeout",
    "stop_timeout",
    "max_retries",
)


def head_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer.sbatch",
        allow_abbrev=False,
        description="An infer cluster over the nodes of this Slurm job (--model: on a path every node reads).",
        epilog="Other options, and the arguments after `--`, go to every worker unchanged.",
    )
    add_options(p, EngineConfig, names=("model",))
    add_options(p, JobOptions, defaults=True)
    add_front_arguments(p)  # --host (default: the first node's address), --port, --api-key, ...
    p.set_defaults(host=None, port=DEFAULT_HTTP_PORT)
    add_options(p.add_argument_group("coordinator options"), CoordinatorConfig, names=COORDINATOR_OPTIONS)
    add_options(
        p.add_argument_group("restarts (of a worker, the coordinator or the HTTP front that dies)"), RestartPolicy
    )
    add_logging_args(p)
    return p


def coordinator_flags(args: argparse.Namespace) -> list[str]:
    """The coordinator's command line: its options given to the head, the job's drain timeout, the traces'
    endpoint, logging."""
    options = dict(
        given(CoordinatorConfig, args, names=COORDINATOR_OPTIONS),
        drain_timeout=args.drain_timeout,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    return to_argv(CoordinatorConfig, options) + logging_flags(args)


def worker_flags(args: argparse.Namespace) -> list[str]:
    """What every worker gets from the head's options: the model, the heartbeat interval (the coordinator's too),
    the job's drain timeout, the traces' endpoint, logging."""
    return (
        to_argv(EngineConfig, {"model": args.model})
        + to_argv(
            WorkerOptions,
            {
                "heartbeat_interval": args.heartbeat_interval,
                "drain_timeout": args.drain_timeout,
                "otlp_traces_endpoint": args.otlp_traces_endpoint,
            },
        )
        + logging_flags(args)
    )


@dataclass(frozen=True)
class HeadPlan:
    """What the head starts: the coordinator's bind address, the front's, and the workers' srun command."""

    nodes: list[str]
    workers_per_node: int
    ep_size: int
    coordinator_host: str
    coordinator_port: int
    http_host: str
    srun: list[str] = field(default_factory=list)
    tp_size: int = 1
    pp_size: int = 1
    coordinators: int = 1
    places: list[CoordinatorPlace] = field(default_factory=list)  # one per coordinator
    # the srun step of each coordinator on another node than the head, by index
    coordinator_steps: dict[int, list[str]] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """Every coordinator's address, comma-separated: what workers, clients and the coordinators are given."""
        return ",".join(place.address for place in self.places)

    @property
    def num_workers(self) -> int:
        """DP ranks (what registers with the coordinator): srun tasks / (tp_size x pp_size)."""
        return len(self.nodes) * self.workers_per_node // (self.tp_size * self.pp_size)


def plan_head(
    args: argparse.Namespace,
    worker_extra: list[str],
    nodes: list[str],
    env: SlurmEnv,
    keys: ClusterKeyDir | None = None,
    resolve: Resolver = socket.gethostbyname,
) -> HeadPlan:
    """Validate the options against the job's `nodes` and build the plan; ValueError naming what is wrong.
    `keys`: the workers and the coordinators get their key flags from it; `resolve`: a node's name to its address."""
    if env.node_name is not None and env.node_name != nodes[0]:
        raise ValueError(
            f"the head must run on the job's first node {nodes[0]}, not {env.node_name} "
            f"(submit infer.sbatch with sbatch)"
        )
    per_node = args.workers_per_node or env.ntasks_per_node or 1
    total = len(nodes) * per_node
    if per_node < 1:
        raise ValueError(f"--workers-per-node must be >= 1, got {per_node}")
    if args.ep_size < 1 or total % args.ep_size:
        raise ValueError(f"{len(nodes)} nodes x {per_node} workers do not split into EP groups of {args.ep_size}")
    if args.tp_size < 1 or total % (args.tp_size * args.ep_size):
        raise ValueError(
            f"{len(nodes)} nodes x {per_node} tasks do not split into TP groups of {args.tp_size} "
            f"(x EP groups of {args.ep_size})"
        )
    world = args.pp_size * args.tp_size * args.ep_size
    if args.pp_size < 1 or total % world:
        raise ValueError(
            f"{len(nodes)} nodes x {per_node} tasks do not split into pipelines of {args.pp_size} "
            f"stages (x TP groups of {args.tp_size} x EP groups of {args.ep_size})"
        )
    for name in ("coordinator_port", "port", "dist_port"):
        if not 0 < getattr(args, name) < 65536:
            raise ValueError(f"--{name.replace('_', '-')} must be in 1..65535 (the other nodes must know it)")
    if args.coordinators == 2 or not 1 <= args.coordinators <= MAX_COORDINATORS:
        raise ValueError(
            f"--coordinators must be 1, or 3 to {MAX_COORDINATORS} (two cannot tell a dead peer from a cut cable), "
            f"got {args.coordinators}"
        )
    if args.coordinator_port + args.coordinators > 65536:
        raise ValueError(f"--coordinator-port {args.coordinator_port} leaves no room for {args.coordinators} ports")
    if args.kv_roles is not None:
        if world > 1:
            raise ValueError(
                "--kv-roles: workers with a KV role are not supported with --tp-size, --pp-size or --ep-size > 1"
            )
        if any(a.split("=", 1)[0] == "--kv-transfer-config" for a in worker_extra):
            raise ValueError("--kv-roles gives each worker its --kv-transfer-config: pass one or the other")
        parse_kv_roles(args.kv_roles, total, "DP rank(s) (nodes x --workers-per-node)")
    restarts = RestartPolicy(**given(RestartPolicy, args))  # checked here: a bad value fails before anything starts
    coordinator_host = args.coordinator_host or reachable_address(nodes[0], nodes, resolve)
    places = place_coordinators(
        args.coordinators, nodes, args.coordinator_port, coordinator_host, args.spread_coordinators, resolve
    )
    address = ",".join(place.address for place in places)
    task = TaskOptions(
        coordinator=address,
        ep_size=args.ep_size,
        tp_size=args.tp_size,
        pp_size=args.pp_size,
        dist_port=args.dist_port,
        kv_roles=",".join(parse_kv_roles(args.kv_roles, total, "DP rank(s)")) or None,
    )
    worker = [
        sys.executable,
        os.path.abspath(__file__),
        "worker",
        *to_argv(TaskOptions, task),
        *to_argv(RestartPolicy, restarts),
        "--",
        *worker_flags(args),
        *(keys.worker_flags() if keys else []),
        *worker_extra,
    ]
    srun = [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={total}",
        f"--ntasks-per-node={per_node}",
        "--distribution=block",
        "--overcommit",
        "--kill-on-bad-exit=0",
        "--label",
        "--job-name=infer-workers",
        *worker,
    ]
    security = [*(keys.coordinator_flags() if keys else []), *(["--trusted-network"] if args.trusted_network else [])]
    steps = {
        place.index: coordinator_step(place, address, [*security, *coordinator_flags(args)])
        for place in places
        if place.node != nodes[0]
    }
    return HeadPlan(
        nodes,
        per_node,
        args.ep_size,
        coordinator_host,
        args.coordinator_port,
        args.host or coordinator_host,
        srun,
        args.tp_size,
        args.pp_size,
        args.coordinators,
        places,
        steps,
    )


def coordinator_step(place: CoordinatorPlace, address: str, flags: list[str]) -> list[str]:
    """The srun step that runs coordinator `place.index` on its node (not the head's): one task, sharing the job's
    CPUs with the workers' step (--overlap), binding its node's address; `address`: every coordinator's."""
    return [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={place.node}",
        "--overlap",
        "--kill-on-bad-exit=0",
        f"--job-name=infer-coordinator{place.index}",
        sys.executable,
        "-m",
        "infer.coordinator.daemon",
        "--host",
        place.bind_host,
        "--port",
        str(place.port),
        "--peers",
        address,
        "--peer-index",
        str(place.index),
        *flags,
    ]


@dataclass
class SrunCluster(LocalCluster):
    """infer-serve's LocalCluster with the workers as one srun step over the job's nodes: the head's coordinators
    are children of this process, another node's coordinator is its srun step (`coordinator_steps`), and srun the
    only 'worker' process (it exits when every task has)."""

    srun: list[str] = field(default_factory=list)
    places: list[CoordinatorPlace] = field(default_factory=list)
    coordinator_steps: dict[int, list[str]] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return ",".join(place.address for place in self.places) if self.places else super().address

    def listen(self) -> None:
        """The sockets of the head's coordinators (another node's binds its own there)."""
        if not self.listeners:
            self.listeners = {
                place.index: listening_socket(place.bind_host, place.port, backlog=1024, inheritable=True)
                for place in self.places
                if place.index not in self.coordinator_steps
            }
        self.ports = [place.port for place in self.places]
        self.port = self.ports[0]

    async def spawn_coordinator(self, index: int = 0) -> asyncio.subprocess.Process:
        if index not in self.coordinator_steps:
            return await super().spawn_coordinator(index)
        return await asyncio.create_subprocess_exec(*self.coordinator_steps[index], start_new_session=True)

    async def start(self) -> None:
        self.listen()
        for index in range(self.num_coordinators):
            self.coordinators.append(await self.spawn_coordinator(index))
        self.workers.append(await self.spawn_worker())

    async def spawn_worker(self) -> asyncio.subprocess.Process:
        """The srun step of every worker task (restarted by infer-serve's supervision only once all have ended)."""
        return await asyncio.create_subprocess_exec(*self.srun, start_new_session=True)

    def _name(self, proc: asyncio.subprocess.Process) -> str:
        if proc in self.coordinators:
            return super()._name(proc)
        return f"the workers' srun step (pid {proc.pid})"


def job_keys_dir(env: SlurmEnv) -> Path:
    """Where the head writes this job's fresh key set: the submit directory, which every node mounts."""
    if not env.submit_dir:
        raise ValueError(
            "SLURM_SUBMIT_DIR is unset: pass --keys-dir DIR (on a path every node reads) or --trusted-network"
        )
    return Path(env.submit_dir) / f".infer-keys-{env.job_id}"


def job_keys(args: argparse.Namespace, env: SlurmEnv) -> tuple[ClusterKeyDir | None, Path | None]:
    """(the job's keys, the directory to remove at the end): --keys-dir's, none with --trusted-network,
    else a fresh set in job_keys_dir (0700)."""
    if args.keys_dir is not None:
        return ClusterKeyDir(Path(args.keys_dir)), None
    if args.trusted_network:
        return None, None
    directory = job_keys_dir(env)
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        raise ValueError(
            f"{directory} exists (a job with this id ran before?): remove it, or pass --keys-dir"
        ) from None
    try:
        return ClusterKeyDir.create(directory), directory
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def run_head(argv: list[str]) -> int:
    own, extra = split_extra(argv)
    args, unknown = head_parser().parse_known_args(own)
    setup_logging(args.log_level, args.log_format)
    made = None
    try:
        env = SlurmEnv.from_environ()
        nodes = hostnames(env.job_nodelist)
        front = front_config(args, None)
        keys, made = job_keys(args, env)
        plan = plan_head(args, unknown + extra, nodes, env, keys)
        check_front_exposure(plan.http_host, front, args.trusted_network)
    except (ValueError, OSError, subprocess.SubprocessError) as e:
        print(f"infer.sbatch: {e}", file=sys.stderr)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        return 2
    try:
        return _serve_job(args, env, plan, keys, made)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def _serve_job(
    args: argparse.Namespace, env: SlurmEnv, plan: HeadPlan, keys: ClusterKeyDir | None, made: Path | None
) -> int:
    args.host = plan.http_host
    if keys is not None:
        print(
            f"infer.sbatch: CurveZMQ on every link, keys in {keys.path}"
            f"{' (made for this job, removed when it ends)' if made else ''}; clients connect with "
            f"curve_key={keys.secret('client')} coordinator_key={keys.public('coordinator')}; administrators "
            f"(pause, suspend, stop) with curve_key={keys.secret('admin')}",
            flush=True,
        )
    nodes = ",".join(place.node for place in plan.places)
    print(
        f"infer.sbatch: job {env.job_id}: coordinator{'s' if plan.coordinators > 1 else ''} {plan.address} on "
        f"{nodes}; {plan.num_workers} workers ({plan.workers_per_node} tasks per node on "
        f"{','.join(plan.nodes)}, EP size {plan.ep_size}, TP size {plan.tp_size}, PP size {plan.pp_size}); HTTP "
        f"front on "
        f"{plan.http_host}:{args.port} once every worker has joined",
        flush=True,
    )
    cluster = SrunCluster(
        num_workers=plan.num_workers,
        host=plan.coordinator_host,
        port=plan.coordinator_port,
        num_coordinators=plan.coordinators,
        coordinator_args=coordinator_flags(args),
        srun=plan.srun,
        places=plan.places,
        coordinator_steps=plan.coordinator_steps,
        keys=keys,
        trusted_network=args.trusted_network,
    )
    return asyncio.run(serve(cluster, args))


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the arguments before `--`, the ones after it)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("head", "worker"):
        print("usage: launch.py head|worker [options] [-- worker options]", file=sys.stderr)
        return 2
    return run_head(argv[1:]) if argv[0] == "head" else run_worker(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
