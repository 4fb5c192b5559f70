"""kill -9 of the coordinator mid-generation, and a new one on the same address: the workers register again
with the requests they run (snapshots), the clients notice the new instance and re-attach their requests, and
every stream ends exactly as the in-process greedy reference, tokens and text, with no gap and no repeat.
Sampled streams (seeded or not) of multi-byte text with stop strings whose worker died with the coordinator
resume from their clients' copies (tokens, text length, seed) and equal a run without a fault. Requests that
were only queued in the dead coordinator are sent again by their clients and complete."""

from __future__ import annotations

import asyncio
import random

import pytest
from fault_streams import (
    CHAIN_PROMPTS,
    assert_exact_streams,
    assert_same_streams,
    chain_params,
    replayed_without_a_fault,
    streams_through_a_fault,
)
from prompts import prompt_of_length

from infer import LLM, SamplingParams

# Long enough that the pause below lands while every request still runs: the tiny model makes 120 tokens in ~0.3 s
# on a quiet machine, and a CI run saw all 12 finish before the pause reached the workers.
LONG = SamplingParams(temperature=0, max_tokens=700, ignore_eos=True)
PROMPTS = [prompt_of_length(4 + 5 * i, i) for i in range(12)]
RESTART_FLAGS = ("--restart-grace", "3")
ENGINE = ("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "8000000", "--threads", "1")


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return LLM(
        model=str(tiny_llama), dtype="float32", max_model_len=1024, kv_cache_memory=8_000_000, num_threads=1
    ).generate(PROMPTS, LONG, use_tqdm=False)


def _restart_coordinator(cluster) -> None:
    old = next(p for p in cluster.procs if p.name == "coordinator" and p.popen.poll() is None)
    old.kill9()
    cluster.coordinator(*RESTART_FLAGS)


async def test_streams_survive_a_coordinator_kill_9_and_restart(model_cluster, reference, wait_until):
    cluster = model_cluster(workers=2, coordinator_flags=RESTART_FLAGS, engine_flags=ENGINE)

    async def restart(client):
        # Paused first, so that every request is still on its worker when the new coordinator comes: the tiny
        # model runs 120 tokens in a fraction of a second, and a request that ends into the dead coordinator is
        # resumed from its client's copy instead (the sampled test below covers that path). The new coordinator
        # tells the registering workers its state (running): the pause ends with the restart.
        await client.pause()
        await asyncio.sleep(0.5)  # the Control reaches both workers
        assert (await client.stats()).num_in_flight == len(PROMPTS)
        _restart_coordinator(cluster)

    streams, after = await streams_through_a_fault(cluster, PROMPTS, LONG, restart)
    assert_exact_streams(streams, [want.token_ids for want in reference])
    assert ["".join(d.text for d in deltas) for deltas in streams] == [want.text for want in reference]
    # the workers' copies were handed back (not recomputed): the new coordinator re-attached every one
    assert after.requests_reattached == len(PROMPTS) and after.num_healthy_workers == 2
    assert all(w.registrations == 1 for w in after.workers)  # new coordinator: first registration each

    async with cluster.client() as client:

        async def idle():
            workers = (await client.stats()).workers
            return all(
                w.load is not None
                and w.load.num_running == w.load.num_waiting == 0
                and w.load.num_free_blocks == w.load.num_total_blocks
                for w in workers
            )

        await wait_until(idle, 15, "every worker's KV blocks to be free")


async def test_sampled_streams_resume_exactly_from_the_clients_copies(model_cluster, word_chain_model):
    """The coordinator and a worker die together: that worker's streams resume from what their clients hold."""
    cluster = model_cluster(workers=2, coordinator_flags=RESTART_FLAGS, model=word_chain_model)
    params = [chain_params(i) for i in range(len(CHAIN_PROMPTS))]
    strike_after = random.randint(3, 8)

    async def restart_without_a_worker(client):
        victim = max((await client.stats()).workers, key=lambda w: w.num_in_flight)
        assert victim.num_in_flight > 0
        cluster.proc_of(victim.worker_id).kill9()
        _restart_coordinator(cluster)

    streams, _ = await streams_through_a_fault(
        cluster, CHAIN_PROMPTS, params, restart_without_a_worker, strike_after=strike_after
    )
    reference = await replayed_without_a_fault(word_chain_model, CHAIN_PROMPTS, streams, params)
    assert_same_streams(streams, reference, f" (struck after {strike_after} deltas)")


async def test_requests_queued_in_a_dead_coordinator_are_sent_again(model_cluster, reference):
    cluster = model_cluster(workers=1, coordinator_flags=RESTART_FLAGS, engine_flags=ENGINE)
    async with cluster.client() as client:
        await client.pause()  # they wait in the coordinator only
        runs = [asyncio.create_task(client.generate(PROMPTS[i], LONG)) for i in range(3)]
        await asyncio.sleep(0.5)
        assert (await client.stats()).num_held == 3
        _restart_coordinator(cluster)  # the new one runs (a pause is not kept across a restart)
        done = await asyncio.wait_for(asyncio.gather(*runs), 90)
    assert [c.token_ids for c in done] == [reference[i].token_ids for i in range(3)]
    assert all(c.finish_reason == "length" for c in done)
