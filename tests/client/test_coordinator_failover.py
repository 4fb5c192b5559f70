"""InferenceClient with several coordinators (docs/architecture.md, "Several coordinators") against stand-ins (ROUTERs
on loopback speaking the real codec, tests/stand_ins.py), so that each Redirect, Welcome and lost connection comes
exactly when the test says: the client connects through a Redirect to the leader, switches on a Redirect or a lost
connection in the middle of a stream and re-attaches it from its copy (the stream goes on, nothing lost or repeated),
re-sends an interrupted lifecycle call once but not a refit, and refuses a bad address list."""

from __future__ import annotations

import asyncio

import pytest
from stand_ins import WAIT, StandIn

from infer import SamplingParams
from infer.client import ClusterError, InferenceClient
from infer.protocol.messages import (
    Control,
    ControlAck,
    Delta,
    Hello,
    Redirect,
    Submit,
    TokenIds,
    UpdateWeights,
    Welcome,
)


@pytest.fixture
async def three():
    stand_ins = [StandIn(), StandIn(), StandIn()]
    yield stand_ins
    for stand_in in stand_ins:
        if not stand_in.sock.closed:
            stand_in.close()


def _client(stand_ins: list[StandIn], **options) -> InferenceClient:
    options = {"heartbeat_interval": 0.2, "silence_timeout": 5.0, "direct_streams": False, **options}
    return InferenceClient(",".join(s.address for s in stand_ins), **options)


async def _lead(stand_in: StandIn, instance: str) -> None:
    """Welcome the next Hello, as the leader would."""
    await stand_in.recv(Hello)
    await stand_in.send(Welcome(coordinator_id=instance, state="running", instance=instance, term=1))


async def _connected(stand_ins: list[StandIn]) -> InferenceClient:
    client = _client(stand_ins)
    connecting = asyncio.create_task(client.connect())
    await _lead(stand_ins[0], "a")
    await connecting
    return client


async def _streaming(client: InferenceClient, coordinator: StandIn):
    """Request "r" (a token-id prompt) started, with tokens 7, 8 received; its deltas' task."""

    async def read():
        return [d async for d in client.stream([1, 2, 3], SamplingParams(max_tokens=4), request_id="r")]

    reading = asyncio.create_task(read())
    await coordinator.recv(Submit)
    await coordinator.send(Delta(request_id="r", token_ids=TokenIds([7, 8]), text="ab"))
    await _until(lambda: client._requests["r"].received.token_ids == [7, 8])
    return reading


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _resumed(leader: StandIn, reading: asyncio.Task) -> list:
    """The leader takes the client's copy of "r" (7, 8 delivered) and finishes it."""
    copy = await leader.recv(Submit)
    assert copy.request_id == "r" and copy.reattach
    assert (
        copy.spec.prompt_token_ids == [1, 2, 3] and copy.delivered_token_ids == [7, 8] and copy.delivered_text_len == 2
    )
    await leader.send(Delta.final("r", "length", token_ids=[9, 10], text="cd"))
    return await asyncio.wait_for(reading, WAIT)


def test_the_address_list_is_checked_entry_by_entry():
    client = InferenceClient("tcp://h:1, tcp://h:2,tcp://h:3")
    assert client.addresses == ("tcp://h:1", "tcp://h:2", "tcp://h:3") and client.address == "tcp://h:1"
    assert InferenceClient("tcp://h:1").addresses == ("tcp://h:1",)
    with pytest.raises(ValueError, match="entry 2 of .* is empty"):
        InferenceClient("tcp://h:1,,tcp://h:3")
    with pytest.raises(ValueError, match="entry 3, 'h:3', is not tcp://HOST:PORT"):
        InferenceClient("tcp://h:1,tcp://h:2,h:3")
    with pytest.raises(ValueError, match="names an address twice"):
        InferenceClient("tcp://h:1,tcp://h:1")


async def test_connect_follows_a_redirect_to_the_leader(three):
    a, b, c = three
    client = _client(three)
    connecting = asyncio.create_task(client.connect())
    await a.recv(Hello)
    await a.send(Redirect(reason="a follower", leader=c.address))
    await _lead(c, "c")
    welcome = await asyncio.wait_for(connecting, WAIT)
    try:
        assert welcome.instance == "c" and client.address == c.address
    finally:
        await client.close()


async def test_connect_tries_the_next_address_while_no_leader_is_known(three):
    a, b, c = three
    client = _client(three)
    connecting = asyncio.create_task(client.connect())
    await a.recv(Hello)
    await a.send(Redirect(reason="an election is under way"))
    await _lead(b, "b")
    await asyncio.wait_for(connecting, WAIT)
    try:
        assert client.address == b.address
    finally:
        await client.close()


async def test_connect_fails_at_its_timeout_naming_every_address_tried_and_the_last_reason(three):
    a, b, c = three
    c.close()

    async def redirect_all(stand_in: StandIn) -> None:
        while True:
            await stand_in.recv(Hello)
            await stand_in.send(Redirect(reason="no leader yet"))

    followers = [asyncio.create_task(redirect_all(s)) for s in (a, b)]
    client = _client(three, connect_timeout=2.5)
    try:
        with pytest.raises(ClusterError) as failure:
            await client.connect()
    finally:
        for task in followers:
            task.cancel()
    message = str(failure.value)
    assert all(s.address in message for s in three), message
    assert "within 2.5 s" in message and "the last: " in message


