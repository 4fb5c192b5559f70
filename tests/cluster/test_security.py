"""CurveZMQ and the trusted-network rule on real processes and real sockets (workers in --benchmark-mode).

With keys, an authorized worker and client serve end to end; a client or worker with an unknown key, and a
peer without keys, never get a frame to the coordinator (it logs who it refused, its counters show nothing
rejected and no new client), and the client's connect() fails at once (from the handshake events, not at its
connect timeout) saying why; such a worker exits 3 at once, saying why. (Key roles: test_key_roles.py.)
Without keys, the daemons refuse a non-loopback bind unless --trusted-network; bad key files exit 2 with the
reason. The EP wake channel lets in only its group's keys. infer-serve and LLM plumb the keys through.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import signal
import stat
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from aioprocs import kill_group
from ports import join_gloo, tcp_store

from infer import AsyncLLM, SamplingParams
from infer.client import ClusterError, InferenceClient
from infer.client import serve as serve_module
from infer.client.api import server as api_server
from infer.protocol.keys import ClusterKeyDir, read_public_key

BENCH = ("--max-model-len", "100000")
SHORT = SamplingParams(max_tokens=4)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> ClusterKeyDir:
    return ClusterKeyDir.create(tmp_path_factory.mktemp("keys") / "cluster")


@pytest.fixture(scope="module")
def stranger(tmp_path_factory) -> ClusterKeyDir:
    """A whole key set nobody authorized."""
    return ClusterKeyDir.create(tmp_path_factory.mktemp("stranger") / "keys")


@pytest.fixture
def secured(cluster_factory, keys):
    """A coordinator with keys and one authorized benchmark worker (not waited for)."""
    cluster = cluster_factory()
    cluster.coordinator(*keys.coordinator_flags())
    cluster.worker(0, *BENCH, *keys.worker_flags(), benchmark=True)
    return cluster


def _log_has(proc, text: str):
    async def check() -> bool:
        return text in proc.text()

    return check


async def test_with_keys_an_authorized_worker_and_client_serve(secured, keys):
    async with secured.client(**keys.client_options()) as client:
        await client.wait_for_workers(1, timeout=30)
        done = await client.generate([1, 2, 3], SHORT)
        assert (done.token_ids, done.finish_reason) == ([3, 4, 5, 6], "length")  # benchmark: (P + i) % 1000
    coordinator_log = secured.procs[0].text()
    assert f"coordinator public key {read_public_key(keys.public('coordinator')).decode()}" in coordinator_log
    assert "3 authorized key(s): 1 worker key(s)" in coordinator_log and "refused" not in coordinator_log


async def test_a_client_with_an_unknown_key_is_refused_logged_and_never_a_client(secured, keys, stranger, wait_until):
    coordinator = secured.procs[0]
    async with secured.client(**keys.client_options()) as client:
        await client.wait_for_workers(1, timeout=30)
        before = await client.stats()
        intruder = secured.client(
            curve_key=stranger.secret("client"), coordinator_key=keys.public("coordinator"), connect_timeout=60
        )
        started = time.monotonic()
        with pytest.raises(ClusterError, match="the coordinator refused this peer's CURVE key"):
            await intruder.connect()
        assert time.monotonic() - started < 40  # well before its 60 s connect timeout
        key = read_public_key(stranger.public("client")).decode()
        await wait_until(
            _log_has(coordinator, f"from 127.0.0.1 with unknown public key {key}"),
            5,
            "the refusal in the coordinator's log",
        )
        after = await client.stats()
        assert before.frames_rejected == after.frames_rejected == 0  # no frame of its reached a handler
        assert before.num_clients == after.num_clients == 1  # only this client ever said Hello
        assert after.requests_submitted == before.requests_submitted
    assert "WARNING" in next(line for line in coordinator.text().splitlines() if key in line)


@pytest.mark.parametrize("hello_delay", [0.0, 0.5])
async def test_a_refused_client_gets_its_error_however_its_hello_and_the_refusal_race(
    secured, monkeypatch, hello_delay
):
    """The refusal can tear the client's only pipe down before its Hello is queued, and a DEALER's send then
    waits for a pipe that never comes: once, CI hung here for good. With the Hello sent at once and after the
    refusal (delayed), each try must end in a ClusterError, fast."""
    real = InferenceClient._request_reply

    async def late(self, *args):
        await asyncio.sleep(hello_delay)
        return await real(self, *args)

    monkeypatch.setattr(InferenceClient, "_request_reply", late)
    for _ in range(4):
        plain = secured.client(connect_timeout=60)
        with pytest.raises(ClusterError):
            await asyncio.wait_for(plain.connect(), 15)


async def test_a_client_without_keys_is_refused_by_a_coordinator_with_keys(secured, keys, wait_until):
    coordinator = secured.procs[0]
    plain = secured.client(connect_timeout=60)
    started = time.monotonic()
    with pytest.raises(ClusterError, match="CURVE keys: pass curve_key and coordinator_key"):
        await plain.connect()
    await wait_until(_log_has(coordinator, "does not speak CURVE"), 5, "the refusal in the log")
    wrong_server = secured.client(
        curve_key=keys.secret("client"), coordinator_key=keys.public("worker"), connect_timeout=60
    )
    with pytest.raises(ClusterError, match="coordinator_key is not the coordinator's public key"):
        await wrong_server.connect()
    assert time.monotonic() - started < 40  # both before their 60 s connect timeouts
    async with secured.client(**keys.client_options()) as client:
        stats = await client.stats()
        assert (stats.frames_rejected, stats.num_clients) == (0, 1)


async def test_workers_with_an_unknown_key_or_none_never_register(secured, keys, stranger, wait_until):
    coordinator = secured.procs[0]
    intruder = secured.worker(
        1,
        *BENCH,
        "--curve-key",
        str(stranger.secret("worker")),
        "--coordinator-key",
        str(keys.public("coordinator")),
        "--connect-timeout",
        "120",
        benchmark=True,
    )
    plain = secured.worker(2, *BENCH, "--connect-timeout", "120", benchmark=True)
    assert intruder.wait(timeout=60) == 3 and plain.wait(timeout=60) == 3  # refused at once, not at 120 s
    key = read_public_key(stranger.public("worker")).decode()
    await wait_until(_log_has(coordinator, f"unknown public key {key}"), 5, "the refusal in the log")
    async with secured.client(**keys.client_options()) as client:
        stats = await client.wait_for_workers(1, timeout=30)
        assert [w.dp_rank for w in stats.workers] == [0] and stats.frames_rejected == 0
    assert "the coordinator refused this peer's CURVE key" in intruder.text()
    assert "CURVE keys: pass --curve-key and --coordinator-key" in plain.text()


def _run(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout)


def test_without_keys_a_non_loopback_bind_needs_trusted_network(cluster_factory):
    refused = _run("-m", "infer.coordinator.daemon", "--host", "0.0.0.0", "--port", "0")
    assert refused.returncode == 2
    assert (
        "refusing to run the coordinator on 0.0.0.0, which is not a loopback address, without "
        "authentication: pass --curve-secret-key FILE and --authorized-keys DIR"
    ) in refused.stderr
    assert "--trusted-network" in refused.stderr
    cluster = cluster_factory()
    trusted = cluster.coordinator("--host", "0.0.0.0", "--trusted-network")
    deadline = time.monotonic() + 20
    while not re.search(r"listening on tcp://0\.0\.0\.0:\d+", trusted.text()):
        assert trusted.popen.poll() is None and time.monotonic() < deadline, trusted.text()
        time.sleep(0.05)
    trusted.popen.send_signal(signal.SIGTERM)
    assert trusted.wait(timeout=15) == 0


@pytest.mark.parametrize(
    "case",
    [
        "public-as-secret",
        "one-flag",
        "no-directory",
        "empty-directory",
        "flat-directory",
        "no-role-directory",
        "worker-public-as-secret",
        "worker-one-flag",
    ],
)
def test_bad_key_options_exit_2_with_the_reason(case, keys, tmp_path):
    coordinator = ("-m", "infer.coordinator.daemon", "--port", "0")
    worker = ("-m", "infer.worker.service.daemon", "--coordinator", "tcp://127.0.0.1:9", "--benchmark-mode")
    (tmp_path / "empty").mkdir()
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "client.key").write_bytes(keys.public("client").read_bytes())
    argv, message = {
        "public-as-secret": (
            (*coordinator, "--curve-secret-key", str(keys.public("coordinator")), "--authorized-keys", str(keys.path)),
            "holds only a public key",
        ),
        "one-flag": (
            (*coordinator, "--curve-secret-key", str(keys.secret("coordinator"))),
            "--curve-secret-key and --authorized-keys go together",
        ),
        "no-directory": (
            (
                *coordinator,
                "--curve-secret-key",
                str(keys.secret("coordinator")),
                "--authorized-keys",
                str(tmp_path / "missing"),
            ),
            "does not exist or is not a ",
        ),
        "empty-directory": (
            (
                *coordinator,
                "--curve-secret-key",
                str(keys.secret("coordinator")),
                "--authorized-keys",
                str(tmp_path / "empty"),
            ),
            "no public key files",
        ),
        "no-role-directory": (
            (
                *coordinator,
                "--curve-secret-key",
                str(keys.secret("coordinator")),
                "--authorized-keys",
                str(keys.path),
                "--admin-keys",
                str(tmp_path / "missing"),
            ),
            "admin keys directory",
        ),
        "flat-directory": (
            (
                *coordinator,
                "--curve-secret-key",
                str(keys.secret("coordinator")),
                "--authorized-keys",
                str(tmp_path / "flat"),
            ),
            "the layout from before key roles",
        ),
        "worker-public-as-secret": (
            (*worker, "--curve-key", str(keys.public("worker")), "--coordinator-key", str(keys.public("coordinator"))),
            "holds only a public key",
        ),
        "worker-one-flag": (
            (*worker, "--curve-key", str(keys.secret("worker"))),
            "--curve-key and --coordinator-key go together",
        ),
    }[case]
    done = _run(*argv)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_infer_keygen_writes_a_private_secret_and_never_overwrites(tmp_path):
    keygen = Path(sys.executable).with_name("infer-keygen")
    argv = [str(keygen), "ops", "--dir", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    secret = tmp_path / "ops.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and (tmp_path / "ops.key").exists()
    before = secret.read_bytes()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert again.returncode == 1 and "refusing to overwrite" in again.stderr
    assert secret.read_bytes() == before


# ---- infer-serve, infer-api, LLM -------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--coordinator-host", "0.0.0.0"], "refusing to run the coordinator on 0.0.0.0"),
        (["--host", "0.0.0.0"], "refusing to run the HTTP front on 0.0.0.0"),
    ],
)
def test_infer_serve_refuses_an_unprotected_non_loopback_bind(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("INFER_API_KEY", raising=False)
    assert serve_module.main(["--benchmark-mode", *argv]) == 2
    assert message in capsys.readouterr().err


def test_infer_api_refuses_an_open_front_and_bad_key_files(capsys, monkeypatch, keys):
    monkeypatch.delenv("INFER_API_KEY", raising=False)
    assert api_server.main(["--coordinator", "tcp://127.0.0.1:9", "--host", "0.0.0.0"]) == 2
    assert "the HTTP front on 0.0.0.0" in capsys.readouterr().err
    one_key = ["--curve-key", str(keys.secret("client"))]
    assert api_server.main(["--coordinator", "tcp://127.0.0.1:9", *one_key]) == 2
    assert "--curve-key and --coordinator-key go together" in capsys.readouterr().err


async def test_infer_serve_with_a_keys_dir_secures_every_link(keys):
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
        "--keys-dir",
        str(keys.path),
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
        match = re.search(r"ready: 1 worker\(s\).*connect to (tcp://\S+)", line)
        assert match, line
        async with InferenceClient(match.group(1), **keys.client_options()) as client:
            assert (await client.generate([1, 2], SHORT)).token_ids == [2, 3, 4, 5]
        with pytest.raises(ClusterError):
            await InferenceClient(match.group(1), connect_timeout=1).connect()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await kill_group(proc)


async def test_llm_joins_a_secured_cluster_with_its_keys(secured, keys):
    options = keys.client_options()
    async with AsyncLLM(coordinator_address=secured.address, ready_timeout=30, **options) as llm:
        assert llm.engine.curve is not None
        stats = await llm.engine.stats()
        assert stats.num_healthy_workers == 1
    with pytest.raises(ValueError, match="for joining a cluster"):
        AsyncLLM(use_coordinator=True, **options)
    with pytest.raises(ValueError, match="go together"):
        AsyncLLM(coordinator_address=secured.address, curve_key=options["curve_key"])


# ---- the EP group's wake channel ----------------------------------------------------------------


def _ep_rank(rank: int, port: int, key_files: list[str], stranger_secret: str, results) -> None:
    """Rank `rank` of a 2-rank gloo group: first a wake channel where rank 1 has no key (every rank must
    refuse it), then one where each rank has its own key; a stranger's wake to rank 1 is refused, rank 0's
    arrives. Puts (rank, (the refusal text, what rank 1 saw or "woke rank 1")) or a traceback."""
    import torch.distributed as dist
    import zmq

    from infer.protocol.keys import CurveKeys
    from infer.protocol.transport import make_socket
    from infer.worker.distributed.group_sync import EpOptions, GroupSync

    try:
        options = EpOptions(size=2, rank=rank, dist_init=f"tcp://127.0.0.1:{port}", timeout_s=20)
        join_gloo(rank, 2, port)
        ctx = zmq.Context()
        curve = CurveKeys.server(key_files[rank])
        try:
            GroupSync(options, ctx, curve=curve if rank == 0 else None)
            mixed = "accepted"
        except ValueError as e:
            mixed = str(e)
        sync = GroupSync(options, ctx, curve=curve)
        if rank == 1:  # a stranger with rank 1's address and public key, and its own key, cannot wake it
            endpoint = sync.wake_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
            intruder_keys = CurveKeys.server(stranger_secret).towards(curve.public_key)
            intruder = make_socket(ctx, zmq.PUSH, curve=intruder_keys)
            intruder.connect(endpoint)
            intruder.send(b"\0" * 8)  # a wake for round 0
            time.sleep(1.0)
            stranger_woke = sync.woken()
            intruder.close()
            dist.barrier()
            deadline = time.monotonic() + 10
            while not sync.woken():
                assert time.monotonic() < deadline, "rank 0's wake never arrived"
                time.sleep(0.01)
            seen = ("stranger woke me" if stranger_woke else "only the peer woke me", sync._gate.refused)
        else:
            dist.barrier()
            sync.wake_peers()
            seen = "woke rank 1"
        results.put((rank, (mixed, seen)))
        dist.barrier()
        sync.close()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_the_ep_wake_channel_needs_keys_on_every_rank_and_lets_in_only_the_groups(keys, stranger):
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    store = tcp_store()  # the ranks' rendezvous, held by this process until they are done
    port = store.port
    key_files = [str(keys.secret("worker")), str(keys.secret("client"))]  # each rank its own pair
    intruder = str(stranger.secret("worker"))
    procs = [spawn.Process(target=_ep_rank, args=(r, port, key_files, intruder, results)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        got = dict(results.get(timeout=90) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    for rank in (0, 1):
        assert isinstance(got[rank], tuple), got[rank]
        assert "EP group ranks [1] have no CURVE key and the others do" in got[rank][0]
    assert got[0][1] == "woke rank 1"
    assert got[1][1][0] == "only the peer woke me" and got[1][1][1] >= 1
