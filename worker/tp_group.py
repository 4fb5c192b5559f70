"""The processes of a TP group: joining the torch.distributed world, the step commands TP rank 0 sends to
the others, and the follower loop. (torch is imported only when a group is joined: the worker daemon imports
this module to parse its flags.)

**World.** A DP rank of T processes is a TP group; with an EP group of E DP ranks the world is T x E
processes, global rank = ep_rank * T + tp_rank. Every process joins the same rendezvous (`--dist-init`);
before that, each checks through the rendezvous store that it agrees with global rank 0 on T and E (a
mismatch names both sides). Groups: one TP group per DP rank; with E > 1, one EP group per TP rank (the
processes with the same TP rank: the MoE all-to-all runs among them); the EP lockstep (`GroupSync`) runs
among the TP rank 0 processes. Then every process compares its model files, dtype and sizes with the
others (`check_same_model`): a rank started with other files is refused before any request.

**Commands.** TP rank 0 runs the engine (scheduler, sampler, the coordinator's connection). Each model
forward it runs, it first sends to the others as a command over zmq (PUSH -> each follower's PULL; frames
are msgpack maps, tensors as raw bytes, never pickled): "forward" (the step's ForwardBatch), "logits" (rows
of the last forward's hidden states whose logits rank 0 gathers), "dummy" (an EP group's dummy step),
"ping" (while idle, every `ping_interval_s`), "stop". A follower runs each command on its shards; the
collectives inside the forward keep the group in step.

**Faults.** Every collective has the group's timeout (`--tp-timeout`): a member that died fails the next
collective at once, one that hangs fails it after the timeout; rank 0 then gives its requests back and
exits (`GroupBroken`, as an EP group), and tells the followers to stop. A follower that hears nothing from
rank 0 for the timeout (no command, no ping) exits: rank 0 is gone. The supervisor that started the group's
processes (`supervise`) ends the others once one of them exits.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgpack
import zmq

from infer.protocol.transport import make_socket
from infer.worker.group_sync import GroupBroken, _local_address_towards

if TYPE_CHECKING:
    import torch

    from infer.worker.expert_parallel import ExpertParallel
    from infer.worker.forward_batch import ForwardBatch
    from infer.worker.group_sync import EpOptions
    from infer.worker.tensor_parallel import TensorParallel

log = logging.getLogger("infer.worker")

SUPERVISOR_GRACE_S = 5.0     # once a member exits, the others get this long before SIGKILL


class LeaderGone(RuntimeError):
    """A follower heard nothing from TP rank 0 within the timeout."""


@dataclass(frozen=True)
class TpOptions:
    """Where this process sits in its TP group. `rank` None: this process supervises the group's T
    processes on this node (it starts them with --tp-rank r)."""

    size: int
    rank: int | None
    dist_init: str | None
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"a TP group has at least 2 processes, got --tp-size {self.size}")
        if self.rank is not None and not 0 <= self.rank < self.size:
            raise ValueError(f"--tp-rank must be in [0, {self.size}), got {self.rank}")
        if self.rank is not None and self.dist_init is None:
            raise ValueError("--tp-rank needs --dist-init tcp://HOST:PORT (or MASTER_ADDR and MASTER_PORT)")
        if self.dist_init is not None:
            parts = urlsplit(self.dist_init)
            if parts.scheme != "tcp" or not parts.hostname or not parts.port:
                raise ValueError(f"--dist-init must be tcp://HOST:PORT, got {self.dist_init!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"--tp-timeout must be > 0, got {self.timeout_s}")

    @property
    def ping_interval_s(self) -> float:
        return min(1.0, self.timeout_s / 4)


@dataclass(frozen=True)
class Parallel:
    """This process's place in the world: its TP and EP shares, and the CPU group of the EP lockstep
    (the TP rank 0 processes; None without an EP group)."""

    tp: TensorParallel
    ep: ExpertParallel
    ep_leaders_group: Any
    options: TpOptions


def resolve_ranks(tp_size: int, tp_rank: int | None, ep_size: int, ep_rank: int | None,
                  env: dict[str, str] | None = None) -> tuple[int | None, int | None]:
    """(tp rank, ep rank) from the flags, else from torchrun's RANK or Slurm's SLURM_PROCID read as the
    global rank ep_rank * tp_size + tp_rank (only when --tp-rank is not given: with neither flag nor
    variables the TP rank stays None, and this process supervises its group)."""
    env = dict(os.environ) if env is None else env
    if tp_rank is not None or tp_size == 1:
        return tp_rank, ep_rank
    name = "RANK" if "RANK" in env else "SLURM_PROCID" if "SLURM_PROCID" in env else None
    if name is None or "INFER_TP_SUPERVISED" in env:
        return None, ep_rank
    try:
        global_rank = int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {env[name]!r}") from None
    return global_rank % tp_size, (global_rank // tp_size) % ep_size if ep_rank is None else ep_rank


# ---- joining the world ----------------------------------------------------------------------------------

def init_world(options: TpOptions, ep: EpOptions | None, device: torch.device) -> Parallel:
    """Join the T x E world (blocks until every process has joined, at most the timeout) and make its groups."""
    import torch.distributed as dist

    from infer.worker.expert_parallel import ExpertParallel
    from infer.worker.tensor_parallel import TensorParallel

    if options.rank is None or options.dist_init is None:
        raise ValueError("init_world needs this process's --tp-rank and the group's --dist-init")
    ep_size, ep_rank = (ep.size, ep.rank) if ep is not None else (1, 0)
    size, rank = options.size * ep_size, ep_rank * options.size + options.rank
    timeout = datetime.timedelta(seconds=options.timeout_s)
    store = _rendezvous(options.dist_init, rank, size, f"{options.size}x{ep_size}", timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    T = options.size
    cpu = (lambda ranks: dist.new_group(ranks, backend="gloo", timeout=timeout)) if backend == "nccl" else None
    tp_groups = [dist.new_group([e * T + t for t in range(T)], timeout=timeout) for e in range(ep_size)]
    tp_cpu = [cpu([e * T + t for t in range(T)]) for e in range(ep_size)] if cpu else tp_groups
    ep_groups = [dist.new_group([e * T + t for e in range(ep_size)], timeout=timeout) for t in range(T)]
    leaders_cpu = cpu([e * T for e in range(ep_size)]) if cpu else ep_groups[0]
    tp = TensorParallel(rank=options.rank, size=T, group=tp_groups[ep_rank], leader=ep_rank * T,
                        cpu_group=tp_cpu[ep_rank])
    expert = ExpertParallel(rank=ep_rank, size=ep_size, group=ep_groups[options.rank])
    log.info("TP group joined: TP rank %d of %d, EP rank %d of %d, global rank %d of %d at %s (%s)",
             options.rank, T, ep_rank, ep_size, rank, size, options.dist_init, backend)
    return Parallel(tp=tp, ep=expert, ep_leaders_group=leaders_cpu if ep_size > 1 else None, options=options)


def _rendezvous(dist_init: str, rank: int, size: int, layout: str, timeout: datetime.timedelta) -> Any:
    """The world's TCPStore (global rank 0 hosts it), after checking that this process and global rank 0
    agree on the layout (TP size x EP size): ValueError naming both sides otherwise."""
    import torch.distributed as dist

    parts = urlsplit(dist_init)
    store = dist.TCPStore(parts.hostname, parts.port, None if rank else size, rank == 0, timeout=timeout,
                          wait_for_workers=False)
    store.set(f"infer/layout/{rank}", f"{layout}:{size}")
    theirs = store.get("infer/layout/0").decode()
    if theirs != f"{layout}:{size}":
        raise ValueError(f"this process (global rank {rank}) was started with --tp-size x --ep-size = {layout}, "
                         f"but global rank 0 at {dist_init} with {theirs.split(':')[0]}: every member of the "
                         f"group must be given the same sizes")
    if rank >= size:
        raise ValueError(f"global rank {rank} is outside the world of {size} processes")
    return store


def check_same_model(tp: TensorParallel, group: Any, facts: dict[str, Any]) -> None:
    """Compare `facts` (model files fingerprint, dtype, sizes) with every member of `group`; ValueError naming
    the first member that differs and both values."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, {"host": socket.gethostname(), "pid": os.getpid(), **facts}, group=group)
    mine = gathered[dist.get_rank(group)]
    for rank, theirs in enumerate(gathered):
        for key in facts:
            if theirs[key] != mine[key]:
                raise ValueError(f"rank {rank} of the group ({theirs['host']}, pid {theirs['pid']}) has {key} "
                                 f"{theirs[key]!r}, this process ({mine['host']}, pid {mine['pid']}) has "
                                 f"{mine[key]!r}: every member must serve the same model with the same options")


