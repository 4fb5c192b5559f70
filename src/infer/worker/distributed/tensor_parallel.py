"""Tensor parallelism: this process's share of one DP rank's model, and the collectives that join the shares.

A TP group is `size` processes serving one DP rank (Megatron's layout): column-parallel qkv and gate_up
projections (each rank computes its heads / its slice of the intermediate size, no communication),
row-parallel o and down projections (partial sums, one all-reduce each), a vocab-parallel embedding (each
rank looks up the ids in its rows, zeros elsewhere, one all-reduce) and LM head (each rank computes its
vocabulary slice of the logits; they are gathered on TP rank 0, the one that samples). KV heads are split
like the query heads, or replicated when the model has fewer KV heads than the group has ranks. MoE
experts are split along their intermediate size and their summed output all-reduced (TP x EP: the EP
exchange runs first, among the processes with the same TP rank of each DP rank).

Collectives run over torch.distributed (gloo on CPUs, NCCL on GPUs) within `group`; a failure or a
timeout (a member died, hung or left) raises `GroupBroken`, which the worker turns into "give every
request back and exit". `TensorParallel.single()` is the one-process case: nothing is exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from infer.worker.distributed.group_sync import GroupBroken, agree_min


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: Any = None  # the torch.distributed process group of the TP group (unused when size 1)
    leader: int = 0  # the global rank of TP rank 0 (where logits are gathered)
    cpu_group: Any = None  # the same processes on gloo, for host-side agreements (the group itself with gloo)
    # the same processes on gloo with STARTUP_TIMEOUT_S, for the agreements before serving (members load at their
    # own pace; the group's step timeout is for steps)
    startup_group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside a group of {self.size}")

    @classmethod
    def single(cls) -> TensorParallel:
        return cls(rank=0, size=1)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the group (the KV blocks every member can hold), once every member has loaded
        its shard: on the group's startup group (gloo, STARTUP_TIMEOUT_S), since one member loads seconds after
        another on a busy machine; the group's own timeout (--tp-timeout, 5 s in the tests) broke the start of a TP
        group whose members loaded 5 s apart, on whichever side waited (a monitored barrier bounds only rank 0's
        wait: the others' send to it runs under the group's timeout). A member that died fails it at once."""
        if self.size == 1:
            return value
        return agree_min(value, self.startup_group or self.cpu_group, "TP group")

    def part(self, size: int, what: str) -> range:
        """This rank's contiguous 1/size of `size` items (heads, rows, ...); ValueError if they do not split."""
        if size % self.size:
            raise ValueError(f"{what} ({size}) does not split across {self.size} tensor-parallel ranks")
        per_rank = size // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def kv_heads(self, num_kv_heads: int) -> range:
        """The KV heads this rank holds: its 1/size of them, or, with fewer KV heads than ranks, the one
        its query heads read (replicated on size / num_kv_heads ranks)."""
        if num_kv_heads >= self.size:
            return self.part(num_kv_heads, "the number of KV heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"{num_kv_heads} KV heads neither split across nor replicate evenly over "
                f"{self.size} tensor-parallel ranks"
            )
        head = self.rank * num_kv_heads // self.size
        return range(head, head + 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place (a collective: every rank calls it)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        try:
            dist.all_reduce(x, group=self.group)
        except Exception as e:  # noqa: BLE001 - gloo / NCCL raise RuntimeError / DistBackendError variants
            raise GroupBroken(f"TP group all-reduce failed: {e}") from e
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each rank's x [N, C] -> on TP rank 0 the [N, size * C] concatenation in rank order; None elsewhere."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_leader else None
        try:
            dist.gather(x, parts, dst=self.leader, group=self.group)
        except Exception as e:  # noqa: BLE001
            raise GroupBroken(f"TP group gather of the logits failed: {e}") from e
        return torch.cat(parts, dim=-1) if parts is not None else None
