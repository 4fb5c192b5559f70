"""Pipeline parallelism v1: one DP rank as P stages, each a process holding a contiguous range of the layers (and
only their KV cache). Stage 0 owns the embedding, schedules, samples and talks to the coordinator; the last stage
owns the final norm and the LM head (a tied head: it loads the embedding table as its weight). (torch is imported
only when a group is joined: the worker daemon imports this module to parse its flags.) The stage model is
worker/pp_stage.py.

**A step.** Stage 0 runs the engine as TP rank 0 does: before each forward its `TpLeader` (worker/tp_commands.py,
the same channel and watch over the peers' connections) sends the step's ForwardBatch to every other stage; stage 0
then runs the embedding and its layers and sends (hidden, residual) to stage 1 over torch.distributed
point-to-point (gloo on CPU, NCCL on GPU); each stage receives, runs its layers and sends on; the last stage keeps
the normed hidden states. The rows whose logits stage 0 needs go out as a "logits" command, and the last stage sends
their logits back to stage 0 (prompt logprobs the same way). v1 runs one batch at a time through the stages: PP
gives capacity (a model over several processes' memory), not speed; micro-batches in flight are v2.

**World.** P processes, global rank = stage, one rendezvous (`--dist-init`); through the rendezvous store each
checks that it agrees with stage 0 on P and the layer partition, then every stage compares its model files, dtype
and sizes (`check_same_model`), and the stages agree on the KV block count (the smallest).

**Faults** as for TP groups: every point-to-point wait of a step has the group's timeout (`--pp-timeout`; joining,
loading and the agreements before serving have at least STARTUP_TIMEOUT_S, so that stages that load at different
speeds on a busy machine still meet); stage 0 notices
a stage gone even while idle (its command connection closes) and gives its requests back and exits non-zero,
telling the others to stop with its code; a stage that hears nothing from stage 0 for the timeout, or whose
connection closes, or whose send / receive fails, exits non-zero. A restarting launcher restarts the whole rank.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from infer.protocol.env import TP_SUPERVISED
from infer.protocol.env import read as read_env
from infer.worker.group_sync import GroupBroken, rendezvous_address

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from infer.worker.config import EngineConfig
    from infer.worker.engine import Engine

log = logging.getLogger("infer.worker")

STARTUP_TIMEOUT_S = 300.0   # the least time the stages get to meet, load and agree before serving


@dataclass(frozen=True)
class PpOptions:
    """Where this process sits in its pipeline. `rank` None: this process supervises the rank's P stage processes
    on this node (it starts them with --pp-rank r). `partition`: layers per stage (None: an even split, the
    remainder on the first stages)."""

    size: int
    rank: int | None
    dist_init: str | None
    timeout_s: float = 60.0
    partition: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"a pipeline has at least 2 stages, got --pp-size {self.size}")
        if self.rank is not None and not 0 <= self.rank < self.size:
            raise ValueError(f"--pp-rank must be in [0, {self.size}), got {self.rank}")
        if self.rank is not None and self.dist_init is None:
            raise ValueError("--pp-rank needs --dist-init tcp://HOST:PORT (or MASTER_ADDR and MASTER_PORT)")
        if self.dist_init is not None:
            parts = urlsplit(self.dist_init)
            if parts.scheme != "tcp" or not parts.hostname or not parts.port:
                raise ValueError(f"--dist-init must be tcp://HOST:PORT, got {self.dist_init!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"--pp-timeout must be > 0, got {self.timeout_s}")
        if self.partition is not None:
            if len(self.partition) != self.size:
                raise ValueError(f"--pp-layer-partition gives {len(self.partition)} stage(s) "
                                 f"({','.join(map(str, self.partition))}), --pp-size is {self.size}")
            if min(self.partition) < 1:
                raise ValueError(f"--pp-layer-partition: every stage needs at least one layer, got "
                                 f"{','.join(map(str, self.partition))}")

    @property
    def ping_interval_s(self) -> float:
        return min(1.0, self.timeout_s / 4)

    def layers(self, num_layers: int) -> list[range]:
        """Each stage's layers of a model of `num_layers`; ValueError if they do not split so."""
        return stage_layers(num_layers, self.size, self.partition)


