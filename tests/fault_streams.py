"""Streams through a fault, for the cluster fault tests: start streams, strike once every stream is under way,
then check every stream against the reference token for token (and character for character)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from infer import SamplingParams

# Sampled streams on the word-chain model (tests/conftest.py): random words of multi-byte text.
CHAIN_PROMPTS = ["Words:", "More words:", "Go on:", "Write:", "Next:", "List:"]
CHAIN_STOPS = ("好😀", "語é", "界.")  # each spans a token boundary inside a multi-byte character


def chain_params(i: int) -> SamplingParams:
    """Temperature 1, seeded (even i) and unseeded, with stop strings (i < 4; the stop in the output for
    i == 2) and without."""
    return SamplingParams(
        temperature=1.0,
        max_tokens=120,
        seed=1000 + i if i % 2 == 0 else None,
        stop=CHAIN_STOPS if i < 4 else (),
        include_stop_str_in_output=i == 2,
    )


async def streams_through_a_fault(
    cluster: Any,
    prompts: list,
    params: Any,
    fault: Callable[[Any], Awaitable[None]],
    start_timeout: float = 60,
    finish_timeout: float = 120,
    strike_after: int = 3,
) -> tuple[list, object]:
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


async def kill9_the_busiest_worker(cluster: Any, client: Any, in_flight: int = 1) -> None:
    """A `fault` for streams_through_a_fault: kill -9 the worker running the most requests (`in_flight` of them)."""
    victim = max((await client.stats()).workers, key=lambda w: w.num_in_flight)
    assert victim.num_in_flight == in_flight
    cluster.proc_of(victim.worker_id).kill9()


def assert_exact_streams(streams: list, want_token_ids: list[list[int]]) -> None:
    """Each stream ends once, with "length", and its tokens are exactly the reference's: no gap, no repeat."""
    for deltas, want in zip(streams, want_token_ids, strict=True):
        assert deltas[-1].finish_reason == "length" and not any(d.finished for d in deltas[:-1])
        assert [t for d in deltas for t in d.token_ids] == want


def reported_seeds(streams: list, params: list) -> list[int]:
    """The seed each stream's first delta reported: the given one, or the one the cluster assigned."""
    seeds = [deltas[0].seed for deltas in streams]
    assert all(s is not None for s in seeds)
    assert all(s == p.seed for s, p in zip(seeds, params) if p.seed is not None)
    return seeds


async def replayed_without_a_fault(model: Any, prompts: list, streams: list, params: list) -> list:
    """The Completions of `prompts` run in-process on `model` (fp32, as the test clusters run it) with the
    seeds the cluster reported on `streams`: what each stream must equal."""
    import msgspec

    from infer import LLM

    seeds = reported_seeds(streams, params)
    llm = LLM(model=str(model), dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1)
    return await asyncio.to_thread(
        llm.generate, prompts, [msgspec.structs.replace(p, seed=s) for p, s in zip(params, seeds)], use_tqdm=False
    )


def assert_same_streams(streams: list, reference: list, where: str = "") -> None:
    """Each stream ends once and equals its reference Completion: tokens, text and finish reason."""
    for i, (deltas, want) in enumerate(zip(streams, reference, strict=True)):
        at = f"stream {i}{where}"
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1]), at
        assert [t for d in deltas for t in d.token_ids] == want.token_ids, at
        assert "".join(d.text for d in deltas) == want.text, at
        assert deltas[-1].finish_reason == want.finish_reason, at
