"""Routing by what the workers hold: a multi-turn chat workload over 4 workers under --policy kv-aware against
prefix-affinity and least-loaded, and the hit rate one worker holding everything gets (the target: kv-aware >= 90%
of it, with no worker's queue above 2x the mean).

Workload (fixed seed): `--conversations` conversations (32) of `--turns` turns (8), all running at once, each turn
sent a think time after the previous one's answer is in (uniform in [0, `--think-ms`], 300 ms by default, fixed by
the seed: the conversations drift out of step, as users' do; 0: in lockstep): a shared 32-token system prefix, a 64-token first user message, then
32 new user tokens a turn; every prompt is the whole conversation so far (prompts, answers, the new turn) as token
ids, answers 16 tokens (greedy, ignore_eos). The model is the tests' tiny Llama (random weights, the embedded
model's tokenizer, float32), so the run measures the cluster's routing and the engines' real prefix caches, not
the model's arithmetic. Each policy runs on a fresh `infer-serve` (its coordinator and workers, KV pools of
`--kv-cache-memory` each: large enough that one worker holds the whole working set).

Reported per policy: the prefix-cache hit rate (prompt tokens served from the cache / prompt tokens looked up,
summed over the workers' Load counters), TTFT (first token-carrying delta - submit, client side) p50 / p99, the
requests each worker ran and the mean of its in-flight requests sampled every 50 ms, with the busiest worker's
over the mean ("queue max/mean"). JSON: benchmarks/results/kv_routing-*.json.

kv-aware runs once per weight of `--overlap-weights` (the coordinator's --kv-overlap-weight; one run named
"kv-aware" for the coordinator's default, "kv-aware@W" for each W given).

    .venv/bin/python benchmarks/kv_routing.py [--conversations 32] [--turns 8] [--workers 4] [--think-ms 300]
        [--overlap-weights 1,4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common import random_model, stop_serve, write_result
from common import start_serve as serve

from infer.client.inference_client import InferenceClient
from infer.protocol.sampling import SamplingParams

VOCAB_LOW, VOCAB_HIGH = 100, 49000


def start_serve(
    model: Path, workers: int, policy: str, args: argparse.Namespace, weight: str | None = None
) -> tuple[subprocess.Popen, str]:
    flags = ["--workers", str(workers), "--model", str(model), "--policy", policy, "--log-level", "WARNING"]
    if weight is not None:
        flags += ["--kv-overlap-weight", weight]
    flags += ["--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", str(args.kv_cache_memory)]
    return serve(flags + ["--threads", "1"])


Turn = tuple[float, list[int]]  # (seconds to think before sending it, its user tokens)


def workload(args: argparse.Namespace) -> list[list[Turn]]:
    """Each conversation's user turns (the first with the shared system prefix), each with its think time."""
    rng = random.Random(0)
    system = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(32)]
    conversations = []
    for _ in range(args.conversations):
        first = system + [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(64)]
        later = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(32)] for _ in range(args.turns - 1)]
        conversations.append([(rng.uniform(0, args.think_ms) / 1000, user) for user in [first, *later]])
    return conversations


