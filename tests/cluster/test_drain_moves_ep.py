"""A drain that moves KV out of an EP group, through real processes on a tiny Mixtral (gloo on loopback): an EP group
of two ranks A0 and A1 and a dense worker D, each with a KV port (`--kv-transfer-config '{"kv_role": "kv_both"}'`).
SIGTERM to the whole group while requests stream on it: each rank ships its running requests' KV to D, never to a rank
of its own group (which goes away with it); the rank whose peer left the group first finishes its drain instead of
failing, and the coordinator, hearing the first one gone, leaves the other's requests to it. Every stream equals the
undisturbed run's greedy tokens, D received and hit the blocks, none is recomputed, both ranks exit 0. SIGTERM to one
rank alone drains the whole group the same way (its mate hears it in the group's rounds), and the coordinator routes no
new request to either rank meanwhile. A rank killed -9 mid-drain: every stream still completes exactly (its requests
recomputed)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest
from moe_models import tiny_mixtral

from infer.protocol.sampling import SamplingParams

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1"]
KV_PORT = ["--kv-transfer-config", json.dumps({"kv_role": "kv_both", "kv_transfer_timeout": 5.0})]
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [[(5 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((40, 53, 70, 35))]
BEFORE = 8  # tokens each stream has when the group is told to drain
# new requests sent during a drain: no full block in common with PROMPTS, so they add nothing to what D is sent
LATE = [[(3 * j + 200 + i) % 400 + 3 for j in range(20)] for i in range(2)]
SHORT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, smollm2_tokenizer):
    return tiny_mixtral(tmp_path_factory.mktemp("moe") / "mixtral", tokenizer=smollm2_tokenizer)


class GroupAndDense:
    """A coordinator, the EP group A0 + A1 (each drains in 30 s at most) and D (unless not `dense`); `rank` by name
    once ready."""

    def __init__(self, cluster_factory, model, dense: bool = True) -> None:
        from ports import reserved_port

        self.cluster = cluster_factory()
        self.cluster.coordinator()
        group = ["--ep-size", "2", "--dist-init", f"tcp://127.0.0.1:{reserved_port()}", "--ep-timeout", "20"]
        self.procs = {
            f"A{r}": self.cluster.worker(
                r, *ENGINE_FLAGS, *KV_PORT, *group, "--ep-rank", str(r), "--drain-timeout", "30", model=model
            )
            for r in range(2)
        }
        # the highest rank, whatever the start order: an idle rank of the group would win a tie of loads against D
        if dense:
            self.procs["D"] = self.cluster.worker(2, *ENGINE_FLAGS, *KV_PORT, model=model, dp_rank=2)
        self.rank: dict[str, int] = {}

    async def ready(self, client, wait_until) -> None:
        self.rank = await self.cluster.ranks(client, self.procs, wait_until)

    async def reference(self, client, on: list[str]) -> list[list[int]]:
        """Every prompt's tokens, prompt i pinned to worker on[i], undisturbed (at once: one batch, as under load)."""
        done = await asyncio.gather(
            *(client.generate(p, LONG, pin_rank=self.rank[name]) for p, name in zip(PROMPTS, on, strict=True))
        )
        return [c.token_ids for c in done]

    def signal(self, name: str, sig: signal.Signals) -> None:
        os.killpg(self.procs[name].popen.pid, sig)

    async def drain_group(self) -> None:
        """SIGTERM to both ranks, both stopped meanwhile: each sees it before its next round."""
        for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGCONT):
            for name in ("A0", "A1"):
                self.signal(name, sig)

    async def stream_and_strike(self, client, on: list[str], strike) -> list[list[int]]:
        """Stream prompt i on worker on[i]; once each has BEFORE tokens, await `strike()`; every stream's tokens."""
        tokens: list[list[int]] = [[] for _ in PROMPTS]
        started = asyncio.Event()

        async def stream(i: int) -> None:
            async for delta in client.stream(PROMPTS[i], LONG, pin_rank=self.rank[on[i]]):
                tokens[i] += delta.token_ids
                if all(len(t) >= BEFORE for t in tokens):
                    started.set()

        tasks = [asyncio.create_task(stream(i)) for i in range(len(PROMPTS))]
        await asyncio.wait_for(started.wait(), 60)
        await strike()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return tokens

    async def routed(self, client) -> dict[str, int]:
        """The dispatches the coordinator sent each worker so far, by name."""
        by_id = {w.worker_id: w.requests_routed for w in (await client.stats()).workers}
        return {name: by_id[proc.worker_id] for name, proc in self.procs.items()}

    async def load(self, client, name: str):
        await asyncio.sleep(0.6)  # a heartbeat or two: the counters of the last step
        worker_id = self.procs[name].worker_id
        return next(w.load for w in (await client.stats()).workers if w.worker_id == worker_id)

    def kv_targets(self, name: str) -> set[str]:
        """The KV addresses worker `name` sent blocks to (on one host they go through shared memory, logged once per
        target)."""
        return set(re.findall(r"KV transfers to (\S+) go through shared memory", self.procs[name].text()))

    def kv_address(self, name: str) -> str:
        (address,) = re.findall(r"KV socket \(kv_both\) at (\S+)", self.procs[name].text())
        return address


