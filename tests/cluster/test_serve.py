"""infer-serve starts a coordinator and N workers, reports ready, serves, and on SIGTERM (or a client's
stop) shuts everything down with no process left behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from aioprocs import kill_group, pid_gone
from group_procs import launched

from infer import SamplingParams
from infer.client import InferenceClient


def _children(pid: int) -> list[int]:
    return launched(pid)


async def _start_serve(*flags: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "infer.client.serve",
        "--benchmark-mode",
        "--heartbeat-interval",
        "0.2",
        "--log-level",
        "WARNING",
        "--port",
        "0",
        *flags,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    match = re.search(r"ready: (\d+) worker\(s\).*HTTP at (http://\S+?);.*connect to (tcp://\S+)", line)
    assert match, line
    proc.url = match.group(2)  # the HTTP front
    return proc, match.group(3)


async def test_serve_runs_a_cluster_and_sigterm_leaves_no_process():
    proc, address = await _start_serve("--workers", "2", "--threads", "1")
    children = _children(proc.pid)
    try:
        assert len(children) == 4  # the coordinator, two workers and the HTTP front
        async with InferenceClient(address) as client:
            stats = await client.stats()
            assert stats.num_healthy_workers == 2
            done = await asyncio.gather(*(client.generate([1, 2, 3], SamplingParams(max_tokens=4)) for _ in range(20)))
            assert {c.finish_reason for c in done} == {"length"}
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert all(pid_gone(pid) for pid in children)
    finally:
        await kill_group(proc)
        for pid in children:
            if not pid_gone(pid):
                os.killpg(pid, signal.SIGKILL)


async def test_serve_with_three_coordinators_serves_through_the_leaders_kill_9():
    proc, address = await _start_serve("--workers", "1", "--coordinators", "3")
    children = _children(proc.pid)
    try:
        assert len(address.split(",")) == 3 and len(children) == 5  # three coordinators, the worker, the HTTP front
        async with InferenceClient(address) as client:
            leader = client.address  # the one that welcomed it
            done = await asyncio.wait_for(client.generate([1, 2, 3], SamplingParams(max_tokens=4)), 30)
            assert done.token_ids == [3, 4, 5, 6]
            model = client.model_id
        leader_pid = next(pid for pid in children if f"--port {leader.rpartition(':')[2]} " in _cmdline(pid))
        os.killpg(leader_pid, signal.SIGKILL)
        async with InferenceClient(address, connect_timeout=30) as client:
            await client.wait_for_workers(1, 30)
            assert client.address != leader
            done = await asyncio.wait_for(client.generate([1, 2], SamplingParams(max_tokens=3)), 30)
            assert done.token_ids == [2, 3, 4]
        # the HTTP front's own client moved to the new leader too
        body = json.dumps({"model": model, "prompt": [1, 2, 3], "max_tokens": 2}).encode()
        request = urllib.request.Request(
            f"{proc.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        answer = await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(request, timeout=60).read()))
        assert answer["choices"][0]["finish_reason"] == "length", answer
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        children += [pid for pid in _children(proc.pid) if pid not in children]  # a restarted coordinator too
        await kill_group(proc)
        for pid in children:
            if not pid_gone(pid):
                os.killpg(pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode() + " "
    except OSError:
        return ""


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


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pp-size", "0"], "--pp-size must be >= 1, got 0"),
        (["--tp-size", "-1"], "--tp-size must be >= 1, got -1"),
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (
            ["--coordinators", "2"],
            "--coordinators must be 1, or 3 to 15 (two cannot tell a dead peer from a cut cable, so neither could "
            "take over safely), got 2",
        ),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--ready-timeout", "0"], "--ready-timeout must be > 0 seconds, got 0.0"),
        (["--shutdown-timeout", "nan"], "--shutdown-timeout must be > 0 seconds, got nan"),
    ],
)
def test_infer_serve_refuses_its_own_bad_sizes_before_starting_anything(flags, message):
    done = subprocess.run(
        [sys.executable, "-m", "infer.client.serve", *flags], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"infer-serve: {message}"


def test_a_worker_that_refuses_its_flags_stops_infer_serve_with_one_clear_reason():
    done = subprocess.run(
        [sys.executable, "-m", "infer.client.serve", "--benchmark-mode", "--port", "0", "--", "--max-num-seqs", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "max_num_seqs must be a positive integer, got 0" in done.stderr
    assert "worker 0 is not restarted: it exited with code 2" in done.stderr
    assert "never retrieved" not in done.stderr and "Traceback" not in done.stderr, done.stderr
