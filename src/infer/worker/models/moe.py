"""Mixture-of-experts models: Mixtral and Qwen3-MoE, the Llama family with sparse MoE feed-forward blocks.

Attention, norms, embeddings and the residual stream are the Llama family's (`LlamaForCausalLM` built with
an `mlp_factory`); a layer's feed-forward sublayer is a `SparseMoeBlock`, or for Qwen3-MoE's dense layers
(`mlp_only_layers`, `decoder_sparse_step`) a `LlamaMLP`. Neither architecture has shared experts.

A `SparseMoeBlock` routes each token to its top-k experts (router logits in the model dtype, softmax in
float32, top-k, optional renormalization) and hands the routed rows to `ExpertParallel.run_experts`, which
runs them through the experts' fused MLP (`infer.kernels.moe`: the kernel kernels/dispatch.py picks) on the rank
that holds each expert and sums the weighted results per token. A rank holds only `ep.expert_range(num_experts)`.

Parameter names follow transformers' in-memory modules (`mlp.gate.weight`, `mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]). Checkpoints saved by transformers store the experts one by
one (`experts.{i}.w1/w3/w2.weight` for Mixtral, under `block_sparse_moe`; `experts.{i}.gate_proj/up_proj/
down_proj.weight` for Qwen3-MoE): the loader maps those through `checkpoint_module_renames` and
`expert_modules_mapping` to an `ExpertShard` of the fused parameter, and skips experts of other ranks
without reading them. The fused layout loads directly (each rank slicing out its experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from infer.kernels.dispatch import Kernels, kernels_here
from infer.worker.distributed.expert_parallel import ExpertParallel
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.models.layers import ColumnLinear, _copy_checked, _param, _rank_slice
from infer.worker.models.llama import LlamaForCausalLM, LlamaMLP, LlamaVariant

EXPERT_PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertShard:
    """One expert's projection inside a fused expert parameter: `projection` ("gate", "up" or "down") of
    global expert `expert`. The loader's shard id for per-expert checkpoint tensors."""

    projection: str
    expert: int

    def __str__(self) -> str:
        return f"{self.projection} of expert {self.expert}"