def at_least_blocks(prompts) -> int:
    """The full blocks of 16 each moved request holds at least: its prompt and BEFORE - 1 generated tokens."""
    return sum((len(p) + BEFORE - 1) // 16 for p in prompts)


async def test_a_whole_ep_group_drained_under_load_ships_every_request_to_the_dense_worker_exactly(
    cluster_factory, moe_model, wait_until
):
    """Streams on both ranks; SIGTERM to both. Each rank moves its two requests to D, finishes its drain whichever of
    them leaves the group first, and exits 0; D received and hit the blocks; no request was recomputed."""
    on = ["A0", "A1", "A0", "A1"]
    both = GroupAndDense(cluster_factory, moe_model)
    async with both.cluster.client() as client:
        await both.ready(client, wait_until)
        reference = await both.reference(client, on)
        hits_before = (await both.load(client, "D")).prefix_cache_hits
        assert await both.stream_and_strike(client, on, both.drain_group) == reference
        assert both.procs["A0"].wait(30) == 0 and both.procs["A1"].wait(30) == 0
        got = await both.load(client, "D")
        assert got.kv_transfer_received_blocks >= at_least_blocks(PROMPTS) and got.kv_transfer_dropped_blocks == 0
        assert got.prefix_cache_hits - hits_before >= 16 * got.kv_transfer_received_blocks
        assert (await client.stats()).requests_redispatched == 0  # moved with their KV, none re-prefilled
    for name in ("A0", "A1"):
        text = both.procs[name].text()
        assert "drain: moving 2 request(s) with their KV" in text and "fatal" not in text
        assert both.kv_targets(name) == {both.kv_address("D")}
    assert len(re.findall(r"drains: 2 of 2 request\(s\) move with their KV", both.cluster.procs[0].text())) == 2


async def test_one_rank_drained_drains_its_whole_group_and_nothing_new_is_routed_to_it(
    cluster_factory, moe_model, wait_until
):
    """Streams on both ranks; SIGTERM to A0 alone, D stopped for the drain's first moments (the moves wait on it, so
    the group is still there). A1, never signalled, hears A0 drain in the group's next round and drains too: each rank
    ships its two requests to D. Two new requests sent meanwhile both go to D, none to A0 or A1. Every stream and both
    new requests equal the undisturbed run; D received and hit the blocks; none recomputed; both ranks exit 0."""
    on = ["A0", "A1", "A0", "A1"]
    both = GroupAndDense(cluster_factory, moe_model)
    async with both.cluster.client() as client:
        await both.ready(client, wait_until)
        reference = await both.reference(client, on)
        late_reference = [(await client.generate(p, SHORT, pin_rank=both.rank["D"])).token_ids for p in LATE]
        hits_before = (await both.load(client, "D")).prefix_cache_hits
        coordinator = both.cluster.procs[0]
        late: list[asyncio.Task] = []

        async def strike() -> None:
            both.signal("D", signal.SIGSTOP)
            try:
                both.signal("A0", signal.SIGTERM)

                async def both_ask() -> bool:
                    return len(re.findall(r"drains: 2 of 2 request\(s\) move", coordinator.text())) == 2

                await wait_until(both_ask, 10, "A0 and A1 to ask where their requests go")
                before = await both.routed(client)
                late.extend(asyncio.create_task(client.generate(p, SHORT)) for p in LATE)

                async def routed() -> dict[str, int] | None:
                    now = await both.routed(client)
                    return now if now["D"] == before["D"] + 2 else None

                after = await wait_until(routed, 10, "the new requests to be routed")
                assert (after["A0"], after["A1"]) == (before["A0"], before["A1"])
            finally:
                both.signal("D", signal.SIGCONT)

        assert await both.stream_and_strike(client, on, strike) == reference
        assert [c.token_ids for c in await asyncio.wait_for(asyncio.gather(*late), 60)] == late_reference
        assert both.procs["A0"].wait(30) == 0 and both.procs["A1"].wait(30) == 0
        got = await both.load(client, "D")
        assert got.kv_transfer_received_blocks >= at_least_blocks(PROMPTS) and got.kv_transfer_dropped_blocks == 0
        assert got.prefix_cache_hits - hits_before >= 16 * got.kv_transfer_received_blocks
        assert (await client.stats()).requests_redispatched == 0
    a1 = both.procs["A1"].text()
    assert "a member of EP group" in a1 and "drains: draining 2 requests" in a1 and "fatal" not in a1
    for name in ("A0", "A1"):
        assert "drain: moving 2 request(s) with their KV" in both.procs[name].text()
        assert both.kv_targets(name) == {both.kv_address("D")}


async def test_the_idle_rank_leaves_first_its_peer_ships_anyway_and_keeps_its_requests(
    cluster_factory, moe_model, wait_until
):
    """Streams on A1 only; D stopped for the drain's first moments, so A1's moves wait on it. A0, idle, has nothing
    to move (its DrainMoves is empty) and leaves the group at once: A1 goes on without it (maybe before its moves are
    decided: it waits for them) and ships its four requests to D, never to A0 (as idle as D, of a lower rank). The coordinator hears A0 gone while A1 still ships and leaves A1's requests to it: once D continues, they go
    on there with their KV, none recomputed; both ranks exit 0."""
    on = ["A1", "A1", "A1", "A1"]
    both = GroupAndDense(cluster_factory, moe_model)
    async with both.cluster.client() as client:
        await both.ready(client, wait_until)
        reference = await both.reference(client, on)
        coordinator = both.cluster.procs[0]

        async def strike() -> None:
            both.signal("D", signal.SIGSTOP)
            try:
                await both.drain_group()

                async def a0_gone_a1_shipping() -> bool:
                    gone = f"worker left: worker {both.procs['A0'].worker_id} " in coordinator.text()
                    return gone and "drain: moving 4 request(s) with their KV" in both.procs["A1"].text()

                await wait_until(a0_gone_a1_shipping, 10, "the coordinator to hear A0 left, and A1 to ship")
            finally:
                both.signal("D", signal.SIGCONT)

        assert await both.stream_and_strike(client, on, strike) == reference
        assert both.procs["A0"].wait(30) == 0 and both.procs["A1"].wait(30) == 0
        got = await both.load(client, "D")
        assert got.kv_transfer_received_blocks >= at_least_blocks(PROMPTS)
        assert (await client.stats()).requests_redispatched == 0
    a1 = both.procs["A1"].text()
    assert "left during the drain" in a1 and "fatal" not in a1
    assert both.kv_targets("A1") == {both.kv_address("D")}
    assert not both.kv_targets("A0")


async def test_with_nowhere_to_move_the_idle_rank_stays_until_its_peer_s_requests_finish(
    cluster_factory, moe_model, wait_until
):
    """No other worker (no KV target): streams on A1 only, SIGTERM to the group. A0's own drain is over at once, but
    A1's requests cannot step without it: A0 stays in the group's rounds (dummy forwards) until they finish, then both
    leave and exit 0. Every stream equals the undisturbed run's; none is given back or computed again."""
    on = ["A1", "A1", "A1", "A1"]
    both = GroupAndDense(cluster_factory, moe_model, dense=False)
    async with both.cluster.client() as client:
        await both.ready(client, wait_until)
        reference = await both.reference(client, on)
        assert await both.stream_and_strike(client, on, both.drain_group) == reference
        assert both.procs["A0"].wait(30) == 0 and both.procs["A1"].wait(30) == 0
        assert (await client.stats()).requests_redispatched == 0
    assert "drains: 0 of 4 request(s) move with their KV" in both.cluster.procs[0].text()
    for name in ("A0", "A1"):
        assert "giving back" not in both.procs[name].text() and "fatal" not in both.procs[name].text()


async def test_a_rank_killed_mid_drain_still_ends_every_stream_exactly(cluster_factory, moe_model, wait_until):
    """D is stopped, so the group's moves wait on it; once both ranks ship, A1 is killed -9 and D continues. A1's
    requests are recomputed elsewhere (a dead worker's move as before); A0, its group broken during the drain, goes on
    shipping its own (as if A1 had left in order) and exits 0; every stream equals the undisturbed run's, in bounded
    time."""
    on = ["A0", "A1", "A0", "A1"]
    both = GroupAndDense(cluster_factory, moe_model)
    async with both.cluster.client() as client:
        await both.ready(client, wait_until)
        reference = await both.reference(client, on)
        started = time.monotonic()

        async def strike() -> None:
            both.signal("D", signal.SIGSTOP)
            try:
                await both.drain_group()

                async def both_ship() -> bool:
                    return all("drain: moving" in both.procs[n].text() for n in ("A0", "A1"))

                await wait_until(both_ship, 10, "both ranks to start their moves")
                both.procs["A1"].kill9()
            finally:
                both.signal("D", signal.SIGCONT)

        assert await both.stream_and_strike(client, on, strike) == reference
        assert time.monotonic() - started < 60
        assert both.procs["A0"].wait(30) == 0
        assert (await client.stats()).requests_redispatched > 0
    assert "fatal" not in both.procs["A0"].text()
