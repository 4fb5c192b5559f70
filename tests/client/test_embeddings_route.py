"""POST /v1/embeddings on a direct-mode front (the tiny Llama) with the official openai client's
`embeddings.create`: float and base64 (the client's default) give LLM.embed's vectors (themselves checked against
transformers in tests/worker/test_pooling.py), batch inputs keep their order, usage counts the prompt tokens;
`dimensions` only where the model is Matryoshka; bad input is a 400 naming the field."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Iterator

import openai
import pytest
import torch
from front_harness import MODEL, error_of, http, local_engine, serving

from infer import LLM
from infer.client.local_engine import LocalEngine

INPUTS = ["The capital of France", "a much longer prompt " * 6, "one"]
TOKENS = [[5, 6, 7, 8], [9, 10]]


@pytest.fixture(scope="module")
def local(tiny_model_dir) -> Iterator[LocalEngine]:
    engine = local_engine(tiny_model_dir("llama"))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> dict[str, list[list[float]]]:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    out = {
        pooling: [o.embedding for o in llm.embed(INPUTS, pooling=pooling, use_tqdm=False)]
        for pooling in ("last", "mean")
    }
    out["tokens"] = [o.embedding for o in llm.embed(TOKENS, use_tqdm=False)]
    return out


@pytest.fixture(scope="module")
def url(local, smollm2_tokenizer) -> Iterator[str]:
    with serving(local, smollm2_tokenizer) as url:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_openai_clients_embeddings_create_gives_the_engines_vectors(local, smollm2_tokenizer, expected):
    with serving(local, smollm2_tokenizer) as url:
        client = _client(url)
        for encoding in (None, "float", "base64"):  # None: the client asks for base64 and decodes it itself
            extra = {} if encoding is None else {"encoding_format": encoding}
            got = client.embeddings.create(model=MODEL, input=INPUTS, **extra)
            assert [d.index for d in got.data] == [0, 1, 2] and got.model == MODEL
            for d, want in zip(got.data, expected["last"]):
                vector = d.embedding
                if encoding == "base64":  # little-endian float32, as OpenAI sends it
                    vector = list(struct.unpack(f"<{len(want)}f", base64.b64decode(vector)))
                torch.testing.assert_close(torch.tensor(vector), torch.tensor(want), atol=1e-6, rtol=1e-5)
            tokens = sum(len(smollm2_tokenizer(p)["input_ids"]) for p in INPUTS)
            assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
        by_ids = client.embeddings.create(model=MODEL, input=TOKENS)
        for d, want in zip(by_ids.data, expected["tokens"]):
            torch.testing.assert_close(torch.tensor(d.embedding), torch.tensor(want), atol=1e-6, rtol=1e-5)
        mean = client.embeddings.create(model=MODEL, input=INPUTS[0], extra_body={"pooling": "mean"})
        torch.testing.assert_close(
            torch.tensor(mean.data[0].embedding), torch.tensor(expected["mean"][0]), atol=1e-6, rtol=1e-5
        )
        with pytest.raises(openai.BadRequestError, match="Matryoshka"):
            client.embeddings.create(model=MODEL, input="hi", dimensions=8)


def test_dimensions_on_a_matryoshka_model_truncate_and_renormalize(local, smollm2_tokenizer, expected):
    with serving(local, smollm2_tokenizer, matryoshka_dimensions=(8, 16)) as url:
        got = _client(url).embeddings.create(model=MODEL, input=INPUTS[0], dimensions=16).data[0].embedding
        want = torch.nn.functional.normalize(torch.tensor(expected["last"][0][:16]), dim=0)
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-6, rtol=1e-5)
        status, _, text = http(f"{url}/v1/embeddings", {"model": MODEL, "input": "hi", "dimensions": 12})
        assert status == 400 and error_of(text)["param"] == "dimensions"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "pooling": "max"}, "pooling"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "extra": 1}, "extra"),
        ({"input": ["x"] * 513}, "input"),
        ({"input": ["x", [1]]}, "input"),
        ({"input": [10**6]}, "input"),
        ({"input": "word " * 5000}, "input"),
    ],
)
def test_bad_embedding_bodies_are_400s_naming_the_field(url, body, param):
    status, _, text = http(f"{url}/v1/embeddings", {"model": MODEL, **body})
    assert status == 400 and error_of(text)["param"].split(".")[0] == param, text
    assert http(f"{url}/v1/embeddings", {"model": MODEL, "input": "still fine"})[0] == 200
