"""Several coordinators (docs/architecture.md, "Several coordinators"), real processes on loopback: three
`infer-coordinator --peers LIST`, workers, clients and `infer-api` given the same LIST.

- kill -9 of the leader, then of the next leader (the first restarted meanwhile), each while streams run: greedy
  streams of benchmark workers and greedy and seeded streams of a tiny Llama, through the Python client and
  through the HTTP front read by the official `openai` client. Every stream ends exactly as the same request
  without a fault (every token once, in order), no benchmark stream waits more than 1 s beyond its pace for a
  delta, every worker keeps its DP rank, new requests are served, and the cluster's paused state comes through a
  third takeover;
- the leader stopped (SIGSTOP: cut off, as a partition would), then let go: another leads meanwhile and the
  streams go on exactly; once back, the old one serves nothing (it redirects a raw Hello to the new leader), and
  no DP rank is held twice.

(`infer-serve --coordinators 3` serving through the leader's kill -9: tests/cluster/test_serve.py.)
Benchmark workers run --benchmark-mode with 20 ms steps: a known pace, and token i of a P-token prompt is
(P + i) % 1000."""

from __future__ import annotations

import asyncio
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import zmq
from ports import reserved_port

from infer import LLM, SamplingParams
from infer.client import InferenceClient
from infer.protocol.messages import Hello, Redirect, decode, encode
from tests.cluster.conftest import Cluster, Proc

STEP_S = 0.02
TOKENS = 250  # 5 s of stream at 20 ms a step
PROMPTS = [[7] * (3 + i) for i in range(6)]
BENCH = ("--benchmark-mode", "--benchmark-step-time", str(STEP_S), "--max-num-seqs", "16")
BENCH_MODEL = "bench"  # the benchmark workers' name beside the tiny Llama's
WORKERS = 3  # two benchmark workers, the tiny Llama's
# The tiny Llama's requests (a worker of its own, served as LLAMA): greedy and seeded sampling on each prompt, run
# in this process once for the reference.
LLAMA = "llama"
LLAMA_ENGINE = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "8000000", "--threads", "1")
LLAMA_PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 32))]
LLAMA_PARAMS = [
    SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=120, ignore_eos=True),
]
LLAMA_REQUESTS = [(prompt, params) for prompt in LLAMA_PROMPTS for params in LLAMA_PARAMS]


@dataclass
class Trio:
    """Three coordinators on `ports` of one test Cluster (tests/cluster/conftest.py), electing their leader;
    workers, clients and the HTTP front (at `url`) are given the list. `reference`: LLAMA_REQUESTS run without a
    fault."""

    cluster: Cluster
    ports: list[int] = field(default_factory=lambda: [reserved_port() for _ in range(3)])
    coordinators: list[Any] = field(default_factory=lambda: [None, None, None])
    url: str = ""
    reference: list = field(default_factory=list)

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

    def worker(self, index: int, *flags: str) -> Any:
        """A benchmark worker, or with `flags` (a --model and engine options) a model's."""
        return self.cluster.spawn(
            f"worker{index}",
            "-m",
            "infer.worker.service.daemon",
            "--coordinator",
            self.address,
            "--worker-id",
            f"w{index}",
            *(flags or BENCH),
        )

    def front(self, model: Path) -> subprocess.Popen:
        """`infer-api --coordinator LIST` with the tokenizer of `model`; read its URL with `front_url`."""
        argv = ["-m", "infer.client.api.server", "--coordinator", self.address, "--model", str(model), "--port", "0"]
        log = self.cluster.logs / "front.log"
        with open(log, "wb") as err:
            popen = subprocess.Popen(
                [sys.executable, *argv], stdout=subprocess.PIPE, stderr=err, start_new_session=True
            )
        self.cluster.procs.append(Proc("front", popen, log))
        return popen

    def client(self, **options: Any) -> InferenceClient:
        return InferenceClient(self.address, **{"heartbeat_interval": 0.2, "connect_timeout": 30.0, **options})

    def dump(self) -> str:
        return self.cluster.dump()


def front_url(front: subprocess.Popen, timeout: float) -> str:
    """The URL `infer-api` prints once it serves."""
    with selectors.DefaultSelector() as selector:
        selector.register(front.stdout, selectors.EVENT_READ)
        line = front.stdout.readline().decode() if selector.select(timeout) else ""
    match = re.search(r"on (http://\S+?),", line)
    assert match, f"infer-api printed {line!r}"
    return match.group(1)


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


