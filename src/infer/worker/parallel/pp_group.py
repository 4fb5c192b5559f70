"""Pipeline parallelism: one DP rank as P stages, each holding a contiguous range of the layers (and only their
KV cache). Stage 0 owns the embedding, schedules, samples and talks to the coordinator; the last stage owns the
final norm and the LM head (a tied head: it loads the embedding table as its weight). (torch is imported only when
a group is joined: the worker daemon imports this module to parse its flags.) The stage model is
worker/parallel/pp_stage.py.

**Composition.** PP x TP: each stage is a TP group of T processes (worker/distributed/tensor_parallel.py's shards of the
stage's layers); TP rank t of a stage hands its hidden states to TP rank t of the next. PP with EP: the E DP ranks
of an EP group are E pipelines in one world; stage s's MoE layers exchange tokens among the processes of stage s
(with the same TP rank), and the engines (stage 0, TP rank 0 of each) keep the group in lockstep as EP ranks do
(worker/distributed/group_sync.py), their dummy steps flowing through the stages like real ones. Global rank = (EP rank
x P + stage) x T + TP rank.

**A step.** The engine's process (stage 0, TP rank 0) runs the engine as TP rank 0 does: before each forward its
`TpLeader` (worker/parallel/tp_commands.py, the same channel and watch over the peers' connections) sends the step's
ForwardBatch to every other process of the DP rank; stage 0 then runs the embedding and its layers and sends
(hidden, residual) to stage 1 over torch.distributed point-to-point (gloo on CPU, NCCL on GPU); each stage
receives, runs its layers and sends on; the last stage keeps the normed hidden states. The rows whose logits stage
0 needs go out as a "logits" command, and the last stage (its TP rank 0, after gathering the vocabulary slices)
sends their logits back to stage 0 (prompt logprobs the same way). Every process but the engine's runs TP's
follower loop (`serve_follower`).

**Micro-batches in flight.** Stage 0 launches up to P micro-batches (`--pp-micro-batches`) before it finishes the
oldest (worker/engine/micro_batches.py: a request is in one at most, each takes its share of the requests), so that
while the last stage computes batch k the first computes batch k + 1 and every stage works at once. For that no
stage waits on a hand-off it sends (`start_send`: the receiver takes it when it gets to that batch), and the last
stage sends each forward's logits (its `logits_indices` rows) as soon as it has them, unasked; stage 0 receives
them when it finishes that batch (`StageModel.receive_logits`). Batches go through every stage in launch order,
so a KV block freed by an abort and given to a later batch is written by the later batch last, on every stage.

**World.** E x P x T processes, one rendezvous (`--dist-init`); through the rendezvous store each checks that it
agrees with global rank 0 on P, the layer partition, T and E, then every process compares its model files, dtype
and sizes (`check_same_model`), and each DP rank's processes agree on the KV block count (the smallest).

**Faults** as for TP groups: every point-to-point wait of a step has the group's timeout (`--pp-timeout`; joining,
loading and the agreements before serving have at least STARTUP_TIMEOUT_S, so that stages that load at different
speeds on a busy machine still meet); stage 0 notices a process gone even while idle (its command connection
closes) and gives its requests back and exits non-zero, telling the others to stop with its code; a process that
hears nothing from stage 0 for the timeout, or whose connection closes, or whose send / receive fails, exits
non-zero. A restarting launcher restarts the whole rank.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from infer.protocol.env import TP_SUPERVISED
from infer.protocol.env import read as read_env
from infer.worker.distributed.group_sync import STARTUP_TIMEOUT_S, GroupBroken, join_world
from infer.worker.distributed.group_sync import agree_min as group_agree_min

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from infer.worker.distributed.expert_parallel import ExpertParallel
    from infer.worker.distributed.group_sync import EpOptions
    from infer.worker.distributed.tensor_parallel import TensorParallel
    from infer.worker.engine.config import EngineConfig
    from infer.worker.parallel.tp_group import TpOptions

log = logging.getLogger("infer.worker")


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
                raise ValueError(
                    f"--pp-layer-partition gives {len(self.partition)} stage(s) "
                    f"({','.join(map(str, self.partition))}), --pp-size is {self.size}"
                )
            if min(self.partition) < 1:
                raise ValueError(
                    f"--pp-layer-partition: every stage needs at least one layer, got "
                    f"{','.join(map(str, self.partition))}"
                )

    @property
    def ping_interval_s(self) -> float:
        return min(1.0, self.timeout_s / 4)

    def layers(self, num_layers: int) -> list[range]:
        """Each stage's layers of a model of `num_layers`; ValueError if they do not split so."""
        return stage_layers(num_layers, self.size, self.partition)


