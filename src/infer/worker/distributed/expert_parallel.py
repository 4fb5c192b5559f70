"""Expert parallelism: this rank's share of an MoE model's experts, and the token exchange between ranks.

An EP group is N data-parallel ranks (each its own engine, scheduler, KV cache and requests) whose MoE
layers split the experts: rank r holds experts [r * E / N, (r + 1) * E / N). In every MoE layer each rank
sends each (token, chosen expert) pair to the rank holding that expert, which runs it and sends the result
back (two all-to-alls over torch.distributed: gloo on CPUs, NCCL on GPUs); the sender weights and sums
the results per token. Every rank must therefore run every MoE layer of every step, with zero tokens if it
has no work: the worker loop keeps the group in lockstep (see `infer.worker.distributed.group_sync`).

`ExpertParallel.single()` is the one-rank case: every expert is local and nothing is exchanged.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from infer.worker.distributed.group_sync import EpOptions, GroupBroken

log = logging.getLogger("infer.worker")

# (rows [N, hidden], local expert ids [N] int64) -> each row through its expert [N, hidden], unweighted
ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertParallel:
    rank: int
    size: int
    group: Any = None  # the torch.distributed process group (None: the default group), unused when size 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"EP rank {self.rank} is outside a group of {self.size}")

    @classmethod
    def single(cls) -> ExpertParallel:
        return cls(rank=0, size=1)

    @classmethod
    def join(cls, options: EpOptions, device: torch.device) -> ExpertParallel:
        """Join the group's torch.distributed world (blocks until every rank has joined, at most timeout_s)."""
        from infer.worker.distributed.group_sync import join_world

        timeout = datetime.timedelta(seconds=options.timeout_s)
        layout = f"EP {options.size}"
        backend = join_world(options.dist_init, options.rank, options.size, layout, "--ep-size", timeout, device)
        log.info("EP group joined: rank %d of %d at %s (%s)", options.rank, options.size, options.dist_init, backend)
        return cls(rank=options.rank, size=options.size)

    def expert_range(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds (a contiguous 1/size of them)."""
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts do not split evenly across an EP group of {self.size}")
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def run_experts(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        num_experts: int,
        experts: ExpertsFn,
    ) -> torch.Tensor:
        """hidden [T, H]; topk_ids [T, k] global expert ids; topk_weights [T, k] -> [T, H] in hidden's dtype:
        sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]), with transformers' arithmetic:
        each expert output times its weight in the promoted dtype of the two (float32 weights, as Mixtral's
        router gives, weight in float32; weights already in hidden's dtype, as Qwen3-MoE's, in that dtype),
        cast to hidden's dtype, then summed one expert at a time in hidden's dtype, in ascending expert order
        per token: transformers' loop over experts, bit for bit (index_add_ with repeated indices accumulates
        bf16 / fp16 in float32 on CPUs and adds in any order with atomics on GPUs).

        `experts` runs rows through this rank's experts (local ids). With size > 1 this is a collective:
        every rank of the group must call it, T may be 0."""
        num_tokens, top_k = topk_ids.shape
        topk_ids, order = topk_ids.to(torch.int64).sort(dim=1)
        topk_weights = topk_weights.gather(1, order)
        token_of_pair = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)
        pair_ids = topk_ids.reshape(-1)
        if self.size == 1:
            pair_out = experts(hidden.index_select(0, token_of_pair), pair_ids)
        else:
            pair_out = self._exchange(hidden, token_of_pair, pair_ids, num_experts, experts)
        weighted = (pair_out * topk_weights.reshape(-1, 1)).to(hidden.dtype)
        weighted = weighted.view(num_tokens, top_k, hidden.shape[1])
        out = weighted[:, 0].clone()
        for j in range(1, top_k):
            out += weighted[:, j]
        return out

    def _exchange(
        self,
        hidden: torch.Tensor,
        token_of_pair: torch.Tensor,
        pair_ids: torch.Tensor,
        num_experts: int,
        experts: ExpertsFn,
    ) -> torch.Tensor:
        try:
            return self._all_to_all(hidden, token_of_pair, pair_ids, num_experts, experts)
        except GroupBroken:
            raise
        except (RuntimeError, OSError) as e:  # gloo / NCCL failures: a member died, hung or left
            raise GroupBroken(f"EP group exchange failed: {e}") from e

    def _all_to_all(
        self,
        hidden: torch.Tensor,
        token_of_pair: torch.Tensor,
        pair_ids: torch.Tensor,
        num_experts: int,
        experts: ExpertsFn,
    ) -> torch.Tensor:
        import torch.distributed as dist

        per_rank = len(self.expert_range(num_experts))
        dest = pair_ids // per_rank
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        num_recv = sum(recv_splits)
        rows = hidden.index_select(0, token_of_pair.index_select(0, order))
        recv_rows = hidden.new_empty((num_recv, hidden.shape[1]))
        dist.all_to_all_single(recv_rows, rows, recv_splits, send_splits, group=self.group)
        recv_ids = pair_ids.new_empty(num_recv)
        dist.all_to_all_single(recv_ids, pair_ids.index_select(0, order), recv_splits, send_splits, group=self.group)
        local_out = experts(recv_rows, recv_ids - self.rank * per_rank) if num_recv else recv_rows
        back = local_out.new_empty((len(order), hidden.shape[1]))
        dist.all_to_all_single(back, local_out.contiguous(), send_splits, recv_splits, group=self.group)
        pair_out = torch.empty_like(back)
        pair_out[order] = back
        return pair_out
