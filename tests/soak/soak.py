"""Soak: steady load at 70% of the measured capacity for 30 minutes; the memory of every process must stay
flat and no request may fail. A program (not a test, not in CI).

1. A coordinator and --workers workers on loopback (tests/soak/harness.py's ProcessCluster) on the embedded
   model (or --model PATH, or --benchmark-mode workers: no model, deterministic tokens checked one by one).
2. Capacity: a closed loop of workers x --max-num-seqs outstanding requests for --capacity-seconds after a
   warm-up: completed requests/s.
3. Steady load: Poisson arrivals at --load x capacity for --duration seconds through --clients
   InferenceClients in this process: streams and generate calls (half each), greedy, ignore_eos, no aborts.
   Outcomes are folded into counters as they end (the load generator keeps no per-request state, so its own
   memory is measured too). Every --sample-every seconds the RSS (VmRSS) of every process is sampled.
4. Verdict:
   memory_flat  for every process (coordinator, each worker, the load generator): the median RSS of the last
                window differs from the median RSS of the first window by at most --tolerance (10%). The first
                window starts after --settle seconds (allocators, caches and the prefix cache fill up first);
                windows are 5 minutes long, or a quarter of the run when it is shorter than 20 minutes.
   no_errors    every request (capacity phase included) completed with all its tokens (status "completed";
                see harness.Outcome).
   none_lost    every request ended, with all its tokens or with a clear error (a refusal as "overloaded",
                at once or after --max-queue-time in a worker's queue, counts as clear): none hung past
                --request-deadline, raised, or broke the stream's promises.
   Also reported: every process's RSS at each sample, its peak (VmHWM), latency percentiles, and whether
   all processes outlived the run and stopped cleanly afterwards.

    .venv/bin/python tests/soak/soak.py                                   # 30 min at 70%, embedded model
    .venv/bin/python tests/soak/soak.py --duration 120                    # a 2-minute proof run
    .venv/bin/python tests/soak/soak.py --benchmark-mode --duration 600 --load 0.7

Prints a table and writes benchmarks/results/soak-<UTC time>.json (date, machine, git revision).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `soak` imports when run as a script
from infer.client.inference_client import InferenceClient
from soak.harness import (
    STATUSES,
    ClusterSpec,
    Outcome,
    ProcessCluster,
    Workload,
    measure_capacity,
    percentiles_ms,
    run_request,
    self_memory_kb,
    write_result,
)


class Tally:
    """Outcomes folded as they end: counts by status, a bounded uniform sample of latencies (reservoir), the
    first few problems. Constant memory, whatever the length of the run."""

    def __init__(self, reservoir: int = 20000, seed: int = 0) -> None:
        self.counts = {s: 0 for s in STATUSES}
        self.tokens = 0
        self.latencies: list[float] = []
        self.reservoir = reservoir
        self.seen = 0
        self.problems: list[str] = []
        self._rng = random.Random(seed)

    def add(self, o: Outcome) -> None:
        self.counts[o.status] += 1
        self.tokens += o.num_tokens
        if o.status != "completed" and len(self.problems) < 10:
            self.problems.append(f"{o.request_id} {o.kind} {o.status}: {o.problem or o.error}")
        if o.latency is not None and o.status == "completed":
            self.seen += 1
            if len(self.latencies) < self.reservoir:
                self.latencies.append(o.latency)
            elif (j := self._rng.randrange(self.seen)) < self.reservoir:
                self.latencies[j] = o.latency


async def steady_load(
    clients: list[InferenceClient],
    workload: Workload,
    rate: float,
    seconds: float,
    deadline_s: float,
    oracle: bool,
    tally: Tally,
    seed: int,
) -> dict[str, float]:
    """Poisson arrivals at `rate`/s for `seconds` (open loop); each outcome goes to `tally` as it ends."""
    rng = random.Random(f"{seed}:arrivals")
    pending: set[asyncio.Task] = set()
    turn = itertools.count()
    start, due, max_lag, sent = time.monotonic(), 0.0, 0.0, 0

    def done(task: asyncio.Task) -> None:
        pending.discard(task)
        tally.add(task.result())

    while (due := due + rng.expovariate(rate)) < seconds:
        delay = start + due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            max_lag = max(max_lag, -delay)
        client = clients[next(turn) % len(clients)]
        task = asyncio.create_task(run_request(client, workload.next(), deadline_s, oracle))
        task.add_done_callback(done)
        pending.add(task)
        sent += 1
    sent_until = time.monotonic()
    if pending:
        await asyncio.wait(set(pending))
    return {
        "sent": sent,
        "send_window_s": sent_until - start,
        "drain_s": time.monotonic() - sent_until,
        "max_send_lag_s": max_lag,
    }


async def sample_memory(
    cluster: ProcessCluster, every: float, start: float, samples: list[dict[str, Any]], stop: asyncio.Event
) -> None:
    while True:
        rss = cluster.sample_memory()
        rss["loadgen"] = self_memory_kb()[0]
        samples.append({"t": round(time.monotonic() - start, 1), "rss_kb": rss})
        try:
            await asyncio.wait_for(stop.wait(), every)  # the sampling period; stop ends it at once
            return
        except asyncio.TimeoutError:
            pass


def windows(duration: float, settle: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """(first window, last window), seconds into the steady phase: 5 minutes each, or a quarter of the run
    when it is shorter than 20 minutes; the first starts after `settle` (capped at a quarter of the run)."""
    length = 300.0 if duration >= 1200 else duration / 4
    first_start = min(settle, duration / 4)
    return (first_start, first_start + length), (duration - length, duration)


def memory_verdict(samples: list[dict[str, Any]], duration: float, settle: float, tolerance: float) -> dict[str, Any]:
    (a0, a1), (b0, b1) = windows(duration, settle)
    names = sorted({name for s in samples for name in s["rss_kb"]})
    per_process = {}
    for name in names:
        first = [s["rss_kb"][name] for s in samples if a0 <= s["t"] <= a1 and name in s["rss_kb"]]
        last = [s["rss_kb"][name] for s in samples if b0 <= s["t"] <= b1 and name in s["rss_kb"]]
        if not first or not last:
            per_process[name] = {"flat": False, "why": "no samples in a window (did it die?)"}
            continue
        m0, m1 = statistics.median(first), statistics.median(last)
        change = m1 / m0 - 1
        per_process[name] = {
            "first_median_kb": m0,
            "last_median_kb": m1,
            "change": round(change, 4),
            "flat": abs(change) <= tolerance,
        }
    return {
        "first_window_s": [a0, a1],
        "last_window_s": [b0, b1],
        "tolerance": tolerance,
        "per_process": per_process,
        "flat": all(p["flat"] for p in per_process.values()),
    }


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    worker = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
    if not args.benchmark_mode:
        worker += [
            "--dtype",
            args.dtype,
            "--threads",
            str(args.threads),
            "--kv-cache-memory",
            str(args.kv_cache_memory),
        ]
    return ClusterSpec(
        workers=args.workers, benchmark=args.benchmark_mode, model=args.model, worker_flags=tuple(worker)
    )


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    logs = args.logs or Path(tempfile.mkdtemp(prefix="infer-soak-"))
    cluster = ProcessCluster(cluster_spec(args), logs)
    oracle = args.benchmark_mode
    workload = Workload(tuple(args.prompt_len), tuple(args.max_tokens), stream_fraction=0.5, seed=args.seed, tag="cap")
    tally = Tally(seed=args.seed)
    samples: list[dict[str, Any]] = []
    with cluster.dumped_on_failure():
        await cluster.start(ready_timeout=args.ready_timeout)
        clients = await cluster.connected_clients(args.clients, call_timeout=30.0)
        concurrency = args.workers * args.max_num_seqs
        print(f"cluster up; capacity: {concurrency} outstanding for {args.capacity_seconds:g} s", flush=True)
        capacity = await measure_capacity(
            clients, workload, concurrency, args.capacity_seconds, args.warmup, args.request_deadline, oracle
        )
        rate = args.load * capacity["requests_per_s"]
        print(
            f"capacity {capacity['requests_per_s']:.2f} req/s ({capacity['tokens_per_s']:.0f} tok/s); "
            f"steady {rate:.2f} req/s for {args.duration:g} s, RSS every {args.sample_every:g} s",
            flush=True,
        )
        steady = Workload(workload.prompt_len, workload.max_tokens, stream_fraction=0.5, seed=args.seed + 1, tag="soak")
        stop = asyncio.Event()
        start = time.monotonic()
        sampler = asyncio.create_task(sample_memory(cluster, args.sample_every, start, samples, stop))
        load = await steady_load(clients, steady, rate, args.duration, args.request_deadline, oracle, tally, args.seed)
        stop.set()
        await sampler
        alive = {d.instance: d.alive() for d in cluster.daemons}
        final = await clients[0].stats()
        peaks, shutdown = await cluster.finish(clients)
    verdict = memory_verdict(samples, args.duration, args.settle, args.tolerance)
    no_errors = all(
        n == 0 for status, n in [*tally.counts.items(), *capacity["statuses"].items()] if status != "completed"
    )
    none_lost = all(
        n == 0
        for status, n in [*tally.counts.items(), *capacity["statuses"].items()]
        if status in ("hung", "raised", "bad")
    )
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "logs": str(logs),
        "model": "benchmark-mode" if args.benchmark_mode else (args.model or "embedded default"),
        "capacity": capacity,
        "rate": rate,
        "load": load,
        "requests": {
            "statuses": tally.counts,
            "tokens": tally.tokens,
            "problems": tally.problems,
            "latency_ms_completed": percentiles_ms(tally.latencies),
        },
        "final_stats": {
            k: getattr(final, k, None)
            for k in (
                "requests_completed",
                "requests_failed",
                "requests_rejected",
                "requests_timed_out",
                "requests_redispatched",
                "num_in_flight",
            )
        },
        "memory": verdict,
        "rss_samples": samples,
        "peak_rss_kb": {**peaks, "loadgen": self_memory_kb()[1]},
        "processes_alive_at_end": alive,
        "shutdown": shutdown,
        "checks": {
            "memory_flat": verdict["flat"],
            "no_errors": no_errors,
            "none_lost": none_lost,
            "all_processes_alive": all(alive.values()),
            "no_leaks": not shutdown["leaked"],
        },
    }


def print_report(result: dict[str, Any]) -> None:
    mem = result["memory"]
    print(
        f"\nRSS (MiB), median of the first window {mem['first_window_s']} s vs the last "
        f"{mem['last_window_s']} s of the steady phase (tolerance {100 * mem['tolerance']:.0f}%)"
    )
    print(f"  {'process':<16} {'first':>8} {'last':>8} {'change':>8} {'peak':>8}  flat")
    for name, p in mem["per_process"].items():
        peak = result["peak_rss_kb"].get(name, 0) / 1024
        if "first_median_kb" in p:
            print(
                f"  {name:<16} {p['first_median_kb'] / 1024:>8.1f} {p['last_median_kb'] / 1024:>8.1f} "
                f"{100 * p['change']:>7.1f}% {peak:>8.1f}  {'yes' if p['flat'] else 'NO'}"
            )
        else:
            print(f"  {name:<16} {p['why']}")
    req = result["requests"]
    lat = req["latency_ms_completed"]
    counts = ", ".join(f"{k} {n}" for k, n in req["statuses"].items() if n or k == "completed")
    print(
        f"\nrequests at {result['rate']:.2f} req/s ({result['config']['load']:g} x capacity "
        f"{result['capacity']['requests_per_s']:.2f}): {counts}"
    )
    print(
        f"  latency ms p50 {lat['p50']} p90 {lat['p90']} p99 {lat['p99']} max {lat['max']}; "
        f"send lag max {result['load']['max_send_lag_s']:.2f} s"
    )
    for problem in req["problems"][:5]:
        print(f"  problem: {problem}")
    if result["capacity"]["not_completed"]:
        print(f"  capacity phase: {result['capacity']['statuses']}")
        for problem in result["capacity"]["not_completed"][:5]:
            print(f"  capacity phase problem: {problem}")
    print("\nchecks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in result["checks"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of steady load (default 30 min)")
    p.add_argument("--load", type=float, default=0.7, help="offered rate / capacity (default %(default)s)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--benchmark-mode", action="store_true", help="workers without a model")
    p.add_argument("--model", help="the workers' model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--kv-cache-memory", type=int, default=64_000_000, help="KV pool bytes per worker")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--capacity-seconds", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--settle", type=float, default=60.0, help="seconds before the first memory window")
    p.add_argument("--tolerance", type=float, default=0.10, help="allowed RSS change, first vs last window")
    p.add_argument("--request-deadline", type=float, default=300.0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", type=Path, help="directory for the daemons' logs (default: a new temp dir)")
    args = p.parse_args(argv)
    result = asyncio.run(soak(args))
    print_report(result)
    path = write_result("soak", result)
    print(f"\nwrote {path}")
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
