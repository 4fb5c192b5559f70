"""InferenceClient's side of "client_lost" and "client_too_slow", against a stand-in coordinator (a ROUTER
on loopback speaking the real codec), so that the notices arrive exactly when the test says: "client_lost"
re-attaches every request with the tokens received, "client_too_slow" ends each with that error code."""

from __future__ import annotations

import asyncio

import pytest
from stand_ins import WAIT, StandIn

from infer import SamplingParams
from infer.client import InferenceClient
from infer.protocol.messages import (
    Delta,
    DeltaBatch,
    Error,
    Hello,
    StatsRequest,
    Submit,
    TokenIds,
)


@pytest.fixture
async def stand_in():
    coordinator = StandIn()
    yield coordinator
    coordinator.close()


async def _connected(stand_in: StandIn) -> InferenceClient:
    client = InferenceClient(stand_in.address, heartbeat_interval=0.2, silence_timeout=5.0)
    connecting = asyncio.create_task(client.connect())
    await stand_in.welcome()
    await connecting
    return client


async def test_client_lost_re_attaches_every_request_with_the_tokens_it_holds(stand_in):
    client = await _connected(stand_in)
    try:
        stream = client.stream([1, 2, 3], SamplingParams(max_tokens=5), request_id="r")
        first = asyncio.create_task(stream.__anext__())
        await stand_in.recv(Submit)
        await stand_in.send(
            DeltaBatch(
                deltas=[
                    Delta(request_id="r", token_ids=TokenIds([7, 8]), text="", prompt_token_ids=TokenIds([1, 2, 3]))
                ]
            )
        )
        assert (await asyncio.wait_for(first, WAIT)).token_ids == [7, 8]
        await stand_in.send(Error(message="this client was declared lost: silent", code="client_lost"))
        await stand_in.recv(Hello)  # it registers again, then re-attaches
        again = await stand_in.recv(Submit)
        assert again.reattach and again.request_id == "r" and list(again.delivered_token_ids) == [7, 8]
        await stand_in.send(
            DeltaBatch(
                deltas=[
                    Delta(
                        request_id="r", token_ids=TokenIds([9, 10, 11]), text="", finished=True, finish_reason="length"
                    )
                ]
            )
        )
        rest = [d async for d in stream]
        assert [t for d in rest for t in d.token_ids] == [9, 10, 11] and rest[-1].finish_reason == "length"
    finally:
        await client.close()


async def test_a_token_id_prompt_is_not_echoed_and_still_re_attaches_with_its_own_ids(stand_in):
    """The worker echoes prompt ids only for a text prompt: a client that sent ids re-attaches from its own."""
    client = await _connected(stand_in)
    try:
        params = SamplingParams(temperature=0.5, max_tokens=5)
        stream = client.stream([1, 2, 3], params, request_id="r")
        first = asyncio.create_task(stream.__anext__())
        submit = await stand_in.recv(Submit)
        assert submit.spec.sampling == params
        await stand_in.send(
            DeltaBatch(
                deltas=[Delta(request_id="r", token_ids=TokenIds([7, 8]), text="ab", num_prompt_tokens=3, seed=77)]
            )
        )
        got = await asyncio.wait_for(first, WAIT)
        assert got.token_ids == [7, 8] and got.num_prompt_tokens == 3
        assert client.prompt_token_ids("r") == [1, 2, 3]
        await stand_in.send(Error(message="this client was declared lost: silent", code="client_lost"))
        await stand_in.recv(Hello)
        again = await stand_in.recv(Submit)
        assert again.reattach and list(again.spec.prompt_token_ids) == [1, 2, 3] and again.spec.prompt is None
        assert list(again.delivered_token_ids) == [7, 8] and again.delivered_text_len == 2
        assert again.spec.sampling == params.with_seed(77)  # the seed the first delta reported
        await stand_in.send(
            DeltaBatch(
                deltas=[Delta(request_id="r", token_ids=TokenIds([9]), text="", finished=True, finish_reason="length")]
            )
        )
        assert [d.finish_reason async for d in stream] == ["length"]
    finally:
        await client.close()


async def test_client_too_slow_ends_every_request_and_the_pending_call_with_that_error(stand_in):
    client = await _connected(stand_in)
    try:
        runs = [asyncio.create_task(client.generate([1, 2, 3], SamplingParams(max_tokens=5))) for _ in range(3)]
        for _ in runs:
            await stand_in.recv(Submit)
        stats = asyncio.create_task(client.stats())
        await stand_in.recv(StatsRequest)  # dropped by a coordinator
        await stand_in.send(Error(message="this client was too slow: its queue is full", code="client_too_slow"))
        done = await asyncio.wait_for(asyncio.gather(*runs), WAIT)
        assert {(c.finish_reason, c.error_code) for c in done} == {("error", "client_too_slow")}
        assert "too slow" in done[0].error
        with pytest.raises(Exception, match="too slow"):
            await asyncio.wait_for(stats, WAIT)
    finally:
        await client.close()
