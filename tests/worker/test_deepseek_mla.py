"""What only DeepSeek-V2's multi-head latent attention has, on the tiny random dense checkpoint of
tests/family_cases.py (latent 32 + rope key 16 in the pool, yarn scaling with mscale_all_dim, a low-rank q; its
greedy tokens, logprobs and bf16 against transformers, and the plain q_proj variant's: tests/worker/test_families.py):
the pool holds one latent head of 48 dims per token (its MoE layers: test_deepseek_moe.py)."""

from __future__ import annotations

import torch

from infer.worker.loading.loader import load_model


def test_the_pool_holds_the_latent(family_dir):
    model = load_model(family_dir("deepseek_v2"), torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    assert (model.num_kv_heads, model.head_dim) == (1, 32 + 16)  # transformers caches 4 x (32 + 24) per token
