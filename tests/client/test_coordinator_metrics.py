"""The coordinator's counters on the HTTP front's /metrics: a real coordinator process, an HttpFront over an
InferenceClient, and frames the coordinator rejects: counted there, scraped here."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import subprocess
import sys
import urllib.request

import msgpack
import zmq
from ports import reserved_port

from infer.client import InferenceClient
from infer.client.api.config import FrontConfig
from infer.client.api.server import HttpFront
from infer.protocol.messages import Counters


def _series(text: str, name: str) -> float:
    (value,) = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(value)


def _send_junk(address: str, frames: list[bytes]) -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(address)
        for frame in frames:
            sock.send(frame)


async def test_counters_the_coordinator_increments_show_up_in_metrics(tmp_path):
    port = reserved_port()
    address = f"tcp://127.0.0.1:{port}"
    with open(tmp_path / "coordinator.log", "wb") as log:
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "infer.coordinator.daemon", "--port", str(port), "--heartbeat-interval", "0.2"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        async with InferenceClient(address, heartbeat_interval=0.2) as client:
            front = HttpFront(client, None, FrontConfig(served_model_name="tiny"), port=0)
            front.bind()
            serving = asyncio.create_task(front.serve())
            try:
                before = await asyncio.to_thread(_scrape, front.url)
                for name in (f.name for f in dataclasses.fields(Counters)):
                    assert _series(before, f"infer:coordinator_{name}_total") == 0.0, name
                junk = [b"\xc1", msgpack.packb({"type": "no_such_message", "v": 1, "body": {}})]
                await asyncio.to_thread(_send_junk, address, junk)
                for _ in range(100):
                    if (await client.stats()).frames_rejected >= 2:
                        break
                    await asyncio.sleep(0.05)
                after = await asyncio.to_thread(_scrape, front.url)
                assert _series(after, "infer:coordinator_frames_rejected_total") == 2.0
                assert _series(after, "infer:coordinator_requests_submitted_total") == 0.0
            finally:
                front.shutdown()
                await serving
    finally:
        os.killpg(coordinator.pid, signal.SIGKILL)
        coordinator.wait(10)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        return response.read().decode()
