"""Disaggregated prefill and decode through real processes: a coordinator, a kv_producer and a kv_consumer worker
on the tiny Llama (loopback). Each request is prefilled on the producer, its KV blocks travel to the consumer, and
it decodes there: greedy outputs equal one kv_both worker's token for token, and the consumer's counters prove the
blocks arrived and were hit. Then the faults: the consumer killed -9 before its transfer, a transfer that stalls (the
consumer stopped), the producer killed -9 mid-transfer, the consumer killed -9 while it decodes; each request
completes with the same tokens, in a bounded time."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

from infer.protocol.sampling import SamplingParams
from infer.protocol.structured import StructuredOutputsParams

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1"]
TIMEOUT_S = 2.0  # kv_transfer_timeout: a stalled transfer ends after this
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((40, 53, 70))]
# speculation on KV roles: drafts verified against the KV the producer sent
NGRAM = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})]


def self_draft(model) -> tuple[str, ...]:
    """A draft model that is the model itself: its drafts are right (its own KV of the prompt made on the consumer)."""
    return (
        "--speculative-config",
        json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}),
    )


REPEATING = [5, 9, 13, 17, 21] * 8  # drafts can be right


def role(name: str, shm: bool = True) -> list[str]:
    """The flag of a worker of KV role `name`; `shm` False: its blocks go over TCP even on one host."""
    config = {"kv_role": name, "kv_transfer_timeout": TIMEOUT_S, **({} if shm else {"kv_shm_dir": ""})}
    return ["--kv-transfer-config", json.dumps(config)]


class Disaggregated:
    """A coordinator, a kv_producer, a kv_consumer and a kv_both worker (the reference: requests pinned to it run
    whole there); `rank` maps each worker's role to its DP rank once ready."""

    def __init__(
        self,
        cluster_factory,
        tiny_llama,
        keys=None,
        producer_keys: tuple[str, ...] = (),
        shm: bool = True,
        consumer_flags: tuple[str, ...] = (),
        worker_flags: tuple[str, ...] = (),
    ) -> None:
        """`keys`: a ClusterKeyDir (CurveZMQ everywhere); `producer_keys`: the producer's key flags instead of the
        workers' shared pair; `shm` False: the blocks go over TCP (on one host they go through /dev/shm);
        `consumer_flags`: the consumer's own engine flags; `worker_flags`: every worker's."""
        self.cluster = cluster_factory()
        self.cluster.coordinator(*(keys.coordinator_flags() if keys is not None else ()))
        key_flags = keys.worker_flags() if keys is not None else []
        self.procs = {
            name: self.cluster.worker(
                i,
                *ENGINE_FLAGS,
                *role(name, shm),
                *(producer_keys if producer_keys and name == "kv_producer" else key_flags),
                *(consumer_flags if name == "kv_consumer" else ()),
                *worker_flags,
                model=tiny_llama,
            )
            for i, name in enumerate(("kv_producer", "kv_consumer", "kv_both"))
        }
        self.keys = keys
        self.rank: dict[str, int] = {}

    async def ready(self, client, wait_until) -> None:
        self.rank = await self.cluster.ranks(client, self.procs, wait_until)

    async def reference(self, client, prompt: list[int], params: SamplingParams = GREEDY):
        """The tokens of `prompt` on the kv_both worker (the Completion, with `params` other than GREEDY)."""
        completion = await client.generate(prompt, params, pin_rank=self.rank["kv_both"])
        return completion.token_ids if params is GREEDY else completion

    def generate(self, client, prompt: list[int], params: SamplingParams = GREEDY):
        """A request that starts on the producer (its consumer: the kv_consumer)."""
        return client.generate(prompt, params, pin_rank=self.rank["kv_producer"])

    def stop(self, name: str) -> None:
        os.killpg(self.procs[name].popen.pid, signal.SIGSTOP)

    def cont(self, name: str) -> None:
        os.killpg(self.procs[name].popen.pid, signal.SIGCONT)


