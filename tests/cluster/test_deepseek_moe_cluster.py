"""DeepSeek-V2 / V3 MoE models (tests/family_models.py: MLA, a dense first layer, shared experts, grouped top-k
routing) through real clusters (coordinator and infer-worker processes, gloo, fp32): a 2-rank EP group (4 of the 8 routed experts per rank; all requests on rank 0 with rank 1 idle on dummy
steps, then split) and TP 2 x EP 2 (four processes: each TP rank with its 2 heads, its half of every local expert's
and of the shared experts' intermediate size) give transformers' greedy tokens."""

from __future__ import annotations

import pytest
from family_cluster import ENGINE_FLAGS, generate, greedy, models_made_once, start_tp2_x_ep2
from family_models import FAMILIES, tiny_checkpoint

MAX_NEW = 12
GREEDY = greedy(MAX_NEW)
PROMPTS = [[(5 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate((9, 36, 50))]


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer):
    def build(name, folder):
        model_type, fields = FAMILIES[name]
        return tiny_checkpoint(folder, smollm2_tokenizer, model_type, **fields)

    return models_made_once(tmp_path_factory, build, PROMPTS, MAX_NEW)


async def _generate(client, pin_rank=None) -> list[list[int]]:
    return await generate(client, PROMPTS, GREEDY, lambda i: pin_rank if pin_rank is not None else i % 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
async def test_ep2_group_equals_transformers(ep_groups, models, name):
    model, want = models(name)
    cluster, _ = ep_groups(model, groups=1, engine_flags=ENGINE_FLAGS)
    async with cluster.client() as client:
        assert await _generate(client, 0) == want  # rank 1 idle: dummy steps, no hang
        assert await _generate(client) == want  # split over both ranks
        stats = await client.stats()
    assert len({w.group_id for w in stats.workers}) == 1 and len(stats.workers) == 2


@pytest.mark.slow
async def test_tp2_x_ep2_equals_transformers(cluster_factory, models):
    model, want = models("deepseek_v3")
    cluster = cluster_factory()
    start_tp2_x_ep2(cluster, model)
    async with cluster.client() as client:
        assert await _generate(client, 0) == want  # EP rank 1's TP group idle: dummy steps
        assert await _generate(client) == want
        stats = await client.stats()
    assert len({w.group_id for w in stats.workers}) == 1 and len(stats.workers) == 2
