"""Disaggregated prefill and decode against plain workers: how much long prompts arriving slow the streams running.

Two clusters in one run, each started by `infer-serve` as the README does (the embedded default model unless
`--model`; `--threads` torch threads a worker):

    pd    --workers 2 --kv-roles kv_producer,kv_consumer   (prefill on one worker, decode on the other)
    both  --workers 2                                      (two kv_both workers, least-loaded routing)

On each: `--streams` greedy streams run at once (short random prompts, `--tokens` tokens each, each stream started
again when it ends, until the last long prompt is answered), and while they run a long prompt of `--prompt-len`
random token ids (distinct each time: no prefix-cache hit) arrives `--every` seconds after the previous one was
answered, `--long` of them, each generating a few tokens; `--long-at-once K` sends K such prompts together each time
(K = 2: on the kv_both cluster least-loaded routing gives one to each worker, so no stream has a worker free of a
long prefill to run on; with one at a time, new streams go to the other worker and only those already beside the long
prompt stall, a few gaps in a thousand). Measured per cluster, pooled over its streams:

    ITL            gaps between a stream's consecutive token-carrying deltas: p50, p99, max
    ITL in prefill the gaps that overlap a long prompt's prefill (from its submission to its first token): p50,
                   p99, max. These are the gaps a long prompt can stall; over a whole run they are a few percent
                   of all gaps, so the overall p99 hides them (a 2048-token run: p99 72 ms, max 33 s)
    TTFT           of the long prompts: p50, max; of the short streams: p50, max, and how many streams ran (a
                   producer busy with a long prefill delays the prefill of every stream that starts meanwhile)

The table prints pd against both (ratios); benchmarks/results/disaggregated-*.json holds every gap and each worker's
counters at the end (preemptions, prefix-cache queries and hits, KV blocks sent, received and dropped).

`--long-prefill-token-threshold N` is given to every worker of both clusters (infer-serve's flag of that name): the
producer, the consumer (where it cuts only a recompute's chunks) and both kv_both workers, so the two clusters run
the same scheduler. Without it each worker keeps its role's default: a kv_producer caps a prefill chunk at a quarter
of the step's budget (512 tokens), the others do not cap. To measure short-stream and long-prompt TTFT with and
without the cap, run twice: `--long-prefill-token-threshold 0` (no cap anywhere) and `... 512`.

    .venv/bin/python benchmarks/disaggregated.py [--prompt-len 8000] [--streams 4] [--tokens 256] [--long 3]
                                                 [--every 4] [--long-at-once 1] [--model M] [--threads 1]
                                                 [--long-prefill-token-threshold N]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import start_serve, stop_serve, write_result

from infer.client.inference_client import InferenceClient
from infer.protocol.sampling import SamplingParams

CONFIGS = {"pd": ["--kv-roles", "kv_producer,kv_consumer"], "both": []}
# each worker's, recorded at the end (a consumer that recomputed shows dropped blocks, preemptions or fewer hits)
WORKER_COUNTERS = (
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "kv_transfer_sent_blocks",
    "kv_transfer_received_blocks",
    "kv_transfer_dropped_blocks",
)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Gap = tuple[float, float]  # (the previous token-carrying delta's arrival, this one's): perf_counter seconds


async def stream_gaps(client: InferenceClient, prompt: list[int], tokens: int, ttfts: list[float]) -> list[Gap]:
    """One stream's gaps; its time to first token goes to `ttfts`."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    gaps, last = [], None
    started = time.perf_counter()
    async for delta in client.stream(prompt, params):
        if delta.token_ids:
            now = time.perf_counter()
            if last is None:
                ttfts.append(now - started)
            else:
                gaps.append((last, now))
            last = now
    return gaps


async def streams_until(
    client: InferenceClient, rng: random.Random, tokens: int, done: asyncio.Event, ttfts: list[float]
) -> list[Gap]:
    """One stream after another until `done` is set (the one running then is finished)."""
    gaps: list[Gap] = []
    while not done.is_set():
        gaps += await stream_gaps(client, [rng.randrange(3, 30000) for _ in range(16)], tokens, ttfts)
    return gaps


