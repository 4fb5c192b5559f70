"""Lifecycle and handshake on real processes (workers in --benchmark-mode: the real daemon, no model).

pause holds new requests, unpause runs them; stop fails every pending request with a clear message, the
coordinator and workers exit 0 and no process is left. Workers with another model id, a taken dp_rank or
another protocol version are refused with a message that says what differs."""

from __future__ import annotations

import asyncio
import signal

import pytest
import zmq
import zmq.asyncio

from infer import SamplingParams
from infer.client import ClusterError
from infer.protocol.messages import PROTOCOL_VERSION, Hello, Refused, decode, encode

BENCH = ("--max-model-len", "1000000")  # benchmark workers: one token per step, contexts long enough
SHORT = SamplingParams(max_tokens=5)
ENDLESS = SamplingParams(max_tokens=900_000)


async def test_pause_unpause_then_stop_fails_what_is_pending_and_everything_exits(cluster_factory, wait_until):
    cluster = cluster_factory()
    cluster.coordinator()
    for rank in range(2):
        cluster.worker(rank, *BENCH, benchmark=True)
    async with cluster.client() as client:
        await client.wait_for_workers(2, timeout=30)
        assert (await client.generate([1, 2], SHORT)).finish_reason == "length"

        assert await client.pause() == "paused"
        waiting = [asyncio.create_task(client.generate([i + 1], SHORT)) for i in range(5)]
        await wait_until(lambda: _held(client, 5), 5, "five held requests")
        done, _ = await asyncio.wait(waiting, timeout=0.5)
        assert not done  # paused: they wait
        assert await client.unpause() == "running"
        finished = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        assert [c.finish_reason for c in finished] == ["length"] * 5 and all(len(c.token_ids) == 5 for c in finished)

        running = [client.stream([7, i], ENDLESS) for i in range(3)]
        for stream in running:
            await stream.__anext__()  # in flight on a worker
        assert await client.pause() == "paused"
        held = [asyncio.create_task(client.generate([9, i], SHORT)) for i in range(3)]
        await wait_until(lambda: _held(client, 3), 5, "three held requests")
        assert await client.stop() == "stopped"
        failed = await asyncio.wait_for(asyncio.gather(*held), 10)
        for stream in running:
            last = [d async for d in stream][-1]
            failed.append(last)
    assert len(failed) == 6
    for result in failed:
        assert result.finish_reason == "error" and "the cluster was stopped" in result.error
    for proc in cluster.procs:
        assert proc.wait(timeout=15) == 0, cluster.dump()
    assert not cluster.alive()
    coordinator_log = cluster.procs[0].text()
    for line in (
        "lifecycle: pause: running -> paused",
        "lifecycle: unpause: paused -> running",
        "lifecycle: stop: paused -> stopped",
        "worker joined",
        "coordinator stopped",
    ):
        assert line in coordinator_log


async def _held(client, count: int) -> bool:
    return (await client.stats()).num_held == count


async def test_refused_lifecycle_command_raises_with_the_servers_reason(cluster_factory):
    cluster = cluster_factory()
    cluster.coordinator()
    async with cluster.client() as client:
        with pytest.raises(ClusterError, match="cannot suspend a running cluster: pause it first"):
            await client.suspend()


async def test_incompatible_workers_are_refused_with_what_differs(cluster_factory):
    cluster = cluster_factory()
    cluster.coordinator("--model-id", "model-a")  # pinned: a worker of another model is refused
    first = cluster.worker(0, "--model", "model-a", benchmark=True, dp_rank=0)
    async with cluster.client() as client:
        await client.wait_for_workers(1, timeout=30)
        other_model = cluster.worker(1, "--model", "model-b", benchmark=True)
        same_rank = cluster.worker(0, "--model", "model-a", benchmark=True, dp_rank=0)
        assert other_model.wait(timeout=30) == 3 and same_rank.wait(timeout=30) == 3
        assert "model id differs: the cluster serves 'model-a' (from --model-id)" in other_model.text()
        assert "'model-b'" in other_model.text()
        assert "duplicate dp_rank 0: live worker 'w0-1' already serves it" in same_rank.text()
        refused = await _hello(
            cluster.address,
            Hello(
                role="worker",
                peer_id="future",
                protocol_version=99,
                model_id="model-a",
                dp_rank=5,
                group_id="g",
                num_kv_blocks=1,
                block_size=16,
                max_num_seqs=1,
                max_model_len=16,
            ),
        )
        assert isinstance(refused, Refused)
        assert refused.reason == (
            f"protocol version differs: the coordinator speaks {PROTOCOL_VERSION}, worker 'future' speaks 99"
        )
        stats = await client.stats()
    assert [w.worker_id for w in stats.workers] == ["w0-1"] and first.popen.poll() is None
    assert cluster.procs[0].text().count("refused worker") == 3


async def _hello(address: str, hello: Hello):
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        await sock.send(encode(hello))
        return decode(await asyncio.wait_for(sock.recv(), 10))
    finally:
        sock.close()
        ctx.term()


async def test_sigterm_runs_stop(cluster_factory):
    cluster = cluster_factory()
    coordinator = cluster.coordinator()
    worker = cluster.worker(0, *BENCH, benchmark=True)
    async with cluster.client() as client:
        await client.wait_for_workers(1, timeout=30)
        stream = client.stream([1], ENDLESS)
        await stream.__anext__()
        coordinator.popen.send_signal(signal.SIGTERM)
        last = [d async for d in stream][-1]
    assert last.finish_reason == "error" and "the cluster was stopped (signal SIGTERM)" in last.error
    assert coordinator.wait(timeout=15) == 0 and worker.wait(timeout=15) == 0
