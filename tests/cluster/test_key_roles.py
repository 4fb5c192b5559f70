"""Key roles on real processes and real sockets (CurveZMQ, workers in --benchmark-mode).

A client key cannot register as a worker (the worker exits 3 saying why; a raw peer gets Refused and never a
Dispatch) nor pause or stop the cluster (it keeps serving); an admin key can, and may act as a client. A second
connection presenting a client's routing id with another key gets nothing of that client's stream, which
completes. A key removed from the authorized folders is cut off: its client's stream and calls fail with
the reason, its worker exits 3, and the cluster serves the others.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from infer import SamplingParams
from infer.client import ClusterError
from infer.protocol.keys import ClusterKeyDir, CurveKeys, write_key_pair
from infer.protocol.messages import Dispatch, Heartbeat, Hello, Refused, decode, encode
from infer.protocol.transport import make_socket

BENCH = ("--max-model-len", "100000")
SHORT = SamplingParams(max_tokens=4)


@pytest.fixture
def keys(tmp_path) -> ClusterKeyDir:
    """A cluster set plus a second client key (clients/other) and a worker key to revoke (workers/doomed)."""
    keys = ClusterKeyDir.create(tmp_path / "keys")
    write_key_pair(keys.path / "clients", "other")
    write_key_pair(keys.path / "clients", "doomed")
    write_key_pair(keys.path / "workers", "doomed")
    return keys


@pytest.fixture
def cluster(cluster_factory, keys):
    cluster = cluster_factory()
    cluster.coordinator(*keys.coordinator_flags())
    cluster.worker(0, *BENCH, *keys.worker_flags(), benchmark=True)
    return cluster


def key_options(keys: ClusterKeyDir, secret) -> dict[str, str]:
    return {"curve_key": str(secret), "coordinator_key": str(keys.public("coordinator"))}


async def raw_peer(
    ctx: zmq.asyncio.Context, keys: ClusterKeyDir, secret, address: str, identity: bytes | None = None
) -> zmq.asyncio.Socket:
    """A bare DEALER with key `secret`, connected once its CURVE handshake succeeded."""
    sock = make_socket(ctx, zmq.DEALER, identity=identity, curve=CurveKeys.client(secret, keys.public("coordinator")))
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    assert await monitor.poll(10_000), "the handshake never succeeded"
    await monitor.recv_multipart()
    sock.disable_monitor()
    monitor.close(0)
    return sock


async def received(sock: zmq.asyncio.Socket, wait_s: float) -> list:
    """Everything `sock` receives within `wait_s` seconds."""
    got = []
    deadline = asyncio.get_running_loop().time() + wait_s
    while (left := deadline - asyncio.get_running_loop().time()) > 0 and await sock.poll(int(left * 1000)):
        got.append(decode((await sock.recv_multipart())[-1]))
    return got


async def collect(stream) -> list:
    return [delta async for delta in stream]


async def test_a_client_key_cannot_register_as_a_worker(cluster, keys):
    impostor = cluster.worker(
        1,
        *BENCH,
        "--curve-key",
        str(keys.secret("client")),
        "--coordinator-key",
        str(keys.public("coordinator")),
        "--connect-timeout",
        "120",
        benchmark=True,
    )
    assert impostor.wait(timeout=60) == 3
    assert "the coordinator refused this worker: hello as a worker refused: it needs a worker key" in impostor.text()
    ctx = zmq.asyncio.Context()
    try:
        async with cluster.client(**keys.client_options()) as client:
            await client.wait_for_workers(1, timeout=30)
            raw = await raw_peer(ctx, keys, keys.path / "clients" / "other.key_secret", cluster.address)
            await raw.send(
                encode(
                    Hello(
                        role="worker",
                        peer_id="w-evil",
                        model_id="x",
                        dp_rank=7,
                        group_id="dp7",
                        num_kv_blocks=10,
                        block_size=16,
                        max_num_seqs=8,
                        max_model_len=64,
                    )
                )
            )
            (refused,) = await received(raw, 1.0)
            assert isinstance(refused, Refused) and "needs a worker key" in refused.reason
            for n in range(4):
                assert (await client.generate([1, 2, n], SHORT)).finish_reason == "length"
            stats = await client.stats()
            assert [w.dp_rank for w in stats.workers] == [0] and stats.num_healthy_workers == 1
            assert not [m for m in await received(raw, 0.5) if isinstance(m, Dispatch)]
            raw.close(0)
    finally:
        ctx.destroy(linger=0)
    assert "refused 'hello' from peer" in cluster.procs[0].text()


async def test_only_an_admin_key_pauses_or_stops_and_it_may_act_as_a_client(cluster, keys):
    async with cluster.client(**keys.client_options()) as client:
        await client.wait_for_workers(1, timeout=30)
        worker_id = (await client.stats()).workers[0].worker_id
        for command in (client.pause, client.stop, lambda: client.drain_worker(worker_id)):
            with pytest.raises(ClusterError, match="refused: it needs a admin key, and key .* is a client key"):
                await command()
        assert (await client.generate([1, 2, 3], SHORT)).token_ids == [3, 4, 5, 6]  # still serving
        async with cluster.client(**keys.admin_options()) as admin:
            assert await admin.pause() == "paused"
            assert await admin.unpause() == "running"
            assert (await admin.generate([1, 2], SHORT)).token_ids == [2, 3, 4, 5]
        assert (await client.stats()).state == "running"
    assert "lifecycle command 'stop' refused" in cluster.procs[0].text()


async def test_a_client_key_probing_refit_paths_learns_nothing_about_them(cluster, keys, tmp_path):
    """The role is checked before anything reads the path: an existing directory (with weights in it) and a
    missing one get the same refusal, which names neither."""
    existing = tmp_path / "weights"
    existing.mkdir()
    (existing / "model.safetensors").write_bytes(b"not really")
    answers = []
    async with cluster.client(**keys.client_options()) as client:
        await client.wait_for_workers(1, timeout=30)
        for path in (existing, tmp_path / "missing", "/etc"):
            with pytest.raises(ClusterError) as refused:
                await client.update_weights(path)
            answers.append(str(refused.value))
    assert answers[0] == answers[1] == answers[2]
    assert "refused: it needs a admin key" in answers[0] and str(tmp_path) not in answers[0]


async def test_another_key_presenting_a_clients_routing_id_gets_nothing_of_its_stream(cluster, keys):
    ctx = zmq.asyncio.Context()
    try:
        async with cluster.client(**keys.client_options()) as client, cluster.client(**keys.admin_options()) as admin:
            await admin.wait_for_workers(1, timeout=30)
            stream = client.stream([1, 2, 3], SamplingParams(max_tokens=60))
            first = await stream.__anext__()
            await admin.pause()  # the stream is in flight while the thief connects
            identity = client._conn.sock.getsockopt(zmq.IDENTITY)
            thief = await raw_peer(
                ctx, keys, keys.path / "clients" / "other.key_secret", cluster.address, identity=identity
            )
            await thief.send(encode(Hello(role="client", peer_id="thief")))
            await thief.send(encode(Heartbeat(sent_at=0.0)))
            await admin.unpause()
            rest = await asyncio.wait_for(collect(stream), 30)
            assert [t for d in [first, *rest] for t in d.token_ids] == list(range(3, 63))
            assert rest[-1].finish_reason == "length"
            assert await received(thief, 1.0) == []  # not one frame: no delta, no Welcome
            thief.close(0)
    finally:
        ctx.destroy(linger=0)


async def test_a_revoked_key_is_cut_off_and_the_others_are_served(cluster, keys, wait_until):
    doomed_worker = cluster.worker(
        1,
        *BENCH,
        "--curve-key",
        str(keys.path / "workers" / "doomed.key_secret"),
        "--coordinator-key",
        str(keys.public("coordinator")),
        benchmark=True,
    )
    async with (
        cluster.client(**keys.client_options()) as client,
        cluster.client(**keys.admin_options()) as admin,
        cluster.client(**key_options(keys, keys.path / "clients" / "doomed.key_secret")) as doomed,
    ):
        await admin.wait_for_workers(2, timeout=30)
        assert (await doomed.generate([1, 2], SHORT)).finish_reason == "length"
        await admin.pause()
        stream = doomed.stream([1, 2, 3], SamplingParams(max_tokens=40))
        pending = asyncio.ensure_future(stream.__anext__())
        kept = asyncio.ensure_future(client.generate([1, 2, 3], SamplingParams(max_tokens=40)))
        await asyncio.sleep(0.3)  # both requests reach the coordinator before the keys go
        (keys.path / "clients" / "doomed.key").unlink()
        (keys.path / "workers" / "doomed.key").unlink()
        with pytest.raises(ClusterError, match="cut this connection off: its key .* is no longer authorized"):
            await asyncio.wait_for(pending, 20)
        with pytest.raises(ClusterError, match="no longer authorized"):
            await doomed.stats()
        assert doomed_worker.wait(timeout=20) == 3
        assert "cut this connection off" in doomed_worker.text()
        await admin.unpause()
        done = await asyncio.wait_for(kept, 30)
        assert done.token_ids == list(range(3, 43))
        stats = await admin.stats()
        assert stats.num_healthy_workers == 1 and stats.num_clients == 2


async def test_one_directory_per_role(cluster_factory, keys):
    """--worker-keys / --client-keys instead of --authorized-keys; no admin keys: nobody drives the lifecycle."""
    cluster = cluster_factory()
    coordinator = cluster.coordinator(
        "--curve-secret-key",
        str(keys.secret("coordinator")),
        "--worker-keys",
        str(keys.path / "workers"),
        "--client-keys",
        str(keys.path / "clients"),
    )
    cluster.worker(0, *BENCH, *keys.worker_flags(), benchmark=True)
    async with cluster.client(**keys.client_options()) as client:
        await client.wait_for_workers(1, timeout=30)
        assert (await client.generate([1, 2, 3], SHORT)).token_ids == [3, 4, 5, 6]
        with pytest.raises(ClusterError, match="needs a admin key"):
            await client.pause()
    admin = cluster.client(**keys.admin_options())
    with pytest.raises(ClusterError, match="refused this peer's CURVE key"):
        await admin.connect()
    assert "no admin keys" in coordinator.text()
