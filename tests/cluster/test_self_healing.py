"""infer-serve keeps its cluster whole (client/supervisor.py): after kill -9 of a worker, the coordinator or the
HTTP front under streaming load, the process is restarted, every stream ends exactly as an uninterrupted greedy
run of it, and all workers are healthy again within 30 s (kill -9 of one member of a TP group: the whole group
is restarted); a worker that crashes at every start is given up after
--max-restarts and the log says why. Real processes on the embedded model, started as the README starts them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from fault_streams import assert_exact_streams, streams_through_a_fault
from group_procs import launched, members_named
from prompts import prompt_of_length
from serve_harness import Served

from infer import SamplingParams
from infer.client import InferenceClient

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
PROMPTS = [prompt_of_length(6 + 4 * i, i) for i in range(6)]
BACK_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def served(smollm2_gguf, tmp_path_factory):
    """`infer-serve --workers 2 --threads 1` on the embedded model at its default dtype, shared by this module's
    kill tests: a stream resumed by a re-prefill continues exactly (a generated token's row is computed again with
    its decode step's bits, tests/worker/test_resume.py)."""
    cluster = Served(None, tmp_path_factory.mktemp("heal") / "serve.log", "smol", ["--threads", "1"])
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def reference(served):
    async def run():
        async with InferenceClient(served.address) as client:
            return await asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS))

    return [c.token_ids for c in asyncio.run(run())]


class _Clients:
    """What streams_through_a_fault needs of a cluster: its clients."""

    def __init__(self, address: str) -> None:
        self.address = address

    def client(self) -> InferenceClient:
        return InferenceClient(self.address, connect_timeout=30)


def _child_pids(served: Served, module: str) -> list[int]:
    return [pid for pid in launched(served.proc.pid) if module in _cmdline(pid)]


async def _back_to_full_capacity(served: Served, since: float) -> None:
    async with InferenceClient(served.address, connect_timeout=30) as client:
        stats = await client.wait_for_workers(2, BACK_WITHIN_S - (time.monotonic() - since))
    assert stats.num_healthy_workers == 2, stats


async def _kill_9_under_load(served: Served, module: str, reference: list[list[int]]) -> int:
    """kill -9 the first child running `module` once every stream is under way; every stream ends exactly as
    the reference and the cluster is back to 2 healthy workers within 30 s. Returns the killed pid."""
    victim = _child_pids(served, module)[0]
    killed_at = 0.0

    async def kill(_client):
        nonlocal killed_at
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()

    streams, _ = await streams_through_a_fault(_Clients(served.address), PROMPTS, GREEDY, kill, finish_timeout=90)
    assert_exact_streams(streams, reference)
    await _back_to_full_capacity(served, killed_at)
    assert victim not in _child_pids(served, module) and len(_child_pids(served, module)) >= 1
    return victim


async def test_a_killed_worker_is_restarted_and_streams_complete_exactly(served, reference):
    await _kill_9_under_load(served, "infer.worker.service.daemon", reference)
    assert "worker" in served.log.read_text() and "restarting it in" in served.log.read_text()


async def test_a_killed_coordinator_is_restarted_and_streams_complete_exactly(served, reference):
    await _kill_9_under_load(served, "infer.coordinator.daemon", reference)
    assert "the coordinator (pid" in served.log.read_text()


def _complete(url: str) -> dict:
    body = json.dumps(
        {"model": "smol", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    ).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_a_killed_http_front_is_restarted_and_serves_a_new_request(served):
    before = _complete(served.url)
    front = _child_pids(served, "infer.client.api.server")[0]
    os.kill(front, signal.SIGKILL)
    after = _complete(served.url)  # waits in the kept socket's backlog until the new front serves
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert front not in _child_pids(served, "infer.client.api.server")


async def test_a_killed_tp_member_takes_its_group_down_and_the_group_is_restarted_whole(tiny_model_dir, tmp_path):
    """`infer-serve --workers 2 --tp-size 2` on a tiny Llama (the embedded model's 9 heads do not split in two):
    kill -9 of one group's follower mid-stream. Its group gives its streams back (they end exactly on the other
    group), infer-serve restarts the whole group, and both DP ranks are healthy again within 30 s."""
    served = Served(
        tiny_model_dir("llama"),
        tmp_path / "serve.log",
        "tiny",
        ["--threads", "1", "--tp-size", "2", "--dtype", "float32"],
    )
    try:
        async with InferenceClient(served.address) as client:
            reference = [c.token_ids for c in await asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS))]
        groups = _child_pids(served, "infer.worker.service.daemon")
        followers = [pid for group in groups for pid in members_named(group, "infer-tp1")]
        assert len(groups) == 2 and len(followers) == 2, (groups, followers)
        killed_at = 0.0

        async def kill(_client):
            nonlocal killed_at
            os.kill(followers[0], signal.SIGKILL)
            killed_at = time.monotonic()

        streams, _ = await streams_through_a_fault(_Clients(served.address), PROMPTS, GREEDY, kill, finish_timeout=120)
        assert_exact_streams(streams, reference)
        await _back_to_full_capacity(served, killed_at)
        text = served.log.read_text()
        assert "restarting it in" in text and followers[0] not in [
            pid for group in _child_pids(served, "infer.worker.service.daemon") for pid in _member_pids(group)
        ]
    finally:
        served.stop()


def _member_pids(group: int) -> list[int]:
    return [
        int(pid)
        for pid in subprocess.run(
            ["pgrep", "-P", str(group)], capture_output=True, text=True, check=False
        ).stdout.split()
    ]


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError:
        return ""


def test_a_worker_that_crashes_at_every_start_is_given_up(tmp_path):
    log = tmp_path / "serve.log"
    started = time.monotonic()
    with open(log, "wb") as err:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "infer.client.serve",
                "--workers",
                "1",
                "--port",
                "0",
                "--benchmark-mode",
                "--max-restarts",
                "2",
                "--restart-backoff",
                "0.1",
                "--",
                "--coordinator",
                "tcp://127.0.0.1:9",
                "--connect-timeout",
                "1",
            ],  # nobody there
            stdout=subprocess.PIPE,
            stderr=err,
            timeout=120,
        )
    text = log.read_text()
    assert done.returncode == 1, text
    assert text.count("restarting it in") == 2
    assert "worker 0 (pid" in text and "is not restarted: it exited with code 1 after 2 restarts within 300 s" in text
    assert time.monotonic() - started < 120


def test_a_worker_that_refuses_its_options_is_given_up_at_once_saying_why(smollm2_gguf, tmp_path):
    """`infer-serve --tp-size 2` on the embedded model (9 attention heads): the group exits 2 and is not restarted
    (the same command would fail again); infer-serve ends with the model's reason in its log."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "infer.client.serve",
                "--workers",
                "1",
                "--port",
                "0",
                "--tp-size",
                "2",
                "--threads",
                "1",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            timeout=120,
        )
    text = log.read_text()
    assert done.returncode == 1, text
    assert "restarting it in" not in text
    assert "the number of attention heads (9) does not split across 2 tensor-parallel ranks" in text
    assert "is not restarted: it exited with code 2: its options or model were refused" in text
