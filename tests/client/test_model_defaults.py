"""--chat-template and --generation-config (client/api/model_defaults.py): on a direct-mode front with the openai
client (the template renders the chat; the checkpoint's defaults fill what a request leaves out, and what it gives
wins), on infer-serve started with the two flags (bad values stop it with the reason), and LLM's generation_config
(vLLM's: the defaults of a generate given no sampling params)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator

import openai
import pytest
from front_harness import MODEL, http, local_engine, serving
from serve_harness import Served

from infer import LLM, SamplingParams
from infer.client.api.model_defaults import generation_defaults, load_chat_template, matryoshka_dimensions
from infer.client.local_engine import LocalEngine

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def local(tiny_model_dir) -> Iterator[LocalEngine]:
    engine = local_engine(tiny_model_dir("llama"))
    yield engine
    asyncio.run(engine.close())


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_chat_template_given_renders_the_chat_and_leaves_the_tokenizer_alone(local, smollm2_tokenizer):
    original = smollm2_tokenizer.chat_template
    with serving(local, smollm2_tokenizer, chat_template=load_chat_template(TEMPLATE)) as url:
        status, _, text = http(f"{url}/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and json.loads(text)["tokens"] == smollm2_tokenizer("<user>hi")["input_ids"]
        chat = _client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.usage.prompt_tokens == len(smollm2_tokenizer("<user>hi")["input_ids"])
    assert smollm2_tokenizer.chat_template == original


def test_generation_config_defaults_fill_what_a_request_leaves_out(local, smollm2_tokenizer, tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3, "top_k": 20, "bos_token_id": 1, "do_sample": False})
    )
    defaults = generation_defaults(str(tmp_path), None)
    assert defaults == {"temperature": 0.0, "top_k": 20, "max_tokens": 3}
    assert generation_defaults("auto", tmp_path) == defaults and generation_defaults("vllm", tmp_path) == {}
    with serving(local, smollm2_tokenizer, sampling_defaults=defaults) as url:
        client = _client(url)
        plain = client.completions.create(model=MODEL, prompt=[3, 4, 5], extra_body={"ignore_eos": True})
        greedy = client.completions.create(
            model=MODEL, prompt=[3, 4, 5], temperature=0, max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert plain.usage.completion_tokens == 3 and plain.choices[0].text == greedy.choices[0].text
        longer = client.completions.create(model=MODEL, prompt=[3, 4, 5], max_tokens=6, extra_body={"ignore_eos": True})
        assert longer.usage.completion_tokens == 6  # the request's own value wins
        sampled = {
            client.completions.create(
                model=MODEL, prompt=[3, 4, 5], max_tokens=6, temperature=1.0, seed=s, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for s in range(4)
        }
        assert len(sampled) > 1  # temperature given: not the default's greedy
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
        )
        assert chat.usage.completion_tokens == 3


@pytest.mark.parametrize(
    "content, reason",
    [
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ("[1]", "not a JSON object"),
    ],
)
def test_a_bad_generation_config_is_refused_naming_the_field(tmp_path, content, reason):
    (tmp_path / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match="--generation-config") as e:
        generation_defaults(str(tmp_path), None)
    assert reason in str(e.value)


def test_infer_serve_with_a_chat_template_file_and_a_generation_config(tiny_model_dir, smollm2_tokenizer, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    config = tmp_path / "gen"
    config.mkdir()
    (config / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 2}))
    served = Served(
        tiny_model_dir("llama"),
        tmp_path / "serve.log",
        "m",
        ["--chat-template", str(template), "--generation-config", str(config)],
    )
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)
        chat = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
        )
        assert chat.usage.completion_tokens == 2
        status, _, text = http(f"{served.url}/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
        ids = smollm2_tokenizer("<user>hi")["input_ids"]
        assert status == 200 and json.loads(text)["tokens"] == ids and chat.usage.prompt_tokens == len(ids)
    finally:
        served.stop()


@pytest.mark.parametrize(
    "flags, reason",
    [
        (["--chat-template", "/no/such/template.jinja"], "not a template"),
        (["--chat-template", "{% for m in messages %}"], "line 1"),
        (["--generation-config", "/no/such/dir"], "cannot read"),
    ],
)
def test_infer_serve_refuses_a_bad_template_or_generation_config(flags, reason):
    done = subprocess.run(
        [sys.executable, "-m", "infer.client.serve", "--benchmark-mode", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and reason in done.stderr, done.stderr[-500:]


@pytest.mark.parametrize(
    "config, sizes",
    [
        ({"matryoshka_dimensions": [64, 128]}, (64, 128)),
        ({"is_matryoshka": True}, ()),
        ({}, None),
        ({"matryoshka_dimensions": ["x"]}, None),
    ],
)
def test_matryoshka_sizes_come_from_config_json(tmp_path, config, sizes):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert matryoshka_dimensions(tmp_path) == sizes


def test_llm_generation_config_gives_the_defaults_of_a_generate_without_params(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3, "top_k": 20}))
    options = dict(dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    with LLM(model=str(model), **options) as llm:  # generation_config="auto": the model's file
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 3, 20)
        plain = llm.generate([5, 6, 7], use_tqdm=False)[0]
        greedy = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, top_k=20), use_tqdm=False)[0]
        assert plain.token_ids == greedy.token_ids and len(plain.token_ids) == 3
        given = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert len(given[0].token_ids) == 6  # params given are used as they are
    with LLM(model=str(model), generation_config="vllm", **options) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match=r"generation_config: .*bad.json: top_p must be in \(0, 1\]"):
        LLM(model=str(model), generation_config=str(bad), **options)
