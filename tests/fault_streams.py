"""Streams through a fault, for the cluster fault tests: start streams, strike once every stream is under way,
then check every stream against the reference token for token."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


async def streams_through_a_fault(cluster: Any, prompts: list, params: Any,
                                  fault: Callable[[Any], Awaitable[None]],
                                  start_timeout: float = 60,
                                  finish_timeout: float = 120, strike_after: int = 3) -> tuple[list, object]:
    """Stream every prompt (`params`: one SamplingParams for all, or a list, one per prompt); once every
    stream has `strike_after` deltas (or ended), `await fault(client)` (the client sees the cluster's stats).
    Returns every stream's deltas, in prompt order, and the stats after."""
    all_started = asyncio.Event()
    started: set[int] = set()
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)

    async def run(i: int):
        deltas = []
        async for delta in client.stream(prompts[i], per_prompt[i]):
            deltas.append(delta)
            if len(deltas) == strike_after or (delta.finished and len(deltas) < strike_after):
                started.add(i)
                if len(started) == len(prompts):
                    all_started.set()
        return deltas

    async with cluster.client() as client:
        tasks = [asyncio.create_task(run(i)) for i in range(len(prompts))]
        await asyncio.wait_for(all_started.wait(), start_timeout)
        await fault(client)
        streams = await asyncio.wait_for(asyncio.gather(*tasks), finish_timeout)
        return streams, await client.stats()


def assert_exact_streams(streams: list, want_token_ids: list[list[int]]) -> None:
    """Each stream ends once, with "length", and its tokens are exactly the reference's: no gap, no repeat."""
    for deltas, want in zip(streams, want_token_ids, strict=True):
        assert deltas[-1].finish_reason == "length" and not any(d.finished for d in deltas[:-1])
        assert [t for d in deltas for t in d.token_ids] == want
