"""GPT-OSS (tests/gpt_oss_models.py: sinks, alternating windows of 8, 4 experts top 2) through real clusters of
coordinator and infer-worker processes: a 2-rank EP group (all requests on
rank 0 with rank 1 idle on dummy steps, then split) and TP 2 x EP 2 (each TP rank with 2 of the 4 query heads, their
sinks and its half of every local expert's intermediate size) give transformers' greedy tokens on prompts past the
window."""

from __future__ import annotations

import pytest
from family_cluster import ENGINE_FLAGS, generate, greedy, start_tp2_x_ep2
from gpt_oss_models import tiny_gpt_oss
from hf_reference import transformers_greedy

MAX_NEW = 16
GREEDY = greedy(MAX_NEW)
PROMPTS = [[(7 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate((19, 30, 57, 70))]


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm2_tokenizer):
    """(model directory, transformers' greedy tokens)."""
    path = tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), smollm2_tokenizer)
    return path, transformers_greedy(path, PROMPTS, MAX_NEW)


async def _generate(cluster, pin=lambda i: None) -> list[list[int]]:
    async with cluster.client() as client:
        return await generate(client, PROMPTS, GREEDY, pin)


async def test_a_two_rank_ep_group_equals_transformers(ep_groups, model):
    path, want = model
    cluster, _ = ep_groups(path, groups=1, engine_flags=ENGINE_FLAGS)
    assert await _generate(cluster, lambda i: 0) == want  # rank 1 idle: dummy steps
    assert await _generate(cluster, lambda i: i % 2) == want


@pytest.mark.slow
async def test_tp2_x_ep2_equals_transformers(cluster_factory, model):
    path, want = model
    cluster = cluster_factory()
    start_tp2_x_ep2(cluster, path)
    assert await _generate(cluster, lambda i: i % 2) == want
