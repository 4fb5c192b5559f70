"""Speculative decoding in worker groups, through `infer-worker` processes (gloo on CPU, fp32): a TP-2 group (rank 0
proposes, verifies and samples; its follower runs the verification forwards it is sent) and an EP-2 group on a
tiny Mixtral (each rank verifies its own requests; the expert all-to-all takes whatever rows each rank has, and an
idle rank's dummy step joins in) and a 2-stage pipeline (stage 0 proposes and verifies; the verification rows
travel through the stages like any batch) give the greedy output of one process without speculation, token for
token, with drafts accepted. A draft model with tensor parallelism is refused at start, the refusal naming both. (kill -9
of a worker mid-stream with speculation on: tests/cluster/test_speculative_faults.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest
from group_procs import ready
from moe_models import tiny_mixtral

from infer import LLM, SamplingParams

pytestmark = pytest.mark.slow

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1")
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# repeating prompts of varied lengths (drafts can be right), one of them long enough to be chunked (budget 32)
PROMPTS = [[(i * 7 + j * 13) % 300 + 3 for j in range(5)] * n for i, n in enumerate((1, 3, 6, 9))]


def _one_process(model, prompts: list, params: SamplingParams) -> list[list[int]]:
    llm = LLM(model=str(model), dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1)
    return [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]


def _accepted(stats) -> int:
    return sum(w.load.spec_decode_num_accepted_tokens for w in stats.workers if w.load is not None)


async def test_tp2_group_with_speculation_equals_one_process_without(cluster_factory, tiny_llama):
    want = _one_process(tiny_llama, PROMPTS, GREEDY)
    cluster = cluster_factory()
    cluster.coordinator()
    cluster.worker(
        0,
        *ENGINE_FLAGS,
        "--tp-size",
        "2",
        "--tp-timeout",
        "20",
        "--max-num-batched-tokens",
        "32",
        "--speculative-config",
        NGRAM,
        model=tiny_llama,
    )
    ready(cluster, 1)
    async with cluster.client() as client:
        alone = [(await client.generate(p, GREEDY)).token_ids for p in PROMPTS[:2]]  # batch 1
        batch = await asyncio.wait_for(asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS)), 180)
        stats = await client.stats()
    assert alone == want[:2]
    assert [c.token_ids for c in batch] == want
    assert _accepted(stats) > 0


async def test_ep2_group_with_speculation_equals_one_process_without(ep_groups, tmp_path, smollm2_tokenizer):
    model = tiny_mixtral(tmp_path / "mixtral", tokenizer=smollm2_tokenizer)
    want = _one_process(model, PROMPTS, GREEDY)
    cluster, _ = ep_groups(model, groups=1, engine_flags=(*ENGINE_FLAGS, "--speculative-config", NGRAM))
    async with cluster.client() as client:
        on_rank0 = await asyncio.gather(*(client.generate(p, GREEDY, pin_rank=0) for p in PROMPTS))
        assert [c.token_ids for c in on_rank0] == want  # rank 1 idle: dummy steps beside verifications
        split = await asyncio.gather(*(client.generate(p, GREEDY, pin_rank=i % 2) for i, p in enumerate(PROMPTS)))
        assert [c.token_ids for c in split] == want  # both ranks verify, different row counts
        stats = await client.stats()
    assert all(w.load is not None and w.load.spec_decode_num_accepted_tokens > 0 for w in stats.workers)


def test_a_draft_model_with_tensor_parallelism_is_refused_by_name(cluster_factory, tiny_llama):
    cluster = cluster_factory()
    cluster.coordinator()
    spec = json.dumps({"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 2})
    worker = cluster.worker(
        0, *ENGINE_FLAGS, "--tp-size", "2", "--tp-timeout", "20", "--speculative-config", spec, model=tiny_llama
    )
    assert worker.wait(timeout=120) == 2, worker.text()[-2000:]
    text = worker.text()
    assert "draft model" in text and "tensor parallelism" in text, text[-2000:]


async def test_pp2_pipeline_with_speculation_equals_one_process_without(cluster_factory, tiny_llama):
    want = _one_process(tiny_llama, PROMPTS, GREEDY)
    cluster = cluster_factory()
    cluster.coordinator()
    cluster.worker(
        0,
        *ENGINE_FLAGS,
        "--pp-size",
        "2",
        "--pp-timeout",
        "20",
        "--max-num-batched-tokens",
        "32",
        "--speculative-config",
        NGRAM,
        model=tiny_llama,
    )
    ready(cluster, 1)
    async with cluster.client() as client:
        batch = await asyncio.wait_for(asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS)), 180)
        stats = await client.stats()
    assert [c.token_ids for c in batch] == want
    assert _accepted(stats) > 0
