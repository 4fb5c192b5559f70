"""Rope scaling against transformers: every type's cos / sin at long positions (llama3, yarn, dynamic NTK up to
max_position_embeddings, LongRoPE's short and long sets, partial rotary), q and k rotated by our kernel in the
permuted head layout equal transformers' rotation, and greedy tokens of a tiny Llama with llama3 and with yarn
scaling (original length 32, prompts of 40-70 tokens) equal transformers' generate in fp32."""

from __future__ import annotations

import random

import pytest
import torch
from family_models import tiny_checkpoint
from hf_reference import transformers_greedy

from infer import LLM, SamplingParams
from infer.kernels.rotary import rotary_embedding_cpu
from infer.worker.models.layers import RotaryEmbedding, partial_rotary_order

LONG = 4096
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.2],
    "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 9.0, 11.0],
}
ROPES = {
    "llama3": (
        "llama",
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        {},
    ),
    "yarn": (
        "llama",
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 16.0,
        },
        {},
    ),
    "dynamic": ("llama", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}, {}),
    "longrope": ("phi3", LONGROPE, {"original_max_position_embeddings": 512}),
    "longrope-partial": (
        "phi3",
        {**LONGROPE, "short_factor": LONGROPE["short_factor"][:6], "long_factor": LONGROPE["long_factor"][:6]},
        {"original_max_position_embeddings": 512, "partial_rotary_factor": 0.75},
    ),
}


def _config(name: str):
    from transformers import AutoConfig

    model_type, rope, extra = ROPES[name]
    return AutoConfig.for_model(
        model_type,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LONG,
        rope_scaling=dict(rope),
        **extra,
    )


def _theirs(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos, sin [T, rotary_dim] for one forward over `positions` (its length decides LongRoPE's set)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rotary = (Phi3RotaryEmbedding if config.model_type == "phi3" else LlamaRotaryEmbedding)(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("name", list(ROPES))
def test_cos_sin_equal_transformers_at_long_positions(name):
    """Rows of our cache at positions up to 4095 (LongRoPE: a sequence within 512 reads the short rows, a longer one
    the long rows) against transformers' cos / sin; partial rotary: the passing columns are cos 1, sin 0."""
    config = _config(name)
    ours = RotaryEmbedding(config, head_dim=16, partial=True)
    rot = ours.rotary_dim // 2
    cases = [(torch.arange(LONG), 0)]
    if name.startswith("longrope"):
        assert ours.length_dependent and ours.max_positions == LONG
        cases = [(torch.arange(500), 0), (torch.arange(LONG), LONG)]  # short sequence, long sequence
    for positions, offset in cases:
        cos, sin = _theirs(config, positions)
        rows = ours.cos_sin_cache[positions + offset]
        torch.testing.assert_close(rows[:, :rot], cos[:, :rot], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(rows[:, 8 : 8 + rot], sin[:, :rot], atol=2e-6, rtol=1e-5)
        assert (rows[:, rot:8] == 1).all() and (rows[:, 8 + rot :] == 0).all()


def test_partial_rotary_q_k_equal_transformers():
    """q, k heads permuted by partial_rotary_order, rotated by our kernel and permuted back, equal transformers'
    apply_rotary_pos_emb (rotated first 12 of 16 dims, the last 4 passed) within fp32 rounding."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    config = _config("longrope-partial")
    ours = RotaryEmbedding(config, head_dim=16, partial=True)
    order = partial_rotary_order(16, ours.rotary_dim)
    assert sorted(order.tolist()) == list(range(16))
    positions = torch.randint(0, LONG, (50,), generator=torch.Generator().manual_seed(0))
    q, k = torch.randn(50, 4, 16), torch.randn(50, 2, 16)
    cos, sin = _theirs(config, torch.arange(LONG))
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[positions][None], sin[positions][None]
    )
    q_ours, k_ours = q[..., order].contiguous(), k[..., order].contiguous()
    rotary_embedding_cpu(positions + LONG, q_ours, k_ours, ours.cos_sin_cache, True)
    back = torch.argsort(order)
    torch.testing.assert_close(q_ours[..., back], want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ours[..., back], want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_refusals_by_name():
    """Dynamic NTK past max_position_embeddings, partial rotary in a model that does not permute its heads, and a
    rope type we do not compute are refused naming them."""
    dynamic = RotaryEmbedding(_config("dynamic"), head_dim=16)
    with pytest.raises(NotImplementedError, match="dynamic"):
        dynamic.reserve(LONG + 1)
    with pytest.raises(NotImplementedError, match="partial_rotary_factor 0.75"):
        RotaryEmbedding(_config("longrope-partial"), head_dim=16)

    class Unknown:
        rope_parameters = {"rope_type": "proportional", "rope_theta": 10000.0}  # noqa: RUF012

    with pytest.raises(NotImplementedError, match="rope_type 'proportional' is not supported"):
        RotaryEmbedding(Unknown(), head_dim=8)


# ---- greedy tokens of a tiny Llama with scaled rope --------------------------------------------------------

MAX_NEW = 16
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(3, 250) for _ in range(n)] for n in (12, 40, 70)]
SCALED = {
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("name", list(SCALED))
def test_greedy_tokens_of_a_scaled_llama_equal_transformers(name, tmp_path, smollm2_tokenizer):
    path = tiny_checkpoint(
        tmp_path / name,
        smollm2_tokenizer,
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_scaling=dict(SCALED[name]),
        tie_word_embeddings=True,
    )
    want = transformers_greedy(path, PROMPTS, MAX_NEW)
    llm = LLM(
        model=str(path), dtype="float32", max_model_len=128, kv_cache_memory=4_000_000, num_threads=1, block_size=4
    )
    got = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in got] == want
