"""The processes of a TP group: joining the torch.distributed world, agreeing before serving, and the
members' entry points. (torch is imported only when a group is joined: the worker daemon imports this
module to parse its flags.) The step commands are worker/parallel/tp_commands.py; starting a group's processes on
one node, worker/parallel/tp_supervisor.py.

**World.** A DP rank of T processes is a TP group; with an EP group of E DP ranks the world is T x E
processes, global rank = ep_rank * T + tp_rank. Every process joins the same rendezvous (`--dist-init`);
before that, each checks through the rendezvous store that it agrees with global rank 0 on T and E (a
mismatch names both sides). Groups: one TP group per DP rank; with E > 1, one EP group per TP rank (the
processes with the same TP rank: the MoE all-to-all runs among them); the EP lockstep (`GroupSync`) runs
among the TP rank 0 processes. Then every process compares its model files, dtype and sizes with the
others (`check_same_model`): a rank started with other files is refused before any request.

**Faults.** Every collective has the group's timeout (`--tp-timeout`): a member that died fails the next
collective at once, one that hangs fails it after the timeout; rank 0 notices a follower that died even while
idle (its command connection closes, worker/parallel/tp_commands.py). Rank 0 then gives its requests back and exits
(`GroupBroken`, as an EP group), telling the followers to stop with its exit code. A follower that hears nothing
from rank 0 for the timeout, or whose connection from rank 0 closes, exits non-zero. So every member of a broken
group exits non-zero, and a launcher that restarts failed processes (the Slurm launcher's tasks) restarts the
whole group, which meets again at the same rendezvous. The supervisor that started the group's processes on one
node (tp_supervisor.py) ends the others once one of them exits.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from infer.protocol.env import TP_SUPERVISED
from infer.protocol.env import read as read_env
from infer.worker.distributed.group_sync import STARTUP_TIMEOUT_S, join_world

if TYPE_CHECKING:
    import torch

    from infer.worker.distributed.expert_parallel import ExpertParallel
    from infer.worker.distributed.group_sync import EpOptions
    from infer.worker.distributed.tensor_parallel import TensorParallel
    from infer.worker.engine.config import EngineConfig
    from infer.worker.engine.engine import Engine
    from infer.worker.models.registry import CausalLM

log = logging.getLogger("infer.worker")


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

    @property
    def commands(self) -> TensorParallel:
        """The processes of the command channel (worker/parallel/tp_commands.py): the TP group, rank 0 its leader."""
        return self.tp

    def member(self, index: int) -> str:
        """The name of the channel's member `index` in messages."""
        return f"TP rank {index}"


