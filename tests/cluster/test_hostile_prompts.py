"""Hostile requests against real processes. A prompt far too long for the context, sent over ZeroMQ to a
coordinator and worker (the tiny Llama, max_model_len 256): the worker refuses it before tokenizing
(tokenizing 20 MB takes seconds on its loop, long enough to miss heartbeats and be declared dead), so the
refusal comes at once, as invalid_request, while another request on the same worker streams on and the
worker stays healthy (nothing re-dispatched). A stream through an `infer-api` front whose coordinator is
killed mid-way still ends: an SSE error event, then [DONE]."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time

from infer.client.inference_client import SyncInferenceClient
from infer.protocol.sampling import SamplingParams

HUGE_PROMPT = "hello world " * (20_000_000 // 12)  # 20 MB
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


async def _refusal_while_streaming(cluster) -> None:
    async with cluster.client() as client:
        done = []
        async with asyncio.timeout(60):
            stream = client.stream([3, 4, 5], LONG)
            done.append(await anext(stream))
            refused = await client.generate(HUGE_PROMPT, SamplingParams(max_tokens=4))
            done.extend([delta async for delta in stream])
        assert refused.finish_reason == "error" and refused.error_code == "invalid_request", refused
        # the refusal's own words show the path: the length was bounded from the text, nothing was tokenized
        assert "refused without tokenizing" in refused.error and "256 tokens" in refused.error
        assert sum(len(d.token_ids) for d in done) == 200 and done[-1].finish_reason == "length"
        stats = await client.stats()
        assert stats.requests_redispatched == 0 and stats.num_healthy_workers == 1
        assert stats.workers[0].registrations == 1
        again = await client.generate("hello world " * 10, SamplingParams(max_tokens=4, temperature=0))
        assert again.finish_reason == "length" and len(again.token_ids) == 4


def test_a_20_mb_prompt_is_refused_at_once_while_another_stream_continues(model_cluster):
    cluster = model_cluster(workers=1)
    asyncio.run(_refusal_while_streaming(cluster))


def _start_front(cluster) -> tuple[str, int]:
    """An infer-api front on `cluster`; (host, port) once it listens."""
    proc = cluster.spawn(
        "front",
        "-m",
        "infer.client.api.server",
        "--coordinator",
        cluster.address,
        "--port",
        "0",
        "--served-model-name",
        "tiny",
        "--log-level",
        "WARNING",
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the front logs its address once it listens
        match = re.search(r"on http://(\S+):(\d+), cluster", proc.text())
        if match:
            return match.group(1), int(match.group(2))
        assert proc.popen.poll() is None, proc.text()
        time.sleep(0.1)
    raise AssertionError(f"infer-api did not start: {proc.text()}")


def test_a_stream_ends_with_an_error_event_and_done_when_the_coordinator_dies(cluster_factory, tiny_llama):
    cluster = cluster_factory()
    cluster.coordinator()
    cluster.worker(
        0,
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        "16000000",
        "--threads",
        "1",
        model=tiny_llama,
    )
    with SyncInferenceClient(cluster.address, connect_timeout=30) as client:  # the front's tokenizer: the
        # model the cluster serves, known once a worker joined (before that it would load the default model)
        client.wait_for_workers(1, timeout=120)
    host, port = _start_front(cluster)
    body = json.dumps(
        dict(model="tiny", prompt=[3, 4, 5], max_tokens=2000, ignore_eos=True, temperature=0, stream=True)
    ).encode()
    with socket.create_connection((host, port), timeout=60) as sock:  # the front's silence timeout is 10 s
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        reader = sock.makefile("rb")
        assert b" 200 " in reader.readline()
        while not reader.readline().startswith(b"data: {"):  # the first chunk: the stream is under way
            pass
        cluster.procs[0].kill9()  # the coordinator, mid-stream, never back
        # The worker stopped too, so that the stream cannot end by itself first: a direct stream keeps flowing from
        # its worker, and only the coordinator's silence for the front's 10 s ends it (a fast machine finished all
        # 2,000 tokens within those 10 s).
        worker = cluster.procs[1].popen
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            events = [line.strip() for line in reader if line.startswith(b"data: ")]
        finally:
            os.kill(worker.pid, signal.SIGCONT)
    assert events[-1] == b"data: [DONE]", events[-3:]
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "unavailable" and "coordinator" in error["message"]
    finish = [c["finish_reason"] for e in events[:-2] for c in json.loads(e[6:])["choices"]]
    assert not any(finish)  # cut off, not finished
