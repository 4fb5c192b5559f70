"""What only the DeepSeek-V2 / V3 MoE layers (worker/models/deepseek_moe.py) have, on the tiny random checkpoints of
tests/family_cases.py (V2 with group-limited greedy routing and 2 shared experts, V3 with sigmoid scores,
e_score_correction_bias, grouped top-3, norm_topk_prob and routed_scaling_factor; a dense first layer in both; their
greedy tokens, logprobs and bf16 against transformers: tests/worker/test_families.py): the routers choose
transformers' experts with its weights; the latent row is stored once in the pool (V is K, twice the blocks of a
K + V pool); config features we do not compute are refused with their names; V3's MTP layer tensors are skipped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from family_models import DEEPSEEK_V2, FAMILIES, tiny_llm
from hf_reference import hf_model

from infer import LLM
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine_setup import num_kv_blocks
from infer.worker.engine.forward_batch import KVCache
from infer.worker.loading.loader import build_model, load_model
from infer.worker.models.deepseek_moe import DeepseekMoE, GroupedTopK
from infer.worker.models.llama import LlamaMLP


def _llm(path: Path, **options) -> LLM:
    return tiny_llm(path, **{"kv_cache_memory": 4_000_000, **options})  # a smaller pool than the default


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_dense_first_layer_then_moe_layers_and_the_latent_row_once_in_the_pool(family_dir, name):
    llm = _llm(family_dir(name))
    layers = llm.engine.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [LlamaMLP, DeepseekMoE, DeepseekMoE]
    pool = llm.engine.kv_cache
    assert all(v is k for k, v in zip(pool.k, pool.v, strict=True))  # the latent row, once
    assert pool.shape[0] == 1 and pool.shape[3] == 32 + 16


def _config(model_type: str, **fields):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, vocab_size=256, **{**dict(FAMILIES["deepseek_v3"][1]), **fields})


@pytest.mark.parametrize("name", list(FAMILIES))
def test_router_chooses_transformers_experts_and_weights(family_dir, name):
    """Layer 1's router on 64 random hidden rows: the same expert set per token, the same weights (1e-6)."""
    path = family_dir(name)
    ours = load_model(path, torch.float32, torch.device("cpu")).model.layers[1].mlp.gate
    theirs = hf_model(path).model.layers[1].mlp.gate
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        weights, ids = ours(hidden)
        _, want_weights, want_ids = theirs(hidden)
    ids, order = ids.sort(dim=1)
    want_ids, want_order = want_ids.sort(dim=1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), rtol=1e-6, atol=1e-6)
    if name == "deepseek_v3":  # the bias matters: without it other experts win for some tokens
        ours.e_score_correction_bias.zero_()
        assert not torch.equal(ours(hidden)[1].sort(dim=1)[0], want_ids)


def test_the_pool_holds_twice_the_blocks_of_a_k_and_v_pool():
    model = build_model(_config("deepseek_v3"), torch.float32, "meta")
    config = EngineConfig(kv_cache_memory=3 * 48 * 4 * 4 * 100, block_size=4, max_num_seqs=1000)
    assert num_kv_blocks(config, model, torch.float32, torch.device("cpu"), 256) == 100  # 3 layers x 48 x fp32


def test_a_shared_pool_stays_shared_through_suspend_and_copies():
    pool = KVCache.allocate(2, 3, 4, 1, 8, torch.float32, torch.device("cpu"), shared_kv=True)
    assert pool.nbytes == 2 * 1 * 4 * 4 * 8 * 4  # 2 layers x (3 + scratch) blocks, once
    assert pool.release() >= 0 and pool.released
    assert pool.restore() == 2 * 1 * 4 * 4 * 8 * 4
    assert all(v is k for k, v in zip(pool.k, pool.v, strict=True))
    pool.k[1][0, 0].fill_(3.0)
    pool.copy_blocks([(0, 2)])
    assert torch.equal(pool.v[1][0, 2], torch.full((4, 8), 3.0))


def test_layer_kinds_follow_first_k_dense_replace_and_moe_layer_freq():
    model = build_model(
        _config("deepseek_v3", num_hidden_layers=5, first_k_dense_replace=1, moe_layer_freq=2), torch.float32, "meta"
    )
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "LlamaMLP",
        "LlamaMLP",
        "DeepseekMoE",
        "LlamaMLP",
        "DeepseekMoE",
    ]
    shared = model.model.layers[2].mlp.shared_experts
    assert tuple(shared.down_proj.weight.shape) == (64, 32)  # n_shared_experts x moe_intermediate_size


@pytest.mark.parametrize(
    ("model_type", "fields", "named"),
    [
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
        ("deepseek_v2", {"topk_method": "greedy", "norm_topk_prob": True}, "norm_topk_prob=True"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ("deepseek_v3", {"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy'"),
        ("deepseek_v3", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unimplemented_routing_is_refused_by_name(model_type, fields, named):
    base = {} if model_type == "deepseek_v3" else {"norm_topk_prob": False}
    with pytest.raises(NotImplementedError, match=named):
        build_model(_config(model_type, **{**base, **fields}), torch.float32, "meta")


def test_inconsistent_groups_are_a_value_error():
    with pytest.raises(ValueError, match="n_group 3 must divide n_routed_experts 8"):
        GroupedTopK.from_config(_config("deepseek_v3", n_group=3))
    with pytest.raises(ValueError, match="topk_group 1 groups of 2 experts hold fewer than num_experts_per_tok 3"):
        GroupedTopK.from_config(_config("deepseek_v3", topk_group=1))


def test_a_dense_config_refuses_an_ep_group():
    from infer.worker.distributed.expert_parallel import ExpertParallel

    dense = _config("deepseek_v2", **DEEPSEEK_V2, norm_topk_prob=False)
    with pytest.raises(ValueError, match="EP group of 2 ranks needs MoE layers"):
        build_model(dense, torch.float32, "meta", ep=ExpertParallel(rank=0, size=2))


def test_v3_multi_token_prediction_layer_tensors_are_skipped(family_dir, tmp_path):
    """The released V3 checkpoints store the MTP layer as model.layers.{num_hidden_layers}.*: skipped, as transformers
    does; a tensor of a layer past it is still refused by name."""
    from safetensors.torch import load_file, save_file

    path = family_dir("deepseek_v3")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (path / name).exists():
            shutil.copy(path / name, tmp_path / name)
    tensors = load_file(path / "model.safetensors")
    mtp = {
        "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.3.enorm.weight": torch.ones(64),
        "model.layers.3.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64),
    }
    save_file({**tensors, **mtp}, tmp_path / "model.safetensors")
    model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert model.num_layers == 3
    save_file({**tensors, "model.layers.4.enorm.weight": torch.ones(64)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="'model.layers.4.enorm.weight'.* matches no parameter"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