def model_fingerprint(path: Path, weight_files: Sequence[Path]) -> str:
    """A digest of config.json, each safetensors file's header (names, dtypes, shapes) and the first and last
    MiB of its data: cheap, and different for files saved from different weights."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in weight_files:
        with open(file, "rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little")
            digest.update(f.read(header_len))
            digest.update(f.read(1 << 20))
            end = f.seek(0, os.SEEK_END)
            f.seek(max(8 + header_len, end - (1 << 20)))
            digest.update(f.read())
    return digest.hexdigest()[:16]


def agree_min(tp: TensorParallel, value: int) -> int:
    """The smallest `value` over the TP group (the KV blocks every member can hold)."""
    if tp.size == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    except Exception as e:  # noqa: BLE001
        raise GroupBroken(f"TP group agreement failed: {e}") from e
    return int(t.item())


def _gather_addresses(tp: TensorParallel, address: str | None) -> list[str | None]:
    import torch.distributed as dist

    values: list[Any] = [None] * tp.size
    dist.all_gather_object(values, address, group=tp.cpu_group)
    return values


# ---- commands -----------------------------------------------------------------------------------------

_BATCH_TENSORS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                  "logits_indices")


def _pack_tensor(t: torch.Tensor) -> list[Any]:
    t = t.detach().to("cpu").contiguous()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), t.numpy().tobytes()]


def _unpack_tensor(packed: list[Any], device: torch.device) -> torch.Tensor:
    import numpy as np
    import torch

    dtype, shape, data = packed
    array = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    return torch.from_numpy(array.copy()).to(device)


def encode_batch(batch: ForwardBatch) -> dict[str, Any]:
    body: dict[str, Any] = {name: _pack_tensor(getattr(batch, name)) for name in _BATCH_TENSORS}
    body.update(num_decodes=batch.num_decodes, query_lens=list(batch.query_lens),
                context_lens=list(batch.context_lens), block_size=batch.block_size,
                decode_split_tokens=batch.decode_split_tokens)
    return body


def decode_batch(body: dict[str, Any], device: torch.device) -> ForwardBatch:
    from infer.worker.forward_batch import ForwardBatch

    known = {f.name for f in fields(ForwardBatch)}
    values = {name: _unpack_tensor(body[name], device) for name in _BATCH_TENSORS}
    values.update(num_decodes=body["num_decodes"], query_lens=tuple(body["query_lens"]),
                  context_lens=tuple(body["context_lens"]), block_size=body["block_size"],
                  decode_split_tokens=body["decode_split_tokens"])
    return ForwardBatch(**{k: v for k, v in values.items() if k in known})


class TpLeader:
    """TP rank 0's side of the command channel: a PUSH socket to each follower, and a thread that pings
    them while nothing else is sent (a follower takes silence for rank 0's death)."""

    def __init__(self, parallel: Parallel, ctx: zmq.Context | None = None,
                 children: Sequence[subprocess.Popen] = ()) -> None:
        """`children`: the follower processes this process started (stop() waits for them, and leaves the
        torch.distributed world so that another group can be made here)."""
        self.tp = parallel.tp
        self._children = list(children)
        ctx = ctx or zmq.Context.instance()
        self._lock = threading.Lock()
        self._pushes = []
        for address in _gather_addresses(self.tp, None)[1:]:
            push = make_socket(ctx, zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.connect(address)
            self._pushes.append(push)
        self._interval = parallel.options.ping_interval_s
        self._stop = threading.Event()
        self._pinger = threading.Thread(target=self._ping_while_alive, name="infer-tp-ping", daemon=True)
        self._pinger.start()

    def forward(self, batch: ForwardBatch) -> None:
        self._send({"op": "forward", "batch": encode_batch(batch)})

    def logits(self, rows: torch.Tensor) -> None:
        self._send({"op": "logits", "rows": _pack_tensor(rows)})

    def dummy(self) -> None:
        self._send({"op": "dummy"})

    def _send(self, command: dict[str, Any]) -> None:
        frame = msgpack.packb(command, use_bin_type=True)
        with self._lock:
            for push in self._pushes:
                push.send(frame, copy=False)

    def _ping_while_alive(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._send({"op": "ping"})
            except zmq.ZMQError:
                return

    def stop(self) -> None:
        """Tell the followers to exit, and close the channel (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._pinger.join(timeout=5)
        try:
            self._send({"op": "stop"})
        except zmq.ZMQError:
            pass
        for push in self._pushes:
            push.setsockopt(zmq.LINGER, 2000)
            push.close()
        if self._children:
            _reap(self._children)
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _reap(children: Sequence[subprocess.Popen]) -> None:
    """Wait SUPERVISOR_GRACE_S for each child to exit, then SIGKILL it."""
    for child in children:
        try:
            child.wait(timeout=SUPERVISOR_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("TP member pid %d did not exit with its group; killing it", child.pid)
            child.kill()
            child.wait(timeout=SUPERVISOR_GRACE_S)


def start_followers(size: int, dist_init: str, worker_flags: Sequence[str]) -> list[subprocess.Popen]:
    """TP ranks 1 .. size-1 as `infer-worker` child processes of this one (which is TP rank 0)."""
    env = {**os.environ, "INFER_TP_SUPERVISED": "1"}
    return [subprocess.Popen([sys.executable, "-m", "infer.worker.daemon", *worker_flags, "--tp-size", str(size),
                              "--tp-rank", str(rank), "--dist-init", dist_init], env=env,
                             preexec_fn=_die_with_parent, process_group=0) for rank in range(1, size)]


class FollowerChannel:
    """A follower's end of the command channel: one PULL socket."""

    def __init__(self, parallel: Parallel, ctx: zmq.Context | None = None) -> None:
        ctx = ctx or zmq.Context.instance()
        self.timeout_s = parallel.options.timeout_s
        self.pull = make_socket(ctx, zmq.PULL)
        dist_init = parallel.options.dist_init or "tcp://127.0.0.1:0"
        host = _local_address_towards(urlsplit(dist_init).hostname or "127.0.0.1")
        port = self.pull.bind_to_random_port(f"tcp://{host}")
        _gather_addresses(parallel.tp, f"tcp://{host}:{port}")

    def receive(self) -> dict[str, Any]:
        """The next command; LeaderGone after `timeout_s` of silence."""
        if not self.pull.poll(int(self.timeout_s * 1000)):
            raise LeaderGone(f"nothing heard from TP rank 0 for {self.timeout_s:g} s")
        command = msgpack.unpackb(self.pull.recv(), raw=False)
        if not isinstance(command, dict) or not isinstance(command.get("op"), str):
            raise ValueError(f"a malformed TP command: {type(command).__name__}")
        return command

    def close(self) -> None:
        self.pull.close(0)


def serve_follower(model: Any, kv_cache: Any, block_size: int, channel: FollowerChannel,
                   device: torch.device) -> None:
    """Run rank 0's commands on this rank's shards until "stop" (returns), silence (LeaderGone) or a broken
    collective (GroupBroken)."""
    import torch

    from infer.worker.model_runner import dummy_forward_batch

    hidden = None
    with torch.inference_mode():
        while True:
            command = channel.receive()
            op = command["op"]
            if op == "forward":
                hidden = model(decode_batch(command["batch"], device), kv_cache)
            elif op == "logits":
                if hidden is None:
                    raise ValueError("a logits command before any forward")
                model.compute_logits(hidden[_unpack_tensor(command["rows"], device)])
            elif op == "dummy":
                model(dummy_forward_batch(block_size, device), kv_cache)
            elif op == "stop":
                log.info("TP rank 0 says stop; exiting")
                return
            elif op != "ping":
                raise ValueError(f"unknown TP command {op!r}")


# ---- supervising the group's processes on one node ---------------------------------------------------------

def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervisor dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def supervise(argv: Sequence[str], options: TpOptions) -> int:
    """Start this DP rank's T processes (this command line + --tp-rank r, one shared --dist-init) and wait;
    once one exits, the others get SUPERVISOR_GRACE_S to follow, then SIGKILL. SIGTERM / SIGINT go to TP
    rank 0 (it drains, then stops the others). Returns rank 0's exit code, else the first non-zero one.
    The members run in a process group of their own (a signal to the supervisor's group reaches only it) and
    die with it (SIGKILL when it dies, kill -9 included)."""
    dist_init = options.dist_init or f"tcp://127.0.0.1:{free_local_port()}"
    env = {**os.environ, "INFER_TP_SUPERVISED": "1"}
    children = []
    for rank in range(options.size):
        cmd = [sys.executable, "-m", "infer.worker.daemon", *argv, "--tp-rank", str(rank), "--dist-init", dist_init]
        children.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent, process_group=0))
        log.info("TP rank %d of this DP rank: pid %d", rank, children[-1].pid)

    def forward(signum: int, _frame: object) -> None:
        if children[0].poll() is None:
            children[0].send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    pid, status = os.wait()   # the first member to exit
    codes = {pid: os.waitstatus_to_exitcode(status)}
    for child in children:
        if child.pid in codes:
            child.returncode = codes[child.pid]
            continue
        try:
            child.wait(timeout=SUPERVISOR_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("TP rank %d (pid %d) did not exit with its group; killing it", children.index(child),
                        child.pid)
            child.kill()
            child.wait(timeout=SUPERVISOR_GRACE_S)
    leader = children[0].returncode
    return leader if leader else next((c.returncode for c in children if c.returncode), 0)


def engine_facts(config: Any, path: Path, weight_files: Sequence[Path], dtype: Any) -> dict[str, Any]:
    """What every member of a group must agree on before serving (see check_same_model)."""
    return {"model files": model_fingerprint(path, weight_files), "dtype": str(dtype).removeprefix("torch."),
            "block_size": config.block_size, "max_model_len": config.max_model_len,
            "config": json.loads((path / "config.json").read_text()).get("model_type")}


# ---- the processes' entry points (the worker daemon calls these) -------------------------------------------

def join(config: Any, options: TpOptions, ep: EpOptions | None) -> tuple[Parallel, Path, Any]:
    """Join the world and check that every member serves the same model: (this process's place, the model
    directory, `config` with this process's own GPU when it runs on CUDA)."""
    import dataclasses

    from infer.worker.engine import pick_device
    from infer.worker.loader import resolve_model, weight_files

    path = resolve_model(config.model)
    device = pick_device(config.device)
    if device.type == "cuda" and device.index is None:
        config = dataclasses.replace(config, device=f"cuda:{_local_gpu(options, ep)}")
        device = pick_device(config.device)
    parallel = init_world(options, ep, device)
    check_same_model(parallel.tp, None, engine_facts(config, path, weight_files(path), config.dtype))
    return parallel, path, config


def _local_gpu(options: TpOptions, ep: EpOptions | None) -> int:
    """This process's GPU on its node: $LOCAL_RANK (torchrun), else $SLURM_LOCALID, else its global rank,
    modulo the GPUs it sees (a TP group started on one node takes GPUs 0 .. T-1)."""
    import torch

    global_rank = (ep.rank if ep is not None else 0) * options.size + (options.rank or 0)
    local = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or str(global_rank)
    return int(local) % max(1, torch.cuda.device_count())


def run_follower(config: Any, parallel: Parallel, path: Path) -> int:
    """A follower's life: load this rank's shards, size the KV pool with the group, serve rank 0's commands.
    Returns the exit code (0 when rank 0 said stop)."""
    import torch

    from infer.worker.engine import context_length, num_kv_blocks, pick_device, pick_dtype
    from infer.worker.forward_batch import KVCache
    from infer.worker.loader import load_model

    for sig in (signal.SIGTERM, signal.SIGINT):   # rank 0 decides when the group ends (it drains first)
        signal.signal(sig, signal.SIG_IGN)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    model = load_model(path, dtype, device, parallel.ep, parallel.tp)
    max_model_len = context_length(config, model.config)
    blocks = agree_min(parallel.tp, num_kv_blocks(config, model, dtype, device, max_model_len))
    kv_cache = KVCache.allocate(model.num_layers, blocks, config.block_size, model.num_kv_heads, model.head_dim,
                                dtype, device)
    channel = FollowerChannel(parallel)
    log.info("TP rank %d ready on %s: %d KV blocks of %d KV head(s)", parallel.tp.rank, socket.gethostname(),
             blocks, model.num_kv_heads)
    try:
        serve_follower(model, kv_cache, config.block_size, channel, device)
        return 0
    except (LeaderGone, GroupBroken) as e:
        log.error("fatal: %s; exiting", e)
        return 1
    finally:
        channel.close()