async def long_prompt(client: InferenceClient, prompt: list[int]) -> tuple[float, float]:
    """(submitted, first token) of one long prompt: perf_counter seconds."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    started = time.perf_counter()
    first = float("nan")
    async for delta in client.stream(prompt, params):
        if delta.token_ids and math.isnan(first):
            first = time.perf_counter()
    return started, first


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan"), "count": 0}
    return {
        "p50_ms": 1000 * statistics.median(values),
        "p99_ms": 1000 * percentile(values, 0.99),
        "max_ms": 1000 * max(values),
        "count": len(values),
    }


async def measure(address: str, args: argparse.Namespace, rng: random.Random) -> dict:
    async with InferenceClient(address) as client:
        await client.generate([1, 2, 3], SamplingParams(max_tokens=2))  # warm both paths
        done = asyncio.Event()
        short_ttfts: list[float] = []
        streams = [
            asyncio.create_task(streams_until(client, random.Random(rng.random()), args.tokens, done, short_ttfts))
            for _ in range(args.streams)
        ]
        windows = []
        for _ in range(args.long):
            await asyncio.sleep(args.every)
            prompts = [[rng.randrange(3, 30000) for _ in range(args.prompt_len)] for _ in range(args.long_at_once)]
            windows += await asyncio.gather(*(long_prompt(client, prompt) for prompt in prompts))
        await asyncio.sleep(args.every)
        done.set()
        gaps = [g for task in streams for g in await task]
        await asyncio.sleep(1.5)  # a heartbeat or two: the workers' counters after their last steps
        counters = {
            f"dp{w.dp_rank}": {name: getattr(w.load, name) for name in WORKER_COUNTERS}
            for w in (await client.stats()).workers
        }
    within = [end - start for start, end in gaps if any(start < w_end and end > w_start for w_start, w_end in windows)]
    ttfts = [first - started for started, first in windows]
    overall = summary([end - start for start, end in gaps])
    prefill = summary(within)
    return {
        "itl_p50_ms": overall["p50_ms"],
        "itl_p99_ms": overall["p99_ms"],
        "itl_max_ms": overall["max_ms"],
        "prefill_itl_p50_ms": prefill["p50_ms"],
        "prefill_itl_p99_ms": prefill["p99_ms"],
        "prefill_itl_max_ms": prefill["max_ms"],
        "prefill_gaps": prefill["count"],
        "short_ttft_p50_s": statistics.median(short_ttfts),
        "short_ttft_max_s": max(short_ttfts),
        "streams_run": len(short_ttfts),
        "long_ttft_p50_s": statistics.median(ttfts),
        "long_ttft_max_s": max(ttfts),
        "gaps_ms": [round(1000 * (end - start), 3) for start, end in gaps],
        "prefill_gaps_ms": [round(1000 * g, 3) for g in within],
        "long_ttft_s": ttfts,
        "workers": counters,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=8000)  # + 64 fits the embedded model's 8192
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--long", type=int, default=3)
    p.add_argument("--every", type=float, default=4.0)
    p.add_argument("--long-at-once", type=int, default=1, metavar="K", help="long prompts sent together each time")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        metavar="N",
        help="passed to every worker of both clusters (0: no cap); default: each role's own (a producer's 512)",
    )
    args = p.parse_args()
    common = ["--workers", "2", "--threads", str(args.threads), "--max-model-len", str(args.prompt_len + 64)]
    if args.model:
        common += ["--model", args.model]
    if args.long_prefill_token_threshold is not None:
        common += ["--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
    results = {}
    for name, flags in CONFIGS.items():
        proc, address = start_serve([*common, *flags])
        try:
            results[name] = asyncio.run(measure(address, args, random.Random(0)))
        finally:
            stop_serve(proc)
    threshold = args.long_prefill_token_threshold
    print("long_prefill_token_threshold:", "each role's default" if threshold is None else threshold)
    print(
        f"{'cluster':8} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'ITL max ms':>11} {'in prefill: p50':>16} "
        f"{'p99':>9} {'max ms':>9} {'gaps':>5} {'streams':>7} {'short TTFT p50 s':>16} {'max s':>7} {'long TTFT p50 s':>16}"
    )
    for name, r in results.items():
        print(
            f"{name:8} {r['itl_p50_ms']:11.1f} {r['itl_p99_ms']:11.1f} {r['itl_max_ms']:11.1f} "
            f"{r['prefill_itl_p50_ms']:16.1f} {r['prefill_itl_p99_ms']:9.1f} {r['prefill_itl_max_ms']:9.1f} "
            f"{r['prefill_gaps']:5d} {r['streams_run']:7d} {r['short_ttft_p50_s']:16.2f} {r['short_ttft_max_s']:7.2f} "
            f"{r['long_ttft_p50_s']:16.2f}"
        )
    ratio = results["pd"]["itl_p99_ms"] / results["both"]["itl_p99_ms"]
    prefill_ratio = results["pd"]["prefill_itl_p99_ms"] / results["both"]["prefill_itl_p99_ms"]
    print(f"ITL p99, pd / both: {ratio:.2f}; during the long prompts' prefill: {prefill_ratio:.3f}")
    path = write_result(
        "disaggregated",
        {"args": vars(args), "results": results, "itl_p99_ratio": ratio, "prefill_itl_p99_ratio": prefill_ratio},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
