"""Inference inside training loops, on real processes: suspend frees each worker's memory (its RSS, read from
/proc) and resume restores identical outputs; held requests survive; update_weights from a directory and from a
trainer over gloo reaches every worker (transformers' output on the new weights, the version on every delta,
no stale prefix cache), all or nothing, and eight of them in a row under load lose and mix nothing."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch
from hf_reference import transformers_greedy

from infer import SamplingParams
from infer.client.engine_client import ClusterError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 300, 41, 9, 77, 1023, 64, 12, 88, 301, 7, 450, 33, 2, 19, 600, 3], [1000, 2000, 3000], [42, 43]]
BIG_POOL = [
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--kv-cache-memory",
    str(96 << 20),
    "--threads",
    "1",
    "--max-num-seqs",
    "512",
]
ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1")


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


async def _generate(client, prompts=PROMPTS, params=GREEDY):
    return await asyncio.gather(*(client.generate(p, params) for p in prompts))


async def test_suspend_frees_worker_memory_and_resume_restores_identical_outputs(model_cluster, tiny_llama) -> None:
    cluster = model_cluster(workers=1, engine_flags=tuple(BIG_POOL))
    async with cluster.client() as client:
        before = [c.token_ids for c in await _generate(client)]
        [worker] = (await client.stats()).workers
        pid = cluster.proc_of(worker.worker_id).popen.pid
        assert await client.pause() == "paused"
        held = asyncio.ensure_future(client.generate(PROMPTS[0], GREEDY))
        rss = _rss(pid)
        assert await client.suspend() == "suspended"
        released = client.last_ack.bytes_released
        # the weights (fp32: the tied 49152 x 64 embedding alone is 12.6 MB) and the KV pool's resident pages (a CPU
        # pool is mapped as steps touch it: worker/engine/forward_batch.py zeroed_pool)
        assert released >= 12 << 20
        assert rss - _rss(pid) >= 0.9 * released  # given back to the OS
        stats = await client.stats()
        assert stats.state == "suspended" and stats.workers[0].load.suspended
        assert stats.workers[0].load.bytes_released == released and stats.num_held == 1
        await asyncio.sleep(0.5)
        assert not held.done()  # not run while suspended
        assert await client.resume() == "paused"
        assert client.last_ack.bytes_restored >= released * 0.99
        assert not (await client.stats()).workers[0].load.suspended
        assert await client.unpause() == "running"
        assert (await asyncio.wait_for(held, 60)).token_ids == before[0]
        assert [c.token_ids for c in await _generate(client)] == before


async def test_refit_from_a_directory_reaches_every_worker(model_cluster, tiny_llama, tiny_weights_b) -> None:
    weights_b = tiny_weights_b("llama")
    cluster = model_cluster(workers=2)
    async with cluster.client() as client:
        on_a = await _generate(client)
        assert [c.token_ids for c in on_a] == transformers_greedy(tiny_llama, PROMPTS, GREEDY.max_tokens)
        assert {c.weight_version for c in on_a} == {0}
        warm = await _generate(client, [PROMPTS[0]] * 4)  # cached on both workers now
        assert max(c.num_cached_tokens for c in warm) > 0
        assert await client.update_weights(weights_b) == 1
        assert (await client.generate(PROMPTS[0], GREEDY)).num_cached_tokens == 0  # recomputed, not stale
        on_b = await _generate(client, PROMPTS * 2)  # both workers get some
        assert [c.token_ids for c in on_b] == transformers_greedy(weights_b, PROMPTS, GREEDY.max_tokens) * 2
        assert {c.weight_version for c in on_b} == {1}
        stats = await client.stats()
        assert stats.weight_version == 1 and {w.load.weight_version for w in stats.workers} == {1}
        # a bad tensor: the whole update fails, naming it, and B keeps serving
        from safetensors.torch import load_file, save_file

        bad = cluster.logs / "bad"
        bad.mkdir()
        tensors = load_file(str(tiny_llama / "model.safetensors"))
        tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][
            :, :-1
        ].contiguous()
        save_file(tensors, str(bad / "model.safetensors"))
        with pytest.raises(ClusterError, match="'model.layers.1.mlp.down_proj.weight'.*shape"):
            await client.update_weights(bad)
        again = await _generate(client)
        assert [c.token_ids for c in again] == [c.token_ids for c in on_b[:3]]
        assert {c.weight_version for c in again} == {1}


async def test_refit_from_a_trainer_over_gloo(model_cluster, tiny_llama, tiny_weights_b) -> None:
    from safetensors.torch import load_file

    weights_b = tiny_weights_b("llama")
    cluster = model_cluster(workers=2)
    async with cluster.client() as client:
        trainer = load_file(str(weights_b / "model.safetensors"))  # the trainer's tensors, in its memory
        version = await client.update_weights(trainer.items(), bucket_bytes=1 << 20)
        on_b = await _generate(client, PROMPTS * 2)
        assert version == 1 and {c.weight_version for c in on_b} == {1}
        assert [c.token_ids for c in on_b] == transformers_greedy(weights_b, PROMPTS, GREEDY.max_tokens) * 2
        # a name no parameter has: refused by every worker, the old weights (B) keep serving
        bad = {**trainer, "model.layers.0.mlp.gate_prj.weight": trainer["model.layers.0.mlp.gate_proj.weight"]}
        with pytest.raises(ClusterError, match="'model.layers.0.mlp.gate_prj.weight'.*matches no parameter"):
            await client.update_weights(bad)
        assert [c.token_ids for c in await _generate(client)] == [c.token_ids for c in on_b[:3]]
        # abort mode: a long request in flight ends with the reason; the next runs on the new weights
        # (the refit is sent once the request's first token is out: a fixed sleep raced its end on a fast machine)
        stream = client.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        aborted = await anext(stream)
        refit = asyncio.ensure_future(
            client.update_weights(load_file(str(tiny_llama / "model.safetensors")), on_running="abort")
        )
        async for aborted in stream:
            pass
        assert await refit == 2
        assert aborted.finish_reason == "abort" and "update_weights" in aborted.error
        on_a = await _generate(client)
        assert [c.token_ids for c in on_a] == transformers_greedy(tiny_llama, PROMPTS, GREEDY.max_tokens)
        assert {c.weight_version for c in on_a} == {2}
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            await client.update_weights([("model.norm.weight", torch.zeros(64, dtype=torch.int64))])


async def _all_at(client, count: int, version: int, timeout: float = 60.0) -> None:
    """Until `count` workers report `version` (a restarted one is brought to it before it serves)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        workers = [w for w in (await client.stats()).workers if w.healthy and w.load is not None]
        if sum(w.load.weight_version == version for w in workers) >= count:
            return
        assert asyncio.get_running_loop().time() < deadline, f"workers not at version {version}: {workers}"
        await asyncio.sleep(0.2)


