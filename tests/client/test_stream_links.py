"""InferenceClient's direct streams against stand-ins (a coordinator ROUTER and a worker stream ROUTER on loopback,
speaking the real codec), so that each event comes exactly when the test says: the client subscribes where the
Placement says, takes only exact continuations (a repeat or a gap from the worker is dropped), subscribes again
from its copy after its stream socket reconnects, and sends its copy to the coordinator when the stream leaves its
worker (Placement with no address) or when the worker answers its Subscribe with an error naming its token."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from stand_ins import WAIT, StandIn

from infer import SamplingParams
from infer.client import InferenceClient
from infer.protocol.messages import (
    Delta,
    Error,
    Hello,
    Placement,
    StreamBatch,
    Submit,
    Subscribe,
    TokenIds,
    Welcome,
)

TOKEN = "t" * 32


class WorkerStandIn(StandIn):
    """A worker's stream socket; `rebind` closes and binds it again on its port (the client's link reconnects)."""

    async def rebind(self) -> None:
        self.sock.close(0)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for _ in range(200):  # the old socket's port is released by ZeroMQ's I/O thread, soon after close
            try:
                return self.sock.bind(self.address)
            except zmq.ZMQError:
                await asyncio.sleep(0.01)
        raise AssertionError(f"could not bind {self.address} again")

    async def deltas(self, *items: tuple[list[int], str, int, int, bool]) -> None:
        """(tokens, text, token start, text start, final) each."""
        await self.send(
            StreamBatch(
                deltas=[
                    Delta.final("r", "length", token_ids=t, text=x)
                    if end
                    else Delta(request_id="r", token_ids=TokenIds(t), text=x)
                    for t, x, _, _, end in items
                ],
                token_starts=[n for _, _, n, _, _ in items],
                text_starts=[c for _, _, _, c, _ in items],
            )
        )


@pytest.fixture
async def stand_ins():
    coordinator, worker = StandIn(), WorkerStandIn()
    yield coordinator, worker
    coordinator.close()
    worker.close()


async def _until(condition, timeout: float = 5.0) -> None:
    """Waits (polling) until `condition()` holds; fails after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _streaming(coordinator: StandIn, worker: WorkerStandIn):
    """A connected client streaming request "r", subscribed at the worker stand-in; (client, its deltas' task)."""
    client = InferenceClient(coordinator.address, heartbeat_interval=0.2, silence_timeout=5.0)
    connecting = asyncio.create_task(client.connect())
    hello = await coordinator.recv(Hello)
    assert hello.streams
    await coordinator.send(Welcome(coordinator_id="stand-in", state="running", instance="i1"))
    await connecting

    async def read():
        return [d async for d in client.stream([1, 2, 3], SamplingParams(max_tokens=4), request_id="r")]

    reading = asyncio.create_task(read())
    await coordinator.recv(Submit)
    await coordinator.send(Placement(request_id="r", stream_address=worker.address, stream_token=TOKEN))
    subscribe = await worker.recv(Subscribe)
    assert (subscribe.request_id, subscribe.stream_token, subscribe.num_tokens, subscribe.text_len) == (
        "r",
        TOKEN,
        0,
        0,
    )
    return client, reading


async def test_exact_continuations_only_and_a_new_subscribe_after_a_reconnection(stand_ins):
    coordinator, worker = stand_ins
    client, reading = await _streaming(coordinator, worker)
    try:
        await worker.deltas(([7], "a", 0, 0, False), ([7], "a", 0, 0, False), ([9], "c", 2, 2, False))  # repeat, gap
        await worker.deltas(([8], "bb", 1, 1, False))
        await worker.rebind()
        # at once (its silence watchdog would take half the silence timeout): from its copy, 2 tokens, 3 characters
        again = await asyncio.wait_for(worker.recv(Subscribe), 2.0)
        assert (again.num_tokens, again.text_len, again.stream_token) == (2, 3, TOKEN)
        await worker.deltas(([8], "bb", 1, 1, False), ([9], "c", 2, 3, False), ([10], "d", 3, 4, True))
        deltas = await asyncio.wait_for(reading, WAIT)
    finally:
        await client.close()
    assert [t for d in deltas for t in d.token_ids] == [7, 8, 9, 10]
    assert "".join(d.text for d in deltas) == "abbcd" and deltas[-1].finish_reason == "length"


async def test_a_stream_that_leaves_its_worker_or_is_not_served_is_sent_again_from_the_copy(stand_ins):
    coordinator, worker = stand_ins
    client, reading = await _streaming(coordinator, worker)
    try:
        first = Delta(request_id="r", token_ids=TokenIds([7]), text="a", prompt_token_ids=TokenIds([1, 2, 3]))
        await worker.send(StreamBatch(deltas=[first], token_starts=[0], text_starts=[0]))
        await worker.send(Error(message="not yours", request_id="r", code="invalid_request", stream_token="x" * 32))
        # the worker's socket and the coordinator's are two: let the delta arrive before the Placement is sent
        await _until(lambda: client._requests["r"].received.token_ids == [7])
        await coordinator.send(Placement(request_id="r"))  # its worker left: send the copy
        copy = await coordinator.recv(Submit)
        assert copy.reattach and copy.delivered_token_ids == [7] and copy.delivered_text_len == 1
        await coordinator.send(Placement(request_id="r", stream_address=worker.address, stream_token="u" * 32))
        await worker.recv(Subscribe)
        await worker.send(Error(message="gone", request_id="r", code="unavailable", stream_token="u" * 32))
        again = await coordinator.recv(Submit)  # an error naming its current token: the copy again
        assert again.reattach and again.delivered_token_ids == [7]
        await coordinator.send(Placement(request_id="r", stream_address=worker.address, stream_token="v" * 32))
        await worker.recv(Subscribe)
        await worker.deltas(([8, 9, 10], "bcd", 1, 1, True))
        deltas = await asyncio.wait_for(reading, WAIT)
    finally:
        await client.close()
    assert [t for d in deltas for t in d.token_ids] == [7, 8, 9, 10]
