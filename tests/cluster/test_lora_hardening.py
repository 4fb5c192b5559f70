"""Hostile and careless LoRA adapters on a real cluster (issue 43): infer-coordinator, an infer-worker with
--enable-lora and an infer-api front as processes, an administrator's InferenceClient beside the front.

- A finite lora_alpha of 1e308 (or a huge rsLoRA alpha) is refused at load, naming the scaled update (it loaded,
  and its requests returned token 0 with flat logprobs); a module of rank 0 is refused in words (it was
  "ZeroDivisionError: float division by zero").
- No adapter takes the base model's name (the cluster's model id): an admin client could load one, and
  /v1/models then listed the id twice with the adapter out of reach.
- An adapter unloaded behind the front's back (by the admin client) is a 404 over HTTP, as the README says (the
  front's stale list made it a 400).
- An embeddings batch of more inputs than the front's --max-concurrent-requests is a 400 naming the limit (it was
  a retryable 503 that could never pass).
- Load / unload cycles on an idle worker leave its RSS flat (each one kept the adapter's weights until a forward
  step that never came: 7.5 MiB a cycle). The 1,000-cycle version is tests/soak/lora_cycles.py.

The worker serves the tiny Llama by a relative --model, so that its model id is a valid adapter name.
"""

from __future__ import annotations

import asyncio
import json
import re
import selectors
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from lora_cases import load_unload_cycles, make_adapter
from soak.harness import read_memory_kb

from infer import LoRARequest, SamplingParams
from infer.client import ClusterError
from infer.client.inference_client import SyncInferenceClient
from tests.cluster.conftest import Cluster, Proc

ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1")
FRONT_LIMIT = 4  # the front's --max-concurrent-requests
BIG_RANK = 256  # the RSS test's adapter: about 2 MiB of fp32 weights on the tiny Llama


