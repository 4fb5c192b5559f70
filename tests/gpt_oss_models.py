"""A tiny random GPT-OSS checkpoint, saved with transformers, for the model, cluster and entry-point tests.

    path = tiny_gpt_oss(tmp_path / "gpt_oss", smollm2_tokenizer)

Alternating sliding (window 8) and full layers, 4 experts (top 2), yarn rope past 64 positions, a SwiGLU limit
low enough (0.5) that the clamps bite at these weights, and sinks drawn from N(0, 1) so they weigh in every softmax.
Import as `from gpt_oss_models import ...` (tests/ is on the path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tiny_models import save_redrawn

GPT_OSS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    swiglu_limit=0.5,
    tie_word_embeddings=False,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_scaling={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
)


def tiny_gpt_oss(path: Path, tokenizer: Any, seed: int = 7, **overrides: Any) -> Path:
    """A GPT-OSS checkpoint with GPT_OSS's fields (and `overrides`) and the tokenizer's vocabulary in `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt_oss",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
        **{**GPT_OSS, **overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    save_redrawn(model, path, tokenizer, wide=("sinks",))
    return Path(path)
