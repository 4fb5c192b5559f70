"""The HTTP front's per-request opt-out of speculative decoding (`disable_speculative_decoding`, our extension)
through the official openai client's extra_body, on /v1/completions and /v1/chat/completions of a front whose
engine speculates (n-gram): an opted-out request drafts nothing, the others draft, and both answer the same
greedy text; a value that is not a boolean is a 400 naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
from front_harness import MODEL, error_of, http, local_engine, serving

from infer.client.local_engine import LocalEngine

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPT = [(i * 13) % 200 + 3 for i in range(5)] * 6  # repeating: drafts are proposed
CHAT = [{"role": "user", "content": "Say it again: the cat sat on the mat, the cat sat on the mat."}]


@pytest.fixture(scope="module")
def local(tiny_model_dir) -> Iterator[LocalEngine]:
    engine = local_engine(tiny_model_dir("llama"), speculative_config=NGRAM)
    yield engine
    asyncio.run(engine.close())


def _drafted(local: LocalEngine, call) -> tuple[str, int]:
    """(the answer's text, draft tokens the engine verified while answering)."""
    before = local.engine.stats.spec_decode_num_draft_tokens
    text = call()
    return text, local.engine.stats.spec_decode_num_draft_tokens - before


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_disable_speculative_decoding_through_the_openai_client(local, smollm2_tokenizer, endpoint):
    with serving(local, smollm2_tokenizer) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(**extra_body):
            if endpoint == "completions":
                return lambda: (
                    client.completions.create(
                        model=MODEL,
                        prompt=PROMPT,
                        max_tokens=24,
                        temperature=0,
                        extra_body={"ignore_eos": True, **extra_body},
                    )
                    .choices[0]
                    .text
                )
            return lambda: (
                client.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,
                    max_tokens=24,
                    temperature=0,
                    extra_body={"ignore_eos": True, **extra_body},
                )
                .choices[0]
                .message.content
            )

        speculated, drafted = _drafted(local, ask())
        opted_out, drafted_opted_out = _drafted(local, ask(disable_speculative_decoding=True))
        assert drafted > 0 and drafted_opted_out == 0
        assert opted_out == speculated
        again, drafted_again = _drafted(local, ask(disable_speculative_decoding=False))
        assert again == speculated and drafted_again > 0


def test_a_non_boolean_opt_out_is_a_400_naming_it(local, smollm2_tokenizer):
    with serving(local, smollm2_tokenizer) as url:
        status, _, text = http(
            f"{url}/v1/completions",
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "disable_speculative_decoding": "sometimes"},
        )
    assert status == 400 and error_of(text)["param"] == "disable_speculative_decoding", text