async def _start(trio: Trio, model: Path) -> None:
    """The coordinators, two benchmark workers (served as BENCH_MODEL), a worker of `model` (served as LLAMA) and
    the HTTP front on it; meanwhile LLAMA_REQUESTS run in this process for the reference."""
    reference = asyncio.ensure_future(asyncio.to_thread(_llama_reference, model))
    for index in range(3):
        trio.start_coordinator(index)
    for index in range(WORKERS - 1):
        trio.worker(index, *BENCH, "--served-model-name", BENCH_MODEL)
    trio.worker(WORKERS - 1, "--model", str(model), "--served-model-name", LLAMA, *LLAMA_ENGINE)
    front = trio.front(model)
    async with trio.client() as client:
        await client.wait_for_workers(WORKERS, 90)
    trio.url = await asyncio.to_thread(front_url, front, 60)
    trio.reference = await asyncio.wait_for(reference, 120)


async def _heal(trio: Trio) -> int:
    """Start again the coordinators an earlier test left dead (as a launcher would); the leader, once every worker
    is with it."""
    for index, proc in enumerate(trio.coordinators):
        if proc.popen.poll() is not None:
            trio.start_coordinator(index)
    leader = await _leader(trio, 30)
    async with trio.client() as client:
        await client.wait_for_workers(WORKERS, 30)
    return leader


async def _streams_through(trio: Trio, fault) -> tuple[list[list[int]], list[float]]:
    """Stream every prompt; once every stream has its first tokens, run `fault`. Returns each stream's tokens and
    its longest wait between two deltas."""
    async with trio.client() as client:
        load = await _under_load(client)
        await fault(client)
        bench, _, _ = await load
    return [t for t, _ in bench], [g for _, g in bench]


