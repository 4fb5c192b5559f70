"""Chaos: mixed load through faults. A program (not a test); tests/cluster/test_chaos.py runs a short version.

A coordinator and --workers workers in --benchmark-mode (deterministic tokens: token i of a P-token prompt
is (P + i) % 1000, so every stream is checked token for token) on loopback, and --clients InferenceClients in
this process sending Poisson arrivals at --rate requests/s: streams and generate calls, a fraction of them
aborted part-way (a stream after k tokens, a generate call after a random delay). Meanwhile one controller,
one event at a time:
  - every --kill-every seconds: kill -9 of a random worker among those with requests in flight, then its
    restart (alternately at once under the same --worker-id, as a supervisor with a fixed id does, and under
    a new id once the coordinator has declared the old one dead), then a wait until every worker is healthy;
  - once, at --coordinator-kill-at (default: mid-run, between two worker kills), with requests in flight:
    kill -9 of the coordinator and its restart on the same port, then a wait until every worker has
    registered with the new one;
  - between kills: pause, hold --pause-seconds, unpause.
At the end, the checks (each true or false in the JSON):
  every_request_ended  every request completed, was aborted (by us), or got a clear error: no request hung
  streams_exact        no stream or completion has a gap, a repeat, a wrong token or two ends; every error has
                       a message and a code (`bad` outcomes: none)
  kv_back_to_zero      the coordinator's stats: every worker healthy, running = waiting = 0, free blocks =
                       total blocks, nothing in flight or held (within --settle-timeout)
  no_leaks             after the lifecycle STOP every process exited (or was SIGKILLed and reaped) and no
                       process carrying this run's environment marker is alive
Requests that raise ClusterError (a client losing its coordinator) count as clear errors ("raised") but are
listed. With the "Coordinator restart" feature, requests in flight across the coordinator kill re-attach and
finish; without it they end as errors, raised or hung.

    .venv/bin/python tests/soak/chaos.py                       # 5 minutes, 3 workers, ~35 s of events
    .venv/bin/python tests/soak/chaos.py --duration 60 --kill-every 15
    .venv/bin/python tests/soak/chaos.py --no-coordinator-kill

Prints a table and writes benchmarks/results/chaos-<UTC time>.json (date, machine, git revision, config,
events, outcome counts, checks, peak memory of every process).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `soak` imports when run as a script
from infer.client.inference_client import ClusterError, InferenceClient
from soak.harness import (
    ClusterSpec,
    ProcessCluster,
    Workload,
    count_statuses,
    idle,
    open_loop,
    percentiles_ms,
    problems,
    self_memory_kb,
    wait_until,
    write_result,
)

BUSY_WAIT_S = 5.0  # a kill waits at most this long for its target to have requests in flight


@dataclass
class ChaosConfig:
    duration: float = 300.0  # seconds of load
    workers: int = 3
    clients: int = 4
    rate: float = 25.0  # requests/s offered (Poisson): well below capacity on 2 cores
    kill_every: float = 30.0  # a worker kill -9 every this many seconds
    worker_kills: list[float] | None = None  # explicit times instead (seconds into the run)
    coordinator_kill_at: float | None = -1.0  # -1: mid-run, between two worker kills; None: never
    pauses: list[float] | None = None  # times of pause / unpause (default: halfway between worker kills)
    pause_seconds: float = 1.0
    stream_fraction: float = 0.6
    abort_fraction: float = 0.15
    prompt_len: tuple[int, int] = (4, 64)
    max_tokens: tuple[int, int] = (64, 1024)  # long enough that dozens of requests are in flight at a kill
    max_num_seqs: int = 32  # per worker
    max_outstanding: int = 400  # arrivals wait beyond this many requests out (counted: throttled)
    request_deadline: float = 90.0  # a request not ended by then is "hung"
    recovery_timeout: float = 30.0  # for the cluster to be whole again after an event
    settle_timeout: float = 30.0  # for the KV pools to empty at the end
    seed: int = 0
    logs: Path | None = None

    def worker_kill_times(self) -> list[float]:
        if self.worker_kills is not None:
            return list(self.worker_kills)
        times, t = [], self.kill_every
        while t < self.duration - 5:
            times.append(t)
            t += self.kill_every
        return times

    def coordinator_kill_time(self) -> float | None:
        if self.coordinator_kill_at is None or self.coordinator_kill_at >= 0:
            return self.coordinator_kill_at
        half = self.duration / 2
        kills = self.worker_kill_times()
        before = max([t for t in kills if t <= half], default=0.0)
        after = min([t for t in kills if t > half], default=self.duration)
        return before + (after - before) / 4  # a quarter of the way from the mid-run kill to the next one

    def pause_times(self) -> list[float]:
        if self.pauses is not None:
            return list(self.pauses)
        return [t - self.kill_every / 2 for t in self.worker_kill_times()[1:]]


@dataclass
class Event:
    at: float  # seconds into the run, planned
    kind: str  # worker_kill | coordinator_kill | pause
    target: str = ""
    started: float = 0.0  # seconds into the run, actual
    recovery_s: float | None = None
    in_flight: int | None = None  # kills: requests on the victim (the whole cluster's, for the coordinator)
    ok: bool = False
    note: str = ""


async def run_event(
    event: Event,
    cluster: ProcessCluster,
    control: InferenceClient,
    config: ChaosConfig,
    rng: random.Random,
    kill_count: list[int],
) -> None:
    t0 = time.monotonic()
    try:
        if event.kind == "worker_kill":
            await kill_worker(event, cluster, control, config, rng, kill_count)
        elif event.kind == "coordinator_kill":
            event.in_flight = await wait_until(lambda: _in_flight(control), BUSY_WAIT_S, 0.02) or 0
            cluster.coordinator.kill9()
            cluster.start_coordinator()
            event.target = cluster.coordinator.instance
        elif event.kind == "pause":
            await control.pause()
            await asyncio.sleep(config.pause_seconds)  # the pause lasts this long: the point of the event
            await control.unpause()
        whole = await wait_until(lambda: healthy_count(control, config.workers), config.recovery_timeout, 0.05)
        event.recovery_s = time.monotonic() - t0
        event.ok = bool(whole)
        if not whole:
            event.note += f" the cluster was not whole again within {config.recovery_timeout} s"
    except (ClusterError, TimeoutError) as e:
        event.note += f" {type(e).__name__}: {e}"


async def kill_worker(
    event: Event,
    cluster: ProcessCluster,
    control: InferenceClient,
    config: ChaosConfig,
    rng: random.Random,
    kill_count: list[int],
) -> None:
    busy = await wait_until(lambda: _busy_ranks(control), BUSY_WAIT_S, 0.02) or {}  # a worker with requests
    rank = rng.choice(sorted(busy)) if busy else rng.randrange(config.workers)
    victim = cluster.workers[rank]
    old_id = cluster.worker_ids[rank]
    event.in_flight = busy.get(rank, 0)
    victim.kill9()
    kill_count[0] += 1
    same_id = kill_count[0] % 2 == 1
    if not same_id:  # a new id may register once the coordinator has declared the old one dead

        async def declared_dead() -> bool:
            stats = await control.stats()
            return all(not w.healthy for w in stats.workers if w.worker_id == old_id)

        if not await wait_until(declared_dead, config.recovery_timeout, 0.05):
            event.note += f" {old_id} was not declared dead within {config.recovery_timeout} s;"
    cluster.start_worker(rank, same_id=same_id)
    event.target = (
        f"{victim.instance} ({old_id}) -> {cluster.workers[rank].instance} "
        f"({cluster.worker_ids[rank]}, {'same id' if same_id else 'new id'})"
    )


async def _in_flight(control: InferenceClient) -> int:
    return (await control.stats()).num_in_flight


async def _busy_ranks(control: InferenceClient) -> dict[int, int]:
    """{dp rank: requests in flight} of the healthy workers that have some."""
    stats = await control.stats()
    return {w.dp_rank: w.num_in_flight for w in stats.workers if w.healthy and w.num_in_flight}


async def healthy_count(control: InferenceClient, workers: int) -> bool:
    stats = await control.stats()
    return sum(w.healthy for w in stats.workers) == workers


async def controller(
    cluster: ProcessCluster, control: InferenceClient, config: ChaosConfig, start: float, events: list[Event]
) -> None:
    rng = random.Random(f"{config.seed}:chaos")
    kill_count = [0]
    for event in events:
        delay = start + event.at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        event.started = time.monotonic() - start
        await run_event(event, cluster, control, config, rng, kill_count)


def plan(config: ChaosConfig) -> list[Event]:
    events = [Event(t, "worker_kill") for t in config.worker_kill_times()]
    events += [Event(t, "pause") for t in config.pause_times()]
    if (t := config.coordinator_kill_time()) is not None:
        events.append(Event(t, "coordinator_kill"))
    return sorted(events, key=lambda e: e.at)


async def run_chaos(config: ChaosConfig) -> dict[str, Any]:
    """Run the whole scenario (module doc) and return its result: config, events, outcomes and checks."""
    logs = config.logs or Path(tempfile.mkdtemp(prefix="infer-chaos-"))
    worker_flags = ("--max-num-seqs", str(config.max_num_seqs), "--max-model-len", "4096")
    cluster = ProcessCluster(ClusterSpec(workers=config.workers, benchmark=True, worker_flags=worker_flags), logs)
    workload = Workload(
        config.prompt_len, config.max_tokens, config.stream_fraction, config.abort_fraction, config.seed, tag="chaos"
    )
    events = plan(config)
    result: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "logs": str(logs),
        "workload": workload.describe(),
    }
    with cluster.dumped_on_failure():
        await cluster.start()
        clients = await cluster.connected_clients(config.clients)
        (control,) = await cluster.connected_clients(1, call_timeout=10.0)
        start = time.monotonic()
        chaos = asyncio.create_task(controller(cluster, control, config, start, events))
        load = await open_loop(
            clients,
            workload,
            config.rate,
            config.duration,
            config.request_deadline,
            oracle=True,
            seed=config.seed,
            max_outstanding=config.max_outstanding,
        )
        await chaos
        settled = await wait_until(lambda: _idle_stats(control, config.workers), config.settle_timeout)
        final = settled or await _stats_or_none(control)
        peaks, shutdown = await cluster.finish([*clients, control])
    outcomes = load["outcomes"]
    statuses = count_statuses(outcomes)
    checks = {
        "every_request_ended": statuses["hung"] == 0,
        "streams_exact": statuses["bad"] == 0,
        "kv_back_to_zero": settled is not None,
        "no_leaks": not shutdown["leaked"],
        "events_recovered": all(e.ok for e in events),
    }
    result.update(
        {
            "events": [asdict(e) for e in events],
            "requests": {
                "offered": load["offered"],
                "throttled": load["throttled"],
                "statuses": statuses,
                "by_kind": {
                    kind: count_statuses([o for o in outcomes if o.kind == kind]) for kind in ("stream", "generate")
                },
                "errors": sorted(
                    {f"{o.error_code}: {o.error}"[:160] for o in outcomes if o.status in ("error", "raised")}
                )[:20],
                "latency_ms_completed": percentiles_ms([o.latency for o in outcomes if o.status == "completed"]),
            },
            "problems": problems(outcomes),
            "final_stats": None if final is None else _stats_summary(final),
            "peak_rss_kb": {**peaks, "loadgen": self_memory_kb()[1]},
            "shutdown": shutdown,
            "checks": checks,
            "passed": all(checks.values()),
        }
    )
    return result


async def _idle_stats(control: InferenceClient, workers: int):
    stats = await control.stats()
    return stats if idle(stats, workers) else None


async def _stats_or_none(control: InferenceClient):
    try:
        return await control.stats()
    except (ClusterError, TimeoutError):
        return None


def _stats_summary(stats: Any) -> dict[str, Any]:
    keys = (
        "num_in_flight",
        "num_held",
        "requests_submitted",
        "requests_completed",
        "requests_failed",
        "requests_aborted",
        "requests_redispatched",
        "requests_rejected",
        "requests_timed_out",
    )
    return {
        **{k: getattr(stats, k, None) for k in keys},
        "workers": [
            {
                "worker_id": w.worker_id,
                "dp_rank": w.dp_rank,
                "healthy": w.healthy,
                "registrations": w.registrations,
                "load": None
                if w.load is None
                else {
                    "running": w.load.num_running,
                    "waiting": w.load.num_waiting,
                    "free_blocks": w.load.num_free_blocks,
                    "total_blocks": w.load.num_total_blocks,
                },
            }
            for w in stats.workers
        ],
    }


def print_report(result: dict[str, Any]) -> None:
    print("\nevents")
    print(f"  {'at s':>6} {'kind':<17} {'in flight':>9} {'recovery s':>10} {'ok':>3}  target / note")
    for e in result["events"]:
        rec = "-" if e["recovery_s"] is None else f"{e['recovery_s']:.2f}"
        flight = "-" if e["in_flight"] is None else str(e["in_flight"])
        ok = "yes" if e["ok"] else "NO"
        print(f"  {e['started']:>6.1f} {e['kind']:<17} {flight:>9} {rec:>10} {ok:>3}  {e['target']}{e['note']}")
    req = result["requests"]
    print(f"\nrequests: {req['offered']} offered ({req['throttled']} throttled at the outstanding cap)")
    print(f"  {'kind':<9}" + "".join(f"{s:>10}" for s in req["statuses"]))
    for kind, counts in [*req["by_kind"].items(), ("all", req["statuses"])]:
        print(f"  {kind:<9}" + "".join(f"{n:>10}" for n in counts.values()))
    lat = req["latency_ms_completed"]
    print(f"  completed latency ms: p50 {lat['p50']}  p99 {lat['p99']}  max {lat['max']}")
    for err in req["errors"][:8]:
        print(f"  error: {err}")
    for p in result["problems"][:5]:
        print(f"  problem: {p['request_id']} {p['kind']} {p['status']}: {p['problem']}")
    print("\npeak RSS (MiB): " + ", ".join(f"{k} {v / 1024:.0f}" for k, v in result["peak_rss_kb"].items()))
    shutdown = result["shutdown"]
    print(f"shutdown: killed after STOP {shutdown['killed_after_stop']}, leaked {shutdown['leaked']}")
    print("\nchecks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in result["checks"].items()))
    print("PASSED" if result["passed"] else "FAILED")


def main(argv: list[str] | None = None) -> int:
    d = ChaosConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of load (default %(default)s)")
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--clients", type=int, default=d.clients)
    p.add_argument("--rate", type=float, default=d.rate, help="requests/s offered (default %(default)s)")
    p.add_argument("--kill-every", type=float, default=d.kill_every, help="seconds between worker kills")
    p.add_argument(
        "--coordinator-kill-at",
        type=float,
        default=None,
        help="seconds into the run (default: mid-run, between two worker kills)",
    )
    p.add_argument("--no-coordinator-kill", action="store_true")
    p.add_argument("--pause-seconds", type=float, default=d.pause_seconds)
    p.add_argument("--abort-fraction", type=float, default=d.abort_fraction)
    p.add_argument("--stream-fraction", type=float, default=d.stream_fraction)
    p.add_argument("--max-tokens", type=int, nargs=2, default=d.max_tokens, metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--logs", type=Path, help="directory for the daemons' logs (default: a new temp dir)")
    args = p.parse_args(argv)
    config = ChaosConfig(
        duration=args.duration,
        workers=args.workers,
        clients=args.clients,
        rate=args.rate,
        kill_every=args.kill_every,
        coordinator_kill_at=None
        if args.no_coordinator_kill
        else (-1.0 if args.coordinator_kill_at is None else args.coordinator_kill_at),
        pause_seconds=args.pause_seconds,
        abort_fraction=args.abort_fraction,
        stream_fraction=args.stream_fraction,
        max_tokens=tuple(args.max_tokens),
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        logs=args.logs,
    )
    print(
        f"chaos: {config.duration:g} s, {config.workers} benchmark-mode workers, {config.rate:g} req/s; "
        "events: " + ", ".join(f"{e.kind}@{e.at:g}" for e in plan(config)),
        flush=True,
    )
    result = asyncio.run(run_chaos(config))
    print_report(result)
    path = write_result("chaos", result)
    print(f"\nwrote {path}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
