"""Gemma 2, Phi-3 and DeepSeek-V2's MLA through real clusters (coordinator and infer-worker processes): a TP 2 rank
gives transformers' greedy tokens on prompts past the window (Gemma 2:
soft-capped local and global layers; Phi-3: partial rotary, LongRoPE within and past the original 48 positions, fused
checkpoint tensors that each TP rank cuts its heads from; DeepSeek-V2: the latent pool, each TP rank with its heads'
slice of kv_b_proj and the whole latent)."""

from __future__ import annotations

import pytest
from family_cluster import ENGINE_FLAGS, TP_FLAGS, generate, greedy, models_made_once
from family_models import DEEPSEEK_V2, GEMMA2, PHI3, tiny_checkpoint

MAX_NEW = 16
GREEDY = greedy(MAX_NEW)
PROMPTS = [[(7 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate((19, 30, 57, 70))]
MODELS = {"gemma2": GEMMA2, "phi3": PHI3, "deepseek_v2": DEEPSEEK_V2}


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer):
    def build(name, folder):
        return tiny_checkpoint(folder, smollm2_tokenizer, name, **MODELS[name])

    return models_made_once(tmp_path_factory, build, PROMPTS, MAX_NEW)


async def _generate(cluster, pin_rank=None) -> list[list[int]]:
    async with cluster.client() as client:
        return await generate(client, PROMPTS, GREEDY, lambda i: pin_rank)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
async def test_tp2_equals_transformers(model_cluster, models, name):
    """Each rank attends with its 2 of the 4 query heads and its KV head (chunks of 32 tokens: chunked prefill)."""
    model, want = models(name)
    cluster = model_cluster(workers=1, engine_flags=(*ENGINE_FLAGS, *TP_FLAGS), model=model)
    assert await _generate(cluster) == want
    assert "TP rank 1 ready" in cluster.procs[1].text()
