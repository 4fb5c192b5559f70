"""infer-serve starts a coordinator and N workers, reports ready, serves, and on SIGTERM (or a client's
stop) shuts everything down with no process left behind."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

from aioprocs import kill_group, pid_gone

from infer import SamplingParams
from infer.client import InferenceClient


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return [int(x) for x in out.split()]


async def _start_serve(*flags: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infer.client.serve", "--benchmark-mode", "--heartbeat-interval", "0.2",
        "--log-level", "WARNING", "--port", "0", *flags, stdout=asyncio.subprocess.PIPE, start_new_session=True)
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    match = re.search(r"ready: (\d+) worker\(s\).*connect to (tcp://\S+)", line)
    assert match, line
    return proc, match.group(2)




async def test_serve_runs_a_cluster_and_sigterm_leaves_no_process():
    proc, address = await _start_serve("--workers", "2", "--threads", "1")
    children = _children(proc.pid)
    try:
        assert len(children) == 4                      # the coordinator, two workers and the HTTP front
        async with InferenceClient(address) as client:
            stats = await client.stats()
            assert stats.num_healthy_workers == 2
            done = await asyncio.gather(*(client.generate([1, 2, 3], SamplingParams(max_tokens=4))
                                          for _ in range(20)))
            assert {c.finish_reason for c in done} == {"length"}
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert all(pid_gone(pid) for pid in children)
    finally:
        await kill_group(proc)
        for pid in children:
            if not pid_gone(pid):
                os.killpg(pid, signal.SIGKILL)


async def test_a_client_stop_ends_infer_serve():
    proc, address = await _start_serve("--workers", "1")
    children = _children(proc.pid)
    try:
        async with InferenceClient(address) as client:
            assert await client.stop() == "stopped"
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert all(pid_gone(pid) for pid in children)
    finally:
        await kill_group(proc)
