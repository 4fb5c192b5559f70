"""Pipelines on a real cluster (gloo on CPU, fp32): `infer-worker --coordinator ADDR --pp-size P` starts and
supervises a DP rank of P stage processes. Greedy output equals transformers on tiny random Llamas at PP 2 (tied
head) and PP 3 with an uneven partition, with prompts of varied lengths in one batch, chunked prefill (a small
token budget) and prefix-cache hits. kill -9 of a stage mid-stream: its DP rank leaves routing, every stream
completes on the other rank with the reference tokens, and nothing of the struck rank is left running; the same
for a stage that hangs (SIGSTOP: --pp-timeout); `infer-serve --pp-size 2` restarts a struck rank whole. Stages
started one by one with --pp-rank end whole when one is killed while idle; a stage started with another partition
is refused with both sides named."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from fault_streams import assert_exact_streams, streams_through_a_fault
from group_procs import children, launched, members_named, prompts, ready, reserved_port, state, twice_in_one_batch
from hf_reference import transformers_greedy
from moe_models import save_tiny_model, tiny_mixtral

from infer import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1")
PP_TIMEOUT_S = 5
PP_FLAGS = ("--pp-timeout", str(PP_TIMEOUT_S), "--max-num-batched-tokens", "32")
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


PROMPTS = prompts(4, 0)
FAULT_PROMPTS = prompts(4, 1)


def _one_process(model: Path, prompts: list, params: SamplingParams) -> list[list[int]]:
    llm = LLM(model=str(model), dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1)
    return [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory, smollm2_tokenizer):
    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        vocab_size=len(smollm2_tokenizer),
        bos_token_id=smollm2_tokenizer.bos_token_id,
        eos_token_id=smollm2_tokenizer.eos_token_id,
    )
    return save_tiny_model("llama", fields, tmp_path_factory.mktemp("pp-llama5"), smollm2_tokenizer, seed=7)


@pytest.mark.parametrize("layout", ["pp2", "pp3-uneven"])
async def test_a_pipeline_equals_transformers(cluster_factory, tiny_model_dir, five_layers, layout):
    if layout == "pp2":
        model, flags = tiny_model_dir("llama"), ("--pp-size", "2")
    else:
        model, flags = five_layers, ("--pipeline-parallel-size", "3", "--pp-layer-partition", "1,3,1")
    want = transformers_greedy(model, PROMPTS, MAX_NEW)
    cluster = cluster_factory()
    cluster.coordinator()
    cluster.worker(0, *ENGINE_FLAGS, *PP_FLAGS, *flags, model=model)
    ready(cluster, 1)
    first, second = await twice_in_one_batch(cluster, PROMPTS, GREEDY)
    assert first == want and second == want
    log = cluster.procs[1].text()
    assert "PP stage 1 ready" in log and ("layers 1..3" in log if layout != "pp2" else "layers 1..1" in log)


async def test_pp2_x_tp2_equals_transformers(cluster_factory, tiny_model_dir):
    """`infer-worker --pp-size 2 --tp-size 2`: one DP rank of four processes, each stage a TP group."""
    model = tiny_model_dir("llama")
    want = transformers_greedy(model, PROMPTS, MAX_NEW)
    cluster = cluster_factory()
    cluster.coordinator()
    cluster.worker(0, *ENGINE_FLAGS, *PP_FLAGS, "--pp-size", "2", "--tp-size", "2", "--tp-timeout", "5", model=model)
    ready(cluster, 1)
    first, second = await twice_in_one_batch(cluster, PROMPTS, GREEDY)
    assert first == want and second == want
    log = cluster.procs[1].text()
    assert all(f"PP stage {s} TP rank {t} ready" in log for s, t in ((0, 1), (1, 0), (1, 1))), log[-3000:]


async def test_pp2_with_ep2_on_an_moe_model_equals_transformers(cluster_factory, tmp_path, smollm2_tokenizer):
    """Two DP ranks of an EP group, each a pipeline of two stages (four processes): stage s's MoE layers exchange
    tokens with the other rank's stage s. All requests on one rank (the other steps dummies through its stages),
    then split over both."""
    model = tiny_mixtral(tmp_path / "mixtral", tokenizer=smollm2_tokenizer)
    want = transformers_greedy(model, PROMPTS, MAX_NEW)
    cluster = cluster_factory()
    cluster.coordinator()
    dist_init = f"tcp://127.0.0.1:{reserved_port()}"
    for ep_rank in range(2):
        cluster.worker(
            ep_rank,
            *ENGINE_FLAGS,
            *PP_FLAGS,
            "--pp-size",
            "2",
            "--ep-size",
            "2",
            "--ep-rank",
            str(ep_rank),
            "--dist-init",
            dist_init,
            "--ep-timeout",
            "20",
            model=model,
        )
    ready(cluster, 2)
    async with cluster.client() as client:
        pinned = await asyncio.gather(*(client.generate(p, GREEDY, pin_rank=0) for p in PROMPTS))
        assert [c.token_ids for c in pinned] == want
        split = await asyncio.gather(*(client.generate(p, GREEDY, pin_rank=i % 2) for i, p in enumerate(PROMPTS)))
        assert [c.token_ids for c in split] == want
        stats = await client.stats()
    assert len({w.group_id for w in stats.workers}) == 1 and len(stats.workers) == 2


def _stages(proc) -> list[int]:
    """The pids of the stages under a supervising infer-worker, stage 0 first."""
    return sorted(children(proc.popen.pid))


@pytest.fixture(scope="module")
def fault_reference(five_layers) -> list[list[int]]:
    """One process's greedy tokens of FAULT_PROMPTS on the five-layer Llama, made once for both faults."""
    return _one_process(five_layers, FAULT_PROMPTS, LONG)