def resolve_ranks(
    tp_size: int,
    tp_rank: int | None,
    ep_size: int,
    ep_rank: int | None,
    env: dict[str, str] | None = None,
    pp_size: int = 1,
) -> tuple[int | None, int | None]:
    """(tp rank, ep rank) from the flags, else from torchrun's RANK or Slurm's SLURM_PROCID read as the
    global rank (ep_rank * pp_size + stage) * tp_size + tp_rank (only when --tp-rank is not given: with neither
    flag nor variables the TP rank stays None, and this process supervises its group)."""
    env = dict(os.environ) if env is None else env
    if tp_rank is not None or tp_size == 1:
        return tp_rank, ep_rank
    name = "RANK" if "RANK" in env else "SLURM_PROCID" if "SLURM_PROCID" in env else None
    if name is None or read_env(TP_SUPERVISED, env) is not None:
        return None, ep_rank
    try:
        global_rank = int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {env[name]!r}") from None
    return global_rank % tp_size, (global_rank // (tp_size * pp_size)) % ep_size if ep_rank is None else ep_rank


# ---- joining the world ----------------------------------------------------------------------------------


def init_world(options: TpOptions, ep: EpOptions | None, device: torch.device) -> Parallel:
    """Join the T x E world (blocks until every process has joined, at most the timeout) and make its groups."""
    import torch.distributed as dist

    from infer.worker.distributed.expert_parallel import ExpertParallel
    from infer.worker.distributed.tensor_parallel import TensorParallel

    if options.rank is None or options.dist_init is None:
        raise ValueError("init_world needs this process's --tp-rank and the group's --dist-init")
    ep_size, ep_rank = (ep.size, ep.rank) if ep is not None else (1, 0)
    size, rank = options.size * ep_size, ep_rank * options.size + options.rank
    timeout = datetime.timedelta(seconds=options.timeout_s)
    layout = f"{options.size}x{ep_size}"
    backend = join_world(options.dist_init, rank, size, layout, "--tp-size x --ep-size", timeout, device)
    T = options.size
    cpu = (lambda ranks: dist.new_group(ranks, backend="gloo", timeout=timeout)) if backend == "nccl" else None
    tp_groups = [dist.new_group([e * T + t for t in range(T)], timeout=timeout) for e in range(ep_size)]
    tp_cpu = [cpu([e * T + t for t in range(T)]) for e in range(ep_size)] if cpu else tp_groups
    ep_groups = [dist.new_group([e * T + t for e in range(ep_size)], timeout=timeout) for t in range(T)]
    leaders_cpu = cpu([e * T for e in range(ep_size)]) if cpu else ep_groups[0]
    startup = datetime.timedelta(seconds=max(options.timeout_s, STARTUP_TIMEOUT_S))
    tp_startup = [
        dist.new_group([e * T + t for t in range(T)], backend="gloo", timeout=startup) for e in range(ep_size)
    ]
    tp = TensorParallel(
        rank=options.rank,
        size=T,
        group=tp_groups[ep_rank],
        leader=ep_rank * T,
        cpu_group=tp_cpu[ep_rank],
        startup_group=tp_startup[ep_rank],
    )
    expert = ExpertParallel(rank=ep_rank, size=ep_size, group=ep_groups[options.rank])
    log.info(
        "TP group joined: TP rank %d of %d, EP rank %d of %d, global rank %d of %d at %s (%s)",
        options.rank,
        T,
        ep_rank,
        ep_size,
        rank,
        size,
        options.dist_init,
        backend,
    )
    return Parallel(tp=tp, ep=expert, ep_leaders_group=leaders_cpu if ep_size > 1 else None, options=options)


def check_same_model(tp: TensorParallel | None, group: Any, facts: dict[str, Any]) -> None:
    """Compare `facts` (model files fingerprint, dtype, sizes) with every member of `group`; ValueError naming
    the first member that differs and both values."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, {"host": socket.gethostname(), "pid": os.getpid(), **facts}, group=group)
    mine = gathered[dist.get_rank(group)]
    for rank, theirs in enumerate(gathered):
        for key in facts:
            if theirs[key] != mine[key]:
                raise ValueError(
                    f"rank {rank} of the group ({theirs['host']}, pid {theirs['pid']}) has {key} "
                    f"{theirs[key]!r}, this process ({mine['host']}, pid {mine['pid']}) has "
                    f"{mine[key]!r}: every member must serve the same model with the same options"
                )


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


def engine_facts(config: Any, path: Path, weight_files: Sequence[Path], dtype: Any) -> dict[str, Any]:
    """What every member of a group must agree on before serving (see check_same_model)."""
    return {
        "model files": model_fingerprint(path, weight_files),
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": config.block_size,
        "max_model_len": config.max_model_len,
        "config": json.loads((path / "config.json").read_text()).get("model_type"),
    }


# ---- the processes' entry points (the worker daemon calls these) -------------------------------------------


def join(config: Any, options: TpOptions, ep: EpOptions | None) -> tuple[Parallel, Path, Any]:
    """Join the world and check that every member serves the same model: (this process's place, the model
    directory, `config` with this process's own GPU when it runs on CUDA)."""
    import dataclasses

    from infer.worker.engine.engine_setup import pick_device
    from infer.worker.loading.loader import weight_files
    from infer.worker.loading.model_files import resolve_model

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
    Returns the exit code (rank 0's when it said stop: 0 only when the group was told to stop)."""

    from infer.worker.engine.engine_setup import context_length, num_kv_blocks, shares_kv
    from infer.worker.engine.forward_batch import KVCache
    from infer.worker.loading.loader import load_model, set_weight_prepack
    from infer.worker.parallel.tp_commands import FollowerChannel, serve_follower, start_follower

    device, dtype = start_follower(config)
    model = load_model(path, dtype, device, parallel.ep, parallel.tp, config.quantization)
    set_weight_prepack(model, config.cpu_weight_prepack)
    lm = cast("CausalLM", model)  # one of our model classes, which meet the CausalLM contract
    max_model_len = context_length(config, model.config)
    blocks = parallel.tp.agree_min(num_kv_blocks(config, lm, dtype, device, max_model_len))
    kv_cache = KVCache.allocate(
        lm.num_layers,
        blocks,
        config.block_size,
        lm.num_kv_heads,
        lm.head_dim,
        dtype,
        device,
        shared_kv=shares_kv(model),
    )
    lora = None
    if config.enable_lora:
        from infer.worker.engine.lora import LoraManager

        lora = LoraManager(model, config.max_loras, config.max_lora_rank, dtype, device)
    channel = FollowerChannel(parallel)
    log.info(
        "TP rank %d ready on %s: %d KV blocks of %d KV head(s)",
        parallel.tp.rank,
        socket.gethostname(),
        blocks,
        model.num_kv_heads,
    )
    return serve_follower(model, kv_cache, config.block_size, channel, device, lora)


def tensor_parallel_engine(
    config: EngineConfig, size: int, worker_flags: Sequence[str], timeout_s: float = 60.0
) -> Engine:
    """An engine that is TP rank 0 of a group of `size`, the other ranks started now as child processes of
    this one on this machine (`infer-worker` with `worker_flags`: the same engine options); `close()` ends
    them. (LLM / AsyncLLM's direct mode with tensor_parallel_size > 1.)"""
    from infer.protocol.ports import reserved_port
    from infer.worker.engine.engine import Engine
    from infer.worker.parallel.tp_commands import TpLeader
    from infer.worker.parallel.tp_supervisor import start_followers

    dist_init = f"tcp://127.0.0.1:{reserved_port()}"
    children = start_followers(size, dist_init, worker_flags)
    try:
        parallel, _, config = join(config, TpOptions(size=size, rank=0, dist_init=dist_init, timeout_s=timeout_s), None)
        engine = Engine(config, parallel.ep, tp=parallel.tp)
        engine.runner.followers = TpLeader(parallel, children=children)
    except BaseException:
        for child in children:
            child.kill()
            child.wait(timeout=10)
        raise
    return engine
