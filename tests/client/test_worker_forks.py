"""Workers forked from one torch-imported server (client/worker_forks.py): each child runs its module as a fresh
`python -m` would, its exit code and signals come back through the server, a changed import-time variable takes the
new-interpreter path, and a dead server's children are killed and reported as killed (the Supervisor restarts them).
The whole cluster on forked workers: tests/cluster (infer-serve, LLM's coordinator mode) and test_demo use them by
default; here, LocalCluster's choice between the two ways."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from infer.client import InferenceClient
from infer.client.serve import LocalCluster
from infer.client.worker_forks import ForkedProcess, WorkerForks, forkable
from infer.protocol import env
from infer.protocol.sampling import SamplingParams

# a module the children run: it reports what a fresh interpreter would have set up, then exits as told
PROBE = """
import json, os, random, sys
out = sys.argv[1]
with open(out, "w") as f:
    json.dump({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(), "pid": os.getpid(),
               "sid": os.getsid(0), "ppid": os.getppid(), "probe_var": os.environ.get("PROBE_VAR"),
               "draw": random.random(), "stdin": os.readlink("/proc/self/fd/0"), "torch": "torch" in sys.modules,
               "infer": sorted(m for m in sys.modules if m.split(".")[0] == "infer")}, f)
action = sys.argv[2]
if action == "sleep":
    import time
    time.sleep(600)
raise SystemExit(int(action))
"""


async def _exit_code(proc: ForkedProcess) -> int:
    return await asyncio.wait_for(proc.wait(), 60)


def _report(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture
async def forks(tmp_path, monkeypatch):
    (tmp_path / "probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    server = await WorkerForks.start()
    assert server is not None, "the fork server did not start (see the log)"
    yield server
    await server.close()


async def test_a_forked_child_runs_its_module_as_a_fresh_interpreter_would(forks, tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_VAR", "set after the server started")
    first, second = await forks.spawn(["-m", "probe", "a.json", "3"]), await forks.spawn(["-m", "probe", "b.json", "0"])
    assert isinstance(first, ForkedProcess) and isinstance(second, ForkedProcess)
    assert await _exit_code(first) == 3 and first.returncode == 3
    assert await _exit_code(second) == 0
    a, b = _report(tmp_path / "a.json"), _report(tmp_path / "b.json")
    assert a["argv"][1:] == ["a.json", "3"] and a["argv"][0].endswith("probe.py")  # as `python -m probe` sets it
    assert a["name"] == "__main__" and a["path0"] == str(tmp_path) == a["cwd"]
    assert a["pid"] == first.pid and a["sid"] == first.pid  # a session (and process group) of its own
    assert a["ppid"] != os.getpid()  # the server's child, not ours
    assert a["probe_var"] == "set after the server started"  # the environment at the spawn, not the server's
    assert a["draw"] != b["draw"]  # `random` reseeded in each child
    assert a["stdin"] == "/dev/null"
    # torch came with the fork; nothing of infer did (the server runs by its path), so a worker imports its own
    assert a["torch"] and a["infer"] == []


async def test_signals_reach_the_child_and_come_back_as_popen_codes(forks, tmp_path):
    child = await forks.spawn(["-m", "probe", "c.json", "sleep"])
    for _ in range(600):
        if (tmp_path / "c.json").exists():
            break
        await asyncio.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    assert await _exit_code(child) == -signal.SIGTERM
    child.kill()  # after its end: nothing, no error


async def test_a_changed_import_time_variable_takes_the_new_interpreter_path(forks, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1" if os.environ.get("OMP_NUM_THREADS") != "1" else "2")
    assert await forks.spawn(["-m", "probe", "d.json", "0"]) is None
    assert not forkable({"OMP_NUM_THREADS": "3"}, {}) and forkable({"INFER_X": "1"}, {})
    with pytest.raises(ValueError, match="only `-m module`"):
        await forks.spawn(["probe.py"])


async def test_a_dead_server_s_children_are_killed_and_reported_killed(forks, tmp_path):
    children = [await forks.spawn(["-m", "probe", f"e{i}.json", "sleep"]) for i in range(2)]
    os.killpg(forks._server.pid, signal.SIGKILL)
    for child in children:
        assert await _exit_code(child) == -signal.SIGKILL
    await asyncio.sleep(0.2)
    for child in children:  # killed for real, not only reported so
        assert not Path(f"/proc/{child.pid}").exists() or "Z" in Path(f"/proc/{child.pid}/stat").read_text().split()[2]
    assert not forks.alive and await forks.spawn(["-m", "probe", "f.json", "0"]) is None


@pytest.mark.parametrize("fork", ["1", "0"])
async def test_a_local_cluster_s_workers_serve_forked_or_as_new_interpreters(fork, monkeypatch):
    """The default forks; INFER_FORK_WORKERS=0 starts each worker as a new interpreter. Either way the cluster
    answers the same, and a worker killed -9 is reported with its signal and restarted in place (one worker: the
    request after the restart can only be the new one's)."""
    if fork == "0":
        monkeypatch.setenv(env.FORK_WORKERS.name, "0")
    cluster = LocalCluster(num_workers=1, worker_args=["--log-level", "WARNING"])
    await cluster.start()
    try:
        await cluster.wait_ready(180)
        assert all(isinstance(w, ForkedProcess) == (fork == "1") for w in cluster.workers)
        async with InferenceClient(cluster.address, connect_timeout=60) as client:
            params = SamplingParams(max_tokens=8, temperature=0)
            before = await client.generate("The capital of France is", params)
            first = {w.worker_id for w in (await client.stats()).workers}
            victim = cluster.workers[0]
            victim.send_signal(signal.SIGKILL)
            assert await asyncio.wait_for(victim.wait(), 60) == -signal.SIGKILL
            await cluster.respawn_worker(0)
            for _ in range(1800):  # until the new worker (another id) serves: 180 s at most
                if {w.worker_id for w in (await client.stats()).workers if w.healthy} - first:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the restarted worker did not join within 180 s")
            after = await client.generate("The capital of France is", params)
        assert after.token_ids == before.token_ids and before.finish_reason == "length"
    finally:
        await cluster.shutdown()
    assert all(w.returncode is not None for w in cluster.workers)
