"""Direct streams on real processes with CurveZMQ keys (docs/architecture.md, "Direct streams"): a second client
holding a valid client key of the cluster cannot read the first client's stream at the worker's stream socket,
neither with a wrong token nor with the right token under its own key; it is refused, gets no delta, and the first
client's stream goes on exactly (a benchmark worker: output token i of a 3-token prompt is 3 + i)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from infer import SamplingParams
from infer.protocol.codes import ErrorCode
from infer.protocol.keys import ClusterKeyDir, CurveKeys, read_key_pair, write_key_pair
from infer.protocol.messages import Error, Placement, Subscribe, decode, encode
from infer.protocol.transport import make_socket

STREAM_WAIT_S = 3.0  # the worker's --coordinator-timeout: how long a Subscribe that does not match waits
LONG = SamplingParams(max_tokens=500, ignore_eos=True)  # 25 s at 0.05 s a step: it outlives the intruder


async def _intruder_answers(address: str, worker_key: str, key_file, subscribes: list[Subscribe]) -> list:
    """What a CURVE client with the key pair `key_file` is sent after it sends `subscribes` to the stream socket
    at `address` (every message until the stream socket has been silent past the worker's wait)."""
    public, secret = read_key_pair(key_file)
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.DEALER, curve=CurveKeys(public, secret, server_key=worker_key.encode()))
    try:
        sock.connect(address)
        for msg in subscribes:
            await sock.send_multipart([encode(msg)])
        answers = []
        while True:
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), STREAM_WAIT_S + 3)
            except asyncio.TimeoutError:
                return answers
            answers.append(decode(frames[-1]))
    finally:
        sock.close(0)
        ctx.term()


async def test_a_second_client_with_a_valid_key_cannot_read_another_clients_stream(cluster_factory, tmp_path):
    keys = ClusterKeyDir.create(tmp_path / "keys")
    write_key_pair(keys.path / "clients", "intruder")  # a client key the coordinator authorizes too
    cluster = cluster_factory()
    cluster.coordinator(*keys.coordinator_flags())
    cluster.worker(
        0,
        *("--max-model-len", "100000", "--benchmark-step-time", "0.05"),
        *("--coordinator-timeout", str(STREAM_WAIT_S)),
        *keys.worker_flags(),
        benchmark=True,
    )
    async with (
        cluster.client(**keys.client_options()) as alice,
        cluster.client(
            curve_key=str(keys.path / "clients" / "intruder.key_secret"),
            coordinator_key=str(keys.public("coordinator")),
        ) as b,
    ):
        await alice.wait_for_workers(1, timeout=30)
        assert (await b.stats()).num_healthy_workers == 1  # the intruder is an authorized client of the cluster
        stream = alice.stream([1, 2, 3], LONG).__aiter__()
        deltas = [await asyncio.wait_for(stream.__anext__(), 30)]
        rid = deltas[0].request_id
        placement = alice._requests[rid].placement  # what the coordinator told alice (and only alice)
        assert isinstance(placement, Placement) and placement.worker_key is not None
        token = placement.stream_token
        wrong = "f" * len(token) if token != "f" * len(token) else "e" * len(token)
        reading = asyncio.ensure_future(_consume(stream, deltas))
        answers = []
        for subscribe_with in (wrong, token):  # one connection each (a peer's later Subscribe replaces its earlier)
            answers += await _intruder_answers(
                placement.stream_address,
                placement.worker_key,
                keys.path / "clients" / "intruder.key_secret",
                [Subscribe(request_id=rid, stream_token=subscribe_with)],
            )
        assert not reading.done(), "the stream ended before the intruder was answered: make LONG longer"
        await asyncio.wait_for(reading, 60)
    errors = [a for a in answers if isinstance(a, Error)]
    assert [a for a in answers if not isinstance(a, Error) and a.TYPE != "heartbeat"] == []  # never a delta
    assert sorted(e.stream_token for e in errors) == sorted([wrong, token])
    assert all(e.code == ErrorCode.INVALID_REQUEST and e.request_id == rid for e in errors)
    assert all(token not in e.message for e in errors)
    # alice's stream: every token once, in order, one end
    assert [t for d in deltas for t in d.token_ids] == [3 + i for i in range(LONG.max_tokens)]
    assert deltas[-1].finish_reason == "length" and not any(d.finished for d in deltas[:-1])
    worker_log = next(p for p in cluster.procs if p.name.startswith("worker")).text()
    assert worker_log.count("refused a subscription") >= 1


