"""InferenceClient (async) and SyncInferenceClient against a real coordinator and real workers in
--benchmark-mode (no model: request token i is (prompt_len + i) % 1000).

Request-level failures come back as finish_reason "error"; transport and cluster failures raise
ClusterError; leaving a stream early aborts its request; heartbeats keep a waiting request alive."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from ports import reserved_port

from infer import SamplingParams
from infer.client import ClusterError, InferenceClient, SyncInferenceClient

FAST = ["--heartbeat-interval", "0.2"]
ENDLESS = SamplingParams(max_tokens=900_000)


class Procs:
    def __init__(self, tmp_path) -> None:
        self.port = reserved_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.tmp_path = tmp_path
        self.all: list[subprocess.Popen] = []

    def spawn(self, *argv: str) -> subprocess.Popen:
        with open(self.tmp_path / f"p{len(self.all)}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.all.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


@pytest.fixture
def cluster(tmp_path):
    """A coordinator (client timeout 1 s) and two benchmark-mode workers (max_model_len 1,000,000)."""
    procs = Procs(tmp_path)
    procs.coordinator = procs.spawn(
        "infer.coordinator.daemon", "--port", str(procs.port), *FAST, "--client-timeout", "1", "--worker-timeout", "3"
    )
    for rank in range(2):
        procs.spawn(
            "infer.worker.service.daemon",
            "--coordinator",
            procs.address,
            "--dp-rank",
            str(rank),
            "--benchmark-mode",
            "--max-model-len",
            "1000000",
            *FAST,
        )
    with SyncInferenceClient(procs.address) as client:
        client.wait_for_workers(2, timeout=30)
    yield procs
    for proc in procs.all:
        procs.kill(proc)


def client_of(cluster, **options) -> InferenceClient:
    return InferenceClient(cluster.address, **{"heartbeat_interval": 0.2, "silence_timeout": 2.0, **options})


async def test_generate_and_stream(cluster):
    async with client_of(cluster) as client:
        done = await client.generate([5, 6, 7], SamplingParams(max_tokens=4), request_id="mine")
        assert (done.request_id, done.prompt_token_ids, done.token_ids, done.finish_reason) == (
            "mine",
            [5, 6, 7],
            [3, 4, 5, 6],
            "length",
        )
        deltas = [d async for d in client.stream("abc", SamplingParams(max_tokens=3))]
        assert [d.token_ids for d in deltas] == [[3], [4], [5]]
        assert [d.finished for d in deltas] == [False, False, True] and deltas[-1].finish_reason == "length"


async def test_leaving_a_stream_early_aborts_the_request(cluster):
    async with client_of(cluster) as client:
        async for delta in client.stream([1], ENDLESS):
            break
        stats = await client.stats()
        for _ in range(50):
            if stats.num_in_flight == 0:
                break
            await asyncio.sleep(0.02)
            stats = await client.stats()
        assert stats.num_in_flight == 0 and stats.requests_aborted == 1


async def test_abort_ends_the_stream_with_abort(cluster):
    async with client_of(cluster) as client:
        stream = client.stream([1], ENDLESS, request_id="long")
        await stream.__anext__()
        await client.abort("long")
        assert [d async for d in stream][-1].finish_reason == "abort"


async def test_request_level_failures_are_returned_not_raised(cluster):
    async with client_of(cluster) as client:
        pinned = await client.generate([1], pin_rank=9)
        assert pinned.finish_reason == "error" and "pinned to dp_rank 9" in pinned.error
        empty = await client.generate([], SamplingParams(max_tokens=2))  # the worker refuses it
        assert empty.finish_reason == "error" and "prompt + resumed tokens must be 1.." in empty.error


@pytest.mark.parametrize(
    "prompt, bad",
    [([2**40], "1099511627776"), ([1, -7], "-7"), ([1.5], "1.5"), ([True], "True"), (["7"], "'7'"), (None, "NoneType")],
)
async def test_token_ids_that_cannot_travel_are_refused_before_sending(cluster, prompt, bad):
    """Token ids go on the wire as int32: anything else is a ValueError naming the prompt, and the client goes on."""
    async with client_of(cluster) as client:
        with pytest.raises(ValueError, match="prompt") as refused:
            await client.generate(prompt, SamplingParams(max_tokens=2))
        assert bad in str(refused.value)
        assert (await client.generate([1], SamplingParams(max_tokens=2))).finish_reason == "length"


async def test_heartbeats_keep_a_waiting_request_alive(cluster):
    async with client_of(cluster) as client:
        await client.pause()
        waiting = asyncio.create_task(client.generate([1, 2], SamplingParams(max_tokens=2)))
        await asyncio.sleep(2.5)  # well past the coordinator's 1 s client timeout
        assert not waiting.done()
        await client.unpause()
        assert (await asyncio.wait_for(waiting, 10)).token_ids == [2, 3]


async def test_no_coordinator_raises_after_the_connect_timeout():
    started = time.monotonic()
    with pytest.raises(ClusterError, match="no answer to 'hello'.*within 0.5 s"):
        async with InferenceClient(f"tcp://127.0.0.1:{reserved_port()}", connect_timeout=0.5):
            pass
    assert time.monotonic() - started < 30  # ends at its timeout, not never (the message names the 0.5 s)


async def test_a_dead_coordinator_fails_what_is_in_flight(cluster):
    async with client_of(cluster) as client:
        waiting = asyncio.create_task(client.generate([1], ENDLESS))
        await asyncio.sleep(0.2)
        cluster.kill(cluster.coordinator)
        with pytest.raises(ClusterError, match="no frame from the coordinator"):
            await asyncio.wait_for(waiting, 10)


async def test_closing_the_client_fails_its_waiters(cluster):
    client = client_of(cluster)
    await client.connect()
    waiting = asyncio.create_task(client.generate([1], ENDLESS))
    await asyncio.sleep(0.1)
    await client.close()
    with pytest.raises(ClusterError, match="the client was closed"):
        await waiting


def test_sync_client(cluster):
    with SyncInferenceClient(cluster.address, heartbeat_interval=0.2, silence_timeout=2.0) as client:
        assert client.generate([1, 2], SamplingParams(max_tokens=2)).token_ids == [2, 3]
        assert [c.token_ids for c in client.generate_many([[1], [1, 1]], SamplingParams(max_tokens=1))] == [[1], [2]]
        assert [d.token_ids for d in client.stream([9] * 3, SamplingParams(max_tokens=2))] == [[3], [4]]
        for _ in client.stream([1], ENDLESS):
            break
        deadline = time.monotonic() + 30  # the last delta comes straight from the worker, the count a moment later
        while (stats := client.stats()).requests_completed < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats.num_healthy_workers == 2 and stats.requests_completed == 4
        assert client.pause() == "paused" and client.unpause() == "running"