@pytest.mark.parametrize("fault", ["kill -9", "SIGSTOP"])
async def test_a_struck_stage_takes_its_dp_rank_out(cluster_factory, five_layers, fault_reference, wait_until, fault):
    """PP 3 under load, the middle stage struck: every stream exact on the other rank; after kill -9 the rank is out
    of routing within --pp-timeout (its connections close at once), and the other two stages exit on their own
    (code 1: stage 0 gives its requests back, stage 2 hears stop or loses its peers), none killed by the
    supervisor, no traceback; a hung stage (SIGSTOP) is found by the timeout and killed by the supervisor."""
    want = fault_reference
    cluster = cluster_factory()
    cluster.coordinator()
    ranks = [cluster.worker(g, *ENGINE_FLAGS, *PP_FLAGS, "--pp-size", "3", model=five_layers) for g in range(2)]
    ready(cluster, 2)
    struck: dict[str, object] = {}

    async def strike_the_busiest_rank(client):
        by_id = {w.worker_id: w for w in (await client.stats()).workers}
        busiest = max(by_id.values(), key=lambda w: w.num_in_flight)
        supervisor = cluster.proc_of(busiest.worker_id)
        struck["rank"], struck["stages"] = supervisor, _stages(supervisor)
        assert len(struck["stages"]) == 3
        os.kill(struck["stages"][1], signal.SIGKILL if fault == "kill -9" else signal.SIGSTOP)  # the middle stage
        struck_at = time.monotonic()

        async def out_of_routing():
            return not next(w for w in (await client.stats()).workers if w.worker_id == busiest.worker_id).healthy

        await wait_until(out_of_routing, 20, "the struck DP rank out of routing")
        struck["out after"] = time.monotonic() - struck_at

    streams, stats = await streams_through_a_fault(
        cluster,
        FAULT_PROMPTS,
        [LONG] * len(FAULT_PROMPTS),
        strike_the_busiest_rank,
        start_timeout=120,
        finish_timeout=180,
    )
    assert_exact_streams(streams, want)
    assert stats.requests_redispatched > 0
    supervisor = struck["rank"]
    assert supervisor.wait(timeout=30) != 0
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and state(pid) != "Z" for pid in struck["stages"]):
        assert time.monotonic() < deadline, f"left running: {struck['stages']}"
        await asyncio.sleep(0.1)
    other = next(r for r in ranks if r is not supervisor)
    assert other.popen.poll() is None
    log = supervisor.text()
    if fault == "kill -9":
        assert struck["out after"] < PP_TIMEOUT_S, struck
        assert "PP stage 1 (pid" in log and "ended with signal 9" in log, log[-3000:]
        for stage in (0, 2):
            assert f"PP stage {stage} (pid {struck['stages'][stage]}) ended with code 1" in log, log[-3000:]
        assert "did not exit with its group" not in log and "Traceback" not in log, log[-3000:]
    else:
        assert "PP stage 1 (pid" in log and "did not exit with its group; killing it" in log, log[-3000:]


