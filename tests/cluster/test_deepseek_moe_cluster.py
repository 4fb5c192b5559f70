"""DeepSeek-V2 / V3 MoE models (tests/family_models.py: MLA, a dense first layer, shared experts, grouped top-k
routing) through real clusters (coordinator and infer-worker processes, gloo, fp32): a 2-worker cluster (each rank
in turn), a 2-rank EP group (4 of the 8 routed experts per rank; all requests on rank 0 with rank 1 idle on dummy
steps, then split) and TP 2 x EP 2 (four processes: each TP rank with its 2 heads, its half of every local expert's
and of the shared experts' intermediate size) give transformers' greedy tokens."""

from __future__ import annotations

import asyncio

import pytest
from family_models import FAMILIES, tiny_checkpoint
from group_procs import free_port, ready
from hf_reference import transformers_greedy

from infer import SamplingParams

ENGINE_FLAGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--kv-cache-memory",
    "8000000",
    "--threads",
    "1",
    "--block-size",
    "4",
)
TP_FLAGS = ("--tp-size", "2", "--tp-timeout", "5", "--max-num-batched-tokens", "32")
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[(5 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate((9, 36, 50))]


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer):
    """name -> (model directory, transformers' greedy tokens), each made once."""
    made = {}

    def make(name: str):
        if name not in made:
            model_type, fields = FAMILIES[name]
            path = tiny_checkpoint(tmp_path_factory.mktemp(name), smollm2_tokenizer, model_type, **fields)
            made[name] = path, transformers_greedy(path, PROMPTS, MAX_NEW)
        return made[name]

    return make


async def _generate(client, pin_rank=None) -> list[list[int]]:
    def rank_of(i: int):
        return pin_rank if pin_rank is not None else i % 2

    done = await asyncio.wait_for(
        asyncio.gather(*(client.generate(p, GREEDY, pin_rank=rank_of(i)) for i, p in enumerate(PROMPTS))), 240
    )
    return [c.token_ids for c in done]


@pytest.mark.parametrize("name", list(FAMILIES))
async def test_two_workers_equal_transformers(model_cluster, models, name):
    model, want = models(name)
    cluster = model_cluster(workers=2, engine_flags=ENGINE_FLAGS, model=model)
    async with cluster.client() as client:
        for rank in (0, 1):
            assert await _generate(client, rank) == want, f"rank {rank}"


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
    cluster.coordinator()
    dist_init = f"tcp://127.0.0.1:{free_port()}"
    for ep_rank in range(2):
        cluster.worker(
            ep_rank,
            *ENGINE_FLAGS,
            *TP_FLAGS,
            "--ep-size",
            "2",
            "--ep-rank",
            str(ep_rank),
            "--dist-init",
            dist_init,
            "--ep-timeout",
            "20",
            model=model,
        )
    ready(cluster, 2)
    async with cluster.client() as client:
        assert await _generate(client, 0) == want  # EP rank 1's TP group idle: dummy steps
        assert await _generate(client) == want
        stats = await client.stats()
    assert len({w.group_id for w in stats.workers}) == 1 and len(stats.workers) == 2
