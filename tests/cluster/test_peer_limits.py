"""Peers that misbehave, on real processes and real sockets (a benchmark-mode worker, so no model):

- a client stopped (SIGSTOP) past the client timeout is told it was declared lost when it is continued, and
  its pending call re-attaches and completes with every token exactly once;
- fifty clients that send Submits and StatsRequests and never read are declared too slow, the coordinator's
  memory stays bounded, and a normal client is served meanwhile;
- hostile peer text (a 1 MiB error, a newline in a peer id) reaches the log escaped and bounded, as JSON
  lines with --log-format json;
- a worker whose engine steps last longer than the worker timeout stays registered (heartbeats do not wait
  for steps) and nothing is re-dispatched.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap

import msgpack
import pytest
import zmq

from infer import SamplingParams
from infer.protocol.messages import Error, Hello, RequestSpec, StatsRequest, Submit, TokenIds, encode

pytestmark = pytest.mark.slow

_STOPPED_CLIENT = textwrap.dedent("""
    import asyncio, json, sys
    from infer import SamplingParams
    from infer.client.inference_client import InferenceClient

    async def main():
        async with InferenceClient(sys.argv[1], heartbeat_interval=0.2, silence_timeout=2.0) as client:
            tokens, last = [], None
            async for delta in client.stream([1, 2, 3], SamplingParams(temperature=0, max_tokens=int(sys.argv[2]))):
                if not tokens and delta.token_ids:
                    print("FIRST", flush=True)
                tokens += delta.token_ids
                last = delta
            print("RESULT " + json.dumps({"tokens": tokens, "finish_reason": last.finish_reason,
                                          "error": last.error}), flush=True)

    asyncio.run(main())
