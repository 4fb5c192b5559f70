"""Encoder-decoder models (tests/encdec_models.py's tiny T5 and BART) through real clusters: a coordinator and two
worker processes answer as direct mode does, through kill -9 of the worker streaming the request (the failover's
Dispatch carries the encoder's ids the first worker tokenized and the decoder prompt); hostile input is refused by
name and the cluster keeps serving; a decoder-only model's cluster refuses a decoder prompt by name; `infer-serve`'s
/v1/completions takes the prompt as the encoder's input; a worker refuses KV transfers for such a model."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from encdec_models import encdec_checkpoint
from fault_streams import kill9_the_busiest_worker, streams_through_a_fault
from serve_harness import Served

from infer import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory=4_000_000, num_threads=1, block_size=4)
ENGINE_FLAGS = (
    *("--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "4000000"),
    *("--threads", "1", "--block-size", "4"),
)
LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
TEXT = "Summarize: the quick brown fox jumps over the lazy dog, twice."
PROMPT = {"encoder_prompt": TEXT, "decoder_prompt": [17, 42]}


@pytest.fixture(scope="module", params=["t5", "bart"])
def family(request, tmp_path_factory, smollm2_tokenizer):
    """(the checkpoint, direct mode's completion of PROMPT with LONG)."""
    path = encdec_checkpoint(request.param, tmp_path_factory.mktemp(request.param), smollm2_tokenizer)
    llm = LLM(model=str(path), **ENGINE)
    try:
        return path, llm.generate([PROMPT], LONG, use_tqdm=False)[0]
    finally:
        llm.close()


async def test_kill_9_of_the_worker_streaming_an_encoder_decoder_request(model_cluster, family):
    path, want = family
    assert want.finish_reason == "length" and len(want.token_ids) == 100
    cluster = model_cluster(workers=2, model=path, engine_flags=ENGINE_FLAGS)
    (stream,), stats = await streams_through_a_fault(
        cluster, [PROMPT], LONG, lambda client: kill9_the_busiest_worker(cluster, client), finish_timeout=240
    )
    assert stats.requests_redispatched == 1
    tokens = [t for delta in stream for t in delta.token_ids]
    assert tokens == want.token_ids  # the replay encoded the same input and continued the same decoder
    async with cluster.client() as client:
        # hostile input: each refused by name, the cluster serving on
        too_long = await client.generate(list(range(3, 3 + 129)), LONG)
        assert too_long.finish_reason == "error"
        assert "encoder prompt has 129 tokens, more than the encoder takes (128)" in (too_long.error or "")
        empty = await client.generate({"encoder_prompt": "", "decoder_prompt": [5]}, LONG)
        assert empty.finish_reason == "error" and "empty" in (empty.error or "")
        again = await client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert again.token_ids == want.token_ids[:8]
        assert again.prompt_token_ids == want.prompt_token_ids  # the encoder's ids, as the worker tokenized them


async def test_a_decoder_only_cluster_refuses_a_decoder_prompt(model_cluster):
    cluster = model_cluster(workers=1)
    async with cluster.client() as client:
        out = await client.generate({"encoder_prompt": [5, 6, 7], "decoder_prompt": [8]}, LONG)
        assert out.finish_reason == "error"
        assert "decoder_prompt is for encoder-decoder models" in (out.error or "")
        fine = await client.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert fine.finish_reason == "length" and len(fine.token_ids) == 4


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_tokenizer):
    path = encdec_checkpoint("t5", tmp_path_factory.mktemp("t5-serve"), smollm2_tokenizer)
    server = Served(path, tmp_path_factory.mktemp("serve") / "serve.log", "t5", list(ENGINE_FLAGS))
    yield path, server
    server.stop()


def test_openai_completions_take_the_prompt_as_the_encoder_input(served):
    path, server = served
    llm = LLM(model=str(path), **ENGINE)
    try:
        want = llm.generate([TEXT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    finally:
        llm.close()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.completions.create(
        model="t5", prompt=TEXT, temperature=0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert answer.choices[0].text == want.text
    assert answer.usage.prompt_tokens == len(want.prompt_token_ids)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 128 tokens"):
        client.completions.create(model="t5", prompt=list(range(3, 3 + 129)), max_tokens=4)
    # 100 encoder tokens + 40 to generate pass 128: the encoder's input takes no room in the decoder's context
    long = client.completions.create(
        model="t5", prompt=list(range(3, 103)), temperature=0, max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 40
    again = client.completions.create(
        model="t5", prompt=TEXT, temperature=0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].text == want.text  # still serving


def test_a_worker_refuses_kv_transfers_for_an_encoder_decoder_model(tmp_path, smollm2_tokenizer):
    """Its cross-attention blocks are not sent: infer-worker exits 2 naming the flag, before it joins anything."""
    path = encdec_checkpoint("t5", tmp_path / "t5", smollm2_tokenizer)
    argv = ["--coordinator", "tcp://127.0.0.1:9", "--model", str(path), *ENGINE_FLAGS]
    kv = ["--kv-transfer-config", '{"kv_role": "kv_both"}']
    done = subprocess.run(
        [sys.executable, "-m", "infer.worker.service.cli", *argv, *kv], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 2
    assert "--kv-transfer-config is not supported for an encoder-decoder model" in done.stderr
