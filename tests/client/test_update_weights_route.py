"""POST /v1/update_weights behind the API key, and the refit / lifecycle state in /metrics, on a direct-mode
front (HttpFront over a LocalEngine on the tiny Llama)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest

from infer.client.api.config import FrontConfig
from infer.client.api.server import HttpFront
from infer.client.local_engine import LocalEngine
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine
from infer.worker.loading.tokenizer import transformers_tokenizer

MODEL = "tiny"
KEY = "k-123"


def _http(url: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def front(tiny_model_dir):
    model = tiny_model_dir("llama")
    local = LocalEngine(
        Engine(
            EngineConfig(model=str(model), dtype="float32", max_model_len=256, kv_cache_memory=4_000_000, num_threads=1)
        )
    )
    http = HttpFront(
        local, transformers_tokenizer(local.engine.tokenizer), FrontConfig(served_model_name=MODEL, api_key=KEY), port=0
    )
    http.bind()
    thread = threading.Thread(target=asyncio.run, args=(http.serve(),), daemon=True)
    thread.start()
    yield http.url
    http.shutdown()
    thread.join(10)
    asyncio.run(local.close())


def test_update_weights_route_needs_the_key_and_reports_the_version(front, tiny_weights_b, tmp_path) -> None:
    body = {"model": MODEL, "path": str(tiny_weights_b("llama"))}
    assert _http(f"{front}/v1/update_weights", body, key=None)[0] == 401
    status, text = _http(f"{front}/v1/update_weights", body)
    assert status == 200 and json.loads(text)["weight_version"] == 1
    status, text = _http(f"{front}/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
    assert status == 200
    status, text = _http(f"{front}/v1/update_weights", {"model": MODEL, "path": str(tmp_path)})
    assert status == 400 and "no *.safetensors" in json.loads(text)["error"]["message"]
    status, text = _http(f"{front}/v1/update_weights", {"model": MODEL, "path": "/x", "on_running": "later"})
    assert status == 400 and json.loads(text)["error"]["param"] == "on_running"
    metrics = _http(f"{front}/metrics")[1]
    assert 'infer:weight_version{model_name="tiny"} 1.0' in metrics
    assert 'infer:cluster_state{model_name="tiny",state="running"} 1.0' in metrics
    assert 'infer:cluster_state{model_name="tiny",state="suspended"} 0.0' in metrics
