"""Single-request latency through the cluster, relayed against direct streams, in one run on one cluster.

`infer-serve` starts the cluster as the README does (a coordinator, `--workers` workers on the embedded default
model, the HTTP front); this program connects InferenceClients to its coordinator. The coordinator decides per
request whether a stream is direct (docs/architecture.md, "Direct streams"): a client built with
`direct_streams=False` gets today's relayed path (worker -> coordinator -> client), one with `direct_streams=True`
(the default, what the HTTP front uses) reads its deltas from the worker. So both paths run on the same processes
and the same model, alternating in rounds (relay first in even rounds), each round a fresh client per path.

Per round and path, for each concurrency C (default 1 and 16): C streams at once, each of `--tokens` tokens after
a prompt of `--prompt-len` random token ids (distinct for every request: no prefix-cache hit), greedy, ignore_eos;
`--requests` streams one after the other for C = 1, `--batches` batches of C for C > 1. Measured:

    TTFT  first token-carrying delta - the stream's start
    ITL   gaps between a stream's consecutive token-carrying deltas (pooled over streams)

p50 / p99 per round, then the median over rounds; the client process's CPU per delta (InferenceClient's share of
a stream). The JSON (benchmarks/results/stream_latency-*.json) holds every round.

    .venv/bin/python benchmarks/stream_latency.py [--rounds 4] [--concurrency 1,16] [--tokens 64] [--requests 16]
                                                  [--batches 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import start_serve as serve
from common import stop_serve, write_result

from infer.client.inference_client import InferenceClient
from infer.protocol.sampling import SamplingParams

VOCAB_LOW, VOCAB_HIGH = 100, 49000  # token ids of the embedded model's vocabulary (49,152), past the specials


def start_serve(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`infer-serve` in its own process group; (the process, its coordinator's address) once it is ready."""
    return serve(
        ["--workers", str(args.workers), "--log-level", "WARNING", *args.serve_args.split()], args.ready_timeout
    )


class Prompts:
    """Distinct random token-id prompts (a fixed seed), so no request hits another's prefix cache."""

    def __init__(self, length: int, seed: int = 0) -> None:
        self.rng, self.length = random.Random(seed), length

    def next(self) -> list[int]:
        return [self.rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(self.length)]


async def one_stream(
    client: InferenceClient, prompt: list[int], params: SamplingParams
) -> tuple[float, list[float], int]:
    """(TTFT ms, inter-delta gaps ms, token-carrying deltas) of one stream."""
    start = time.perf_counter()
    last, ttft, gaps, deltas, tokens = None, float("nan"), [], 0, 0
    async for out in client.stream(prompt, params):
        if not out.token_ids:
            continue
        now = time.perf_counter()
        if last is None:
            ttft = (now - start) * 1000
        else:
            gaps.append((now - last) * 1000)
        last, deltas, tokens = now, deltas + 1, tokens + len(out.token_ids)
    if tokens != params.max_tokens:
        raise RuntimeError(f"a stream ended with {tokens} tokens, not {params.max_tokens}")
    return ttft, gaps, deltas


async def measure(address: str, direct: bool, concurrency: int, args: argparse.Namespace, prompts: Prompts) -> dict:
    """One path, one concurrency: a fresh client; the streams' TTFT and ITL percentiles and the client's CPU."""
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    async with InferenceClient(address, direct_streams=direct, call_timeout=120.0) as client:
        await one_stream(client, prompts.next(), params)  # this client's connections made
        ttfts: list[float] = []
        gaps: list[float] = []
        deltas = 0
        cpu0, start = time.process_time(), time.perf_counter()
        batches = [1] * args.requests if concurrency == 1 else [concurrency] * args.batches
        for size in batches:
            results = await asyncio.gather(*(one_stream(client, prompts.next(), params) for _ in range(size)))
            for ttft, stream_gaps, n in results:
                ttfts.append(ttft)
                gaps.extend(stream_gaps)
                deltas += n
        cpu, elapsed = time.process_time() - cpu0, time.perf_counter() - start
    return {
        "streams": len(ttfts),
        "deltas": deltas,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(len(ttfts) * args.tokens / elapsed, 1),
        "ttft_ms": {"p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99)},
        "itl_ms": {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99)},
        "client_cpu_us_per_delta": round(cpu / max(deltas, 1) * 1e6, 1),
    }


