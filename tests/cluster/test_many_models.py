"""Two models behind one coordinator, through real processes: infer-coordinator, an infer-worker of the tiny Llama
(served as "llama-a", with the LoRA adapter "qv"; SmolLM2's tokenizer) and one of the tiny Qwen3 with a word-level
tokenizer and chat template of its own ("qwen-b"), infer-api (its --model: the Llama's) and the official `openai`
client. Each request runs on its model's worker (the adapter on its base's) and is tokenized with its model's
tokenizer (qwen-b's read where its worker says: Hello.tokenizer), /v1/models lists both and the adapter with its
parent, an unknown model is a 404 naming it, a model whose worker died a 503 with Retry-After while the other keeps
serving, and /metrics is labelled per model."""

from __future__ import annotations

import json
import re
import selectors
import subprocess
import sys
import urllib.request

import openai
import pytest
from lora_cases import make_adapters
from tiny_models import word_level_tokenizer

from infer import SamplingParams
from tests.cluster.conftest import ENGINE_FLAGS, Cluster, Proc

PROMPT = [5, 17, 30, 41, 9]  # ids of both vocabularies (qwen-b's has 250 words)
TEXT = "hello world , the big house"
GREEDY = dict(max_tokens=4, temperature=0, extra_body={"ignore_eos": True})


def start_front(cluster: Cluster, model) -> str:
    """infer-api on the cluster as the README starts it (its tokenizer from --model); its URL once it serves."""
    argv = ["-m", "infer.client.api.server", "--coordinator", cluster.address, "--model", str(model), "--port", "0"]
    log = cluster.logs / "front.log"
    with open(log, "wb") as err:
        popen = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    cluster.procs.append(Proc("front", popen, log))
    with selectors.DefaultSelector() as selector:
        selector.register(popen.stdout, selectors.EVENT_READ)
        line = popen.stdout.readline().decode() if selector.select(60) else ""
    match = re.search(r"on (http://\S+?),", line)
    assert match, f"{line!r}\n{log.read_text()}"
    return match.group(1)


def routed(stats) -> dict[str, int]:
    return {w.model_id: w.requests_routed for w in stats.workers}


def tokenized(url: str, model: str, text: str) -> list[int]:
    body = json.dumps({"model": model, "prompt": text}).encode()
    request = urllib.request.Request(f"{url}/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["tokens"]


async def test_two_models_and_an_adapter_behind_one_coordinator(
    cluster_factory, tiny_llama, tiny_words_model, smollm2_tokenizer, tmp_path_factory, wait_until
):
    qwen = tiny_words_model
    qv = make_adapters(tiny_llama, tmp_path_factory, names=("qv",))["qv"]
    cluster = cluster_factory()
    cluster.coordinator()
    cluster.worker(
        0,
        *ENGINE_FLAGS,
        "--served-model-name",
        "llama-a",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"qv={qv}",
        model=tiny_llama,
    )
    qwen_worker = cluster.worker(1, *ENGINE_FLAGS, "--served-model-name", "qwen-b", model=qwen)
    async with cluster.client() as client:
        await client.wait_for_workers(2, timeout=90)
        stats = await client.stats()
        assert sorted((w.model_id, w.dp_rank) for w in stats.workers) == [("llama-a", 0), ("qwen-b", 0)]
        # the Python client: a model by name, and none named on two models is refused with both named
        answer = await client.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0), model="qwen-b")
        assert answer.finish_reason == "length" and len(answer.token_ids) == 3
        unnamed = await client.generate(PROMPT, SamplingParams(max_tokens=3))
        assert unnamed.error_code == "invalid_request"
        assert "serves several ('llama-a', 'qwen-b')" in unnamed.error
        assert routed(await client.stats()) == {"llama-a": 0, "qwen-b": 1}

        url = start_front(cluster, tiny_llama)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        cards = {m.id: m for m in api.models.list().data}
        assert sorted(cards) == ["llama-a", "qv", "qwen-b"]
        assert cards["qv"].parent == "llama-a" and cards["qwen-b"].parent is None  # type: ignore[attr-defined]

        texts = {}
        for model in ("llama-a", "qwen-b", "qv"):
            done = api.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
            assert done.model == model and done.choices[0].finish_reason == "length"
            texts[model] = done.choices[0].text
        assert routed(await client.stats()) == {"llama-a": 2, "qwen-b": 2}  # qv ran on its base's worker
        assert len(set(texts.values())) == 3  # three models' (random) weights: three answers

        # Each model through its own tokenizer: a text prompt tokenized by the front gives what the model's worker
        # makes of the same text (the Python client sends the text; the worker tokenizes it), chat through each
        # model's own template. With llama-a's tokenizer, qwen-b would get other ids, beyond its vocabulary.
        words = word_level_tokenizer()
        assert tokenized(url, "qwen-b", TEXT) == words(TEXT)["input_ids"]
        assert tokenized(url, "llama-a", TEXT) == smollm2_tokenizer(TEXT)["input_ids"] != words(TEXT)["input_ids"]
        greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        for model in ("qwen-b", "llama-a"):
            done = api.completions.create(model=model, prompt=TEXT, **GREEDY)
            own = await client.generate(TEXT, greedy, model=model)
            assert done.choices[0].text == own.text and done.usage.prompt_tokens == len(own.prompt_token_ids)
        chat = [{"role": "user", "content": "hello there"}]
        answer = api.chat.completions.create(model="qwen-b", messages=chat, **GREEDY)
        rendered = words.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        own = await client.generate(words(rendered, add_special_tokens=False)["input_ids"], greedy, model="qwen-b")
        assert answer.choices[0].message.content == own.text and answer.usage.prompt_tokens == len(rendered.split())

        with pytest.raises(openai.NotFoundError) as missing:
            api.completions.create(model="gpt-nope", prompt=PROMPT, max_tokens=2)
        assert "'gpt-nope' does not exist" in str(missing.value)
        assert "'llama-a', 'qwen-b'" in str(missing.value) and "'qv'" in str(missing.value)

        qwen_worker.kill9()

        async def qwen_down():
            model = (await client.stats()).model("qwen-b")
            return model is not None and model.num_healthy_workers == 0

        await wait_until(qwen_down, 20, "the coordinator to see qwen-b's worker gone")

        async def scraped() -> str:  # a scrape refreshes the front's cluster view, which admission reads
            with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
                text = response.read().decode()
            return text if 'infer:num_healthy_workers{model_name="qwen-b"} 0.0' in text else ""

        metrics = await wait_until(scraped, 10, "the front to see qwen-b's worker gone")
        assert 'infer:num_healthy_workers{model_name="llama-a"} 1.0' in metrics
        assert re.search(r'infer:generation_tokens_total\{model_name="qwen-b"\} 12\.0', metrics)
        assert re.search(r'infer:generation_tokens_total\{model_name="llama-a"\} 12\.0', metrics)  # with qv's 4
        with pytest.raises(openai.APIStatusError) as down:
            api.with_options(timeout=30).completions.create(model="qwen-b", prompt=PROMPT, max_tokens=2)
        assert down.value.status_code == 503 and down.value.response.headers.get("retry-after") == "1"
        assert "no worker of the model 'qwen-b'" in str(down.value)
        alive = api.completions.create(model="llama-a", prompt=PROMPT, max_tokens=2, temperature=0)
        assert alive.choices[0].finish_reason == "length"