async def _under_load(client: InferenceClient, api: openai.AsyncOpenAI | None = None) -> asyncio.Future:
    """Start a round of streams and return once every one is under way (has tokens, or ended), with a future of
    their outcomes: (each benchmark prompt's tokens and longest wait between two deltas, greedy, through `client`;
    with `api`, each of LLAMA_REQUESTS's deltas through `client`, and its (text, finish reason, completion tokens)
    through the HTTP front)."""
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    count = len(PROMPTS) + (0 if api is None else 2 * len(LLAMA_REQUESTS))
    going: set[object] = set()
    all_going = asyncio.Event()

    def under_way(stream: object) -> None:
        going.add(stream)
        if len(going) == count:
            all_going.set()

    async def bench(prompt):
        key, tokens, last, gap = object(), [], None, 0.0
        async for out in client.stream(prompt, params, model=BENCH_MODEL):
            now = time.monotonic()
            if last is not None:
                gap = max(gap, now - last)
            last = now
            tokens += out.token_ids
            if len(tokens) >= 5:
                under_way(key)
            assert out.finish_reason in (None, "length"), out
        return tokens, gap

    async def llama(prompt, sampling):
        key, deltas = object(), []
        async for delta in client.stream(prompt, sampling, model=LLAMA):
            deltas.append(delta)
            if len(deltas) >= 3 or delta.finished:
                under_way(key)
        return deltas

    async def http(prompt, sampling):
        key, text, finish, usage = object(), [], None, None
        seed = {} if sampling.seed is None else {"seed": sampling.seed}
        stream = await api.completions.create(
            model=LLAMA,
            prompt=prompt,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **seed,
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text.append(choice.text)
                finish = choice.finish_reason or finish
                if len(text) >= 3 or finish is not None:
                    under_way(key)
        return "".join(text), finish, usage

    async def models():
        if api is None:
            return [], []
        return await asyncio.gather(
            asyncio.gather(*(llama(p, s) for p, s in LLAMA_REQUESTS)),
            asyncio.gather(*(http(p, s) for p, s in LLAMA_REQUESTS)),
        )

    async def everything():
        (py, web), *benches = await asyncio.gather(models(), *(bench(p) for p in PROMPTS))
        return benches, py, web

    outcome = asyncio.ensure_future(everything())
    waiting = asyncio.ensure_future(all_going.wait())
    await asyncio.wait([outcome, waiting], timeout=60, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if outcome.done():
        outcome.result()  # a stream that failed: its error
    assert all_going.is_set(), f"{len(going)} of {count} streams under way after 60 s"
    return outcome


def _expected(prompt: list[int]) -> list[int]:
    return [(len(prompt) + i) % 1000 for i in range(TOKENS)]


def _llama_reference(model: Path) -> list:
    """LLAMA_REQUESTS run in this process, as the cluster's worker runs them (fp32): what each stream must equal."""
    llm = LLM(model=str(model), dtype="float32", max_model_len=512, kv_cache_memory=8_000_000, num_threads=1)
    return llm.generate([p for p, _ in LLAMA_REQUESTS], [s for _, s in LLAMA_REQUESTS], use_tqdm=False)


def _assert_round(outcome: tuple, reference: list, what: str) -> None:
    """Every stream of a round of `_under_load` equals its run without a fault; no benchmark stream waited more
    than a second beyond its pace (a delta per 20 ms step) for a delta."""
    benches, py, web = outcome
    assert [tokens for tokens, _ in benches] == [_expected(p) for p in PROMPTS], what
    gaps = [gap for _, gap in benches]
    assert max(gaps) < 1.0 + 10 * STEP_S, (what, gaps)
    for i, (deltas, want) in enumerate(zip(py, reference, strict=True)):
        at = f"{what}: Python client, request {i}: {deltas[-1]}"
        assert deltas[-1].finish_reason == "length" and not any(d.finished for d in deltas[:-1]), at
        assert [t for d in deltas for t in d.token_ids] == want.token_ids, at
        assert "".join(d.text for d in deltas) == want.text, at
    for i, (got, want) in enumerate(zip(web, reference, strict=True)):
        assert got == (want.text, "length", len(want.token_ids)), f"{what}: HTTP, request {i}"


@pytest.fixture(scope="module")
def trio(tmp_path_factory, tiny_llama) -> Iterator[Trio]:
    """One cluster for the module: each test starts from what the last one left (`_heal`)."""
    trio = Trio(Cluster(logs=tmp_path_factory.mktemp("trio")))
    try:
        asyncio.run(_start(trio, tiny_llama))
        yield trio
    except BaseException:
        print(trio.dump())
        raise
    finally:
        trio.cluster.teardown()


@pytest.fixture(autouse=True)
def _logs_of_a_failure(request, trio) -> Iterator[None]:
    yield
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        print(trio.dump())


async def test_kill_9_of_each_leader_in_turn_under_load_loses_and_repeats_nothing_and_no_stream_stalls(trio):
    first = await _heal(trio)
    reference = trio.reference
    async with trio.client() as client:
        ranks = sorted((w.worker_id, w.dp_rank) for w in (await client.stats()).workers)
        # the official client as users run it: it retries a 503 after its Retry-After (the front's answer while the
        # new leader has no worker of the model back yet)
        api = openai.AsyncOpenAI(base_url=f"{trio.url}/v1", api_key="unused", max_retries=2, timeout=120)
        # the leader dies under load; once another leads, the first is restarted, a second round of streams starts
        # at once (through the same clients: admitted while the workers register again), and the new leader dies
        # under load too
        before = await _under_load(client, api)
        trio.coordinators[first].kill9()
        second = await _leader(trio, 10, not_=first)
        trio.start_coordinator(first)  # the launcher restarts it: with the third, a majority once it votes
        during = await _under_load(client, api)
        trio.coordinators[second].kill9()
        rounds = await asyncio.wait_for(asyncio.gather(before, during), 120)
        _assert_round(rounds[0], reference, "the first leader killed")
        _assert_round(rounds[1], reference, "the second leader killed")
        third = await _leader(trio, 15, not_=second)
        stats = await client.wait_for_workers(WORKERS, 20)  # every worker registered again at the new leader
        assert sorted((w.worker_id, w.dp_rank) for w in stats.workers if w.healthy) == ranks
        done = await client.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), model=BENCH_MODEL)
        assert done.token_ids == [3, 4, 5, 6]
        # the lifecycle state comes through a third takeover: pause, kill the leader, still paused
        assert await client.pause() == "paused"
        await asyncio.sleep(0.5)  # the Replica rides on the next beats
    trio.coordinators[third].kill9()
    trio.start_coordinator(second)
    fourth = await _leader(trio, 15, not_=third)
    async with trio.client() as client:
        stats = await client.wait_for_workers(WORKERS, 20)
        assert stats.state == "paused", stats
        assert sorted((w.worker_id, w.dp_rank) for w in stats.workers if w.healthy) == ranks
        assert await client.unpause() == "running"
        done = await client.generate([1, 2], SamplingParams(max_tokens=3, ignore_eos=True), model=BENCH_MODEL)
        assert done.token_ids == [2, 3, 4] and fourth != third


async def test_a_stopped_leader_is_replaced_and_once_back_serves_nothing(trio):
    old = await _heal(trio)
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
        stats = await client.wait_for_workers(WORKERS, 20)
        ranks = [w.dp_rank for w in stats.workers if w.healthy and w.model_id == BENCH_MODEL]
        assert sorted(ranks) == [0, 1] and stats.num_healthy_workers == WORKERS
        done = await client.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), model=BENCH_MODEL)
        assert done.token_ids == [3, 4, 5, 6]
    assert stopped.poll() is None  # stepped down, not dead