def percentile(values: list[float], q: float) -> float | None:
    data = sorted(values)
    return round(data[min(len(data) - 1, int(q * len(data)))], 3) if data else None


def summarize(rounds: list[dict], modes: list[str], levels: list[int]) -> dict:
    """Per concurrency and path: the median over rounds of each percentile; relay's and direct's side by side."""
    out: dict = {}
    for c in levels:
        out[str(c)] = {}
        for mode in modes:
            runs = [r[mode][str(c)] for r in rounds]
            out[str(c)][mode] = {
                metric: {q: round(statistics.median(run[metric][q] for run in runs), 3) for q in ("p50", "p99")}
                for metric in ("ttft_ms", "itl_ms")
            } | {
                "tokens_per_s": round(statistics.median(run["tokens_per_s"] for run in runs), 1),
                "client_cpu_us_per_delta": round(statistics.median(run["client_cpu_us_per_delta"] for run in runs), 1),
            }
    return out


async def run(args: argparse.Namespace, address: str, modes: list[str], levels: list[int]) -> list[dict]:
    prompts = Prompts(args.prompt_len)
    rounds = []
    for rnd in range(args.rounds):
        result: dict = {"round": rnd}
        for mode in modes if rnd % 2 == 0 else modes[::-1]:
            result[mode] = {}
            for c in levels:
                m = result[mode][str(c)] = await measure(address, mode == "direct", c, args, prompts)
                print(
                    f"round {rnd} {mode:6} x{c:<3}: TTFT p50 {m['ttft_ms']['p50']} p99 {m['ttft_ms']['p99']} ms; "
                    f"ITL p50 {m['itl_ms']['p50']} p99 {m['itl_ms']['p99']} ms; {m['tokens_per_s']} tok/s; "
                    f"client {m['client_cpu_us_per_delta']} us CPU per delta",
                    flush=True,
                )
        rounds.append(result)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", default="1,16", help="comma-separated stream counts (default 1,16)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per stream")
    parser.add_argument("--requests", type=int, default=16, help="streams one after the other at concurrency 1")
    parser.add_argument("--batches", type=int, default=2, help="batches of C streams at concurrency C > 1")
    parser.add_argument("--workers", type=int, default=1, help="infer-serve --workers")
    parser.add_argument("--serve-args", default="", help="more infer-serve flags, space-separated")
    parser.add_argument("--modes", default="relay,direct")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("relay", "direct") for m in modes):
        parser.error(f"--modes takes relay and / or direct, got {args.modes!r}")
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if not levels or min(levels) < 1 or args.rounds < 1:
        parser.error("--concurrency takes positive counts; --rounds must be at least 1")
    proc, address = start_serve(args)
    try:
        rounds = asyncio.run(run(args, address, modes, levels))
    finally:
        stop_serve(proc)
    summary = summarize(rounds, modes, levels)
    print(f"\n{'streams':>7} {'path':<6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>7}")
    for c, by_mode in summary.items():
        for mode, m in by_mode.items():
            print(
                f"{c:>7} {mode:<6} {m['ttft_ms']['p50']:>9} {m['ttft_ms']['p99']:>9} {m['itl_ms']['p50']:>8} "
                f"{m['itl_ms']['p99']:>8} {m['tokens_per_s']:>7}"
            )
    payload = {"config": vars(args), "model": "embedded default (SmolLM2-135M-Instruct Q4_1)", "median": summary}
    print(f"wrote {write_result('stream_latency', payload | {'rounds': rounds})}")


if __name__ == "__main__":
    main()
