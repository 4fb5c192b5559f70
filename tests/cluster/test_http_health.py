"""`infer-api` fronts on an existing cluster: /health follows the workers (a real round trip), requests with
no worker get 503 + Retry-After, the API key is enforced, and two fronts share one coordinator."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

MODEL = "tiny-llama"
ENGINE = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1")


def _start_front(cluster, *flags: str) -> str:
    proc = cluster.spawn("front", "-m", "infer.client.api.server", "--coordinator", cluster.address, "--port", "0",
                         "--served-model-name", MODEL, "--log-level", "WARNING", *flags)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:      # the front logs its address once it listens
        match = re.search(r"on (http://\S+), cluster", proc.text())
        if match:
            return match.group(1)
        assert proc.popen.poll() is None, proc.text()
        time.sleep(0.1)
    raise AssertionError(f"infer-api did not start: {proc.text()}")


def _get(url: str, key: str | None = None) -> tuple[int, Any, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def _wait_status(url: str, status: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        code, _, body = _get(url)
        if code == status:
            return body
        assert time.monotonic() < deadline, f"{url} stayed {code} ({body}), expected {status}"
        time.sleep(0.2)


@pytest.fixture
def cluster(cluster_factory, tiny_llama):
    cluster = cluster_factory()
    cluster.coordinator("--worker-timeout", "2", "--queue-timeout", "3")
    cluster.model = tiny_llama
    return cluster


def test_health_follows_the_workers_and_requests_get_503_without_one(cluster):
    url = _start_front(cluster)
    code, headers, body = _get(f"{url}/health")
    assert code == 503 and "no healthy worker" in body["reason"] and headers["Retry-After"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert err.value.status_code == 503 and "no worker" in err.value.message
    assert err.value.response.headers["retry-after"]

    worker = cluster.worker(0, *ENGINE, model=cluster.model)
    assert _wait_status(f"{url}/health", 200, 60)["healthy_workers"] == 1
    assert client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3).usage.completion_tokens >= 1

    worker.kill9()                                    # every worker gone
    _wait_status(f"{url}/health", 503, 15)
    cluster.worker(1, *ENGINE, model=cluster.model)   # and one returns
    _wait_status(f"{url}/health", 200, 60)
    assert client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3).choices


def test_api_key_and_two_fronts_on_one_coordinator(cluster):
    cluster.worker(0, *ENGINE, model=cluster.model)
    keyed = _start_front(cluster, "--api-key", "s3cret")
    open_front = _start_front(cluster)
    _wait_status(f"{open_front}/health", 200, 60)
    code, _, body = _get(f"{keyed}/v1/models")
    assert code == 401 and "API key" in body["error"]["message"]
    assert _get(f"{keyed}/v1/models", key="wrong")[0] == 401
    assert _get(f"{keyed}/v1/models", key="s3cret")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="nope", max_retries=0).completions.create(
            model=MODEL, prompt="hi", max_tokens=2)
    a = openai.OpenAI(base_url=f"{keyed}/v1", api_key="s3cret", max_retries=0, timeout=60)
    b = openai.OpenAI(base_url=f"{open_front}/v1", api_key="x", max_retries=0, timeout=60)
    same = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=6, temperature=0)
    assert a.completions.create(**same).choices[0].text == b.completions.create(**same).choices[0].text
