"""A tiny random Gemma 3 (text) checkpoint saved with transformers, for the model and cluster tests.

    path = tiny_gemma3(tmp_path / "gemma3", smollm2_tokenizer)

Local layers with a window of 8 and their own rope, a global layer with linear rope scaling,
query_pre_attn_scalar other than head_dim, final logit soft-capping, and random (not zero) norm weights so that
every (1 + w) sandwich norm matters. Import as `from gemma_models import ...` (tests/ is on the path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

GEMMA3: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,
    sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
    },
    final_logit_softcapping=3.0,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)


def tiny_gemma3(path: Path, tokenizer: Any, seed: int = 99, **overrides: Any) -> Path:
    """The checkpoint in `path` (created) with the tokenizer's vocabulary; returns `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma3_text",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
        **{**GEMMA3, **overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3 if param.dim() == 1 else 0.08)  # norms: (1 + w) with w far from 0
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return Path(path)