class FusedExperts(nn.Module):
    """This rank's experts of one MoE layer, stacked: gate_up_proj [E_local, 2I, H] (gate rows, then up
    rows) and down_proj [E_local, H, I], where E_local = len(ep.expert_range(num_experts)).

    `experts(rows, local_ids)` runs each row through its (local) expert's MLP, unweighted: the
    `ExpertsFn` that `ExpertParallel.run_experts` calls.

    With tensor parallelism each rank holds its slice `tp.part(I)` of every local expert's intermediate
    size (I below is then I / tp.size): its outputs are partial sums, which the block all-reduces.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        ep: ExpertParallel,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.tp = TensorParallel.single() if tp is None else tp
        self.num_experts = num_experts
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = len(self.tp.part(intermediate_size, "the experts' intermediate size"))
        self.expert_range = ep.expert_range(num_experts)
        num_local = len(self.expert_range)
        self.gate_up_proj = _param(num_local, 2 * self.intermediate_size, hidden_size, dtype=dtype)
        self.down_proj = _param(num_local, hidden_size, self.intermediate_size, dtype=dtype)
        self.kernels: Kernels = kernels_here()

    def forward(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """rows [N, H], local_ids [N] int64 in [0, E_local) -> [N, H]."""
        return self.kernels.fused_experts(rows, local_ids, self.gate_up_proj, self.down_proj)

    # Loading (see infer.worker.loading.loader): per-expert tensors arrive with an ExpertShard, the fused layout
    # [E, ...] with shard None.

    def shards_of(self, param_name: str) -> tuple[ExpertShard, ...]:
        """The shards of `param_name` this rank must load: its projections of every local expert."""
        projections = ("gate", "up") if param_name == "gate_up_proj" else ("down",)
        return tuple(ExpertShard(p, e) for e in self.expert_range for p in projections)

    def holds(self, shard: object) -> bool:
        """Whether this rank loads `shard` (False for other ranks' experts: the loader skips them)."""
        return not isinstance(shard, ExpertShard) or shard.expert in self.expert_range

    def load_shard(self, param_name: str, tensor: Any, shard: object = None) -> None:
        param: torch.Tensor = getattr(self, param_name)
        if shard is None:  # the fused layout: every expert's tensor stacked along dim 0
            if tensor.shape[0] != self.num_experts:
                raise ValueError(
                    f"{param_name}: {tensor.shape[0]} experts in the checkpoint, the config has {self.num_experts}"
                )
            ours = tensor.narrow(0, self.expert_range.start, len(self.expert_range))
            for i in range(len(self.expert_range)):
                if param_name == "down_proj":
                    self._load_projection(param[i], "down", ours[i], param_name)
                else:
                    half = self.full_intermediate_size
                    self._load_projection(param[i], "gate", ours[i].narrow(0, 0, half), param_name)
                    self._load_projection(param[i], "up", ours[i].narrow(0, half, half), param_name)
            return
        if not isinstance(shard, ExpertShard) or shard.projection not in EXPERT_PROJECTIONS:
            raise ValueError(f"{param_name} takes an expert shard, got {shard!r}")
        if (param_name == "down_proj") != (shard.projection == "down"):
            raise ValueError(f"{shard} does not belong in {param_name}")
        self._load_projection(
            param[shard.expert - self.expert_range.start], shard.projection, tensor, f"{param_name}[{shard}]"
        )

    def _load_projection(self, expert_param: torch.Tensor, projection: str, tensor: Any, what: str) -> None:
        """One expert's full gate / up [I, H] or down [H, I] -> this rank's slice of it in `expert_param`."""
        if projection == "down":
            _copy_checked(expert_param, _rank_slice(tensor, 1, self.tp.rank, self.tp.size, what), what)
            return
        start = 0 if projection == "gate" else self.intermediate_size
        target = expert_param.narrow(0, start, self.intermediate_size)
        _copy_checked(target, _rank_slice(tensor, 0, self.tp.rank, self.tp.size, what), what)


@dataclass(frozen=True)
class Routing:
    """How a sparse block turns router logits into expert choices and weights."""

    num_experts: int
    top_k: int
    renormalize: bool  # divide the top-k probabilities by their sum
    weights_in_model_dtype: bool  # round the weights to the model dtype before weighting (Qwen3-MoE);
    # Mixtral weights the expert outputs by float32 weights

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top-k {self.top_k} must be in [1, {self.num_experts}] (the number of experts)")

    def select(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (weights [T, k] float32, or the logits' dtype if weights_in_model_dtype;
        expert ids [T, k] int64), as transformers' routers: softmax in float32, top-k, renormalize."""
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(router_logits.dtype)
        return weights, ids


class SparseMoeBlock(nn.Module):
    """hidden [T, H] -> sum over each token's top-k experts of weight * expert(hidden), [T, H].

    `gate` is the router (a linear layer without bias, replicated on every rank); `experts` this rank's
    experts. With an EP group of several ranks, forward is a collective (see `ExpertParallel.run_experts`);
    with tensor parallelism the experts' partial sums are all-reduced over the TP group after it.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        routing: Routing,
        dtype: torch.dtype,
        ep: ExpertParallel,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.routing = routing
        self.ep = ep
        self.tp = TensorParallel.single() if tp is None else tp
        self.gate = ColumnLinear(hidden_size, routing.num_experts, bias=False, dtype=dtype)
        self.experts = FusedExperts(routing.num_experts, hidden_size, intermediate_size, dtype, ep, self.tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.routing.select(self.gate(hidden))
        out = self.ep.run_experts(hidden, expert_ids, weights, self.routing.num_experts, self.experts)
        return self.tp.all_reduce(out)


def _check_activation(config: Any) -> None:
    if config.hidden_act not in ("silu", "swish"):
        raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: every layer sparse, `num_local_experts` experts of `intermediate_size`, top-k always
    renormalized, float32 routing weights."""

    supports_step_graphs: ClassVar[bool] = False  # expert dispatch is data-dependent
    supports_expert_parallel: ClassVar[bool] = True
    # checkpoint module name -> ours (transformers renames these on load too)
    checkpoint_module_renames: ClassVar[dict[str, str]] = {"block_sparse_moe": "mlp"}
    # per-expert checkpoint module (experts.{i}.<name>) -> (our fused expert parameter, projection)
    expert_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {
        "w1": ("gate_up_proj", "gate"),
        "w3": ("gate_up_proj", "up"),
        "w2": ("down_proj", "down"),
    }

    def __init__(
        self, config: Any, dtype: torch.dtype, ep: ExpertParallel | None = None, tp: TensorParallel | None = None
    ) -> None:
        _check_activation(config)
        ep = ExpertParallel.single() if ep is None else ep
        routing = Routing(
            config.num_local_experts, config.num_experts_per_tok, renormalize=True, weights_in_model_dtype=False
        )

        def sparse_block(layer_index: int) -> nn.Module:
            return SparseMoeBlock(config.hidden_size, config.intermediate_size, routing, dtype, ep, tp)

        super().__init__(config, dtype, mlp_factory=sparse_block, tp=tp)
        self.ep = ep


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE: Qwen3 attention (q/k norm); layer i is sparse unless it is in `mlp_only_layers` or
    (i + 1) is not a multiple of `decoder_sparse_step`, in which case it has a dense MLP of
    `intermediate_size`. `num_experts` experts of `moe_intermediate_size`; the top-k weights are
    renormalized when `norm_topk_prob`, then rounded to the model dtype."""

    supports_step_graphs: ClassVar[bool] = False  # expert dispatch is data-dependent
    supports_expert_parallel: ClassVar[bool] = True
    expert_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
        "down_proj": ("down_proj", "down"),
    }

    def __init__(
        self, config: Any, dtype: torch.dtype, ep: ExpertParallel | None = None, tp: TensorParallel | None = None
    ) -> None:
        _check_activation(config)
        ep = ExpertParallel.single() if ep is None else ep
        tp = TensorParallel.single() if tp is None else tp
        routing = Routing(
            config.num_experts,
            config.num_experts_per_tok,
            renormalize=bool(config.norm_topk_prob),
            weights_in_model_dtype=True,
        )
        variant = LlamaVariant.from_config(config)

        def mlp_of_layer(layer_index: int) -> nn.Module:
            if Qwen3MoeForCausalLM.is_sparse_layer(config, layer_index):
                return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, routing, dtype, ep, tp)
            return LlamaMLP(config, variant, dtype, tp)

        super().__init__(config, dtype, mlp_factory=mlp_of_layer, tp=tp)
        self.ep = ep

    @staticmethod
    def is_sparse_layer(config: Any, layer_index: int) -> bool:
        """transformers' rule for which Qwen3-MoE layers have experts."""
        return (
            layer_index not in (getattr(config, "mlp_only_layers", None) or ())
            and config.num_experts > 0
            and (layer_index + 1) % config.decoder_sparse_step == 0
        )
