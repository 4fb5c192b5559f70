"""MoE models (worker/models/moe.py): greedy output token-identical to transformers on tiny random Mixtral
and Qwen3-MoE checkpoints, loaded through the real loader; expert-parallel loading of one rank's experts;
transformers' fused expert layout; a checkpoint lacking an expert is refused."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from moe_models import reference_greedy, reference_model, tiny_mixtral, tiny_qwen3_moe
from safetensors import safe_open
from safetensors.torch import save_file

from infer import LLM, SamplingParams
from infer.worker.distributed.expert_parallel import ExpertParallel
from infer.worker.loading.loader import load_model
from infer.worker.models.moe import FusedExperts, MixtralForCausalLM, Qwen3MoeForCausalLM, SparseMoeBlock

MAX_NEW = 10

# name -> (builder, config overrides)
CASES = {
    "mixtral": (tiny_mixtral, {}),
    "mixtral-top3": (tiny_mixtral, dict(num_local_experts=4, num_experts_per_tok=3)),
    "qwen3moe-norm-dense1": (tiny_qwen3_moe, dict(norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen3moe-nonorm-step2": (tiny_qwen3_moe, dict(norm_topk_prob=False, decoder_sparse_step=2, num_experts_per_tok=4)),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 4, 9, 23, 57)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer):
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            builder, overrides = CASES[name]
            made[name] = builder(tmp_path_factory.mktemp(name), tokenizer=smollm2_tokenizer, **overrides)
        return made[name]

    return make


def _moe_blocks(model: torch.nn.Module) -> list[tuple[int, SparseMoeBlock]]:
    layers = enumerate(model.model.layers)
    return [(i, layer.mlp) for i, layer in layers if isinstance(layer.mlp, SparseMoeBlock)]


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_transformers(checkpoints, name):
    path = checkpoints(name)
    prompts = _prompts()
    expected = reference_greedy(path, prompts, MAX_NEW)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=48)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for i, (completion, want) in enumerate(zip(got, expected, strict=True)):
        assert completion.token_ids == want, f"{name}: prompt {i} ({len(prompts[i])} tokens) differs"


def test_layer_kinds_follow_the_config(checkpoints):
    dense1 = load_model(checkpoints("qwen3moe-norm-dense1"), torch.float32, torch.device("cpu"))
    assert isinstance(dense1, Qwen3MoeForCausalLM)
    assert [i for i, _ in _moe_blocks(dense1)] == [0, 2]  # mlp_only_layers=[1]
    step2 = load_model(checkpoints("qwen3moe-nonorm-step2"), torch.float32, torch.device("cpu"))
    assert [i for i, _ in _moe_blocks(step2)] == [1]  # decoder_sparse_step=2: layers 1, 3, ...
    assert not step2.model.layers[1].mlp.routing.renormalize
    mixtral = load_model(checkpoints("mixtral"), torch.float32, torch.device("cpu"))
    assert isinstance(mixtral, MixtralForCausalLM) and len(_moe_blocks(mixtral)) == 2


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize(
    "name, prefix, names",
    [
        ("mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
        ("qwen3moe-norm-dense1", "mlp", ("gate_proj", "up_proj", "down_proj")),
    ],
)
def test_expert_parallel_rank_holds_only_its_experts(checkpoints, name, prefix, names):
    path = checkpoints(name)
    model = load_model(path, torch.float32, torch.device("cpu"), ep=ExpertParallel(rank=1, size=2))
    assert not torch.distributed.is_initialized()
    ckpt = _checkpoint(path)
    gate, up, down = names
    config = json.loads((path / "config.json").read_text())
    num_experts = config.get("num_local_experts") or config["num_experts"]
    blocks = _moe_blocks(model)
    assert blocks
    for i, block in blocks:
        experts = block.experts
        assert isinstance(experts, FusedExperts)
        assert experts.expert_range == range(num_experts // 2, num_experts)
        assert experts.gate_up_proj.shape[0] == experts.down_proj.shape[0] == num_experts // 2
        router = ckpt[f"model.layers.{i}.{prefix}.gate.weight"]
        assert torch.equal(block.gate.weight, router)  # the router is whole on every rank
        for local, expert in enumerate(experts.expert_range):
            key = f"model.layers.{i}.{prefix}.experts.{expert}"
            want_gate_up = torch.cat([ckpt[f"{key}.{gate}.weight"], ckpt[f"{key}.{up}.weight"]])
            assert torch.equal(experts.gate_up_proj[local], want_gate_up)
            assert torch.equal(experts.down_proj[local], ckpt[f"{key}.{down}.weight"])


def test_fused_expert_layout_loads_like_the_per_expert_one(checkpoints, tmp_path):
    """A checkpoint in transformers' in-memory layout (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) gives the same parameters, on one rank and on rank 1 of 2."""
    path = checkpoints("mixtral")
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    state = {k: v.contiguous() for k, v in reference_model(path).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused_dir / "model.safetensors"))
    (fused_dir / "config.json").write_text((path / "config.json").read_text())
    for ep in (ExpertParallel.single(), ExpertParallel(rank=1, size=2)):
        per_expert = dict(load_model(path, torch.float32, torch.device("cpu"), ep=ep).named_parameters())
        fused = dict(load_model(fused_dir, torch.float32, torch.device("cpu"), ep=ep).named_parameters())
        assert per_expert.keys() == fused.keys()
        for key in per_expert:
            assert torch.equal(per_expert[key], fused[key]), key


