"""`infer-api` fronts on an existing cluster: /health follows the workers (a real round trip), requests with
no worker get 503 + Retry-After, the API key (from --api-key-file, never in the process list) is enforced,
two fronts share one coordinator, and a request the coordinator refuses as overloaded is a 503 "overloaded"
with Retry-After while the accepted one completes."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

MODEL = "tiny-llama"
ENGINE = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1")


def _start_front(cluster, *flags: str) -> str:
    proc = cluster.spawn(
        "front",
        "-m",
        "infer.client.api.server",
        "--coordinator",
        cluster.address,
        "--port",
        "0",
        "--served-model-name",
        MODEL,
        "--log-level",
        "WARNING",
        *flags,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the front logs its address once it listens
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

    worker.kill9()  # every worker gone
    _wait_status(f"{url}/health", 503, 15)
    cluster.worker(1, *ENGINE, model=cluster.model)  # and one returns
    _wait_status(f"{url}/health", 200, 60)
    assert client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3).choices


def test_api_key_and_two_fronts_on_one_coordinator(cluster, tmp_path, monkeypatch):
    monkeypatch.delenv("INFER_API_KEY", raising=False)
    cluster.worker(0, *ENGINE, model=cluster.model)
    key_file = tmp_path / "api-key"
    key_file.write_text("s3cret\n")
    keyed = _start_front(cluster, "--api-key-file", str(key_file))
    assert b"s3cret" not in Path(f"/proc/{cluster.procs[-1].popen.pid}/cmdline").read_bytes()
    open_front = _start_front(cluster)
    _wait_status(f"{open_front}/health", 200, 60)
    code, _, body = _get(f"{keyed}/v1/models")
    assert code == 401 and "API key" in body["error"]["message"]
    assert _get(f"{keyed}/v1/models", key="wrong")[0] == 401
    assert _get(f"{keyed}/v1/models", key="s3cret")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="nope", max_retries=0).completions.create(
            model=MODEL, prompt="hi", max_tokens=2
        )
    a = openai.OpenAI(base_url=f"{keyed}/v1", api_key="s3cret", max_retries=0, timeout=60)
    b = openai.OpenAI(base_url=f"{open_front}/v1", api_key="x", max_retries=0, timeout=60)
    same = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=6, temperature=0)
    assert a.completions.create(**same).choices[0].text == b.completions.create(**same).choices[0].text


def test_a_request_the_cluster_refuses_as_overloaded_is_a_503_and_the_accepted_one_completes(
    cluster_factory, tiny_llama
):
    cluster = cluster_factory()
    cluster.coordinator("--max-requests-per-worker", "1")
    cluster.worker(0, *ENGINE, model=tiny_llama)
    url = _start_front(cluster)
    _wait_status(f"{url}/health", 200, 60)
    host, port = url.removeprefix("http://").split(":")
    long = dict(model=MODEL, prompt=[3, 4, 5], max_tokens=200, ignore_eos=True, stream=True)
    payload = json.dumps(long).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:  # the worker's one request
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
        )
        reader = sock.makefile("rb")
        assert b" 200 " in reader.readline()
        while not reader.readline().startswith(b"data: {"):  # it runs on the worker
            pass
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        for stream in (False, True):  # a 503, not queued behind the running request (that would end in a 200)
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=stream)
            assert err.value.status_code == 503
            assert err.value.code == "overloaded" and "overloaded" in err.value.message
            assert err.value.response.headers["retry-after"]
        events = [json.loads(line[6:]) for line in reader if line.startswith(b"data: {")]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3).choices  # room again