@pytest.mark.parametrize("struck", ["stage 1", "stage 0"])
def test_idle_stages_started_one_by_one_end_whole_when_one_is_killed(cluster_factory, tiny_model_dir, struck):
    """Stages started one by one with --pp-rank (as the Slurm launcher's tasks start them): kill -9 of one while
    the rank is idle makes the other exit non-zero within a few seconds (its connection closed; --pp-timeout is a
    minute), so a restarting launcher restarts the whole rank."""
    cluster = cluster_factory()
    cluster.coordinator()
    flags = (*ENGINE_FLAGS, "--pp-size", "2", "--pp-timeout", "60", "--dist-init", f"tcp://127.0.0.1:{reserved_port()}")
    model = tiny_model_dir("llama")
    first = cluster.worker(0, *flags, "--pp-rank", "0", model=model)
    second = cluster.worker(1, *flags, "--pp-rank", "1", model=model)
    ready(cluster, 1)
    victim, survivor = (second, first) if struck == "stage 1" else (first, second)
    victim.kill9()
    killed_at = time.monotonic()
    code = survivor.wait(timeout=30)
    # well inside --pp-timeout (60 s): the survivor saw the connection close, it did not wait the timeout out
    assert code != 0 and time.monotonic() - killed_at < 30, (code, survivor.text()[-2000:])
    assert "connection closed" in survivor.text(), survivor.text()[-2000:]
    if struck == "stage 1":
        assert "PP stage 1's connection closed" in first.text() and "giving back" in first.text()


def test_a_stage_with_another_partition_is_refused(cluster_factory, five_layers):
    cluster = cluster_factory()
    dist_init = f"tcp://127.0.0.1:{reserved_port()}"
    first = cluster.worker(
        0,
        *ENGINE_FLAGS,
        "--pp-size",
        "2",
        "--pp-rank",
        "0",
        "--pp-timeout",
        "8",
        "--dist-init",
        dist_init,
        model=five_layers,
    )
    other = cluster.worker(
        1,
        *ENGINE_FLAGS,
        "--pp-size",
        "2",
        "--pp-rank",
        "1",
        "--pp-timeout",
        "8",
        "--pp-layer-partition",
        "1,4",
        "--dist-init",
        dist_init,
        model=five_layers,
    )
    assert other.wait(timeout=60) == 2
    text = other.text()
    assert "layers 1,4" in text and "global rank 0 of the group" in text and "layers 3,2" in text, text
    assert first.wait(timeout=60) == 2 and "but global rank 1 of the group" in first.text(), first.text()


class _Clients:
    """What streams_through_a_fault needs of a cluster: its clients."""

    def __init__(self, address: str) -> None:
        self.address = address

    def client(self):
        from infer.client import InferenceClient

        return InferenceClient(self.address, connect_timeout=30)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


async def test_infer_serve_restarts_a_pipeline_whole_after_kill_9_of_a_stage(tiny_model_dir, tmp_path):
    """`infer-serve --workers 2 --pp-size 2`: kill -9 of one rank's stage 1 mid-stream. The rank's streams end
    exactly on the other rank, infer-serve restarts the whole rank (its stage 0 exits non-zero), and both DP ranks
    are healthy again."""
    from serve_harness import Served

    from infer.client import InferenceClient

    served = Served(
        tiny_model_dir("llama"),
        tmp_path / "serve.log",
        "tiny",
        ["--threads", "1", "--pp-size", "2", "--dtype", "float32"],
    )
    try:
        async with InferenceClient(served.address) as client:
            reference = [c.token_ids for c in await asyncio.gather(*(client.generate(p, LONG) for p in PROMPTS))]
        ranks = [pid for pid in launched(served.proc.pid) if "infer.worker.service.daemon" in _cmdline(pid)]
        stage1 = [pid for rank in ranks for pid in members_named(rank, "infer-pp1")]
        assert len(ranks) == 2 and len(stage1) == 2, (ranks, stage1)
        killed_at = 0.0

        async def kill(_client):
            nonlocal killed_at
            os.kill(stage1[0], signal.SIGKILL)
            killed_at = time.monotonic()

        streams, _ = await streams_through_a_fault(_Clients(served.address), PROMPTS, LONG, kill, finish_timeout=120)
        assert_exact_streams(streams, reference)
        async with InferenceClient(served.address, connect_timeout=30) as client:
            stats = await client.wait_for_workers(2, 60 - (time.monotonic() - killed_at))
        assert stats.num_healthy_workers == 2, stats
        assert "restarting it in" in served.log.read_text()
        now = [
            pid
            for rank in launched(served.proc.pid)
            if "infer.worker.service.daemon" in _cmdline(rank)
            for pid in children(rank)
        ]
        assert stage1[0] not in now and len(now) == 4, now
    finally:
        served.stop()