def parse_partition(text: str) -> tuple[int, ...]:
    """ "10,10,10" -> (10, 10, 10); ValueError naming the text otherwise."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"--pp-layer-partition must be comma-separated layer counts such as 10,10,10, got {text!r}"
        ) from None


def stage_layers(num_layers: int, size: int, partition: Sequence[int] | None = None) -> list[range]:
    """The contiguous layer ranges of `size` stages: `partition`'s counts, or an even split with the remainder
    on the first stages. ValueError if the model has fewer layers than stages or the partition's sum differs."""
    if partition is None:
        if num_layers < size:
            raise ValueError(f"a model of {num_layers} layer(s) cannot be split into {size} pipeline stages")
        per, extra = divmod(num_layers, size)
        partition = [per + (stage < extra) for stage in range(size)]
    elif sum(partition) != num_layers:
        raise ValueError(
            f"--pp-layer-partition {','.join(map(str, partition))} covers {sum(partition)} layers; "
            f"the model has {num_layers}"
        )
    starts = [sum(partition[:stage]) for stage in range(size)]
    return [range(start, start + count) for start, count in zip(starts, partition, strict=True)]


def resolve_stage(size: int, rank: int | None, env: dict[str, str] | None = None, tp_size: int = 1) -> int | None:
    """This process's stage: --pp-rank, else from torchrun's RANK or Slurm's SLURM_PROCID, the global rank
    (ep_rank x size + stage) x tp_size + tp_rank (not in a process a supervisor started, nor with neither: None, and
    this process supervises the stages)."""
    env = dict(os.environ) if env is None else env
    if rank is not None:
        return rank
    name = "RANK" if "RANK" in env else "SLURM_PROCID" if "SLURM_PROCID" in env else None
    if name is None or read_env(TP_SUPERVISED, env) is not None:
        return None
    try:
        return int(env[name]) // tp_size % size
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {env[name]!r}") from None


