"""TP groups on a real cluster (gloo on CPU, fp32): `infer-worker --coordinator ADDR --tp-size 2` starts and
supervises a DP rank of two processes. Greedy output equals one process and transformers on tiny random
Llama, Qwen3 with one KV head (replicated on both ranks, 6 query heads: 3 per rank) and Qwen3-MoE, with prompts of
varied lengths in one batch, chunked prefill (a small token budget) and prefix-cache hits; TP=2 x EP=2 on a
tiny Mixtral (four processes) equals transformers. kill -9 or SIGSTOP of a follower mid-stream: its DP rank
leaves routing, every stream completes on the other rank with the reference tokens, and nothing of the
struck group is left running. A member started with other model files, or another TP size, is refused with
both sides named, before any request."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from family_cluster import start_tp2_x_ep2
from fault_streams import assert_exact_streams, streams_through_a_fault
from group_procs import children, prompts, ready, reserved_port, state, twice_in_one_batch
from hf_reference import transformers_greedy
from moe_models import save_tiny_model, tiny_mixtral, tiny_qwen3_moe

from infer import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1")

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
TP_FLAGS = ("--tp-size", "2", "--tp-timeout", "5", "--max-num-batched-tokens", "32")


PROMPTS = prompts(4, 0)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
FAULT_PROMPTS = prompts(4, 1)


def _qwen3_one_kv_head(path: Path, tokenizer) -> Path:
    fields = dict(
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=16,
        rope_theta=1e6,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return save_tiny_model("qwen3", fields, path, tokenizer, seed=1234)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model_dir, smollm2_tokenizer):
    root = tmp_path_factory.mktemp("tp-models")
    return {
        "llama": lambda: tiny_model_dir("llama"),
        "qwen3-1kv": lambda: _qwen3_one_kv_head(root / "qwen3-1kv", smollm2_tokenizer),
        "qwen3-moe": lambda: tiny_qwen3_moe(root / "qwen3moe", tokenizer=smollm2_tokenizer),
        "mixtral": lambda: tiny_mixtral(root / "mixtral", tokenizer=smollm2_tokenizer),
    }


def _one_process(model: Path, prompts: list, params: SamplingParams) -> list[list[int]]:
    llm = LLM(model=str(model), dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1)
    return [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]


# Each member forked from its supervisor (named infer-tp0 / infer-tp1), or with INFER_FORK_MEMBERS=0 started as a
# process of its own (its own command line): worker/parallel/tp_supervisor.py.
@pytest.mark.parametrize("arch, fork", [("llama", True), ("qwen3-1kv", False), ("qwen3-moe", True)])
async def test_tp2_equals_one_process_and_transformers(cluster_factory, models, arch, fork, monkeypatch):
    if not fork:
        monkeypatch.setenv("INFER_FORK_MEMBERS", "0")
    model = models[arch]()
    want = transformers_greedy(model, PROMPTS, MAX_NEW)
    assert _one_process(model, PROMPTS, GREEDY) == want
    cluster = cluster_factory()
    cluster.coordinator()
    cluster.worker(0, *ENGINE_FLAGS, *TP_FLAGS, model=model)
    ready(cluster, 1)
    first, second = await twice_in_one_batch(cluster, PROMPTS, GREEDY)
    assert first == want and second == want
    log = cluster.procs[1].text()
    assert "TP rank 1 ready" in log and "KV head(s)" in log
    supervisor = cluster.procs[1].popen.pid
    members = sorted(children(supervisor))
    # a forked worker's command line is one string (client/worker_forks.py writes it as setproctitle does)
    argv = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split() for pid in [supervisor, *members]]
    if fork:
        assert [Path(f"/proc/{pid}/comm").read_text().strip() for pid in members] == ["infer-tp0", "infer-tp1"]
        assert argv[0] == argv[1] == argv[2] and "(infer-tp1)" in log
    else:
        assert [a[a.index(b"--tp-rank") + 1] for a in argv[1:]] == [b"0", b"1"] and b"--tp-rank" not in argv[0]


async def test_tp2_x_ep2_on_an_moe_model_equals_transformers(cluster_factory, models):
    model = models["mixtral"]()
    want = transformers_greedy(model, PROMPTS, MAX_NEW)
    cluster = cluster_factory()
    start_tp2_x_ep2(cluster, model, ENGINE_FLAGS)
    async with cluster.client() as client:
        pinned = await asyncio.gather(*(client.generate(p, GREEDY, pin_rank=0) for p in PROMPTS))
        assert [c.token_ids for c in pinned] == want  # EP rank 1's TP group idle: dummy steps
        split = await asyncio.gather(*(client.generate(p, GREEDY, pin_rank=i % 2) for i, p in enumerate(PROMPTS)))
        assert [c.token_ids for c in split] == want
        stats = await client.stats()
    assert len({w.group_id for w in stats.workers}) == 1 and len(stats.workers) == 2


def _follower(proc) -> int:
    """The pid of TP rank 1 under a supervising infer-worker (the second process it started)."""
    members = children(proc.popen.pid)
    assert len(members) == 2, members
    return sorted(members)[1]


@pytest.fixture(scope="module")
def fault_reference(models) -> list[list[int]]:
    """One process's greedy tokens of FAULT_PROMPTS on the tiny Llama, made once for both faults."""
    return _one_process(models["llama"](), FAULT_PROMPTS, LONG)


