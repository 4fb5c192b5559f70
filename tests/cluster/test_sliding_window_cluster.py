"""Sliding-window models through real clusters (coordinator and infer-worker processes): a TP 2 rank gives
transformers' greedy tokens past the window, and again from the prefix cache. Qwen2 with use_sliding_window (layer 0 full, layers 1-2 a window of 8), Gemma 3 (local layers
with a window of 8, a global one) and Mistral (every layer a window of 8: blocks out of it given back)."""

from __future__ import annotations

import asyncio

import pytest
from family_cluster import ENGINE_FLAGS, TP_FLAGS, generate, greedy, models_made_once
from gemma_models import tiny_gemma3
from moe_models import save_tiny_model

MAX_NEW = 20
GREEDY = greedy(MAX_NEW)
PROMPTS = [[(7 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate((19, 40, 57, 33))]


def _qwen2(path, tokenizer):
    fields = dict(
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return save_tiny_model("qwen2", fields, path, tokenizer, seed=1234)


def _mistral(path, tokenizer):
    """Every layer a window of 8: the workers give back the blocks out of it."""
    fields = dict(
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=8,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return save_tiny_model("mistral", fields, path, tokenizer, seed=1234)


MODELS = {"qwen2-swa": _qwen2, "gemma3": tiny_gemma3, "mistral-swa": _mistral}


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer):
    def build(name, folder):
        return MODELS[name](folder, smollm2_tokenizer)

    return models_made_once(tmp_path_factory, build, PROMPTS, MAX_NEW)


async def _generate(cluster, pin_rank=None) -> list[list[int]]:
    async with cluster.client() as client:
        return await generate(client, PROMPTS, GREEDY, lambda i: pin_rank)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
async def test_tp2_equals_transformers_past_the_window(model_cluster, models, name):
    """Each rank of the TP group attends with its heads' windows (chunks of 32 tokens: chunked prefill too); the
    prompts again are served from the prefix cache with the same tokens."""
    model, want = models(name)
    cluster = model_cluster(workers=1, engine_flags=(*ENGINE_FLAGS, *TP_FLAGS), model=model)
    assert await _generate(cluster) == want
    assert "TP rank 1 ready" in cluster.procs[1].text()
    async with cluster.client() as client:
        again = await asyncio.wait_for(asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS)), 180)
    assert [c.token_ids for c in again] == want
    assert sum(c.num_cached_tokens for c in again) > 0