def parse_partition(text: str) -> tuple[int, ...]:
    """"10,10,10" -> (10, 10, 10); ValueError naming the text otherwise."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--pp-layer-partition must be comma-separated layer counts such as 10,10,10, got "
                         f"{text!r}") from None


def stage_layers(num_layers: int, size: int, partition: Sequence[int] | None = None) -> list[range]:
    """The contiguous layer ranges of `size` stages: `partition`'s counts, or an even split with the remainder
    on the first stages. ValueError if the model has fewer layers than stages or the partition's sum differs."""
    if partition is None:
        if num_layers < size:
            raise ValueError(f"a model of {num_layers} layer(s) cannot be split into {size} pipeline stages")
        per, extra = divmod(num_layers, size)
        partition = [per + (stage < extra) for stage in range(size)]
    elif sum(partition) != num_layers:
        raise ValueError(f"--pp-layer-partition {','.join(map(str, partition))} covers {sum(partition)} layers; "
                         f"the model has {num_layers}")
    starts = [sum(partition[:stage]) for stage in range(size)]
    return [range(start, start + count) for start, count in zip(starts, partition, strict=True)]


def resolve_stage(size: int, rank: int | None, env: dict[str, str] | None = None) -> int | None:
    """This process's stage: --pp-rank, else torchrun's RANK or Slurm's SLURM_PROCID modulo the size (not in a
    process a supervisor started, nor with neither: None, and this process supervises the stages)."""
    env = dict(os.environ) if env is None else env
    if rank is not None:
        return rank
    name = "RANK" if "RANK" in env else "SLURM_PROCID" if "SLURM_PROCID" in env else None
    if name is None or read_env(TP_SUPERVISED, env) is not None:
        return None
    try:
        return int(env[name]) % size
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {env[name]!r}") from None


@dataclass(frozen=True)
class PipelineGroup:
    """This process's stage in the joined world. It also has the shape the TP command channel
    (worker/tp_commands.py) reads from a TP group: `tp.size`, `tp.cpu_group`, `options.timeout_s`,
    `options.ping_interval_s`, `options.dist_init`."""

    stage: int
    size: int
    layers: range                 # this stage's layers
    num_layers: int               # the model's
    options: PpOptions
    device: Any                   # torch.device of this stage
    cpu_group: Any = None         # the world on gloo (None: the world is gloo already)

    member_name = "PP stage"      # in the command channel's messages

    @property
    def tp(self) -> PipelineGroup:
        return self

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        """Send `tensor` to `stage` (GroupBroken if it fails or takes past the timeout)."""
        import torch.distributed as dist

        try:
            work = dist.isend(tensor.contiguous(), dst=stage)
            if work is None:   # this process is not in the default group
                raise RuntimeError("not a member of the pipeline's group")
            work.wait(datetime.timedelta(seconds=self.options.timeout_s))
        except Exception as e:  # noqa: BLE001 - gloo / NCCL raise RuntimeError / DistBackendError variants
            raise GroupBroken(f"pipeline stage {self.stage}: sending to stage {stage} failed: {e}") from e

    def receive(self, shape: Sequence[int], dtype: torch.dtype, stage: int) -> torch.Tensor:
        """A tensor of `shape` from `stage` (GroupBroken if it fails or does not come within the timeout)."""
        import torch
        import torch.distributed as dist

        tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        try:
            work = dist.irecv(tensor, src=stage)
            if work is None:   # this process is not in the default group
                raise RuntimeError("not a member of the pipeline's group")
            work.wait(datetime.timedelta(seconds=self.options.timeout_s))
        except Exception as e:  # noqa: BLE001
            raise GroupBroken(f"pipeline stage {self.stage}: receiving from stage {stage} failed: {e}") from e
        return tensor


