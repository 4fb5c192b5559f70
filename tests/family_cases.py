"""The model families checked against transformers, one table: how to build each tiny random checkpoint, its
prompts, and what the shared checks of tests/worker/test_families.py take from it (greedy tokens, a second round
from the prefix cache, chunked prefill, log-probabilities, step graphs, bf16). A family's own file
(tests/worker/test_gemma.py, test_phi3.py, ...) keeps only what is particular to it, on the same checkpoint:

    path, want = family_checkpoint("phi3")   # tests/conftest.py: the directory, transformers' greedy tokens
    path = family_dir("phi3")                # the directory alone

Adding a family is a row here (and a file for what only it has). Import as `from family_cases import ...` (tests/
is on the path).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from family_models import DEEPSEEK_V2, FAMILIES, GEMMA2, PHI3, tiny_checkpoint
from gemma_models import tiny_gemma3
from gpt_oss_models import tiny_gpt_oss

# Phi-4 as it is: Phi-3's fused weights with full rotary, plain rope and no window
PHI4: dict[str, Any] = {
    **{
        k: v
        for k, v in PHI3.items()
        if k not in ("rope_scaling", "partial_rotary_factor", "sliding_window", "original_max_position_embeddings")
    },
    "rope_theta": 250000.0,
}


def _prompts(seed: int, lengths: tuple[int, ...], shared: int = 0) -> list[list[int]]:
    """Random prompts of `lengths`; with `shared`, one more made of the last one's first `shared` tokens and three of
    its own (a prefix-cache hit within the first round)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]
    return prompts + ([prompts[-1][:shared] + [9, 10, 11]] if shared else [])


@dataclass(frozen=True)
class Family:
    build: Callable[[Path, Any], Path]  # (a new directory, the tokenizer) -> the checkpoint's directory
    prompts: list[list[int]]
    max_new: int = 16
    llm: dict[str, Any] = field(default_factory=dict)  # options of tiny_llm beyond the family tests' defaults
    prefix_caching: bool = True  # False: the engine turns it off for this model (LongRoPE: keys depend on the length)
    chunks: tuple[int, ...] = ()  # prefill chunk sizes the greedy check runs too (max_num_batched_tokens)
    native_attention: bool = False  # on a CPU, every attention call must take the native kernels (counted)
    logprobs: bool = True
    logprob_skip: Callable[[list[int], int], bool] | None = None  # (prompt, max_new) -> not comparable
    step_graphs: bool = False  # the model runs decode steps in compiled graphs
    bf16: tuple[int, str, float] | None = (2, "max", 0.8)  # (prompt whose fp32 continuation, measure, same tokens)
    hf_options: dict[str, Any] = field(default_factory=dict)  # transformers' model for logprobs and bf16


def _phi3_crosses_the_original_length(prompt: list[int], max_new: int) -> bool:
    """Phi-3's LongRoPE: a sequence that crosses 48 positions while decoding switches factors at that step in ours
    and re-encodes the whole sequence in transformers' forward (models/phi3.py), so the two are not comparable."""
    return len(prompt) <= 48 < len(prompt) + max_new


EAGER = {"attn_implementation": "eager"}

CASES: dict[str, Family] = {
    # Gemma 3 (text): local layers with a window of 8 and their own rope, a global one, soft-capped logits
    "gemma3": Family(
        build=tiny_gemma3,
        prompts=_prompts(5, (19, 36, 58), shared=40),
        max_new=20,
        step_graphs=True,
        hf_options=EAGER,
    ),
    # Gemma 2: alternating windows of 8, attention and final soft-capping, a query pre-attention scalar
    "gemma2": Family(
        build=lambda path, tok: tiny_checkpoint(path, tok, "gemma2", **GEMMA2),
        prompts=_prompts(8, (5, 30, 61)),
        max_new=20,
        native_attention=True,
        step_graphs=True,
        hf_options=EAGER,
    ),
    # Phi-3: partial rotary, LongRoPE past 48 positions (9 + 16 and 30 + 16 within, 50 and 75 past), windows of 16
    "phi3": Family(
        build=lambda path, tok: tiny_checkpoint(path, tok, "phi3", **PHI3),
        prompts=_prompts(11, (9, 30, 50, 75)),
        prefix_caching=False,
        chunks=(16,),
        logprob_skip=_phi3_crosses_the_original_length,
        step_graphs=True,
        bf16=(3, "max", 0.8),
    ),
    "phi4": Family(
        build=lambda path, tok: tiny_checkpoint(path, tok, "phi3", **PHI4),
        prompts=_prompts(11, (9, 30, 50, 75)),
        logprobs=False,
        bf16=None,
    ),
    # DeepSeek-V2 dense: multi-head latent attention, a low-rank q, yarn with mscale_all_dim past 32 positions
    "deepseek_v2": Family(
        build=lambda path, tok: tiny_checkpoint(path, tok, "deepseek_v2", **DEEPSEEK_V2),
        prompts=_prompts(21, (7, 33, 60), shared=40),
        llm={"kv_cache_memory": 4_000_000},
    ),
    "deepseek_v2_q_proj": Family(
        build=lambda path, tok: tiny_checkpoint(path, tok, "deepseek_v2", **{**DEEPSEEK_V2, "q_lora_rank": None}),
        prompts=_prompts(21, (7, 33, 60), shared=40),
        llm={"kv_cache_memory": 4_000_000},
        logprobs=False,
        bf16=None,
    ),
    # DeepSeek-V2 / V3 MoE: grouped routing, shared experts (V3: sigmoid scores, a correction bias)
    **{
        name: Family(
            build=lambda path, tok, _type=model_type, _fields=fields: tiny_checkpoint(path, tok, _type, **_fields),
            prompts=_prompts(33, (5, 38, 61), shared=44),
            llm={"kv_cache_memory": 4_000_000},
            bf16=(2, "95%", 0.8),
        )
        for name, (model_type, fields) in FAMILIES.items()
    },
    # GPT-OSS: attention sinks, alternating windows of 8, its router and clamped experts, yarn past 64 positions
    "gpt_oss": Family(
        build=tiny_gpt_oss,
        prompts=_prompts(5, (9, 23, 41, 70)),
        chunks=(16,),
        native_attention=True,
        bf16=(3, "mean", 0.9),
    ),
}
