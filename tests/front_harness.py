"""An HTTP front over a direct-mode LocalEngine on a free port, and the helpers the front's tests share."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from infer.client.api.config import FrontConfig
from infer.client.api.server import HttpFront
from infer.client.local_engine import LocalEngine
from infer.worker.engine.config import EngineConfig

MODEL = "tiny"
ENGINE_OPTIONS = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)


def local_engine(model: Path, step_delay: float = 0.0, **options: Any) -> LocalEngine:
    from infer.worker.engine.engine import Engine

    local = LocalEngine(Engine(EngineConfig.from_options(model=str(model), **{**ENGINE_OPTIONS, **options})))
    if step_delay:
        execute = local.engine.runner.execute

        def slowed(chunks):  # the engine thread is idle now; from here on it runs this
            time.sleep(step_delay)
            return execute(chunks)

        local.engine.runner.execute = slowed
    return local


@contextmanager
def serving(engine: Any, tokenizer: Any, **options: Any) -> Iterator[str]:
    """An HttpFront on a free port, served by an event loop on its own thread; yields its URL."""
    front = HttpFront(engine, tokenizer, FrontConfig(served_model_name=MODEL, **options), port=0)
    front.bind()
    thread = threading.Thread(target=asyncio.run, args=(front.serve(),), daemon=True)
    thread.start()
    try:
        yield front.url
    finally:
        front.shutdown()
        thread.join(10)


def http(
    url: str, body: Any = None, *, method: str | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any, str]:
    """(status, headers, body text) of one request; a dict body is sent as JSON."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def error_of(text: str) -> dict[str, Any]:
    """The `error` object of an OpenAI-shaped error body (every key present)."""
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def sse_events(text: str) -> list[Any]:
    """The JSON payloads of an SSE body, "[DONE]" as that string."""
    return [
        json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
        for line in text.splitlines()
        if line.startswith("data: ")
    ]
