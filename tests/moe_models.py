"""Tiny random MoE checkpoints (Mixtral, Qwen3-MoE) saved with transformers, for model and EP tests.

    path = tiny_mixtral(tmp_path / "mixtral", tokenizer=smollm2_tokenizer, num_local_experts=4)
    path = tiny_qwen3_moe(tmp_path / "qwen3moe", tokenizer=smollm2_tokenizer, norm_topk_prob=False)

Each writes config.json, model.safetensors (transformers' own save_pretrained layout: one tensor per
expert), generation_config.json and, when given, the tokenizer (the engine needs one); with a tokenizer the
vocabulary is the tokenizer's (so string prompts work), else 512. Keyword overrides replace config fields
(e.g. vocab_size=512 for a smaller model fed token-id prompts). Weights are
random with a fixed seed, larger than transformers' init so that logits and routing are far from uniform.
Import as `from moe_models import ...` (tests/ is on the path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MIXTRAL: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    sliding_window=None,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

QWEN3_MOE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=512,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    use_sliding_window=False,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_mixtral(path: Path, tokenizer: Any = None, seed: int = 1234, **overrides: Any) -> Path:
    """A tiny random Mixtral checkpoint in `path` (created); returns `path`."""
    fields = {**MIXTRAL, **_vocab(tokenizer), **overrides}
    return save_tiny_model("mixtral", fields, Path(path), tokenizer, seed)


def tiny_qwen3_moe(path: Path, tokenizer: Any = None, seed: int = 1234, **overrides: Any) -> Path:
    """A tiny random Qwen3-MoE checkpoint in `path` (created); returns `path`."""
    fields = {**QWEN3_MOE, **_vocab(tokenizer), **overrides}
    return save_tiny_model("qwen3_moe", fields, Path(path), tokenizer, seed)


def _vocab(tokenizer: Any) -> dict[str, int]:
    return {} if tokenizer is None else {"vocab_size": len(tokenizer)}


def save_tiny_model(model_type: str, fields: dict[str, Any], path: Path, tokenizer: Any, seed: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def reference_model(path: Path) -> Any:
    """transformers' model from `path` in float32, running its experts with the modeling file's own loop
    (experts_implementation="eager", the definition the other implementations follow)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    return model.eval()


def reference_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate`, one prompt at a time (no padding effects): the new token ids."""
    model = reference_model(path)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=model.config.eos_token_id,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs
