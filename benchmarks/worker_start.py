"""A local cluster's workers forked from one torch-imported server (client/worker_forks.py) against a new interpreter
each (INFER_FORK_WORKERS=0): the cluster's start, a worker's restart after kill -9, and the CPU of it all.

Each round starts LocalCluster (infer-serve's: a coordinator and `--workers` workers on the embedded model unless
`--model`, `--threads` torch threads a worker), waits until every worker is healthy, kills worker 0 with SIGKILL,
starts it again in place, waits until it serves again, and shuts the cluster down. Rounds alternate the two ways.
Measured per round: start (spawn to every worker healthy), restart (kill -9 to the new worker healthy; stats polled
every 20 ms: the respawn is immediate here, infer-serve's Supervisor waits its backoff first), and the CPU
seconds of every process of the round (this process's reaped children, the fork server's children with it). Medians
per way; benchmarks/results/worker_start-*.json holds every round.

    .venv/bin/python benchmarks/worker_start.py [--rounds 3] [--workers 2] [--threads 1] [--model M]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from infer.client import InferenceClient  # noqa: E402
from infer.client.serve import LocalCluster  # noqa: E402
from infer.client.worker_forks import ForkedProcess  # noqa: E402
from infer.protocol import env  # noqa: E402


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def one_round(way: str, args: argparse.Namespace) -> dict:
    os.environ[env.FORK_WORKERS.name] = "1" if way == "fork" else "0"
    model = [] if args.model is None else ["--model", args.model]
    cpu0, t0 = _children_cpu(), time.monotonic()
    cluster = LocalCluster(
        num_workers=args.workers,
        worker_args=["--threads", str(args.threads), "--log-level", "WARNING", *model],
        coordinator_args=["--log-level", "WARNING"],
    )
    await cluster.start()
    try:
        await cluster.wait_ready(300)
        started = time.monotonic() - t0
        if (way == "fork") != all(isinstance(w, ForkedProcess) for w in cluster.workers):
            raise RuntimeError(f"the {way} round's workers were not started that way")
        async with InferenceClient(cluster.address, connect_timeout=60) as client:
            before = {w.worker_id for w in (await client.stats()).workers}
            t1 = time.monotonic()
            cluster.workers[0].send_signal(signal.SIGKILL)
            await cluster.workers[0].wait()
            await cluster.respawn_worker(0)
            while True:  # until a worker the cluster did not have serves beside the others
                healthy = {w.worker_id for w in (await client.stats()).workers if w.healthy}
                if len(healthy) == args.workers and healthy - before:
                    break
                if time.monotonic() - t1 > 300:
                    raise RuntimeError("the restarted worker did not join within 300 s")
                await asyncio.sleep(0.02)
            restarted = time.monotonic() - t1
    finally:
        await cluster.shutdown()
    return {"way": way, "start_s": started, "restart_s": restarted, "cpu_s": _children_cpu() - cpu0}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each way, alternating")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    rounds = []
    for i in range(args.rounds):
        for way in ("fork", "exec") if i % 2 == 0 else ("exec", "fork"):
            rounds.append(await one_round(way, args))
            print(rounds[-1], flush=True)
    summary = {
        way: {
            key: statistics.median(r[key] for r in rounds if r["way"] == way)
            for key in ("start_s", "restart_s", "cpu_s")
        }
        for way in ("fork", "exec")
    }
    for way, figures in summary.items():
        print(way, {k: round(v, 2) for k, v in figures.items()})
    path = write_result(
        "worker_start",
        {"workers": args.workers, "threads": args.threads, "model": args.model, "median": summary, "rounds": rounds},
    )
    print(path)


if __name__ == "__main__":
    asyncio.run(main())
