"""DeepSeek-V2 / V3 mixture-of-experts feed-forward layers: routed experts with grouped top-k routing plus shared
experts, on the Mixtral / Qwen3-MoE expert machinery (`FusedExperts`, `ExpertParallel.run_experts`).

Which layers are sparse (`is_sparse_layer`, vLLM's and DeepSeek's rule): layer i has experts when the config has
routed experts, i >= `first_k_dense_replace` and i % `moe_layer_freq` == 0 (transformers ignores
`moe_layer_freq`; every released DeepSeek config has 1). The others have a dense MLP of `intermediate_size`.

Routing (`GroupedTopK`), in float32 on a float32 router weight (transformers keeps `gate.weight` and
`e_score_correction_bias` in float32):
- DeepSeek-V2 (scores = softmax(logits)): `topk_method` "greedy" (top-k of all experts) or "group_limited_greedy"
  (the experts split into `n_group` groups, a group scored by its best expert; only the `topk_group` best groups
  compete). The weights are the chosen scores.
- DeepSeek-V3 "noaux_tc" (scores = sigmoid(logits)): experts are chosen on scores + `e_score_correction_bias`,
  groups by the sum of their two best biased scores; the weights are the unbiased scores, renormalized when
  `norm_topk_prob`.
Both then scale the weights by `routed_scaling_factor`. The shared experts (`n_shared_experts` x
`moe_intermediate_size` wide, one dense MLP) see every token and are added to the routed sum.

Parallelism: an EP rank holds `ep.expert_range(n_routed_experts)` of the routed experts; the router and the shared
experts are replicated on every EP rank. With TP each rank holds its slice of every expert's and of the shared MLP's
intermediate size (the shared MLP all-reduces in its down projection, the routed sum after the exchange).

Checkpoint names are transformers' (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
`mlp.experts.{i}.gate_proj/up_proj/down_proj.weight`, `mlp.shared_experts.*`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.worker.distributed.expert_parallel import ExpertParallel
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.models.layers import _param
from infer.worker.models.llama import LlamaMLP, LlamaVariant
from infer.worker.models.moe import FusedExperts

# (model_type, topk_method) -> the scoring function it routes with; the first listed is the family's default.
_TOPK_METHODS = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}
_SCORING = {"greedy": "softmax", "group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}


def num_routed_experts(config: Any) -> int:
    return int(getattr(config, "n_routed_experts", None) or 0)


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    """Whether DeepSeek layer `layer_index` has experts (see the module docstring)."""
    freq = getattr(config, "moe_layer_freq", None) or 1
    dense = getattr(config, "first_k_dense_replace", None) or 0
    return num_routed_experts(config) > 0 and layer_index >= dense and layer_index % freq == 0


@dataclass(frozen=True)
class GroupedTopK:
    """DeepSeek's router: logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""

    num_experts: int
    top_k: int
    method: str  # "greedy", "group_limited_greedy" or "noaux_tc"
    num_groups: int  # 1: no grouping
    topk_groups: int
    renormalize: bool
    scaling_factor: float

    def __post_init__(self) -> None:
        if self.method not in _SCORING:
            raise NotImplementedError(f"topk_method {self.method!r} is not supported; supported: {', '.join(_SCORING)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {self.num_experts}] (n_routed_experts)")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"n_group {self.num_groups} must divide n_routed_experts {self.num_experts}")
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group {self.topk_groups} must be in [1, n_group {self.num_groups}]")
        if self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
            raise ValueError(
                f"topk_group {self.topk_groups} groups of {self.num_experts // self.num_groups} "
                f"experts hold fewer than num_experts_per_tok {self.top_k}"
            )

    @classmethod
    def from_config(cls, config: Any) -> GroupedTopK:
        """NotImplementedError naming a routing feature of `config` that is not computed here."""
        methods = _TOPK_METHODS[config.model_type]
        method = getattr(config, "topk_method", None) or methods[0]
        if method not in methods:
            raise NotImplementedError(
                f"{config.model_type}: topk_method {method!r} is not supported; supported: {', '.join(methods)}"
            )
        scoring = getattr(config, "scoring_func", None) or _SCORING[method]
        if scoring != _SCORING[method]:
            raise NotImplementedError(
                f"{config.model_type}: scoring_func {scoring!r} is not supported with "
                f"topk_method {method!r} (only {_SCORING[method]!r})"
            )
        renormalize = bool(getattr(config, "norm_topk_prob", False))
        if renormalize and method != "noaux_tc":
            # transformers' DeepSeek-V2 never renormalizes (no released V2 config asks it to)
            raise NotImplementedError(
                f"{config.model_type}: norm_topk_prob=True is not supported with topk_method {method!r}"
            )
        grouped = method != "greedy" and (getattr(config, "n_group", None) or 1) > 1
        groups = int(config.n_group) if grouped else 1
        return cls(
            num_routed_experts(config),
            int(config.num_experts_per_tok),
            method,
            groups,
            int(config.topk_group) if grouped else 1,
            renormalize,
            float(getattr(config, "routed_scaling_factor", None) or 1.0),
        )

    def select(self, logits: torch.Tensor, correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] float32 -> (weights [T, k] float32, ids [T, k] int64), as transformers' routers compute
        them. `correction_bias` [E]: V3's e_score_correction_bias (noaux_tc only)."""
        if self.method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores if correction_bias is None else scores + correction_bias
            ids = torch.topk(self._in_best_groups(choice, float("-inf"), 2), self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            weights, ids = torch.topk(self._in_best_groups(scores, 0.0, 1), self.top_k, dim=-1, sorted=False)
        return weights * self.scaling_factor, ids

    def _in_best_groups(self, scores: torch.Tensor, fill: float, best_of_group: int) -> torch.Tensor:
        """scores [T, E] with every expert outside each token's `topk_groups` best groups set to `fill`; a group
        scores the sum of its `best_of_group` best experts' scores."""
        if self.num_groups == 1:
            return scores
        grouped = scores.view(scores.shape[0], self.num_groups, -1)  # [T, G, E / G]
        group_scores = grouped.topk(best_of_group, dim=-1)[0].sum(dim=-1)  # [T, G]
        best = torch.topk(group_scores, self.topk_groups, dim=-1, sorted=False)[1]  # [T, topk_groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), fill).view_as(scores)


class DeepseekRouter(nn.Module):
    """The router's float32 weight [E, H] (and V3's e_score_correction_bias [E]), replicated on every rank."""

    def __init__(self, routing: GroupedTopK, hidden_size: int) -> None:
        super().__init__()
        self.routing = routing
        self.weight = _param(routing.num_experts, hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = (
            _param(routing.num_experts, dtype=torch.float32) if routing.method == "noaux_tc" else None
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        logits = F.linear(hidden.float(), self.weight)
        return self.routing.select(logits, self.e_score_correction_bias)


class DeepseekMoE(nn.Module):
    """hidden [T, H] -> the routed experts' weighted sum plus the shared experts' output, [T, H]. With an EP group
    of several ranks a collective (every rank calls it, T may be 0)."""

    def __init__(
        self, config: Any, routing: GroupedTopK, dtype: torch.dtype, ep: ExpertParallel, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.ep, self.tp = ep, tp
        self.gate = DeepseekRouter(routing, config.hidden_size)
        self.experts = FusedExperts(
            routing.num_experts, config.hidden_size, config.moe_intermediate_size, dtype, ep, tp
        )
        shared = int(getattr(config, "n_shared_experts", None) or 0)
        self.shared_experts = (
            LlamaMLP(config, dense_variant(config), dtype, tp, intermediate_size=shared * config.moe_intermediate_size)
            if shared
            else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(hidden)
        out = self.ep.run_experts(hidden, expert_ids, weights, self.gate.routing.num_experts, self.experts)
        out = self.tp.all_reduce(out)
        return out if self.shared_experts is None else out + self.shared_experts(hidden)


def dense_variant(config: Any) -> LlamaVariant:
    """The dense and shared MLPs' biases: V2's `mlp_bias` (V3 has none)."""
    return LlamaVariant(qkv_bias=False, o_bias=False, mlp_bias=bool(getattr(config, "mlp_bias", False)), qk_norm=False)


def deepseek_mlp_factory(config: Any, dtype: torch.dtype, ep: ExpertParallel, tp: TensorParallel) -> tuple[Any, bool]:
    """(layer index -> that layer's feed-forward sublayer, whether any layer is sparse) for a DeepSeek config."""
    sparse = [i for i in range(config.num_hidden_layers) if is_sparse_layer(config, i)]
    routing = GroupedTopK.from_config(config) if sparse else None

    def mlp_of_layer(layer_index: int) -> nn.Module:
        if routing is not None and layer_index in sparse:
            return DeepseekMoE(config, routing, dtype, ep, tp)
        return LlamaMLP(config, dense_variant(config), dtype, tp)

    return mlp_of_layer, bool(sparse)
