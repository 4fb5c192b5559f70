"""Weights from a trainer to the workers over torch.distributed: a weight-sync group of its own.

The trainer (rank 0) hosts a TCPStore; every worker joins as rank 1..N. The group is a standalone process
group (ProcessGroupGloo on CPUs, ProcessGroupNCCL when the trainer's tensors are on a GPU) built on that store,
so it never touches a process's default group (an EP group's, a trainer's own). Tensors go by broadcast from
rank 0 in buckets: consecutive tensors of one dtype, flattened into one buffer of at most `bucket_bytes` (a
larger tensor travels alone). Both sides derive the same buckets from the announced list (`plan_buckets`).

Trainer side (what `InferenceClient.update_weights(pairs)` and `LLM.update_weights(pairs)` run):

    sender = WeightSender.open(host, num_workers=N, timeout=60)    # the store listens on sender.init_method
    # ... tell the workers (UpdateWeights with sender.sync(tensors)) ...
    sender.send(tensors)                                           # joins the group, broadcasts, closes

Every wait is bounded by `timeout` (the store, the group's rendezvous and each collective).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.protocol.messages import WeightSync, WeightTensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroupGloo, ProcessGroupNCCL, Store, TCPStore

log = logging.getLogger("infer.weight_sync")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_BUCKET_BYTES = 64 << 20


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"tensors must be float32, bfloat16 or float16 to be sent, got {dtype}")


def describe(pairs: Sequence[tuple[str, torch.Tensor]]) -> list[WeightTensor]:
    """The announced list of `pairs`; ValueError naming a pair that is not (name, float tensor)."""
    infos = []
    for i, pair in enumerate(pairs):
        if not (
            isinstance(pair, tuple)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and isinstance(pair[1], torch.Tensor)
        ):
            raise ValueError(f"weight #{i} must be a (name, torch.Tensor) pair, got {type(pair).__name__}")
        name, tensor = pair
        try:
            infos.append(WeightTensor(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape)))
        except ValueError as e:
            raise ValueError(f"weight update: tensor {name!r}: {e}") from None
    if not infos:
        raise ValueError("the weight update is empty: no (name, tensor) pairs")
    return infos


def plan_buckets(tensors: Sequence[WeightTensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of `tensors` per bucket, in order (see the module docstring)."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, info in enumerate(tensors):
        nbytes = _numel(info.shape) * DTYPES[info.dtype].itemsize
        if not buckets or info.dtype != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, info.dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _host_port(init_method: str) -> tuple[str, int]:
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def _group(
    store: Store, rank: int, world_size: int, backend: str, timeout: float
) -> ProcessGroupGloo | ProcessGroupNCCL:
    from torch.distributed import ProcessGroupGloo

    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = _timedelta(timeout)
        return ProcessGroupNCCL(store, rank, world_size, options)
    return ProcessGroupGloo(store, rank, world_size, _timedelta(timeout))


def _broadcast(group: ProcessGroupGloo | ProcessGroupNCCL, buffer: torch.Tensor, timeout: float) -> None:
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank = 0
    # torch's stub lists broadcast on ProcessGroup only; the Gloo and NCCL backends have it too
    work = group.broadcast([buffer], options)  # type: ignore[union-attr]
    if not work.wait(_timedelta(timeout)):
        raise TimeoutError(f"a weight broadcast did not complete within {timeout} s")


@dataclass
class WeightSender:
    """Rank 0 of a weight-sync group: the trainer's side (see the module docstring)."""

    store: TCPStore
    host: str
    num_workers: int
    timeout: float
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    @classmethod
    def open(
        cls, host: str, num_workers: int, timeout: float, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> WeightSender:
        """Start the rendezvous store on `host` (a free port) for `num_workers` workers."""
        from torch.distributed import TCPStore

        if num_workers < 1:
            raise ValueError(f"a weight-sync group needs at least one worker, got {num_workers}")
        store = TCPStore(host, 0, num_workers + 1, True, _timedelta(timeout), wait_for_workers=False)
        return cls(store, host, num_workers, timeout, bucket_bytes)

    @property
    def init_method(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.store.port}"

    def sync(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> WeightSync:
        """The announcement of `pairs` the workers get (the coordinator sets each worker's rank)."""
        backend = "nccl" if all(t.is_cuda for _, t in pairs) else "gloo"
        return WeightSync(
            init_method=self.init_method,
            world_size=self.num_workers + 1,
            tensors=describe(pairs),
            backend=backend,
            bucket_bytes=self.bucket_bytes,
        )

    def send(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Join the group as rank 0 and broadcast every bucket; returns the bytes sent."""
        sync = self.sync(pairs)
        group = _group(self.store, 0, sync.world_size, sync.backend, self.timeout)
        device = pairs[0][1].device if sync.backend == "nccl" else torch.device("cpu")
        sent = 0
        with torch.no_grad():
            for bucket in plan_buckets(sync.tensors, sync.bucket_bytes):
                flat = torch.cat([pairs[i][1].detach().reshape(-1).to(device) for i in bucket])
                _broadcast(group, flat, self.timeout)
                sent += flat.numel() * flat.element_size()
        log.info("sent %d tensor(s), %d bytes, to %d worker(s)", len(pairs), sent, self.num_workers)
        return sent


def receive_weights(sync: WeightSync, device: torch.device, timeout: float) -> list[tuple[str, torch.Tensor]]:
    """A worker's side: join the group as `sync.rank` and receive every tensor (on `device` with NCCL, on the
    CPU with gloo). Raises RuntimeError / TimeoutError when the trainer or the group fails."""
    from torch.distributed import TCPStore

    if sync.backend == "nccl" and device.type != "cuda":
        raise ValueError("the trainer sends over NCCL (its tensors are on a GPU) but this worker runs on the CPU")
    host, port = _host_port(sync.init_method)
    store = TCPStore(host, port, sync.world_size, False, _timedelta(timeout))
    group = _group(store, sync.rank, sync.world_size, sync.backend, timeout)
    where = device if sync.backend == "nccl" else torch.device("cpu")
    received: list[tuple[str, torch.Tensor]] = []
    for bucket in plan_buckets(sync.tensors, sync.bucket_bytes):
        infos = [sync.tensors[i] for i in bucket]
        sizes = [_numel(info.shape) for info in infos]
        flat = torch.empty(sum(sizes), dtype=DTYPES[infos[0].dtype], device=where)
        _broadcast(group, flat, timeout)
        for info, part in zip(infos, flat.split(sizes)):
            received.append((info.name, part.view(info.shape)))
    return received
