"""The HTTP front's extra parameters and routes on a direct-mode front (the tiny Llama, priority scheduling):
each accepted value does what it says; each invalid one is a 400 naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from front_harness import MODEL, error_of, http, local_engine, serving
from infer.client.local_engine import LocalEngine

SHORT = dict(model=MODEL, prompt=[3, 4, 5], max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def local(tiny_model_dir) -> Iterator[LocalEngine]:
    engine = local_engine(tiny_model_dir("llama"), scheduling_policy="priority")
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def url(local, smollm2_tokenizer) -> Iterator[str]:
    with serving(local, smollm2_tokenizer) as url:
        yield url


def test_a_priority_is_accepted_on_both_endpoints(url):
    status, _, text = http(f"{url}/v1/completions", {**SHORT, "priority": -5})
    assert status == 200, text
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, priority=3)
    status, _, text = http(f"{url}/v1/chat/completions", chat)
    assert status == 200, text


@pytest.mark.parametrize("priority", ["high", 1.5, True, 2**63, -2**63 - 1, None])
def test_an_invalid_priority_is_a_400_naming_it(url, priority):
    status, _, text = http(f"{url}/v1/completions", {**SHORT, "priority": priority})
    assert status == 400 and error_of(text)["param"] == "priority", text