""")


def _benchmark_tokens(prompt_len: int, n: int) -> list[int]:
    return [(prompt_len + i) % 1000 for i in range(n)]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def _lines_of(proc, marker: str, timeout: float, wait_until) -> None:
    async def seen():
        return marker in proc.text()

    await wait_until(seen, timeout, f"{marker!r} in the log of {proc.name}")


async def test_a_client_stopped_past_the_client_timeout_reattaches_and_completes(cluster_factory, wait_until):
    cluster = cluster_factory()
    cluster.coordinator("--client-timeout", "1.5")
    cluster.worker(0, "--benchmark-step-time", "0.02", benchmark=True)
    n = 400  # ~8 s of steps
    async with cluster.client() as observer:
        await observer.wait_for_workers(1, 30)
        client = cluster.spawn("client", "-c", _STOPPED_CLIENT, cluster.address, str(n))
        await _lines_of(client, "FIRST", 30, wait_until)
        client.popen.send_signal(signal.SIGSTOP)
        try:

            async def lost():
                return (await observer.stats()).clients_lost == 1

            await wait_until(lost, 30, "the stopped client to be declared lost")
            await asyncio.sleep(2.5)  # stopped longer than its own silence timeout (2 s) too
        finally:
            client.popen.send_signal(signal.SIGCONT)
        assert client.wait(60) == 0, client.text()
        result = json.loads(client.text().split("RESULT ", 1)[1])
        assert result["finish_reason"] == "length", result
        assert result["tokens"] == _benchmark_tokens(3, n)  # no gap, no repeat
        assert "declared this client lost" in client.text()
        stats = await observer.stats()
        assert stats.clients_lost == 1 and stats.num_in_flight == 0


async def test_fifty_clients_that_never_read_are_cut_off_and_others_are_served(cluster_factory, wait_until):
    cluster = cluster_factory()
    coordinator = cluster.coordinator("--client-timeout", "60")  # only the queue bound may cut them off
    cluster.worker(0, "--max-num-seqs", "256", "--benchmark-step-time", "0.05", benchmark=True)
    ctx = zmq.Context()
    floods = []
    try:
        async with cluster.client() as client:
            await client.wait_for_workers(1, 30)
            baseline = _rss_kib(coordinator.popen.pid)
            stats_frame = encode(StatsRequest())
            junk_frame = msgpack.packb({"type": "x" * 2500, "v": 2, "body": {}})  # answered with ~2 KB
            for i in range(50):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.RCVBUF, 4096)  # small kernel buffers: the coordinator's queue fills
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(cluster.address)
                for j in range(2):
                    submit = Submit(
                        request_id=f"flood-{i}-{j}",
                        spec=RequestSpec(
                            prompt_token_ids=TokenIds([1, 2, 3]), sampling=SamplingParams(max_tokens=4000)
                        ),
                    )  # 200 s of steps
                    sock.send(encode(submit))
                floods.append(sock)

            async def flood_until_cut_off():
                for sock in floods:
                    for frame in (stats_frame, junk_frame) * 100:
                        try:
                            sock.send(frame, zmq.NOBLOCK)
                        except zmq.Again:  # the coordinator stopped reading this one: fine
                            break
                return (await client.stats()).clients_too_slow >= 50

            await wait_until(flood_until_cut_off, 120, "all 50 non-reading clients to be cut off as too slow")

            done = await asyncio.wait_for(
                asyncio.gather(
                    *(client.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=50)) for _ in range(5))
                ),
                60,
            )
            assert all(c.finish_reason == "length" and c.token_ids == _benchmark_tokens(3, 50) for c in done)

            async def counted():
                # a stream's last delta reaches the client straight from the worker; the coordinator counts the
                # request when the worker's progress report of that step arrives, a moment later
                stats = await client.stats()
                return stats.requests_aborted >= 100 and stats.requests_completed >= 5

            await wait_until(counted, 30, "the coordinator to count 100 aborted and 5 completed requests")
            rss = _rss_kib(coordinator.popen.pid)
            # bounded: per peer at most 1000 queued messages to it, 100 from it (PEER_SNDHWM, PEER_RCVHWM);
            # with the old unbounded queues this flood grew the coordinator by hundreds of MiB
            assert rss < max(2 * baseline, baseline + 150 * 1024), (baseline, rss)
            print(f"coordinator VmRSS: {baseline} KiB before the flood, {rss} KiB after")
    finally:
        for sock in floods:
            sock.close(0)
        ctx.term()
    assert "too slow" in coordinator.text()


async def test_hostile_peer_text_is_logged_escaped_and_bounded(cluster_factory):
    cluster = cluster_factory()
    coordinator = cluster.coordinator("--log-format", "json")
    ctx = zmq.Context()
    try:
        async with cluster.client() as client:
            await client.stats()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(cluster.address)
            big = "e" * (1 << 20) + "\nworker joined: FORGED-ERROR"
            for _ in range(20):  # 20 MiB of error text
                sock.send(encode(Error(message=big)))
            evil = Hello(
                role="worker",
                peer_id="w\nworker joined: FORGED-ID",
                model_id="m\nFORGED-MODEL",
                dp_rank=0,
                group_id="g",
                num_kv_blocks=10,
                block_size=16,
                max_num_seqs=4,
                max_model_len=64,
            )
            sock.send(encode(evil))
            await asyncio.sleep(0)
            await client.stats()  # the frames before it were handled
            await asyncio.wait_for(asyncio.to_thread(sock.recv), 10)  # the welcome
            sock.close()
            await client.stop()
        assert coordinator.wait(30) == 0
    finally:
        ctx.term()
    text = coordinator.text()
    assert len(text) < 100_000, len(text)  # 20 MiB in, a few KiB logged
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    messages = [r["message"] for r in records]
    assert not any(m.startswith("worker joined: FORGED") for m in messages)
    assert not any("\n" in m for m in messages)
    errors = [m for m in messages if m.startswith("error reported by peer")]
    assert 1 <= len(errors) <= 5 and all("... (" in m and " more)" in m for m in errors)
    joined = [m for m in messages if m.startswith("worker joined")]
    assert len(joined) == 1 and "w\\nworker joined: FORGED-ID" in joined[0]


async def test_a_worker_whose_steps_outlast_the_worker_timeout_stays_registered(cluster_factory):
    cluster = cluster_factory()
    cluster.coordinator("--worker-timeout", "1")
    worker = cluster.worker(0, "--benchmark-step-time", "2.5", benchmark=True)
    async with cluster.client() as client:
        await client.wait_for_workers(1, 30)
        done = await asyncio.wait_for(client.generate([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=3)), 60)
        assert done.finish_reason == "length" and done.token_ids == _benchmark_tokens(4, 3)
        stats = await client.stats()
        (w,) = stats.workers
        assert w.healthy and w.registrations <= 1 and stats.requests_redispatched == 0
    assert "worker left" not in cluster.procs[0].text() and worker.popen.poll() is None


if sys.platform != "linux":  # /proc
    pytest.skip("Linux only", allow_module_level=True)
