"""A drain that moves requests with their KV, through real processes on the tiny Llama (loopback): workers A and B
have a KV port (`--kv-transfer-config '{"kv_role": "kv_both"}'`), C has none. SIGTERM to A under load ships each
running request's full blocks (prompt and generated) to B, which continues them: greedy tokens equal A's undisturbed
run, and B's counters show the blocks received and hit. A target killed -9 or stopped mid-ship ends in recompute on C,
exact and bounded; C's own drain (no KV port) moves no KV, as before."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest

from infer.client import ClusterError
from infer.protocol.sampling import SamplingParams

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "320", "--kv-cache-memory", "8000000", "--threads", "1"]
TIMEOUT_S = 2.0  # kv_transfer_timeout: a stalled move ends after this
KV_PORT = ["--kv-transfer-config", json.dumps({"kv_role": "kv_both", "kv_transfer_timeout": TIMEOUT_S})]
NGRAM = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})]
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
PROMPTS = [[(5 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((40, 53, 70))]
BEFORE = 24  # tokens each stream has when A is told to drain


class Three:
    """A coordinator and workers A, B (KV ports; A drains in 30 s at most) and C (none); `rank` by name once ready."""

    def __init__(self, cluster_factory, tiny_llama, engine_flags: tuple[str, ...] = ()) -> None:
        """`engine_flags`: every worker's, beside ENGINE_FLAGS."""
        self.cluster = cluster_factory()
        self.cluster.coordinator()
        flags = {"A": [*KV_PORT, "--drain-timeout", "30"], "B": KV_PORT, "C": []}
        self.procs = {
            name: self.cluster.worker(i, *ENGINE_FLAGS, *engine_flags, *flags[name], model=tiny_llama)
            for i, name in enumerate(flags)
        }
        self.rank: dict[str, int] = {}

    async def ready(self, client, wait_until) -> None:
        self.rank = await self.cluster.ranks(client, self.procs, wait_until)

    async def reference(self, client, name: str) -> list[list[int]]:
        """Every prompt's tokens on worker `name`, undisturbed (at once: one batch, as under load)."""
        done = await asyncio.gather(*(client.generate(p, LONG, pin_rank=self.rank[name]) for p in PROMPTS))
        return [c.token_ids for c in done]

    def signal(self, name: str, sig: signal.Signals) -> None:
        os.killpg(self.procs[name].popen.pid, sig)

    async def load(self, client, name: str):
        await asyncio.sleep(0.6)  # a heartbeat or two: the counters of the last step
        worker_id = self.procs[name].worker_id
        return next(w.load for w in (await client.stats()).workers if w.worker_id == worker_id)

    async def drain_under_load(self, client, name: str, before_drain=None, drain=None) -> list[list[int]]:
        """Stream every prompt on worker `name`; once each has BEFORE tokens, SIGTERM it (stopped meanwhile, so the
        drain starts with them all there) and run `before_drain` first, or await `drain()` instead; the streams'
        tokens."""
        tokens: list[list[int]] = [[] for _ in PROMPTS]
        started = asyncio.Event()

        async def stream(i: int) -> None:
            async for delta in client.stream(PROMPTS[i], LONG, pin_rank=self.rank[name]):
                tokens[i] += delta.token_ids
                if all(len(t) >= BEFORE for t in tokens) and not started.is_set():
                    started.set()

        tasks = [asyncio.create_task(stream(i)) for i in range(len(PROMPTS))]
        await asyncio.wait_for(started.wait(), 60)
        if drain is not None:
            await drain()
        else:
            self.signal(name, signal.SIGSTOP)
            if before_drain is not None:
                before_drain()
            self.signal(name, signal.SIGTERM)
            self.signal(name, signal.SIGCONT)
        await asyncio.wait_for(asyncio.gather(*tasks), 90)
        return tokens