# ---- joining the world ----------------------------------------------------------------------------------

def refuse_unsupported(model_config: Any) -> None:
    """ValueError naming what v1 lacks for this model (a transformers config)."""
    from infer.worker.models.registry import model_class

    cls = model_class(model_config)
    if getattr(cls, "supports_expert_parallel", False):
        raise ValueError(f"pipeline parallelism does not support MoE models yet ({model_config.model_type!r}: its "
                         f"MoE layers are not split into stages); serve it with --tp-size / --ep-size")


def join(config: EngineConfig, options: PpOptions) -> tuple[PipelineGroup, Path, EngineConfig]:
    """Join the pipeline's world and check that every stage serves the same model and partition: (this
    stage, the model directory, `config` with this process's own GPU when it runs on CUDA)."""
    import dataclasses

    import torch.distributed as dist
    from transformers import AutoConfig

    from infer.worker.engine import pick_device
    from infer.worker.loader import weight_files
    from infer.worker.model_files import resolve_model
    from infer.worker.tp_group import check_same_model, engine_facts

    if options.rank is None or options.dist_init is None:
        raise ValueError("joining a pipeline needs this process's --pp-rank and the group's --dist-init")
    path = resolve_model(config.model)
    model_config = AutoConfig.from_pretrained(str(path))
    refuse_unsupported(model_config)
    layers = options.layers(model_config.num_hidden_layers)
    device = pick_device(config.device)
    if device.type == "cuda" and device.index is None:
        import torch

        local = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or str(options.rank)
        config = dataclasses.replace(config, device=f"cuda:{int(local) % max(1, torch.cuda.device_count())}")
        device = pick_device(config.device)
    timeout = datetime.timedelta(seconds=max(options.timeout_s, STARTUP_TIMEOUT_S))   # steps: options.timeout_s
    split = ",".join(str(len(r)) for r in layers)
    store = _rendezvous(options.dist_init, options.rank, options.size, split, timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=options.rank, world_size=options.size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    group = PipelineGroup(stage=options.rank, size=options.size, layers=layers[options.rank],
                          num_layers=model_config.num_hidden_layers, options=options, device=device,
                          cpu_group=cpu_group)
    facts = engine_facts(config, path, weight_files(path), config.dtype)
    check_same_model(group, cpu_group, {**facts, "layer partition": split})
    log.info("pipeline joined: stage %d of %d, layers %d..%d of %d, at %s (%s)", options.rank, options.size,
             group.layers.start, group.layers.stop - 1, group.num_layers, options.dist_init, backend)
    return group, path, config


def _rendezvous(dist_init: str, rank: int, size: int, split: str, timeout: datetime.timedelta) -> Any:
    """The world's TCPStore (stage 0 hosts it), after checking that this stage and stage 0 agree on the size and
    the layer partition: ValueError naming both sides otherwise."""
    import torch.distributed as dist

    host, port = rendezvous_address(dist_init)
    store = dist.TCPStore(host, port, None if rank else size, rank == 0, timeout=timeout, wait_for_workers=False)
    mine = f"{size} stages, layers {split}"
    theirs = store.get("infer/pp-layout/0").decode() if rank else mine   # read before stage 0 can see ours, and go
    store.set(f"infer/pp-layout/{rank}", mine)
    if rank == 0:   # every stage's layout, so that stage 0 leaves at once too when one differs
        keys = [f"infer/pp-layout/{stage}" for stage in range(size)]
        store.wait(keys, timeout)
        for stage, stored in enumerate(store.multi_get(keys)):
            if stored.decode() != mine:
                raise ValueError(f"pipeline stage {stage} was started with --pp-size / --pp-layer-partition giving "
                                 f"{stored.decode()}, this process (stage 0 at {dist_init}) with {mine}: every stage "
                                 f"must be given the same sizes")
        return store
    if theirs != mine:
        raise ValueError(f"this process (pipeline stage {rank}) was started with --pp-size / --pp-layer-partition "
                         f"giving {mine}, but stage 0 at {dist_init} with {theirs}: every stage must be given the "
                         f"same sizes")
    return store


def agree_min(group: PipelineGroup, value: int) -> int:
    """The smallest `value` over the stages (the KV blocks every stage can hold)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    except Exception as e:  # noqa: BLE001
        raise GroupBroken(f"pipeline agreement failed: {e}") from e
    return int(t.item())


# ---- the processes' entry points ---------------------------------------------------------------------------

def leader_engine(config: EngineConfig, group: PipelineGroup, children: Sequence[Any] = ()) -> Engine:
    """Stage 0's engine, connected to the other stages (`engine.runner.followers`: the command channel)."""
    from infer.worker.engine import Engine
    from infer.worker.pp_stage import StageLoader
    from infer.worker.tp_commands import TpLeader

    engine = Engine(config, stage=StageLoader(group))
    engine.runner.followers = TpLeader(group, children=children)  # type: ignore[arg-type]
    return engine


def run_stage(config: EngineConfig, group: PipelineGroup, path: Path) -> int:
    """A stage > 0's life: load its layers, size its KV pool with the others, serve stage 0's commands. Returns
    the exit code (stage 0's when it said stop: 0 only when the rank was told to stop)."""
    import torch

    from infer.worker.engine import context_length, num_kv_blocks, pick_device, pick_dtype
    from infer.worker.forward_batch import KVCache
    from infer.worker.pp_stage import StageLoader, serve_stage
    from infer.worker.tp_commands import FollowerChannel, LeaderGone

    for sig in (signal.SIGTERM, signal.SIGINT):   # stage 0 decides when the rank ends (it drains first)
        signal.signal(sig, signal.SIG_IGN)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    loader = StageLoader(group)
    model = loader.load_model(path, dtype, device, config.quantization)
    max_model_len = context_length(config, model.config)
    blocks = loader.agree_min(num_kv_blocks(config, model, dtype, device, max_model_len))
    kv_cache = KVCache.allocate(model.num_layers, blocks, config.block_size, model.num_kv_heads, model.head_dim,
                                dtype, device)
    channel = FollowerChannel(group)  # type: ignore[arg-type]
    log.info("PP stage %d ready on %s: layers %d..%d, %d KV blocks", group.stage, socket.gethostname(),
             group.layers.start, group.layers.stop - 1, blocks)
    try:
        return serve_stage(model, kv_cache, channel, device)
    except (LeaderGone, GroupBroken) as e:
        log.error("fatal: %s; exiting", e)
        return 1
    finally:
        channel.close()


def pipeline_parallel_engine(config: EngineConfig, size: int, worker_flags: Sequence[str], timeout_s: float = 60.0,
                             partition: tuple[int, ...] | None = None) -> Engine:
    """An engine that is stage 0 of a pipeline of `size` stages, the others started now as child processes of
    this one on this machine (`infer-worker` with `worker_flags`: the same engine options); `close()` ends them.
    (LLM / AsyncLLM's direct mode with pipeline_parallel_size > 1.)"""
    from infer.worker.tp_supervisor import free_local_port, start_followers

    dist_init = f"tcp://127.0.0.1:{free_local_port()}"
    flags = [*worker_flags, "--pp-timeout", str(timeout_s)]
    if partition is not None:
        flags += ["--pp-layer-partition", ",".join(map(str, partition))]
    children = start_followers(size, dist_init, flags, size_flag="--pp-size", rank_flag="--pp-rank")
    try:
        group, _, config = join(config, PpOptions(size=size, rank=0, dist_init=dist_init, timeout_s=timeout_s,
                                                  partition=partition))
        return leader_engine(config, group, children)
    except BaseException:
        for child in children:
            child.kill()
            child.wait(timeout=10)
        import torch.distributed as dist

        if dist.is_initialized():   # so that another pipeline can be made in this process
            dist.destroy_process_group()
        raise
