"""POST /v1/requests/{id}/cancel on a direct-mode front (the tiny Llama, slowed so requests outlive the test's
calls), with the official openai client: the caller that sent a request cancels it by the response id (streamed)
or by its own X-Request-Id (not streamed); another caller, or one without a token, gets the same 404 as for an
unknown id; the admin key cancels anyone's; the cancelled request ends with finish_reason "abort", its KV blocks
freed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator

import openai
import pytest
from front_harness import MODEL, error_of, http, local_engine, serving

from infer.client.local_engine import LocalEngine

LONG = dict(model=MODEL, prompt=[3, 4, 5], max_tokens=200, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def slow_local(tiny_model_dir) -> Iterator[LocalEngine]:
    engine = local_engine(tiny_model_dir("llama"), step_delay=0.03)  # 200 tokens: 6 s at least
    yield engine
    asyncio.run(engine.close())


def _client(url: str, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=60)


def _cancel(url: str, request_id: str, token: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    status, _, text = http(f"{url}/v1/requests/{request_id}/cancel", b"", method="POST", headers=headers)
    return status, text


def _all_blocks_free(engine: LocalEngine) -> None:
    for _ in range(50):
        stats = asyncio.run(engine.stats())
        load = stats.workers[0].load
        if (load.num_running, load.num_waiting) == (0, 0) and load.num_free_blocks == load.num_total_blocks:
            return
        time.sleep(0.1)
    raise AssertionError(f"blocks still held: {load}")


def test_the_sender_cancels_its_stream_by_the_response_id_and_no_one_else_can(slow_local, smollm2_tokenizer):
    with serving(slow_local, smollm2_tokenizer, admin_api_key="admin-key") as url:
        stream = _client(url, "alice-token").completions.create(**LONG, stream=True)
        first = next(iter(stream))
        request_id = first.id
        for token in ("mallory-token", None):  # another caller, an anonymous one: as if the id were unknown
            status, text = _cancel(url, request_id, token)
            assert status == 404 and error_of(text)["code"] == "request_not_found", text
        assert _cancel(url, "cmpl-unknown", "alice-token")[0] == 404
        status, text = _cancel(url, request_id, "alice-token")
        assert status == 200, text
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "abort"  # not "length": it ended short of its 200 tokens
        assert _cancel(url, request_id, "alice-token")[0] == 404  # over: nothing left to cancel
    _all_blocks_free(slow_local)


def test_a_request_cancelled_by_its_own_x_request_id_before_its_answer(slow_local, smollm2_tokenizer):
    with (
        serving(slow_local, smollm2_tokenizer, admin_api_key="admin-key") as url,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):

        def run(token: str, request_id: str):
            return _client(url, token).completions.with_raw_response.create(
                **LONG, extra_headers={"X-Request-Id": request_id}
            )

        mine = pool.submit(run, "bob-token", "job-42")
        theirs = pool.submit(run, "carol-token", "job-42")  # the same id, another caller: never meet
        time.sleep(1.0)
        assert _cancel(url, "job-42", "bob-token")[0] == 200
        raw = mine.result(30)
        assert raw.headers["x-request-id"] == "job-42"
        answer = raw.parse()
        assert answer.id == "job-42" and answer.choices[0].finish_reason == "abort"
        assert not theirs.done()
        assert _cancel(url, "job-42", "admin-key")[0] == 200  # the admin cancels anyone's
        assert theirs.result(30).parse().choices[0].finish_reason == "abort"
        anonymous = pool.submit(
            lambda: http(
                f"{url}/v1/completions",
                {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 200, "temperature": 0, "ignore_eos": True},
                headers={"X-Request-Id": "anon-1"},
            )
        )
        time.sleep(1.0)
        assert _cancel(url, "anon-1", None)[0] == 404  # no token: no one but the admin may cancel it
        assert _cancel(url, "anon-1", "admin-key")[0] == 200
        assert anonymous.result(30)[0] == 200
        bad = http(f"{url}/v1/completions", {"model": MODEL, "prompt": "x"}, headers={"X-Request-Id": "a" * 200})
        assert bad[0] == 400 and error_of(bad[2])["param"] == "X-Request-Id"
    _all_blocks_free(slow_local)


def test_with_an_api_key_the_key_holder_or_the_admin_cancels(slow_local, smollm2_tokenizer):
    with serving(slow_local, smollm2_tokenizer, api_key="front-key", admin_api_key="admin-key") as url:
        stream = _client(url, "front-key").completions.create(**LONG, stream=True)
        request_id = next(iter(stream)).id
        assert _cancel(url, request_id, "wrong")[0] == 401
        assert _cancel(url, request_id, "admin-key")[0] == 200
        assert list(stream)[-1].choices[0].finish_reason == "abort"
    _all_blocks_free(slow_local)