async def test_a_drain_under_load_moves_the_kv_and_the_streams_go_on_exactly(cluster_factory, tiny_llama, wait_until):
    """Every worker decodes with n-gram speculation: the moved requests go on speculating on B."""
    three = Three(cluster_factory, tiny_llama, tuple(NGRAM))
    async with three.cluster.client() as client:
        await three.ready(client, wait_until)
        reference = await three.reference(client, "A")
        hits_before = (await three.load(client, "B")).prefix_cache_hits
        assert await three.drain_under_load(client, "A") == reference
        assert three.procs["A"].wait(30) == 0  # drained: every request moved or finished
        got = await three.load(client, "B")
        # every request moved with its prompt's blocks and those of BEFORE - 1 generated tokens at least
        at_least = sum((len(p) + BEFORE - 1) // 16 for p in PROMPTS)
        assert got.kv_transfer_received_blocks >= at_least and got.kv_transfer_dropped_blocks == 0
        # the continuations found them: B prefilled only each request's last partial block
        assert got.prefix_cache_hits - hits_before >= 16 * got.kv_transfer_received_blocks
        assert (await three.load(client, "C")).kv_transfer_received_blocks == 0
        assert got.spec_decode_num_drafts > 0  # B speculated on the requests it continued
    text = three.procs["A"].text()
    assert "drain: moving 3 request(s) with their KV" in text
    assert re.search(r"drains: 3 of 3 request\(s\) move with their KV", three.cluster.procs[0].text())


async def test_an_administrators_drain_worker_moves_the_kv_and_returns_once_the_worker_left(
    cluster_factory, tiny_llama, wait_until
):
    """Scale-down from the coordinator: drain_worker(A) under load does what SIGTERM does (A's streams go on on B
    with their KV, exactly; A exits 0) and returns, with the requests A held, once A has left the cluster. An id
    that names no worker is refused with the workers there are, and the cluster goes on."""
    three = Three(cluster_factory, tiny_llama)
    async with three.cluster.client() as client:
        await three.ready(client, wait_until)
        with pytest.raises(ClusterError, match=r"drain_worker: no worker 'nobody' in this cluster; it has 'w0-1'"):
            await client.drain_worker("nobody")
        with pytest.raises(ValueError, match="worker_id must be a string of 1..256 characters"):
            await client.drain_worker("")
        reference = await three.reference(client, "A")
        held: list[int] = []

        async def drain() -> None:
            held.append(await client.drain_worker(three.procs["A"].worker_id, timeout=60))
            assert three.procs["A"].worker_id not in {w.worker_id for w in (await client.stats()).workers if w.healthy}

        assert await three.drain_under_load(client, "A", drain=drain) == reference
        assert held == [len(PROMPTS)]
        assert three.procs["A"].wait(30) == 0
        got = await three.load(client, "B")
        assert got.kv_transfer_received_blocks >= sum((len(p) + BEFORE - 1) // 16 for p in PROMPTS)
    text = three.procs["A"].text()
    assert "drain asked by the coordinator: draining 3 requests" in text
    assert "drain: moving 3 request(s) with their KV" in text


async def test_a_target_killed_or_stopped_mid_ship_ends_in_recompute_exactly(cluster_factory, tiny_llama, wait_until):
    """B (the only other KV port) is stopped before A drains, so the blocks wait for it. Killed -9: A's transfers time
    out, the requests go on elsewhere (C) by recompute. Then the same with B stopped all along (declared dead)."""
    for kill in (True, False):
        three = Three(cluster_factory, tiny_llama)
        async with three.cluster.client() as client:
            await three.ready(client, wait_until)
            reference = await three.reference(client, "A")
            started = time.monotonic()
            try:
                tokens = await three.drain_under_load(client, "A", lambda: three.signal("B", signal.SIGSTOP))
                if kill:
                    three.procs["B"].kill9()
            finally:
                if not kill:
                    three.signal("B", signal.SIGCONT)
            assert tokens == reference
            assert time.monotonic() - started < 60
            assert three.procs["A"].wait(30) == 0
            assert (await three.load(client, "C")).kv_transfer_received_blocks == 0
        assert "timed out after 2 s (kv_transfer_timeout)" in three.procs["A"].text()
        three.cluster.teardown()


async def test_a_worker_without_a_kv_port_drains_as_before(cluster_factory, tiny_llama, wait_until):
    """C has no KV port: its drain asks for no moves; at its --drain-timeout (2 s) the rest is given back and
    re-prefilled elsewhere, with the same tokens."""
    three = Three(cluster_factory, tiny_llama)
    async with three.cluster.client() as client:
        await three.ready(client, wait_until)
        reference = await three.reference(client, "C")
        assert await three.drain_under_load(client, "C") == reference
        assert three.procs["C"].wait(30) == 0
        for name in ("A", "B"):
            assert (await three.load(client, name)).kv_transfer_received_blocks == 0
    assert "with their KV" not in three.procs["C"].text() + three.cluster.procs[0].text()


def test_infer_serve_kv_both_workers_move_a_stream_of_the_official_client(tiny_llama, tmp_path):
    """`infer-serve --workers 2 --kv-roles kv_both,kv_both` and the official `openai` client: a streamed completion
    whose worker is sent SIGTERM mid-stream has the text of the same request undisturbed (its session keeps both on
    one worker), and the other worker received its blocks."""
    import openai
    from serve_harness import Served

    from infer.client.inference_client import SyncInferenceClient

    served = Served(tiny_llama, tmp_path / "serve.log", "tiny", ["--kv-roles", "kv_both,kv_both", *ENGINE_FLAGS])
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
        common = dict(
            model="tiny",
            prompt=PROMPTS[2],
            max_tokens=LONG.max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Session-ID": "drain"},
        )
        reference = client.completions.create(**common).choices[0].text
        with SyncInferenceClient(served.address, connect_timeout=30) as cluster:
            workers = cluster.stats().workers
            (ran,) = [w for w in workers if w.requests_routed]
            (other,) = [w.worker_id for w in workers if w.worker_id != ran.worker_id]
        pid = int(ran.worker_id.rsplit("-", 1)[1])  # infer-serve's workers are named hostname-pid
        texts = []
        for chunk in client.completions.create(stream=True, **common):
            texts.append(chunk.choices[0].text)
            if len(texts) == BEFORE:  # stopped while it is told, so the drain starts with the request there
                os.kill(pid, signal.SIGSTOP)
                os.kill(pid, signal.SIGTERM)
                os.kill(pid, signal.SIGCONT)
        assert "".join(texts) == reference
        time.sleep(0.6)  # a heartbeat or two: the counters of the last step
        with SyncInferenceClient(served.address, connect_timeout=30) as cluster:
            (load,) = [w.load for w in cluster.stats().workers if w.worker_id == other]
        assert load is not None and load.kv_transfer_received_blocks >= (len(PROMPTS[2]) + BEFORE - 1) // 16
    finally:
        served.stop()
