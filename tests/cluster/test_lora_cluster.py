"""LoRA adapters on a real cluster: adapters given at start (--lora-modules) and loaded at runtime are on every
worker; streams of several adapters and the base model cut by kill -9 of the busiest worker continue on another
worker with the same adapter, each equal to transformers + PEFT; only an administrator's key loads or unloads one."""

from __future__ import annotations

import random

import pytest
from fault_streams import streams_through_a_fault
from lora_cases import make_adapters, peft_greedy

from infer import LoRARequest, SamplingParams
from infer.client import ClusterError, SyncInferenceClient
from infer.protocol.keys import ClusterKeyDir

MAX_NEW = 60
ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1")


async def test_adapters_reach_every_worker_and_a_failover_keeps_the_adapter(
    model_cluster, tiny_llama, tmp_path_factory
):
    folders = make_adapters(tiny_llama, tmp_path_factory, names=("qv", "mlp"))
    flags = (*ENGINE_FLAGS, "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"qv={folders['qv']}")
    cluster = model_cluster(workers=2, engine_flags=flags)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 49000) for _ in range(8)] for _ in range(6)]
    loras = [None, "qv", "mlp"] * 2
    async with cluster.client() as client:
        assert await client.list_loras() == {"qv": str(folders["qv"])}
        assert await client.add_lora(LoRARequest("mlp", 2, folders["mlp"])) == {
            "qv": str(folders["qv"]),
            "mlp": str(folders["mlp"]),
        }
        assert all(w.num_in_flight == 0 for w in (await client.stats()).workers)
        with pytest.raises(ClusterError, match="adapter_config.json: no such file"):
            await client.add_lora(LoRARequest("broken", 3, "/nowhere"))
        with pytest.raises(TypeError, match="add_lora takes a LoRARequest, got str"):
            await client.add_lora("broken")  # type: ignore[arg-type]
        # the names before LLM's vocabulary was the client's too: deprecated, and still working
        with pytest.warns(DeprecationWarning, match=r"load_lora_adapter\(name, path\) is deprecated.*add_lora"):
            with pytest.raises(ClusterError, match="adapter_config.json: no such file"):
                await client.load_lora_adapter("broken", "/nowhere")
        with pytest.warns(
            DeprecationWarning, match="list_lora_adapters is deprecated and will be removed; use list_loras"
        ):
            assert set(await client.list_lora_adapters()) == {"qv", "mlp"}
        unknown = await client.generate(prompts[0], SamplingParams(max_tokens=2, lora_name="nope"))
        assert unknown.finish_reason == "error" and unknown.error_code == "invalid_request"
        assert "unknown LoRA adapter 'nope'" in unknown.error

    async def kill_the_busiest(client):
        victim = max((await client.stats()).workers, key=lambda w: w.num_in_flight)
        assert victim.num_in_flight > 0
        cluster.proc_of(victim.worker_id).kill9()

    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, lora_name=lora) for lora in loras]
    streams, after = await streams_through_a_fault(cluster, prompts, params, kill_the_busiest)
    assert after.requests_redispatched > 0
    for i, (deltas, lora) in enumerate(zip(streams, loras)):
        assert deltas[-1].finish_reason == "length"
        want = peft_greedy(tiny_llama, None if lora is None else folders[lora], [prompts[i]], MAX_NEW)[0]
        assert [t for d in deltas for t in d.token_ids] == want, (i, lora)


@pytest.fixture
def keys(tmp_path) -> ClusterKeyDir:
    return ClusterKeyDir.create(tmp_path / "keys")


async def test_only_an_admin_key_loads_or_unloads_an_adapter(cluster_factory, keys, tmp_path):
    cluster = cluster_factory()
    cluster.coordinator(*keys.coordinator_flags())
    cluster.worker(0, "--max-model-len", "100000", *keys.worker_flags(), benchmark=True)
    answers = []
    async with cluster.client(**keys.client_options()) as client:
        await client.wait_for_workers(1, timeout=30)
        for path in (tmp_path, tmp_path / "missing"):
            with pytest.raises(ClusterError, match="refused: it needs a admin key, and key .* is a client key") as e:
                await client.add_lora(LoRARequest("sql", 1, path))
            answers.append(str(e.value))
        with pytest.raises(ClusterError, match="refused: it needs a admin key"):
            await client.remove_lora("sql")
        assert answers[0] == answers[1] and str(tmp_path) not in answers[0]  # nothing read, nothing learnt
        assert (await client.generate([1, 2, 3], SamplingParams(max_tokens=2))).token_ids == [3, 4]  # still serving
        async with cluster.client(**keys.admin_options()) as admin:  # an admin's reaches the workers
            with pytest.raises(ClusterError, match="not in --benchmark-mode"):
                await admin.add_lora(LoRARequest("sql", 1, tmp_path))
    with SyncInferenceClient(cluster.address, **keys.client_options()) as sync:  # the blocking face: the same verbs
        assert sync.list_loras() == {}
        with pytest.raises(ClusterError, match="refused: it needs a admin key"):
            sync.add_lora(LoRARequest("sql", 1, tmp_path))
        with pytest.raises(ClusterError, match="refused: it needs a admin key"):
            sync.remove_lora("sql")


def test_llm_in_coordinator_mode_loads_lora_requests_on_the_workers(tiny_llama, tmp_path_factory):
    from infer import LLM, LoRARequest

    folders = make_adapters(tiny_llama, tmp_path_factory, names=("qv", "mlp"))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with LLM(
        str(tiny_llama),
        use_coordinator=True,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory=8_000_000,
        num_threads=1,
        enable_lora=True,
        max_lora_rank=8,
        lora_modules={"qv": folders["qv"]},
    ) as llm:
        assert llm.list_loras() == {"qv": str(folders["qv"])}
        outs = llm.generate(
            prompts,
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
            lora_request=[LoRARequest("qv", 1, str(folders["qv"])), LoRARequest("mlp", 2, str(folders["mlp"]))],
        )  # mlp: loaded on first use
        assert llm.list_loras() == {"qv": str(folders["qv"]), "mlp": str(folders["mlp"])}
    assert [o.token_ids for o in outs] == [
        peft_greedy(tiny_llama, folders["qv"], prompts[:1], 8)[0],
        peft_greedy(tiny_llama, folders["mlp"], prompts[1:], 8)[0],
    ]