async def test_a_worker_killed_mid_refit_never_leaves_mixed_versions_serving(
    model_cluster, tiny_llama, tiny_weights_b
) -> None:
    """kill -9 of one worker mid-refit (it has the UpdateWeights, it has not answered: SIGSTOP first): the
    refit fails everywhere and the other worker, prepared, drops what it staged. A worker killed after a refit
    is committed comes back at version 0 and gets no request until it is brought to the cluster's version.
    Every output comes from the cluster's version, token for token."""
    weights_b = tiny_weights_b("llama")
    expected = {
        0: transformers_greedy(tiny_llama, PROMPTS, GREEDY.max_tokens),
        1: transformers_greedy(weights_b, PROMPTS, GREEDY.max_tokens),
    }
    cluster = model_cluster(workers=2)
    async with cluster.client() as client:
        victim = cluster.proc_of((await client.stats()).workers[1].worker_id)
        os.kill(victim.popen.pid, signal.SIGSTOP)
        refit = asyncio.ensure_future(client.update_weights(weights_b))
        await asyncio.sleep(1.0)  # the other worker is prepared, waiting for the commit
        victim.kill9()
        with pytest.raises(ClusterError, match="died before it answered.*no worker changed its weights"):
            await refit
        assert (await client.stats()).weight_version == 0
        cluster.worker(1, *ENGINE_FLAGS, model=tiny_llama)  # back at version 0, as the other
        await client.wait_for_workers(2, timeout=120)
        outs = await _generate(client, PROMPTS * 3)
        assert {c.weight_version for c in outs} == {0} and [c.token_ids for c in outs] == expected[0] * 3
        assert await client.update_weights(weights_b) == 1  # the same refit now reaches both
        # after a committed refit, a worker killed and restarted (version 0) is brought to it before it serves
        victim = (await client.stats()).workers[0]
        cluster.proc_of(victim.worker_id).kill9()
        cluster.worker(0, *ENGINE_FLAGS, model=tiny_llama)
        for _ in range(10):  # requests while it joins go only to the other one
            outs = await _generate(client)
            assert {c.weight_version for c in outs} == {1} and [c.token_ids for c in outs] == expected[1]
        await _all_at(client, 2, 1)
        outs = await _generate(client, PROMPTS * 3)
        assert {c.weight_version for c in outs} == {1} and [c.token_ids for c in outs] == expected[1] * 3
        assert "cannot be brought" not in cluster.procs[0].text()


async def test_a_soak_of_refits_under_load_loses_nothing_and_mixes_no_versions(
    model_cluster, tiny_llama, tiny_weights_b, wait_until
) -> None:
    """Eight refits from directories, alternating weights B and A, while four streams of requests keep both workers
    busy: every request completes (none failed, none lost), each with exactly the tokens of the version it reports
    (A for even versions, B for odd), requests ran on most versions, and every worker ends at the last one."""
    weights_b = tiny_weights_b("llama")
    expected = {
        0: transformers_greedy(tiny_llama, PROMPTS, GREEDY.max_tokens),
        1: transformers_greedy(weights_b, PROMPTS, GREEDY.max_tokens),
    }
    cluster = model_cluster(workers=2)
    stop = asyncio.Event()
    done: list[tuple[int, object]] = []

    async def keep_busy(client, first: int) -> None:
        i = first
        while not stop.is_set():
            done.append((i % len(PROMPTS), await client.generate(PROMPTS[i % len(PROMPTS)], GREEDY)))
            i += 1

    async with cluster.client() as client:
        before = await client.stats()
        load = [asyncio.create_task(keep_busy(client, k)) for k in range(4)]
        for version in range(1, 9):
            assert await client.update_weights(weights_b if version % 2 else tiny_llama) == version
            await asyncio.sleep(0.3)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*load), 60)

        async def all_counted() -> bool:
            # a direct stream's last delta reaches its client from the worker, its end the coordinator in the
            # worker's StepBatch of the same step: the two sockets race by a few milliseconds
            stats = await client.stats()
            return stats.requests_completed - before.requests_completed >= len(done)

        await wait_until(all_counted, 10, "the coordinator to count every completion")
        after = await client.stats()
    assert after.weight_version == 8 and [w.load.weight_version for w in after.workers] == [8, 8]
    assert all(c.finish_reason == "length" and c.error is None for _, c in done)
    assert all(c.token_ids == expected[c.weight_version % 2][i] for i, c in done)
    assert len({c.weight_version for _, c in done}) >= 6
    assert after.requests_failed == before.requests_failed
    assert after.requests_completed - before.requests_completed == len(done)