async def test_one_address_answered_by_a_redirect_fails_connect_saying_where_the_leader_is(three):
    a, b, _ = three
    client = InferenceClient(a.address, connect_timeout=5.0)
    connecting = asyncio.create_task(client.connect())
    await a.recv(Hello)
    await a.send(Redirect(reason="a follower", leader=b.address))
    with pytest.raises(ClusterError, match=f"the leader is {b.address}.*every coordinator's address"):
        await asyncio.wait_for(connecting, WAIT)


async def test_a_redirect_in_the_middle_of_a_stream_re_attaches_it_at_the_leader(three):
    a, b, c = three
    client = await _connected(three)
    try:
        reading = await _streaming(client, a)
        await a.send(Redirect(reason="deposed", leader=c.address))
        await _lead(c, "c")
        deltas = await _resumed(c, reading)
        assert client.address == c.address
    finally:
        await client.close()
    assert [t for d in deltas for t in d.token_ids] == [7, 8, 9, 10]
    assert "".join(d.text for d in deltas) == "abcd" and deltas[-1].finish_reason == "length"


async def test_a_lost_connection_switches_to_the_next_coordinator_and_the_stream_goes_on(three):
    a, b, c = three
    client = await _connected(three)
    try:
        reading = await _streaming(client, a)
        a.close()  # the leader is gone, as after kill -9
        await b.recv(Hello)
        await b.send(Redirect(reason="no leader yet"))  # still electing: on to the next
        await c.recv(Hello)
        await c.send(Redirect(reason="b leads now", leader=b.address))
        await _lead(b, "b")
        deltas = await _resumed(b, reading)
    finally:
        await client.close()
    assert [t for d in deltas for t in d.token_ids] == [7, 8, 9, 10]


async def test_a_request_submitted_during_a_switch_goes_to_the_new_leader_as_it_is(three):
    a, b, c = three
    client = await _connected(three)
    try:
        await a.send(Redirect(reason="deposed"))
        await _until(lambda: client._rejoin is not None)
        reading = asyncio.create_task(client.generate([4, 5], SamplingParams(max_tokens=1), request_id="q"))
        await _lead(b, "b")
        submit = await b.recv(Submit)
        assert submit.request_id == "q" and not submit.reattach
        await b.send(Delta.final("q", "length", token_ids=[6], text="x"))
        completion = await asyncio.wait_for(reading, WAIT)
    finally:
        await client.close()
    assert completion.token_ids == [6]


async def test_a_lifecycle_call_interrupted_by_a_switch_is_sent_again_to_the_new_leader(three):
    a, b, c = three
    client = await _connected(three)
    try:
        pausing = asyncio.create_task(client.pause())
        await a.recv(Control)
        await a.send(Redirect(reason="deposed", leader=b.address))
        await _lead(b, "b")
        again = await b.recv(Control)
        assert again.command == "pause"
        await b.send(ControlAck(command="pause", state="paused"))
        assert await asyncio.wait_for(pausing, WAIT) == "paused"
    finally:
        await client.close()


async def test_a_refit_interrupted_by_a_switch_fails_clearly(three, tmp_path):
    a, b, c = three
    client = await _connected(three)
    try:
        updating = asyncio.create_task(client.update_weights(tmp_path))
        await a.recv(UpdateWeights)
        await a.send(Redirect(reason="deposed", leader=b.address))
        await _lead(b, "b")
        with pytest.raises(ClusterError, match="'update_weights' was interrupted .* cannot be repeated safely"):
            await asyncio.wait_for(updating, WAIT)
        assert client._failure is None  # a Redirect never ends the client
    finally:
        await client.close()


async def test_a_restart_noticed_while_a_submit_is_on_its_way_sends_it_once(three):
    """The restarted coordinator's Welcome handled in the one loop turn between a Submit entering the socket and
    submit() hearing so (what the chaos test's coordinator kill -9 hit under load): the request is not sent a second
    time (the coordinator would refuse the copy, "already in flight", and end the request with that error)."""
    a = three[0]
    client = await _connected(three)
    send = client._send

    async def send_then_restart(msg):
        sent = await send(msg)
        client._check_instance("a, restarted")  # as the new instance's first Welcome or Heartbeat does
        return sent

    client._send = send_then_restart
    try:
        reading = asyncio.create_task(client.generate([4, 5], SamplingParams(max_tokens=1), request_id="q"))
        submit = await a.recv(Submit)
        assert submit.request_id == "q" and not submit.reattach
        await a.recv(Hello)  # the re-attachment's Hello: nothing of "q" was sent with it
        await a.send(Delta.final("q", "length", token_ids=[6], text="x"))
        completion = await asyncio.wait_for(reading, WAIT)
        with pytest.raises(asyncio.TimeoutError):  # no second Submit of "q" behind the Hello (Heartbeats only)
            await asyncio.wait_for(a.recv(Submit), 1.0)
    finally:
        await client.close()
    assert completion.token_ids == [6]
