"""LoRA adapters through the HTTP front (direct mode): `model` picks the adapter (greedy output equals transformers +
PEFT), an unknown model is a 404, /v1/models lists adapters with their parent, vLLM's load / unload routes load and
unload at runtime while requests run, and bad loads get a 400 naming the problem while the front keeps serving."""

from __future__ import annotations

import json
import random
import threading

import pytest
from front_harness import MODEL, error_of, http, local_engine, serving
from lora_cases import make_adapters, peft_greedy

MAX_NEW = 6


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama")
    folders = make_adapters(model, tmp_path_factory, names=("qv", "mlp"))
    local = local_engine(model, block_size=4, enable_lora=True, max_lora_rank=8, lora_modules={"qv": folders["qv"]})
    yield model, folders, local


def _complete(url: str, model: str, prompt: list[int]) -> tuple[int, str]:
    status, _, text = http(
        url + "/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
    )
    return status, text


def test_model_picks_the_adapter_and_adapters_load_and_unload_at_runtime(setup, smollm2_tokenizer):
    model_dir, folders, local = setup
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 49000) for _ in range(12)] for _ in range(3)]
    with serving(local, smollm2_tokenizer) as url:
        status, _, text = http(url + "/v1/models")
        cards = {c["id"]: c for c in json.loads(text)["data"]}
        assert set(cards) == {MODEL, "qv"} and cards["qv"]["parent"] == MODEL and cards[MODEL]["parent"] is None

        status, text = _complete(url, "nope", prompts[0])
        assert status == 404 and error_of(text)["code"] == "model_not_found" and "'qv'" in error_of(text)["message"]

        for name, folder in ((MODEL, None), ("qv", folders["qv"])):
            want = peft_greedy(model_dir, folder, prompts, MAX_NEW)
            got = [json.loads(_complete(url, name, p)[1])["choices"][0]["text"] for p in prompts]
            assert got == [smollm2_tokenizer.decode(w) for w in want], name

        # load "mlp" while requests of the base model and of "qv" run
        results: list[tuple[int, str]] = []
        runs = [
            threading.Thread(target=lambda m=m: results.append(_complete(url, m, prompts[0])))
            for m in (MODEL, "qv") * 3
        ]
        for t in runs:
            t.start()
        status, _, text = http(url + "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(folders["mlp"])})
        assert status == 200 and "mlp" in text
        for t in runs:
            t.join(60)
        assert [s for s, _ in results] == [200] * 6
        want = peft_greedy(model_dir, folders["mlp"], prompts[:1], MAX_NEW)[0]
        assert json.loads(_complete(url, "mlp", prompts[0])[1])["choices"][0]["text"] == smollm2_tokenizer.decode(want)
        status, _, text = http(url + "/v1/models")
        assert {c["id"] for c in json.loads(text)["data"]} == {MODEL, "qv", "mlp"}

        status, _, text = http(url + "/v1/unload_lora_adapter", {"lora_name": "mlp", "lora_path": str(folders["mlp"])})
        assert status == 200, text
        status, text = _complete(url, "mlp", prompts[0])
        assert status == 404 and error_of(text)["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body, message",
    [
        ({"lora_name": "x", "lora_path": "/nowhere/at/all"}, "adapter_config.json: no such file"),
        ({"lora_name": "qv", "lora_path": "/elsewhere"}, "already loaded"),
        ({"lora_name": "bad name", "lora_path": "/p"}, "lora_name"),
        ({"lora_name": "x"}, "lora_path"),
    ],
)
def test_bad_loads_get_a_400_naming_the_problem_and_the_front_keeps_serving(setup, smollm2_tokenizer, body, message):
    _, _, local = setup
    with serving(local, smollm2_tokenizer) as url:
        status, _, text = http(url + "/v1/load_lora_adapter", body)
        assert status == 400 and message in error_of(text)["message"], text
        status, _, text = http(url + "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
        assert status == 400 and "never-loaded" in error_of(text)["message"]
        assert _complete(url, "qv", [5, 6, 7])[0] == 200
