"""Several coordinators (docs/architecture.md, "Several coordinators"), real processes on loopback: three
`infer-coordinator --peers LIST`, workers and a client given the same LIST.

- kill -9 of the leader while every stream runs: each stream ends exactly (every token once, in order), no
  stream waits more than 1 s beyond its pace for a delta, another coordinator leads, the cluster's paused state
  and every worker's DP rank come through, and new requests are served;
- the leader stopped (SIGSTOP: cut off, as a partition would), then let go: another leads meanwhile and the
  streams go on exactly; once back, the old one serves nothing (it redirects a raw Hello to the new leader), and
  no DP rank is held twice;
- `infer-serve --coordinators 3` starts three and serves through the leader's kill -9.

Workers run --benchmark-mode with 20 ms steps: a known pace, and token i of a P-token prompt is (P + i) % 1000."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq
from ports import reserved_port

from infer import SamplingParams
from infer.client import InferenceClient
from infer.protocol.messages import Hello, Redirect, decode, encode

STEP_S = 0.02
TOKENS = 250  # 5 s of stream at 20 ms a step
PROMPTS = [[7] * (3 + i) for i in range(6)]
BENCH = ("--benchmark-mode", "--benchmark-step-time", str(STEP_S), "--max-num-seqs", "16")


@dataclass
class Trio:
    """Three coordinators on `ports` of one test Cluster (tests/cluster/conftest.py), electing their leader;
    workers and clients are given the list."""

    cluster: Any
    ports: list[int] = field(default_factory=lambda: [reserved_port() for _ in range(3)])
    coordinators: list[Any] = field(default_factory=lambda: [None, None, None])

    @property
    def address(self) -> str:
        return ",".join(f"tcp://127.0.0.1:{p}" for p in self.ports)

    def start_coordinator(self, index: int) -> Any:
        self.coordinators[index] = self.cluster.spawn(
            f"coordinator{index}",
            "-m",
            "infer.coordinator.daemon",
            "--port",
            str(self.ports[index]),
            "--peers",
            self.address,
            "--heartbeat-interval",
            "0.2",
        )
        return self.coordinators[index]

    def worker(self, index: int) -> Any:
        return self.cluster.spawn(
            f"worker{index}",
            "-m",
            "infer.worker.daemon",
            "--coordinator",
            self.address,
            "--worker-id",
            f"w{index}",
            *BENCH,
        )

    def client(self, **options: Any) -> InferenceClient:
        return InferenceClient(self.address, **{"heartbeat_interval": 0.2, "connect_timeout": 30.0, **options})

    def dump(self) -> str:
        return self.cluster.dump()


def _hello(port: int, timeout_ms: int = 1000):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(encode(Hello(role="client", peer_id=f"probe-{os.getpid()}")))
        if not sock.poll(timeout_ms):
            return None
        return decode(sock.recv())
    finally:
        sock.close()


def _is_welcome(msg) -> bool:
    return msg is not None and msg.TYPE == "welcome"


async def _leader(trio: Trio, timeout: float, not_: int | None = None) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for index, port in enumerate(trio.ports):
            proc = trio.coordinators[index]
            if index == not_ or proc is None or proc.popen.poll() is not None:
                continue
            if _is_welcome(await asyncio.to_thread(_hello, port, 300)):
                return index
        await asyncio.sleep(0.1)
    raise AssertionError(f"no coordinator led within {timeout} s\n{trio.dump()}")


async def _start(trio: Trio, workers: int = 2) -> None:
    for index in range(3):
        trio.start_coordinator(index)
    for index in range(workers):
        trio.worker(index)
    async with trio.client() as client:
        await client.wait_for_workers(workers, 60)


async def _streams_through(trio: Trio, fault) -> tuple[list[list[int]], list[float]]:
    """Stream every prompt; once every stream has its first tokens, run `fault`. Returns each stream's tokens and
    its longest wait between two deltas."""
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    started = asyncio.Event()
    going = 0

    async with trio.client() as client:

        async def one(prompt):
            nonlocal going
            tokens, last, gap, counted = [], None, 0.0, False
            async for out in client.stream(prompt, params):
                now = time.monotonic()
                if last is not None:
                    gap = max(gap, now - last)
                last = now
                tokens += out.token_ids
                if len(tokens) >= 5 and not counted:
                    counted, going = True, going + 1
                    if going == len(PROMPTS):
                        started.set()
                assert out.finish_reason in (None, "length"), out
            return tokens, gap

        tasks = [asyncio.create_task(one(p)) for p in PROMPTS]
        await asyncio.wait_for(started.wait(), 60)
        await fault(client)
        done = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return [t for t, _ in done], [g for _, g in done]


def _expected(prompt: list[int]) -> list[int]:
    return [(len(prompt) + i) % 1000 for i in range(TOKENS)]


@pytest.fixture
def trio(cluster_factory) -> Trio:
    return Trio(cluster_factory())


async def test_kill_9_of_the_leader_under_load_loses_and_repeats_nothing_and_no_stream_stalls(trio):
    await _start(trio)
    first = await _leader(trio, 30)
    async with trio.client() as admin:
        ranks = sorted((w.worker_id, w.dp_rank) for w in (await admin.stats()).workers)

    async def kill(client):
        trio.coordinators[first].kill9()

    streams, gaps = await _streams_through(trio, kill)
    assert streams == [_expected(p) for p in PROMPTS]
    # the pace is one token per 20 ms step (a delta per step): the takeover added no wait of a second
    assert max(gaps) < 1.0 + 10 * STEP_S, gaps
    second = await _leader(trio, 10, not_=first)
    async with trio.client() as client:
        stats = await client.wait_for_workers(2, 20)  # both registered again at the new leader
        assert sorted((w.worker_id, w.dp_rank) for w in stats.workers if w.healthy) == ranks
        done = await client.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        assert done.token_ids == [3, 4, 5, 6]
        # the lifecycle state comes through a second takeover: pause, kill the new leader, still paused
        assert await client.pause() == "paused"
        await asyncio.sleep(0.5)  # the Replica rides on the next beats
    trio.coordinators[second].kill9()
    trio.start_coordinator(first)  # the launcher restarts the first: a majority again
    third = await _leader(trio, 15, not_=second)
    async with trio.client() as client:
        stats = await client.wait_for_workers(2, 20)
        assert stats.state == "paused", stats
        assert sorted((w.worker_id, w.dp_rank) for w in stats.workers if w.healthy) == ranks
        assert await client.unpause() == "running"
        done = await client.generate([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
        assert done.token_ids == [2, 3, 4] and third != second


async def test_a_stopped_leader_is_replaced_and_once_back_serves_nothing(trio):
    await _start(trio)
    old = await _leader(trio, 30)
    stopped = trio.coordinators[old].popen

    async def stop(client):
        os.killpg(stopped.pid, signal.SIGSTOP)

    try:
        streams, _ = await _streams_through(trio, stop)
        assert streams == [_expected(p) for p in PROMPTS]
        new = await _leader(trio, 10, not_=old)
    finally:
        os.killpg(stopped.pid, signal.SIGCONT)
    await asyncio.sleep(1.0)  # it runs again: its lease is long gone, a newer term leads
    answer = await asyncio.to_thread(_hello, trio.ports[old], 3000)
    assert isinstance(answer, Redirect) and answer.leader == f"tcp://127.0.0.1:{trio.ports[new]}", answer
    async with trio.client() as client:
        stats = await client.wait_for_workers(2, 20)
        ranks = [w.dp_rank for w in stats.workers if w.healthy]
        assert sorted(ranks) == [0, 1] and stats.num_healthy_workers == 2
        done = await client.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        assert done.token_ids == [3, 4, 5, 6]
    assert stopped.poll() is None  # stepped down, not dead