@dataclass(frozen=True)
class PipelineGroup:
    """This process's place in the joined world: its stage and, within the stage, its TP rank (PP x TP: each stage
    a TP group of `tp.size` processes) and its share of an MoE model's experts (PP with EP: the E DP ranks of an EP
    group are E pipelines; stage s's MoE layers exchange tokens among the E processes of stage s with the same TP
    rank). Global rank = (EP rank x P + stage) x T + TP rank. `commands` are this DP rank's P x T processes (rank
    stage x T + TP rank; rank 0, stage 0's TP rank 0, runs the engine): the group of the command channel
    (worker/parallel/tp_commands.py), which also reads `options.timeout_s`, `options.ping_interval_s`,
    `options.dist_init` and `member()`. `tp` / `ep` / `commands` None: a group of one (a stage with no TP group, no EP
    group; a world not joined)."""

    stage: int
    size: int
    layers: range  # this stage's layers
    num_layers: int  # the model's
    options: PpOptions
    device: Any  # torch.device of this stage
    tp: TensorParallel | None = None  # this stage's TP group
    ep: ExpertParallel | None = None  # this rank's experts
    commands: TensorParallel | None = None  # this DP rank's processes
    ep_leaders_group: Any = None  # the EP lockstep's gloo group (the engines' processes), with an EP group
    base: int = 0  # the global rank of this DP rank's stage 0, TP rank 0

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp is None else self.tp.rank

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def is_leader(self) -> bool:
        """Stage 0's TP rank 0: the process that runs the engine."""
        return self.stage == 0 and self.tp_rank == 0

    @property
    def index(self) -> int:
        """This process among its DP rank's: stage x T + TP rank."""
        return self.stage * self.tp_size + self.tp_rank

    def member(self, index: int) -> str:
        """The name of this DP rank's process `index` (stage x T + TP rank) in messages."""
        stage, tp_rank = divmod(index, self.tp_size)
        return f"PP stage {stage}" + (f" TP rank {tp_rank}" if self.tp_size > 1 else "")

    def rank_of(self, stage: int, tp_rank: int | None = None) -> int:
        """The global rank of `stage`'s TP rank `tp_rank` (default: this process's) in this DP rank."""
        return self.base + stage * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)

    def send(self, tensor: torch.Tensor, stage: int, tp_rank: int | None = None) -> None:
        """Send `tensor` to `stage`'s TP rank `tp_rank` (default: this process's) (GroupBroken if it fails or takes
        past the timeout)."""
        self.start_send(tensor, stage, tp_rank).wait()

    def start_send(self, tensor: torch.Tensor, stage: int, tp_rank: int | None = None) -> PendingSend:
        """Start sending `tensor` to `stage`'s TP rank `tp_rank` without waiting for the receiver (micro-batches in
        flight: a stage hands a batch on and goes on with the next); the PendingSend holds the tensor until
        `wait()`."""
        import torch.distributed as dist

        what = f"{self.member(self.index)}: sending to stage {stage} failed"
        tensor = tensor.contiguous()
        try:
            work = dist.isend(tensor, dst=self.rank_of(stage, tp_rank))
            if work is None:  # this process is not in the default group
                raise RuntimeError("not a member of the pipeline's group")
        except Exception as e:  # noqa: BLE001 - gloo / NCCL raise RuntimeError / DistBackendError variants
            raise GroupBroken(f"{what}: {e}") from e
        return PendingSend(work, tensor, self.options.timeout_s, what)

    def receive(self, shape: Sequence[int], dtype: torch.dtype, stage: int, tp_rank: int | None = None) -> torch.Tensor:
        """A tensor of `shape` from `stage`'s TP rank `tp_rank` (default: this process's) (GroupBroken if it fails
        or does not come within the timeout)."""
        import torch
        import torch.distributed as dist

        tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        try:
            work = dist.irecv(tensor, src=self.rank_of(stage, tp_rank))
            if work is None:  # this process is not in the default group
                raise RuntimeError("not a member of the pipeline's group")
            work.wait(datetime.timedelta(seconds=self.options.timeout_s))
        except Exception as e:  # noqa: BLE001
            raise GroupBroken(f"{self.member(self.index)}: receiving from stage {stage} failed: {e}") from e
        return tensor


@dataclass
class PendingSend:
    """A point-to-point send under way: its work handle and the tensor it reads (kept alive until it is done)."""

    work: Any
    tensor: torch.Tensor
    timeout_s: float
    what: str  # "<member>: sending to stage s failed", for the error

    def wait(self) -> None:
        """Until the receiver has the tensor (GroupBroken if it fails or takes past the timeout)."""
        try:
            self.work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001
            raise GroupBroken(f"{self.what}: {e}") from e


# ---- joining the world ----------------------------------------------------------------------------------