async def _consume(stream, deltas: list) -> None:
    async for delta in stream:
        deltas.append(delta)


async def test_steps_longer_than_the_clients_silence_timeout_keep_the_direct_stream(cluster_factory, monkeypatch):
    """A worker inside one step for 3 s at a time (a long prefill chunk on a CPU), past the client's 2 s silence
    timeout: its heartbeat thread takes the client's Subscribe and beats to it during the steps, so the client
    subscribes once, never asks the coordinator where the stream went (a re-dispatch: the request started again), and
    the stream ends exactly (a benchmark worker: output token i of a 3-token prompt is 3 + i)."""
    cluster = cluster_factory()
    cluster.coordinator()
    cluster.worker(0, "--benchmark-step-time", "3", benchmark=True)
    async with cluster.client(heartbeat_interval=0.2, silence_timeout=2.0) as client:
        await client.wait_for_workers(1, timeout=30)
        subscribes, asks = [], []
        subscribe, ask = client._subscribe, client._ask_coordinator
        monkeypatch.setattr(client, "_subscribe", lambda *a: (subscribes.append(a[1].request_id), subscribe(*a)))
        monkeypatch.setattr(client, "_ask_coordinator", lambda r: (asks.append(r.request_id), ask(r)))
        deltas = [d async for d in client.stream([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))]
        stats = await client.stats()
    assert [t for d in deltas for t in d.token_ids] == [3, 4, 5] and deltas[-1].finish_reason == "length"
    assert asks == [] and len(subscribes) == 1, (subscribes, asks)
    assert stats.requests_redispatched == 0


async def test_a_stream_dispatched_during_a_long_step_is_served_after_it(cluster_factory, monkeypatch):
    """A worker inside one step for 4 s at a time (a long prefill chunk on a CPU) is sent a second client's request
    meanwhile: its Dispatch waits in the socket behind the step, the client's Subscribe waits for it (parked) past the
    worker's 3 s wait for a Dispatch and the client's 2 s silence timeout. The parked client hears the worker's beats
    during the step, and once the step ends the worker reads the Dispatch before its timers run: the stream is served
    from its first token, the client never asks the coordinator where it went, nothing is dispatched again."""
    cluster = cluster_factory()
    cluster.coordinator()
    cluster.worker(
        0, "--benchmark-step-time", "4", "--coordinator-timeout", "3", "--heartbeat-interval", "0.2", benchmark=True
    )
    async with cluster.client() as first, cluster.client(heartbeat_interval=0.2, silence_timeout=2.0) as second:
        await first.wait_for_workers(1, timeout=30)
        running = first.stream([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)).__aiter__()
        head = await asyncio.wait_for(running.__anext__(), 30)  # its first step ended: the next one has begun
        subscribes, asks = [], []
        subscribe, ask = second._subscribe, second._ask_coordinator
        monkeypatch.setattr(second, "_subscribe", lambda *a: (subscribes.append(a[1].request_id), subscribe(*a)))
        monkeypatch.setattr(second, "_ask_coordinator", lambda r: (asks.append(r.request_id), ask(r)))
        deltas = [d async for d in second.stream([5, 6], SamplingParams(max_tokens=2, ignore_eos=True))]
        rest = [d async for d in running]
        stats = await second.stats()
    assert [t for d in deltas for t in d.token_ids] == [2, 3] and deltas[-1].finish_reason == "length"
    assert [t for d in [head, *rest] for t in d.token_ids] == [3, 4, 5]
    assert asks == [] and len(subscribes) == 1, (subscribes, asks)
    assert stats.requests_redispatched == 0