async def run_policy(address: str, conversations: list[list[Turn]], sessions: bool) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ttfts: list[float] = []
    async with InferenceClient(address, connect_timeout=60) as client:
        await client.wait_for_workers(1, timeout=60)
        start = {w.worker_id: w for w in (await client.stats()).workers}
        samples: dict[str, list[int]] = {wid: [] for wid in start}
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                for w in (await client.stats()).workers:
                    samples.setdefault(w.worker_id, []).append(w.num_in_flight)
                try:
                    await asyncio.wait_for(done.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass

        async def converse(index: int, turns: list[Turn]) -> None:
            history: list[int] = []
            for think, user in turns:
                await asyncio.sleep(think)
                history = history + user
                began, first, output = time.perf_counter(), None, []
                session = f"conversation-{index}" if sessions else None
                async for delta in client.stream(history, params, session_id=session):
                    if delta.token_ids and first is None:
                        first = time.perf_counter() - began
                    output += delta.token_ids
                ttfts.append(first if first is not None else float("nan"))
                history = history + output

        sampler = asyncio.create_task(sample())
        began = time.perf_counter()
        await asyncio.gather(*(converse(i, turns) for i, turns in enumerate(conversations)))
        elapsed = time.perf_counter() - began
        done.set()
        await sampler
        await asyncio.sleep(0.3)  # the last loads reach the coordinator
        end = {w.worker_id: w for w in (await client.stats()).workers}
    queried = sum(end[w].load.prefix_cache_queries - start[w].load.prefix_cache_queries for w in end)
    hit = sum(end[w].load.prefix_cache_hits - start[w].load.prefix_cache_hits for w in end)
    ran = {w: end[w].requests_routed - start[w].requests_routed for w in sorted(end)}
    queue = {w: statistics.fmean(samples[w]) if samples[w] else 0.0 for w in sorted(end)}
    mean_queue = statistics.fmean(queue.values())
    ttfts.sort()
    return {
        "hit_rate": hit / queried if queried else 0.0,
        "prompt_tokens": queried,
        "cached_tokens": hit,
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        "requests_per_worker": list(ran.values()),
        "mean_in_flight_per_worker": [round(q, 2) for q in queue.values()],
        "queue_max_over_mean": max(queue.values()) / mean_queue if mean_queue else 0.0,
        "requests_max_over_mean": max(ran.values()) / statistics.fmean(ran.values()),
        "seconds": elapsed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--kv-cache-memory", type=int, default=32_000_000)
    p.add_argument("--think-ms", type=float, default=300.0)
    p.add_argument("--policies", default="kv-aware,kv-aware+sessions,prefix-affinity,least-loaded")
    p.add_argument("--overlap-weights", default="", help="kv-aware again at each of these weights (comma-separated)")
    args = p.parse_args()
    from infer.worker.loading.model_files import resolve_model

    folder = Path(tempfile.gettempdir()) / "infer-bench-models"
    model = random_model("tiny", str(resolve_model(None)), folder)
    conversations = workload(args)
    runs: dict[str, dict] = {}
    plans = [(name, args.workers) for name in args.policies.split(",")]
    plans += [(f"kv-aware@{w}", args.workers) for w in args.overlap_weights.split(",") if w]
    plans += [("single worker", 1)]
    for name, workers in plans:
        policy = "least-loaded" if name == "single worker" else name.removesuffix("+sessions").split("@")[0]
        weight = name.split("@")[1] if "@" in name else None
        proc, address = start_serve(model, workers, policy, args, weight)
        try:
            runs[name] = asyncio.run(run_policy(address, conversations, name.endswith("+sessions")))
        finally:
            stop_serve(proc)
        r = runs[name]
        print(
            f"{name:>20}: hit rate {r['hit_rate']:.3f}  TTFT p50 {r['ttft_p50_ms']:.1f} ms p99 {r['ttft_p99_ms']:.1f} ms"
            f"  requests/worker {r['requests_per_worker']}  queue max/mean {r['queue_max_over_mean']:.2f}"
            f"  ({r['seconds']:.1f} s)",
            flush=True,
        )
    single = runs["single worker"]["hit_rate"]
    for name, r in runs.items():
        r["hit_rate_vs_single"] = r["hit_rate"] / single if single else 0.0
    print(
        "hit rate against one worker holding everything: "
        + ", ".join(f"{name} {r['hit_rate_vs_single']:.1%}" for name, r in runs.items() if name != "single worker")
    )
    config = {k: getattr(args, k) for k in ("conversations", "turns", "workers", "kv_cache_memory", "think_ms")}
    path = write_result("kv_routing", {"config": config, "model": "tiny Llama (random, float32)", "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