def _copy(src: Path, dst: Path, **config) -> Path:
    dst.mkdir()
    settings = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**settings, **config}))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("lora-hardening")
    make_adapter(tiny_llama, root / "qv", 7, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    make_adapter(
        tiny_llama,
        root / "big",
        9,
        r=BIG_RANK,
        lora_alpha=BIG_RANK,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    rank0 = _copy(root / "qv", root / "rank0")
    tensors = load_file(str(rank0 / "adapter_model.safetensors"))
    save_file(
        {k: t[:0] if "lora_A" in k else t[:, :0] for k, t in tensors.items()}, rank0 / "adapter_model.safetensors"
    )
    return {
        "qv": root / "qv",
        "big": root / "big",
        "alpha": _copy(root / "qv", root / "alpha", lora_alpha=1e308),
        "rs-alpha": _copy(root / "qv", root / "rs-alpha", lora_alpha=1e12, use_rslora=True),
        "rank0": rank0,
    }


class Front:
    """infer-api as a process of the cluster (torn down with it): its URL read from the line it prints once serving."""

    def __init__(self, cluster: Cluster, model: Path, *flags: str) -> None:
        argv = ["-m", "infer.client.api.server", "--coordinator", cluster.address, "--model", str(model), "--port", "0"]
        log = cluster.logs / "front.log"
        with open(log, "wb") as err:
            popen = subprocess.Popen(
                [sys.executable, *argv, *flags], stdout=subprocess.PIPE, stderr=err, start_new_session=True
            )
        cluster.procs.append(Proc("front", popen, log))
        with selectors.DefaultSelector() as selector:
            selector.register(popen.stdout, selectors.EVENT_READ)
            line = popen.stdout.readline().decode() if selector.select(120) else ""
        match = re.search(r"on (http://\S+?),", line)
        assert match, f"{line!r}\n{log.read_text()}"
        self.url = match.group(1)

    def call(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama):
    """(cluster, front, model id): a coordinator, one LoRA worker on the tiny Llama (a relative --model: the id is
    the folder's name) and an infer-api front with --max-concurrent-requests FRONT_LIMIT."""
    cluster = Cluster(logs=tmp_path_factory.mktemp("lora-hardening-logs"))
    try:
        cluster.coordinator()
        cluster.worker(
            0,
            *ENGINE_FLAGS,
            "--enable-lora",
            "--max-lora-rank",
            str(BIG_RANK),
            "--max-loras",
            "2",
            model=tiny_llama.name,
            cwd=tiny_llama.parent,
        )
        with SyncInferenceClient(cluster.address, connect_timeout=30) as client:
            client.wait_for_workers(1, timeout=120)  # the front takes its model name from the cluster's
        front = Front(cluster, tiny_llama, "--max-concurrent-requests", str(FRONT_LIMIT), "--log-level", "WARNING")
        yield cluster, front, tiny_llama.name
    except BaseException:
        print(cluster.dump())
        raise
    finally:
        cluster.teardown()


async def _ready(cluster):
    client = cluster.client()
    await client.connect()
    await client.wait_for_workers(1, timeout=120)
    return client


async def test_a_huge_alpha_and_a_rank_of_zero_are_refused_in_words(served, adapters):
    cluster, _, _ = served
    client = await _ready(cluster)
    try:
        with pytest.raises(ClusterError, match=r"scale 2\.5e\+307.* can reach .* above 65504"):
            await client.add_lora(LoRARequest("alpha", 1, adapters["alpha"]))
        with pytest.raises(ClusterError, match=r"scale 5e\+11: .*use_rslora\) can reach"):
            await client.add_lora(LoRARequest("rs-alpha", 1, adapters["rs-alpha"]))
        with pytest.raises(ClusterError, match=r"rank \(r\) must be >= 1, got lora_A \(0, 64\)") as refused:
            await client.add_lora(LoRARequest("rank0", 1, adapters["rank0"]))
        assert "ZeroDivisionError" not in str(refused.value)
        assert await client.list_loras() == {}
        done = await client.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert done.finish_reason == "length"  # still serving
    finally:
        await client.close()


async def test_no_adapter_takes_the_base_models_name(served, adapters):
    cluster, front, model_id = served
    client = await _ready(cluster)
    try:
        with pytest.raises(ClusterError, match="the name is the base model's"):
            await client.add_lora(LoRARequest(model_id, 1, adapters["qv"]))
        status, models = await asyncio.to_thread(front.call, "/v1/models")
        assert status == 200 and [card["id"] for card in models["data"]] == [model_id]
    finally:
        await client.close()


async def test_an_adapter_unloaded_behind_the_fronts_back_is_a_404(served, adapters):
    cluster, front, _ = served
    client = await _ready(cluster)
    body = {"model": "qv", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    try:
        await client.add_lora(LoRARequest("qv", 1, adapters["qv"]))
        status, answer = await asyncio.to_thread(front.call, "/v1/completions", body)
        assert status == 200, answer  # the front now lists "qv"
        await client.remove_lora("qv")  # the admin client, not this front
        status, answer = await asyncio.to_thread(front.call, "/v1/completions", body)
        assert status == 404 and answer["error"]["code"] == "model_not_found", answer
        assert "'qv' does not exist" in answer["error"]["message"]
    finally:
        await client.close()


def test_an_embeddings_batch_the_front_can_never_admit_is_a_400_naming_the_limit(served):
    _, front, model_id = served
    inputs = [[5, 6, 7 + i] for i in range(FRONT_LIMIT + 1)]
    status, answer = front.call("/v1/embeddings", {"model": model_id, "input": inputs})
    assert status == 400, answer
    error = answer["error"]
    assert error["code"] == "too_many_engine_requests" and error["param"] == "input"
    assert f"--max-concurrent-requests {FRONT_LIMIT}" in error["message"] and "5 engine requests" in error["message"]
    status, answer = front.call("/v1/embeddings", {"model": model_id, "input": inputs[:FRONT_LIMIT]})
    assert status == 200 and len(answer["data"]) == FRONT_LIMIT


CYCLES = 40
WARMUP = 5


async def test_load_unload_cycles_leave_an_idle_workers_rss_flat(served, adapters):
    """CYCLES load + unload cycles of an adapter of about 2 MiB with no request between them: the worker's RSS
    after them is within a few adapters' size of where it was after WARMUP cycles (before, every cycle kept the
    adapter: CYCLES of them would add CYCLES times its size)."""
    cluster, _, _ = served
    worker = next(p for p in cluster.procs if p.worker_id is not None)
    size = (adapters["big"] / "adapter_model.safetensors").stat().st_size
    client = await _ready(cluster)
    try:
        samples = await load_unload_cycles(
            client, "big", adapters["big"], WARMUP + CYCLES, lambda: read_memory_kb(worker.popen.pid)[0] * 1024
        )
    finally:
        await client.close()
    growth = samples[-1] - samples[WARMUP - 1]
    assert growth < 4 * size, (
        f"RSS grew {growth / 2**20:.1f} MiB over {CYCLES} cycles of a {size / 2**20:.1f} MiB adapter"
    )