def test_missing_local_expert_is_named_but_other_ranks_experts_are_not_needed(checkpoints, tmp_path):
    path = checkpoints("mixtral")
    ckpt = _checkpoint(path)
    del ckpt["model.layers.1.block_sparse_moe.experts.6.w3.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(ckpt, str(broken / "model.safetensors"))
    (broken / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj\[up of expert 6\]"):
        load_model(broken, torch.float32, torch.device("cpu"))
    load_model(broken, torch.float32, torch.device("cpu"), ep=ExpertParallel(rank=0, size=2))  # experts 0-3


@pytest.mark.parametrize("name", ["mixtral-top3", "qwen3moe-nonorm-step2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sparse_block_is_bitwise_transformers_in_half_precision(checkpoints, name, dtype):
    """Routing (float32 softmax, top-k, renormalization, weights' dtype), the weighting and the per-token sum
    in ascending expert order reproduce transformers' MoE block exactly (top-3 / top-4: the sum's order
    matters), for 37 tokens and for none (an EP rank's dummy step)."""
    from transformers import AutoModelForCausalLM

    path = checkpoints(name)
    ours = load_model(path, dtype, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()
    (index, block), *_ = _moe_blocks(ours)
    hidden = torch.randn(37, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.inference_mode():
        want = theirs.model.layers[index].mlp(hidden[None])[0]
        assert torch.equal(block(hidden), want)
        assert block(hidden[:0]).shape == (0, hidden.shape[1])


def test_a_tokenizer_larger_than_the_model_vocabulary_is_a_clear_error(tmp_path, smollm2_tokenizer):
    """SmolLM2's tokenizer in front of a 512-token model: a string prompt whose ids fall outside the model's
    vocabulary is refused with a message (not an IndexError in the embedding); token ids still work."""
    path = tiny_mixtral(tmp_path / "mixtral", tokenizer=smollm2_tokenizer, vocab_size=512)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, kv_cache_memory=4_000_000)
    [refused] = llm.generate("The lighthouse keeper climbed the stairs", use_tqdm=False)
    assert refused.finish_reason == "error" and refused.error_code == "invalid_request"
    assert "outside the model's vocabulary [0, 512): the tokenizer does not match the model" in refused.error
    done = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(done[0].token_ids) == 3
