"""A sliding-window model through a 2-worker cluster (coordinator, two infer-worker processes): greedy tokens equal
transformers' past the window, whichever worker serves each request, and again from the prefix cache."""

from __future__ import annotations

import asyncio

from hf_reference import transformers_greedy
from moe_models import save_tiny_model

from infer import SamplingParams

ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1",
                "--block-size", "4")
MAX_NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate((19, 40, 57, 33))]


async def test_two_workers_equal_transformers_past_the_window(model_cluster, tmp_path, smollm2_tokenizer):
    """Qwen2 with use_sliding_window: layer 0 full, layers 1-2 a window of 8; each prompt pinned to each rank."""
    fields = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=True, sliding_window=8,
                  max_window_layers=1, vocab_size=len(smollm2_tokenizer),
                  bos_token_id=smollm2_tokenizer.bos_token_id, eos_token_id=smollm2_tokenizer.eos_token_id)
    model = save_tiny_model("qwen2", fields, tmp_path / "qwen2-swa", smollm2_tokenizer, seed=1234)
    want = transformers_greedy(model, PROMPTS, MAX_NEW)
    cluster = model_cluster(workers=2, engine_flags=ENGINE_FLAGS, model=model)
    async with cluster.client() as client:
        for rank in (0, 1):
            done = await asyncio.wait_for(
                asyncio.gather(*(client.generate(p, GREEDY, pin_rank=rank) for p in PROMPTS)), 180)
            assert [c.token_ids for c in done] == want, f"rank {rank}"
        again = await asyncio.wait_for(asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS)), 180)
    assert [c.token_ids for c in again] == want
    assert sum(c.num_cached_tokens for c in again) > 0