async def loads(client, wait_until=None, worker_id: str = "", received: int = 0) -> dict[str, object]:
    """Each healthy worker's last load, by worker id (heartbeats bring it); with `wait_until`, once `worker_id`
    reports `received` blocks received (a loaded machine's heartbeat may come late)."""
    await asyncio.sleep(0.6)  # a heartbeat interval or two: the counters of the last step

    async def current() -> dict[str, object]:
        return {w.worker_id: w.load for w in (await client.stats()).workers if w.healthy and w.load is not None}

    if wait_until is not None:

        async def arrived() -> bool:
            load = (await current()).get(worker_id)
            return load is not None and load.kv_transfer_received_blocks >= received

        await wait_until(arrived, 20, f"{worker_id} to report {received} blocks received")
        await asyncio.sleep(0.6)  # and the counters of the step that used them
    return await current()


async def test_prefill_on_the_producer_decode_on_the_consumer_equal_outputs(cluster_factory, tiny_llama, wait_until):
    """The consumer decodes with a draft model (the reference without): the draft prefills the prompt on the consumer,
    its drafts are verified against the KV the consumer received, and the greedy tokens stay the reference's."""
    pd = Disaggregated(cluster_factory, tiny_llama, consumer_flags=self_draft(tiny_llama))
    async with pd.cluster.client() as client:
        await pd.ready(client, wait_until)
        reference = [await pd.reference(client, p) for p in PROMPTS]
        outputs = [(await pd.generate(client, p)).token_ids for p in PROMPTS]
        assert outputs == reference
        full_blocks = sum(len(p) // 16 for p in PROMPTS)
        now = await loads(client, wait_until, pd.procs["kv_consumer"].worker_id, full_blocks)
        sent, got = now[pd.procs["kv_producer"].worker_id], now[pd.procs["kv_consumer"].worker_id]
        assert sent.kv_transfer_sent_blocks == full_blocks
        assert got.kv_transfer_received_blocks == full_blocks and got.kv_transfer_dropped_blocks == 0
        # the consumer prefilled only each prompt's tail: its hits cover every full block the continuation looks up
        assert got.prefix_cache_hits == sum((len(p) // 16) * 16 for p in PROMPTS)
        # the same prompt again: the consumer holds its blocks, so none travels
        assert (await pd.generate(client, PROMPTS[0])).token_ids == reference[0]
        again = await loads(client)
        assert again[pd.procs["kv_consumer"].worker_id].kv_transfer_received_blocks == full_blocks
        # structured outputs: the consumer's grammar replays the producer's first token
        regex = SamplingParams(
            temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]{2,5} [0-9]{1,3}")
        )
        expected = await pd.reference(client, PROMPTS[1], regex)
        constrained = await pd.generate(client, PROMPTS[1], regex)
        assert constrained.token_ids == expected.token_ids and re.fullmatch("[a-z]{2,5} [0-9]{1,3}", constrained.text)
        # a longer continuation: drafts proposed and accepted, the tokens still the reference's
        long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        assert (await pd.generate(client, REPEATING, long)).token_ids == (
            await pd.reference(client, REPEATING, long)
        ).token_ids
        speculated = (await loads(client))[pd.procs["kv_consumer"].worker_id]
        assert speculated.spec_decode_num_drafts > 0 and speculated.spec_decode_num_accepted_tokens > 0
    assert "go through shared memory" in pd.procs["kv_producer"].text()  # one host: /dev/shm, not TCP


async def test_with_keys_the_kv_traffic_is_curve_and_a_producer_under_another_key_is_refused(
    cluster_factory, tiny_llama, wait_until, tmp_path, tmp_path_factory
):
    """CurveZMQ on every link (infer-keygen --cluster): the blocks travel (over TCP) between the workers' shared key pair,
    a LoRA request's with its adapter's name. A producer under another worker key (the coordinator lets it in) fails the
    consumer's handshake: its transfer times out and the consumer recomputes; the tokens are the same either way."""
    from lora_cases import make_adapters

    from infer.protocol.keys import ClusterKeyDir, write_key_pair

    adapter = make_adapters(tiny_llama, tmp_path_factory, names=("qv",))["qv"]
    lora = ("--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"qv={adapter}")
    adapted = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, lora_name="qv")

    keys = ClusterKeyDir.create(tmp_path / "keys")
    _, secret = write_key_pair(keys.path / "workers", "stranger")
    for stranger in (False, True):
        flags = ("--curve-key", str(secret), "--coordinator-key", str(keys.public("coordinator"))) if stranger else ()
        pd = Disaggregated(cluster_factory, tiny_llama, keys, producer_keys=flags, shm=False, worker_flags=lora)
        async with pd.cluster.client(**keys.client_options()) as client:
            await pd.ready(client, wait_until)
            reference = await pd.reference(client, PROMPTS[2])
            assert (await pd.generate(client, PROMPTS[2])).token_ids == reference
            expected_blocks = 0 if stranger else len(PROMPTS[2]) // 16
            if not stranger:  # the adapter's KV, stored under the consumer's id of it: its tokens are the adapter's
                want = await pd.reference(client, PROMPTS[1], adapted)
                assert (await pd.generate(client, PROMPTS[1], adapted)).token_ids == want.token_ids
                assert want.token_ids != await pd.reference(client, PROMPTS[1])  # not the base model's
                expected_blocks += len(PROMPTS[1]) // 16
            consumer_id = pd.procs["kv_consumer"].worker_id
            got = (await loads(client, wait_until, consumer_id, expected_blocks))[consumer_id]
            assert got.kv_transfer_received_blocks == expected_blocks
            assert "go through shared memory" not in pd.procs["kv_producer"].text()  # over CURVE
        pd.cluster.teardown()
    assert "KV producer" in pd.procs["kv_consumer"].text()  # the refused handshake, logged by the consumer


async def test_consumer_killed_before_the_transfer(cluster_factory, tiny_llama, wait_until):
    """The request goes on at the kv_both worker (no consumer left), by recompute, with the same tokens."""
    pd = Disaggregated(cluster_factory, tiny_llama)
    async with pd.cluster.client() as client:
        await pd.ready(client, wait_until)
        reference = await pd.reference(client, PROMPTS[1])
        pd.procs["kv_consumer"].kill9()
        started = time.monotonic()
        assert (await pd.generate(client, PROMPTS[1])).token_ids == reference
        assert time.monotonic() - started < 60  # bounded: the timeouts above, with room for a loaded machine


async def test_a_stalled_transfer_ends_in_bounded_time(cluster_factory, tiny_llama, wait_until):
    """The consumer stops (SIGSTOP) before the transfer: the producer waits kv_transfer_timeout, hands off; the
    coordinator declares the silent consumer dead (--worker-timeout 5) and the request completes elsewhere."""
    pd = Disaggregated(cluster_factory, tiny_llama)
    async with pd.cluster.client() as client:
        await pd.ready(client, wait_until)
        reference = await pd.reference(client, PROMPTS[2])
        pd.stop("kv_consumer")
        try:
            started = time.monotonic()
            assert (await pd.generate(client, PROMPTS[2])).token_ids == reference
            assert time.monotonic() - started < 60  # bounded: the timeouts above, with room for a loaded machine
        finally:
            pd.cont("kv_consumer")


async def test_producer_killed_mid_transfer(cluster_factory, tiny_llama, wait_until):
    """The consumer stops, so the transfer waits; the producer is killed -9 meanwhile, then the consumer goes on: the
    request fails over (a new request again: to the kv_both worker), with the same tokens. Over TCP."""
    pd = Disaggregated(cluster_factory, tiny_llama, shm=False)
    async with pd.cluster.client() as client:
        await pd.ready(client, wait_until)
        reference = await pd.reference(client, PROMPTS[0])
        pd.stop("kv_consumer")
        try:
            task = asyncio.create_task(pd.generate(client, PROMPTS[0]))
            await asyncio.sleep(TIMEOUT_S / 2)  # its first token is out; its transfer waits for the consumer
            pd.procs["kv_producer"].kill9()
        finally:
            pd.cont("kv_consumer")
        assert (await asyncio.wait_for(task, 30)).token_ids == reference


async def test_consumer_killed_while_it_decodes(cluster_factory, tiny_llama, wait_until):
    pd = Disaggregated(cluster_factory, tiny_llama)
    long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    async with pd.cluster.client() as client:
        await pd.ready(client, wait_until)
        reference = (await pd.reference(client, PROMPTS[1], long)).token_ids
        tokens: list[int] = []
        consumer = pd.procs["kv_consumer"]
        async for delta in client.stream(PROMPTS[1], long, pin_rank=pd.rank["kv_producer"]):
            tokens += delta.token_ids
            if len(tokens) >= 10 and consumer.popen.poll() is None:
                consumer.kill9()
        assert tokens == reference
        assert consumer.popen.poll() is not None


def test_infer_serve_starts_a_producer_and_a_consumer_and_the_official_client_gets_equal_text(
    model_cluster, tiny_llama, tmp_path
):
    """`infer-serve --workers 2 --kv-roles kv_producer,kv_consumer` with n-gram speculation, through the official
    `openai` client (token-id prompts, streamed and not): the same text as one kv_both worker without speculation,
    and the consumer received the blocks."""
    import openai
    from serve_harness import Served

    from infer.client.inference_client import SyncInferenceClient

    plain = model_cluster(workers=1)
    with SyncInferenceClient(plain.address, connect_timeout=30) as cluster:
        reference = [cluster.generate(p, GREEDY).text for p in PROMPTS]
    served = Served(
        tiny_llama, tmp_path / "serve.log", "tiny", ["--kv-roles", "kv_producer,kv_consumer", *ENGINE_FLAGS, *NGRAM]
    )
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
        common = dict(model="tiny", max_tokens=GREEDY.max_tokens, temperature=0, extra_body={"ignore_eos": True})
        texts = [client.completions.create(prompt=p, **common).choices[0].text for p in PROMPTS]
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(prompt=PROMPTS[2], stream=True, **common)
        )
        assert texts == reference and streamed == reference[2]
        with SyncInferenceClient(served.address, connect_timeout=30) as cluster:
            received = sum(w.load.kv_transfer_received_blocks for w in cluster.stats().workers if w.load is not None)
        assert received >= sum(len(p) // 16 for p in PROMPTS)
    finally:
        served.stop()


async def test_producer_killed_before_its_first_token(cluster_factory, tiny_llama, wait_until):
    """The producer stops before it can step (SIGSTOP), gets the request, and is killed -9: an ordinary failover
    (the kv_both worker prefills it: no producer left)."""
    pd = Disaggregated(cluster_factory, tiny_llama)
    async with pd.cluster.client() as client:
        await pd.ready(client, wait_until)
        reference = await pd.reference(client, PROMPTS[0])
        pd.stop("kv_producer")
        task = asyncio.create_task(pd.generate(client, PROMPTS[0]))
        await asyncio.sleep(0.5)  # dispatched to the stopped producer
        pd.procs["kv_producer"].kill9()
        assert (await asyncio.wait_for(task, 30)).token_ids == reference


async def test_consumer_killed_mid_transfer_and_producer_killed_after_the_hand_off(
    cluster_factory, tiny_llama, wait_until
):
    """Two kill points on one cluster. The consumer, stopped so that its transfer waits, is killed -9: the transfer
    times out and the request goes on at the kv_both worker. Then a restarted consumer decodes a request whose
    producer is killed -9 after the hand-off: nothing moves, the stream ends as it would have."""
    pd = Disaggregated(cluster_factory, tiny_llama)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    async with pd.cluster.client() as client:
        await pd.ready(client, wait_until)
        reference = await pd.reference(client, PROMPTS[1])
        pd.stop("kv_consumer")
        task = asyncio.create_task(pd.generate(client, PROMPTS[1]))
        await asyncio.sleep(TIMEOUT_S / 2)  # the first token is out; the transfer waits
        pd.procs["kv_consumer"].kill9()
        assert (await asyncio.wait_for(task, 30)).token_ids == reference

        consumer = pd.cluster.worker(3, *ENGINE_FLAGS, *role("kv_consumer"), model=tiny_llama)
        pd.procs["kv_consumer"] = consumer

        async def back() -> bool:
            return any(w.worker_id == consumer.worker_id and w.healthy for w in (await client.stats()).workers)

        await wait_until(back, 120, "the new consumer")
        expected = (await pd.reference(client, PROMPTS[2], long)).token_ids
        tokens: list[int] = []
        async for delta in client.stream(PROMPTS[2], long, pin_rank=pd.rank["kv_producer"]):
            tokens += delta.token_ids
            if len(tokens) >= 5 and pd.procs["kv_producer"].popen.poll() is None:
                pd.procs["kv_producer"].kill9()
        assert tokens == expected
        got = (await loads(client, wait_until, consumer.worker_id, len(PROMPTS[2]) // 16))[consumer.worker_id]
        assert got.kv_transfer_received_blocks == len(PROMPTS[2]) // 16


async def test_ep_groups_prefill_on_a_producer_group_and_decode_on_a_consumer_group(
    cluster_factory, tmp_path, smollm2_tokenizer, wait_until
):
    """Expert parallelism: an EP group of two producers and one of two consumers on a tiny Mixtral (each rank holds
    its own requests' whole KV; the experts are what is split). Greedy tokens equal one process's; the producers
    sent blocks and the consumers received and hit them."""
    from moe_models import tiny_mixtral
    from ports import reserved_port

    from infer import LLM

    model = tiny_mixtral(tmp_path / "mixtral", tokenizer=smollm2_tokenizer)
    cluster = cluster_factory()
    cluster.coordinator()
    procs = {}
    for name in ("kv_producer", "kv_consumer"):
        group = ["--ep-size", "2", "--dist-init", f"tcp://127.0.0.1:{reserved_port()}", "--ep-timeout", "20"]
        for rank in range(2):
            procs[f"{name} {rank}"] = cluster.worker(
                len(procs), *ENGINE_FLAGS, *group, "--ep-rank", str(rank), *role(name), model=model
            )
    llm = LLM(model=str(model), dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1)
    want = [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    async with cluster.client() as client:
        await cluster.ranks(client, procs, wait_until)
        assert [c.token_ids for c in await asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS))] == want
        full_blocks = sum(len(p) // 16 for p in PROMPTS)

        async def received() -> dict[str, object] | None:
            now = await loads(client)
            counts = {pid: load.kv_transfer_received_blocks for pid, load in now.items()}
            return now if sum(counts.values()) >= full_blocks else None

        now = await wait_until(received, 20, f"the consumers to report {full_blocks} blocks received")
    by_role = {name: now[proc.worker_id] for name, proc in procs.items()}
    assert sum(by_role[f"kv_producer {r}"].kv_transfer_sent_blocks for r in range(2)) == full_blocks
    consumers = [by_role[f"kv_consumer {r}"] for r in range(2)]
    assert sum(c.kv_transfer_received_blocks for c in consumers) == full_blocks
    assert sum(c.prefix_cache_hits for c in consumers) == sum((len(p) // 16) * 16 for p in PROMPTS)