def join(
    config: EngineConfig, options: PpOptions, tp: TpOptions | None = None, ep: EpOptions | None = None
) -> tuple[PipelineGroup, Path, EngineConfig]:
    """Join the world of this pipeline (P x T processes; E such pipelines with an EP group) and check that every
    process serves the same model, partition and sizes: (this process's place, the model directory, `config` with
    this process's own GPU when it runs on CUDA)."""
    import dataclasses

    import torch.distributed as dist

    from infer.worker.engine.engine_setup import pick_device
    from infer.worker.loading.loader import weight_files
    from infer.worker.loading.model_config import read_model_config
    from infer.worker.loading.model_files import resolve_model
    from infer.worker.parallel.tp_group import check_same_model, engine_facts

    if options.rank is None or options.dist_init is None or (tp is not None and tp.rank is None):
        raise ValueError(
            "joining a pipeline needs this process's --pp-rank (and --tp-rank with --tp-size) and the "
            "group's --dist-init"
        )
    tp_size, tp_rank = (tp.size, tp.rank or 0) if tp is not None else (1, 0)
    ep_size, ep_rank = (ep.size, ep.rank) if ep is not None else (1, 0)
    path = resolve_model(config.model)
    model_config = read_model_config(path)
    layers = options.layers(model_config.num_hidden_layers)
    per_rank = options.size * tp_size
    rank = ep_rank * per_rank + options.rank * tp_size + tp_rank
    device = pick_device(config.device)
    if device.type == "cuda" and device.index is None:
        import torch

        local = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or str(rank)
        config = dataclasses.replace(config, device=f"cuda:{int(local) % max(1, torch.cuda.device_count())}")
        device = pick_device(config.device)
    timeout = datetime.timedelta(seconds=max(options.timeout_s, STARTUP_TIMEOUT_S))  # steps: options.timeout_s
    split = ",".join(str(len(r)) for r in layers)
    layout = f"{options.size} stages, layers {split}, x TP {tp_size} x EP {ep_size}"
    flags = "--pp-size / --pp-layer-partition / --tp-size / --ep-size"
    backend = join_world(options.dist_init, rank, ep_size * per_rank, layout, flags, timeout, device)
    group = _make_groups(options, rank, layers, model_config.num_hidden_layers, device, tp, ep, timeout)
    world_cpu = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    facts = engine_facts(config, path, weight_files(path), config.dtype)
    check_same_model(group.tp, world_cpu, {**facts, "layer partition": split})
    log.info(
        "pipeline joined: %s of %d stages (EP rank %d of %d), layers %d..%d of %d, at %s (%s)",
        group.member(group.index),
        options.size,
        ep_rank,
        ep_size,
        group.layers.start,
        group.layers.stop - 1,
        group.num_layers,
        options.dist_init,
        backend,
    )
    return group, path, config


def _make_groups(
    options: PpOptions,
    rank: int,
    layers: list[range],
    num_layers: int,
    device: Any,
    tp: TpOptions | None,
    ep: EpOptions | None,
    timeout: datetime.timedelta,
) -> PipelineGroup:
    """This process's PipelineGroup in the joined world of E x P x T processes. Every process creates every
    group, in the same order (torch.distributed's rule)."""
    import torch.distributed as dist

    from infer.worker.distributed.expert_parallel import ExpertParallel
    from infer.worker.distributed.tensor_parallel import TensorParallel

    P, T, E = options.size, tp.size if tp is not None else 1, ep.size if ep is not None else 1
    ep_rank, rest = divmod(rank, P * T)
    stage, tp_rank = divmod(rest, T)
    base = ep_rank * P * T
    nccl = device.type == "cuda"

    def gloo(ranks: list[int]) -> Any:
        return dist.new_group(ranks, backend="gloo", timeout=timeout)

    tensor = None
    if tp is not None:
        for e in range(E):
            for s in range(P):
                ranks = [(e * P + s) * T + t for t in range(T)]
                made = dist.new_group(ranks, timeout=datetime.timedelta(seconds=tp.timeout_s))
                cpu = gloo(ranks) if nccl else made
                if (e, s) == (ep_rank, stage):
                    tensor = TensorParallel(rank=tp_rank, size=T, group=made, leader=ranks[0], cpu_group=cpu)
    expert, leaders = None, None
    if ep is not None:
        for s in range(P):
            for t in range(T):
                made = dist.new_group(
                    [(e * P + s) * T + t for e in range(E)], timeout=datetime.timedelta(seconds=ep.timeout_s)
                )
                if (s, t) == (stage, tp_rank):
                    expert = ExpertParallel(rank=ep_rank, size=E, group=made)
        leaders = gloo([e * P * T for e in range(E)])
    own = [gloo(list(range(e * P * T, (e + 1) * P * T))) for e in range(E)] if E > 1 or nccl else [None]
    commands = TensorParallel(rank=rest, size=P * T, group=own[ep_rank], leader=base, cpu_group=own[ep_rank])
    return PipelineGroup(
        stage=stage,
        size=P,
        layers=layers[stage],
        num_layers=num_layers,
        options=options,
        device=device,
        tp=tensor,
        ep=expert,
        commands=commands,
        ep_leaders_group=leaders,
        base=base,
    )


def agree_min(group: PipelineGroup, value: int) -> int:
    """The smallest `value` over this DP rank's processes (the KV blocks every one of them can hold)."""
    return group_agree_min(value, None if group.commands is None else group.commands.cpu_group, "pipeline")
