"""Overload: offer 10x the measured capacity for 60 s. Admission control must refuse the excess at once (error
code "overloaded") and lose nothing it accepted. A program, not a test.

1. A coordinator and --workers workers on loopback (tests/soak/harness.py's ProcessCluster) on the embedded
   SmolLM2-135M-Instruct (or --model PATH): the workers' compute is the bottleneck, as in production. With
   --benchmark-mode the workers have no model and generate tokens as fast as the coordinator relays them, so
   the coordinator, the wire and the client are the bottleneck (on 2 cores the load generator then competes
   with the coordinator for CPU: see the loop lag and CPU lines). Admission bounds: workers --max-num-seqs S
   --max-waiting-requests W, coordinator --max-requests-per-worker S + W and --max-held-requests H.
2. Capacity: a closed loop keeping every worker at its bound (workers x (S + W) requests outstanding) for
   --capacity-seconds after a warm-up: completed requests/s.
3. Overload: Poisson arrivals at --factor x capacity for --duration seconds, generate() calls through
   --clients InferenceClients in this process (open loop: arrivals never wait for the cluster); every request
   runs to its end, bounded by --request-deadline.
4. Report: offered, accepted (not refused), rejected ("overloaded"), completed (every token, checked against
   --benchmark-mode's deterministic output), lost (accepted but not completed: 0 is the promise), p50 / p99
   latency of the accepted requests, goodput (completed/s while offering) against capacity, the coordinator's
   own counters, the peak RSS (VmHWM) and CPU share of every process, the load generator included, and how
   late the load generator's event loop ran (its own lag, not the cluster's).

    .venv/bin/python benchmarks/overload.py                    # 60 s at 10x capacity, embedded model
    .venv/bin/python benchmarks/overload.py --duration 20 --factor 5
    .venv/bin/python benchmarks/overload.py --benchmark-mode   # coordinator-bound: no model

Prints a table and writes benchmarks/results/overload-<UTC time>.json (date, machine, git revision).
On a 2-core machine the load generator, the coordinator and the workers share the cores: the offered rate
that was really sent is reported next to the planned one (max_send_lag_s says how far sending fell behind).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the shared harness: tests/soak
from soak.harness import (
    ClusterSpec,
    LoopLag,
    ProcessCluster,
    Workload,
    completed_rate,
    count_statuses,
    measure_capacity,
    open_loop,
    percentiles_ms,
    problems,
    self_memory_kb,
    write_result,
)


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    per_worker = args.max_num_seqs + args.max_waiting_requests
    worker = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-waiting-requests",
        str(args.max_waiting_requests),
        "--max-model-len",
        str(args.max_model_len),
    ]
    if not args.benchmark_mode:
        worker += ["--dtype", args.dtype, "--threads", str(args.threads)]
    coordinator = ["--max-requests-per-worker", str(per_worker), "--max-held-requests", str(args.max_held_requests)]
    return ClusterSpec(
        workers=args.workers,
        benchmark=args.benchmark_mode,
        model=args.model,
        coordinator_flags=tuple(coordinator),
        worker_flags=tuple(worker),
    )


def summarize(run: dict[str, Any], capacity: float) -> dict[str, Any]:
    outcomes = run["outcomes"]
    statuses = count_statuses(outcomes)
    accepted = [o for o in outcomes if o.status != "rejected"]
    window = run["sent_until"] - run["start"]
    return {
        "offered": run["offered"],
        "offered_per_s": run["offered"] / window,
        "send_window_s": window,
        "max_send_lag_s": run["max_send_lag_s"],
        "accepted": len(accepted),
        "rejected": statuses["rejected"],
        "completed": statuses["completed"],
        "lost": len(accepted) - statuses["completed"],
        "statuses": statuses,
        "accepted_fraction": len(accepted) / max(1, run["offered"]),
        "latency_ms_accepted": percentiles_ms([o.latency for o in accepted if o.latency is not None]),
        "latency_ms_rejected": percentiles_ms([o.latency for o in outcomes if o.status == "rejected"]),
        "goodput_per_s": completed_rate(outcomes, run["start"], run["sent_until"]),
        "goodput_vs_capacity": completed_rate(outcomes, run["start"], run["sent_until"]) / capacity,
        "drain_s": run["end"] - run["sent_until"],
        "problems": problems(outcomes),
        "errors": sorted({f"{o.error_code}: {o.error}"[:160] for o in outcomes if o.status in ("error", "raised")})[
            :10
        ],
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    logs = args.logs or Path(tempfile.mkdtemp(prefix="infer-overload-"))
    spec = cluster_spec(args)
    cluster = ProcessCluster(spec, logs)
    oracle = spec.benchmark
    workload = Workload(
        (args.prompt_len[0], args.prompt_len[1]),
        (args.max_tokens[0], args.max_tokens[1]),
        stream_fraction=0.0,
        seed=args.seed,
        tag="cap",
    )
    bound = args.workers * (args.max_num_seqs + args.max_waiting_requests)
    with cluster.dumped_on_failure():
        await cluster.start(ready_timeout=args.ready_timeout)
        clients = await cluster.connected_clients(args.clients, call_timeout=30.0)
        print(
            f"cluster up ({'benchmark-mode' if oracle else args.model or 'embedded model'} workers); "
            f"measuring capacity with {bound} outstanding for {args.capacity_seconds:g} s ...",
            flush=True,
        )
        capacity = await measure_capacity(
            clients, workload, bound, args.capacity_seconds, args.warmup, args.request_deadline, oracle
        )
        rate = args.factor * capacity["requests_per_s"]
        print(
            f"capacity {capacity['requests_per_s']:.1f} req/s ({capacity['tokens_per_s']:.0f} tok/s); "
            f"offering {rate:.1f} req/s for {args.duration:g} s ...",
            flush=True,
        )
        before, cpu_before = await clients[0].stats(), cluster.cpu()
        overload_workload = Workload(
            workload.prompt_len, workload.max_tokens, stream_fraction=0.0, seed=args.seed + 1, tag="over"
        )
        with LoopLag() as lag:
            run = await open_loop(
                clients, overload_workload, rate, args.duration, args.request_deadline, oracle, seed=args.seed
            )
        cpu_after = cluster.cpu()
        after = await clients[0].stats()
        peaks, shutdown = await cluster.finish(clients)
    over = summarize(run, capacity["requests_per_s"])
    over["loadgen_loop_lag_ms"] = percentiles_ms(lag.lags)
    wall = run["end"] - run["start"]
    over["cpu_share"] = {
        name: round((cpu_after[name] - used) / wall, 3) for name, used in cpu_before.items() if name in cpu_after
    }
    counters = {
        k: getattr(after, k) - getattr(before, k)
        for k in (
            "requests_submitted",
            "requests_completed",
            "requests_failed",
            "requests_rejected",
            "requests_timed_out",
            "requests_aborted",
            "requests_redispatched",
        )
    }
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "logs": str(logs),
        "admission": {
            "coordinator": list(spec.coordinator_flags),
            "worker": list(spec.worker_flags),
            "bound_requests": bound,
        },
        "capacity": capacity,
        "offered_rate_planned": rate,
        "overload": over,
        "coordinator_counters": counters,
        "peak_rss_kb": {**peaks, "loadgen": self_memory_kb()[1]},
        "shutdown": shutdown,
        "nothing_accepted_lost": over["lost"] == 0,
    }


def print_report(result: dict[str, Any]) -> None:
    cap, over = result["capacity"], result["overload"]
    lat, rej = over["latency_ms_accepted"], over["latency_ms_rejected"]
    print(
        f"\n{'phase':<10} {'offered/s':>10} {'offered':>8} {'accepted':>9} {'rejected':>9} "
        f"{'completed':>10} {'lost':>5} {'p50 ms':>9} {'p99 ms':>9} {'goodput/s':>10}"
    )
    print(
        f"{'capacity':<10} {'closed':>10} {'-':>8} {'-':>9} {cap['statuses']['rejected']:>9} "
        f"{cap['statuses']['completed']:>10} {'-':>5} {'-':>9} {'-':>9} {cap['requests_per_s']:>10.1f}"
    )
    print(
        f"{'overload':<10} {over['offered_per_s']:>10.1f} {over['offered']:>8} {over['accepted']:>9} "
        f"{over['rejected']:>9} {over['completed']:>10} {over['lost']:>5} {lat['p50']!s:>9} "
        f"{lat['p99']!s:>9} {over['goodput_per_s']:>10.1f}"
    )
    print(
        f"\nplanned {result['offered_rate_planned']:.1f} req/s ({result['config']['factor']:g}x capacity), "
        f"sent {over['offered_per_s']:.1f} req/s (max send lag {over['max_send_lag_s']:.2f} s); accepted "
        f"{100 * over['accepted_fraction']:.1f}%; goodput {over['goodput_vs_capacity']:.2f}x capacity; "
        f"rejections answered in p50 {rej['p50']} / p99 {rej['p99']} ms; drain {over['drain_s']:.1f} s"
    )
    print(f"coordinator counters over the overload phase: {result['coordinator_counters']}")
    print(f"load generator loop lag ms: {over['loadgen_loop_lag_ms']}")
    shares = ", ".join(f"{k} {v:.2f}" for k, v in over["cpu_share"].items())
    print(f"CPU while overloaded (cores): {shares}")
    for problem in cap["not_completed"][:5]:
        print(f"  capacity phase, not completed: {problem}")
    for err in over["errors"]:
        print(f"  error: {err}")
    for p in over["problems"][:5]:
        print(f"  problem: {p['request_id']} {p['status']}: {p['problem']}")
    print("peak RSS (MiB): " + ", ".join(f"{k} {v / 1024:.0f}" for k, v in result["peak_rss_kb"].items()))
    print(
        "nothing accepted was lost"
        if result["nothing_accepted_lost"]
        else f"LOST {over['lost']} accepted request(s): {over['statuses']}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of overload (default %(default)s)")
    p.add_argument("--factor", type=float, default=10.0, help="offered rate / capacity (default %(default)s)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--clients", type=int, default=4, help="InferenceClients sending the load")
    p.add_argument("--model", help="the workers' model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--benchmark-mode", action="store_true", help="workers with no model")
    p.add_argument("--dtype", default="bfloat16", help="with a model (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker, with a model")
    p.add_argument("--max-num-seqs", type=int, help="per worker (default 8; 32 with --benchmark-mode)")
    p.add_argument("--max-waiting-requests", type=int, help="per worker (default: --max-num-seqs)")
    p.add_argument("--max-held-requests", type=int, default=64, help="coordinator (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument(
        "--max-tokens",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="uniform range (default 16 64; 512 1536 with --benchmark-mode)",
    )
    p.add_argument("--capacity-seconds", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--request-deadline", type=float, default=300.0, help="not ended by then: lost")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", type=Path, help="directory for the daemons' logs (default: a new temp dir)")
    args = p.parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = 32 if args.benchmark_mode else 8
    if args.max_waiting_requests is None:
        args.max_waiting_requests = args.max_num_seqs
    if args.max_tokens is None:
        args.max_tokens = (512, 1536) if args.benchmark_mode else (16, 64)
    started = time.monotonic()
    result = asyncio.run(bench(args))
    result["wall_s"] = time.monotonic() - started
    print_report(result)
    path = write_result("overload", result)
    print(f"\nwrote {path}")
    return 0 if result["nothing_accepted_lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
