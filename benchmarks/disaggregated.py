"""Disaggregated prefill and decode against plain workers: how much long prompts arriving slow the streams running.

Two clusters in one run, each started by `infer-serve` as the README does (the embedded default model unless
`--model`; `--threads` torch threads a worker):

    pd    --workers 2 --kv-roles kv_producer,kv_consumer   (prefill on one worker, decode on the other)
    both  --workers 2                                      (two kv_both workers, least-loaded routing)

On each: `--streams` greedy streams of `--tokens` tokens run at once (short random prompts), and while they run a
long prompt of `--prompt-len` random token ids (distinct each time: no prefix-cache hit) arrives every `--every`
seconds, `--long` of them, each generating a few tokens. Measured per cluster, pooled over its streams:

    ITL    gaps between a stream's consecutive token-carrying deltas: p50, p99, max
    TTFT   of the long prompts: p50, max

The table prints pd against both (ratios); benchmarks/results/disaggregated-*.json holds every gap.

    .venv/bin/python benchmarks/disaggregated.py [--prompt-len 8192] [--streams 4] [--tokens 256] [--long 3]
                                                 [--every 4] [--model M] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
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


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream_gaps(client: InferenceClient, prompt: list[int], tokens: int) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    gaps, last = [], None
    async for delta in client.stream(prompt, params):
        if delta.token_ids:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


async def long_prompt(client: InferenceClient, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    started = time.perf_counter()
    async for delta in client.stream(prompt, params):
        if delta.token_ids:
            return time.perf_counter() - started
    return float("nan")


async def measure(address: str, args: argparse.Namespace, rng: random.Random) -> dict:
    async with InferenceClient(address) as client:
        await client.generate([1, 2, 3], SamplingParams(max_tokens=2))  # warm both paths
        streams = [
            asyncio.create_task(stream_gaps(client, [rng.randrange(3, 30000) for _ in range(16)], args.tokens))
            for _ in range(args.streams)
        ]
        ttfts = []
        for _ in range(args.long):
            await asyncio.sleep(args.every)
            ttfts.append(await long_prompt(client, [rng.randrange(3, 30000) for _ in range(args.prompt_len)]))
        gaps = [g for task in streams for g in await task]
    return {
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * percentile(gaps, 0.99),
        "itl_max_ms": 1000 * max(gaps),
        "long_ttft_p50_s": statistics.median(ttfts),
        "long_ttft_max_s": max(ttfts),
        "gaps_ms": [round(1000 * g, 3) for g in gaps],
        "long_ttft_s": ttfts,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--long", type=int, default=3)
    p.add_argument("--every", type=float, default=4.0)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    common = ["--workers", "2", "--threads", str(args.threads), "--max-model-len", str(args.prompt_len + 64)]
    if args.model:
        common += ["--model", args.model]
    results = {}
    for name, flags in CONFIGS.items():
        proc, address = start_serve([*common, *flags])
        try:
            results[name] = asyncio.run(measure(address, args, random.Random(0)))
        finally:
            stop_serve(proc)
    print(f"{'cluster':8} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'ITL max ms':>11} {'long TTFT p50 s':>16}")
    for name, r in results.items():
        print(
            f"{name:8} {r['itl_p50_ms']:11.1f} {r['itl_p99_ms']:11.1f} {r['itl_max_ms']:11.1f} "
            f"{r['long_ttft_p50_s']:16.2f}"
        )
    ratio = results["pd"]["itl_p99_ms"] / results["both"]["itl_p99_ms"]
    print(f"ITL p99, pd / both: {ratio:.2f}")
    path = write_result("disaggregated", {"args": vars(args), "results": results, "itl_p99_ratio": ratio})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
