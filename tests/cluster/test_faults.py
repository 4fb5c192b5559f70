"""Faults on a real cluster: kill -9 of a worker mid-generation, and a worker hung (SIGSTOP) past the worker
timeout that later comes back: every stream equals the in-process greedy reference token for token, and the
returning worker re-registers with nothing left running. Sampled streams (temperature 1, seeded or not) of
multi-byte text with stop strings, cut by kill -9 of their worker: each equals the same request run without
a fault (with the seed the cluster reported), tokens and text. kill -9 of a client process: its requests' KV
blocks are freed within 5 s."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time

import pytest
from aioprocs import kill_group
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

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
PROMPTS = [prompt_of_length(4 + 3 * i, i) for i in range(20)]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return LLM(
        model=str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1
    ).generate(PROMPTS, LONG, use_tqdm=False)


async def _streams_through_a_fault(cluster, fault) -> tuple[list, object]:
    """Run PROMPTS as streams; once every stream has 3 tokens, `fault(victim_proc)` hits the busiest worker.
    Returns every stream's deltas and the stats after."""

    async def on_busiest(client):
        victim = max((await client.stats()).workers, key=lambda w: w.num_in_flight)
        assert victim.num_in_flight > 0
        await fault(cluster.proc_of(victim.worker_id))

    return await streams_through_a_fault(cluster, PROMPTS, LONG, on_busiest)


def _assert_exact(streams, reference) -> None:
    assert_exact_streams(streams, [want.token_ids for want in reference])


async def test_kill_9_of_a_worker_mid_generation_loses_and_repeats_nothing(model_cluster, reference):
    """Workers started as the README starts them (only --coordinator): the coordinator gives them ranks
    0..N-1, and a kill -9 of the busiest loses and repeats nothing. Three workers: the survivors share the
    busiest one's requests (kill -9 beside one survivor is most other fault tests' case)."""
    workers = 3

    async def kill(proc):
        proc.kill9()

    streams, after = await _streams_through_a_fault(model_cluster(workers=workers), kill)
    assert sorted(w.dp_rank for w in after.workers) == list(range(workers))
    assert after.requests_redispatched > 0
    _assert_exact(streams, reference)


async def test_sampled_streams_of_multibyte_text_with_stop_strings_continue_exactly_after_kill_9(
    model_cluster, word_chain_model
):
    cluster = model_cluster(workers=2, model=word_chain_model)
    params = [chain_params(i) for i in range(len(CHAIN_PROMPTS))]
    strike_after = random.randint(3, 8)  # a random place in the streams

    async def kill_the_busiest(client):
        victim = max((await client.stats()).workers, key=lambda w: w.num_in_flight)
        assert victim.num_in_flight > 0
        cluster.proc_of(victim.worker_id).kill9()

    streams, after = await streams_through_a_fault(
        cluster, CHAIN_PROMPTS, params, kill_the_busiest, strike_after=strike_after
    )
    assert after.requests_redispatched > 0
    reference = await replayed_without_a_fault(word_chain_model, CHAIN_PROMPTS, streams, params)
    assert_same_streams(streams, reference, f" (struck after {strike_after} deltas)")
    assert any(w.finish_reason == "stop" for w in reference[:4])
    assert any(ord(c) > 0xFFFF for w in reference for c in w.text)  # emoji: 4 bytes over several tokens


async def test_a_hung_worker_is_replaced_and_rejoins_without_duplicates(model_cluster, reference, wait_until):
    cluster = model_cluster(workers=2, coordinator_flags=("--worker-timeout", "1.5"))

    async def hang(proc):
        proc.popen.send_signal(signal.SIGSTOP)  # alive, connected, silent
        try:
            await wait_until(lambda: _unhealthy(cluster), 10, "the hung worker to be declared dead")
        finally:
            proc.popen.send_signal(signal.SIGCONT)

    streams, after = await _streams_through_a_fault(cluster, hang)
    assert after.requests_redispatched > 0
    _assert_exact(streams, reference)
    async with cluster.client() as client:  # it re-registered, and runs nothing it lost
        stats = await wait_until(lambda: _all_healthy_and_idle(client), 15, "the worker to rejoin, idle")
    assert max(w.registrations for w in stats.workers) == 2


async def _unhealthy(cluster) -> bool:
    async with cluster.client() as client:
        return any(not w.healthy for w in (await client.stats()).workers)


async def _all_healthy_and_idle(client):
    stats = await client.stats()
    ok = all(w.healthy and w.load.num_running == 0 and w.load.num_waiting == 0 for w in stats.workers)
    return stats if ok else None


CLIENT = """
import asyncio, sys

from infer.client import InferenceClient
from infer.protocol.sampling import SamplingParams

async def main():
    async with InferenceClient(sys.argv[1], heartbeat_interval=0.2) as client:
        params = SamplingParams(temperature=0, max_tokens=1900, ignore_eos=True)
        streams = [client.stream([100 + i] * 24, params) for i in range(10)]
        for s in streams:
            await s.__anext__()          # every request has produced a token: all are in flight
        print("in flight", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_kill_9_of_a_client_frees_its_blocks_within_5_s(model_cluster, wait_until):
    cluster = model_cluster(
        workers=2,
        coordinator_flags=("--client-timeout", "1.5"),
        engine_flags=(
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--kv-cache-memory",
            "8000000",
            "--threads",
            "1",
        ),
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, cluster.address, stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"in flight\n"
        async with cluster.client() as observer:

            async def blocks_in_use():
                return sum(w.load.num_total_blocks - w.load.num_free_blocks for w in (await observer.stats()).workers)

            async def all_free():
                stats = await observer.stats()
                return stats.num_in_flight == 0 and all(
                    w.load.num_free_blocks == w.load.num_total_blocks and w.load.num_running == 0 for w in stats.workers
                )

            before = await observer.stats()
            assert before.num_in_flight == 10 and await blocks_in_use() > 0
            os.killpg(proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            await wait_until(all_free, 5.0, "the dead client's blocks to be freed")
            freed_after = time.monotonic() - killed_at
            after = await observer.stats()
        assert freed_after < 5.0
        assert after.requests_aborted - before.requests_aborted == 10  # aborted, not finished on their own
        assert after.requests_completed == before.requests_completed
    finally:
        await kill_group(proc)