@pytest.mark.parametrize("fault", ["kill -9", "SIGSTOP"])
async def test_a_struck_tp_member_takes_its_dp_rank_out(cluster_factory, models, fault_reference, wait_until, fault):
    model = models["llama"]()
    want = fault_reference
    cluster = cluster_factory()
    cluster.coordinator()
    groups = [cluster.worker(g, *ENGINE_FLAGS, *TP_FLAGS, model=model) for g in range(2)]
    ready(cluster, 2)
    struck: dict[str, object] = {}

    async def strike_the_busiest_group(client):
        by_id = {w.worker_id: w for w in (await client.stats()).workers}
        busiest = max(by_id.values(), key=lambda w: w.num_in_flight)
        supervisor = cluster.proc_of(busiest.worker_id)
        struck["group"], struck["members"] = supervisor, children(supervisor.popen.pid)
        os.kill(_follower(supervisor), signal.SIGKILL if fault == "kill -9" else signal.SIGSTOP)

        async def out_of_routing():
            return not next(w for w in (await client.stats()).workers if w.worker_id == busiest.worker_id).healthy

        await wait_until(out_of_routing, 20, "the struck DP rank out of routing")

    streams, stats = await streams_through_a_fault(
        cluster,
        FAULT_PROMPTS,
        [LONG] * len(FAULT_PROMPTS),
        strike_the_busiest_group,
        start_timeout=120,
        finish_timeout=180,
    )
    assert_exact_streams(streams, want)
    assert stats.requests_redispatched > 0
    supervisor = struck["group"]
    assert supervisor.wait(timeout=30) != 0
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and state(pid) != "Z" for pid in struck["members"]):
        assert time.monotonic() < deadline, f"left running: {struck['members']}"
        await asyncio.sleep(0.1)
    other = next(g for g in groups if g is not supervisor)
    assert other.popen.poll() is None


def _group_member_by_member(cluster_factory, models):
    """A coordinator and one TP-2 group whose members start as separate processes with --tp-rank (as the Slurm
    launcher's tasks start them), ready: (cluster, leader, follower)."""
    cluster = cluster_factory()
    cluster.coordinator()
    flags = (*ENGINE_FLAGS, "--tp-size", "2", "--tp-timeout", "60", "--dist-init", f"tcp://127.0.0.1:{reserved_port()}")
    model = models["llama"]()
    leader = cluster.worker(0, *flags, "--tp-rank", "0", model=model)
    follower = cluster.worker(1, *flags, "--tp-rank", "1", model=model)
    ready(cluster, 1)
    return cluster, leader, follower


@pytest.mark.parametrize("struck", ["follower", "leader"])
def test_an_idle_group_started_member_by_member_ends_whole_when_one_is_killed(cluster_factory, models, struck):
    """The members of a group started one by one with --tp-rank (as the Slurm launcher's tasks start them, each
    under its own restart loop): kill -9 of one while the group is idle makes the other exit non-zero within a
    few seconds (its connection closed; --tp-timeout is a minute), so every member is restarted and the group
    meets again. A group told to stop (SIGTERM: rank 0 drains) ends with every member at exit 0."""
    cluster, leader, follower = _group_member_by_member(cluster_factory, models)
    victim, survivor = (follower, leader) if struck == "follower" else (leader, follower)
    victim.kill9()
    killed_at = time.monotonic()
    code = survivor.wait(timeout=30)
    assert code != 0 and time.monotonic() - killed_at < 40, (code, survivor.text()[-2000:])  # not --tp-timeout's minute
    assert "connection closed" in survivor.text(), survivor.text()[-2000:]
    if struck == "follower":
        assert "giving back" in leader.text()


def test_a_group_told_to_stop_ends_with_every_member_at_exit_0(cluster_factory, models):
    cluster, leader, follower = _group_member_by_member(cluster_factory, models)
    leader.popen.send_signal(signal.SIGTERM)
    assert leader.wait(timeout=30) == 0 and follower.wait(timeout=30) == 0, cluster.dump()


def test_a_member_with_other_model_files_is_refused(cluster_factory, models, tiny_model_dir):
    cluster = cluster_factory()
    cluster.coordinator()
    dist_init = f"tcp://127.0.0.1:{reserved_port()}"
    flags = (*ENGINE_FLAGS, "--tp-size", "2", "--tp-timeout", "20", "--dist-init", dist_init)
    leader = cluster.worker(0, *flags, "--tp-rank", "0", model=models["llama"]())
    other = cluster.worker(1, *flags, "--tp-rank", "1", model=tiny_model_dir("qwen3"))
    assert leader.wait(timeout=120) == 2 and other.wait(timeout=60) == 2
    for proc in (leader, other):
        text = proc.text()
        assert "model files" in text and "pid" in text and "this process" in text, text
    assert "worker joined" not in cluster.procs[0].text()


def test_a_member_with_another_tp_size_is_refused(cluster_factory, models):
    cluster = cluster_factory()
    dist_init = f"tcp://127.0.0.1:{reserved_port()}"
    model = models["llama"]()
    leader = cluster.worker(
        0, *ENGINE_FLAGS, "--tp-size", "2", "--tp-rank", "0", "--tp-timeout", "8", "--dist-init", dist_init, model=model
    )
    other = cluster.worker(
        1, *ENGINE_FLAGS, "--tp-size", "3", "--tp-rank", "1", "--tp-timeout", "8", "--dist-init", dist_init, model=model
    )
    assert other.wait(timeout=60) == 2
    assert "--tp-size x --ep-size = 3x1" in other.text() and "global rank 0" in other.text() and "2x1" in other.text()
    assert leader.wait(timeout=60) != 0
