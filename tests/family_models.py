"""Tiny random checkpoints of the model families, saved with transformers, for the model and cluster tests.

    path = tiny_checkpoint(tmp_path / "phi3", smollm2_tokenizer, "phi3", **PHI3)

Weights are drawn larger than transformers' init (0.08) so that logits are far from uniform, and norm weights are
random (not 1 or 0) so every norm matters. Import as `from family_models import ...` (tests/ is on the path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from infer import LLM

# Gemma 2: alternating local (window 8) and global layers, attention and final logit soft-capping, a query
# pre-attention scalar other than head_dim.
GEMMA2: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,
    sliding_window=8,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=3.0,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
)

# Phi-3: partial rotary (3/4 of the head), LongRoPE with short and long factors past 48 positions, a window of 16
# on every layer.
PHI3: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    original_max_position_embeddings=48,
    sliding_window=16,
    rms_norm_eps=1e-5,
    partial_rotary_factor=0.75,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
        "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0],
    },
)

# DeepSeek-V2 with dense layers only: multi-head latent attention (latent 32, rope key 16, q / k nope 16, v 24), a
# low-rank q (q_lora_rank 24), yarn scaling with mscale and mscale_all_dim (the softmax scale's factor) past 32.
DEEPSEEK_V2: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    first_k_dense_replace=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


# DeepSeek-V2 with MoE layers: a dense first layer (first_k_dense_replace 1), then 8 routed experts of 32 in 4 groups,
# group-limited greedy top-2 of the 2 best groups, 2 shared experts, routed_scaling_factor 1.5.
DEEPSEEK_V2_MOE: dict[str, Any] = dict(
    DEEPSEEK_V2,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=2,
    topk_method="group_limited_greedy",
    n_group=4,
    topk_group=2,
    routed_scaling_factor=1.5,
)

# DeepSeek-V3: MLA (interleaved rope, yarn), a dense first layer, then 8 routed experts in 4 groups: sigmoid scores,
# e_score_correction_bias (random), groups by their two best biased scores, top-3 of the 2 best groups, renormalized
# (norm_topk_prob), routed_scaling_factor 2.5, one shared expert.
DEEPSEEK_V3: dict[str, Any] = dict(
    DEEPSEEK_V2,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_interleave=True,
)

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v2_moe": ("deepseek_v2", DEEPSEEK_V2_MOE),
    "deepseek_v3": ("deepseek_v3", DEEPSEEK_V3),
}


def tiny_checkpoint(path: Path, tokenizer: Any, model_type: str, seed: int = 7, **fields: Any) -> Path:
    """A checkpoint of `model_type` with `fields` and the tokenizer's vocabulary in `path` (created); returns it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
        **fields,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0 if model_type.startswith("gemma") else 1.0, 0.3)
            else:
                param.normal_(0.0, 0.08)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: zeros would test nothing
                buffer.normal_(0.0, 0.3)
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return Path(path)


def tiny_llm(path: Path, **options: Any) -> LLM:
    """An LLM on a tiny checkpoint as the family tests run it: fp32, 256 tokens of context, an 8 MB KV pool of
    4-token blocks, one thread; `options` override any of these."""
    defaults: dict[str, Any] = dict(
        dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1, block_size=4
    )
    return LLM(model=str(path), **{**defaults, **options})
