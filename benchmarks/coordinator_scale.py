"""Coordinator at scale: many --benchmark-mode workers streaming long outputs through one infer-coordinator.

    load generator (one DEALER) -> infer-coordinator -> W x infer-worker --benchmark-mode --benchmark-step-time S

Each worker runs `--streams-per-worker` requests of `--tokens` tokens, one token per request per step of S
seconds, so the coordinator relays W x streams / S deltas a second at most. Measured, over the streaming phase:

- deltas relayed per second (token-carrying deltas that reached the load generator);
- the coordinator's CPU time per delta (from /proc), hence the deltas a second one coordinator core can carry;
- the latency the coordinator adds: each stream's gap between consecutive deltas minus the step time S (p50,
  p99; the worker's own step is S), and time to the first delta (p50, p99).

On a 2-core machine the workers, the coordinator and the load generator share the cores: the CPU per delta is
the figure that carries over; the latencies say how the hub behaves when the machine is saturated.

    .venv/bin/python benchmarks/coordinator_scale.py [--workers 64] [--streams-per-worker 8] [--tokens 200]
                                                      [--step-time 0.05]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result
from coordinator_overhead import _wait_for_workers, cpu_seconds, dealer, spawn, stop

from infer.protocol.messages import DeltaBatch, Submit, TokenIds, decode, encode
from infer.protocol.ports import reserved_port
from infer.protocol.sampling import SamplingParams

PROMPT = TokenIds(range(1, 17))


def start_cluster(args: argparse.Namespace) -> tuple[str, list, list]:
    """The coordinator and its workers as the README starts them (plus benchmark mode); (address, hub, workers)."""
    port = reserved_port()
    address = f"tcp://127.0.0.1:{port}"
    hub = spawn(
        "-m", "infer.coordinator.daemon", "--port", str(port), "--client-timeout", "600", "--log-level", "WARNING"
    )
    workers = [
        spawn(
            "-m",
            "infer.worker.daemon",
            "--coordinator",
            address,
            "--benchmark-mode",
            "--benchmark-step-time",
            str(args.step_time),
            "--max-num-seqs",
            str(args.streams_per_worker),
            "--log-level",
            "WARNING",
        )
        for _ in range(args.workers)
    ]
    return address, hub, workers


def stream_all(sock: zmq.Socket, args: argparse.Namespace, hub_pid: int, worker_pids: list[int]) -> dict:
    """Submit every stream at once and read deltas until each has finished (or --timeout); the phase's figures."""
    count = args.workers * args.streams_per_worker
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    first_ms: list[float] = []
    gaps_ms: list[float] = []
    deltas = finished = 0
    hub0, workers0, self0 = cpu_seconds(hub_pid), sum(map(cpu_seconds, worker_pids)), time.process_time()
    start = time.perf_counter()
    for i in range(count):
        rid = f"s{i}"
        sent[rid] = time.perf_counter()
        sock.send(encode(Submit(request_id=rid, prompt_token_ids=PROMPT, sampling=params)))
    deadline = start + args.timeout
    while finished < count and time.perf_counter() < deadline:
        if not sock.poll(1000):
            continue
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            now = time.perf_counter()
            batch = decode(frame)
            if not isinstance(batch, DeltaBatch):
                continue
            for delta in batch.deltas:
                if delta.token_ids:
                    deltas += 1
                    before = last.get(delta.request_id)
                    if before is None:
                        first_ms.append((now - sent[delta.request_id]) * 1000)
                    else:
                        gaps_ms.append((now - before) * 1000 - args.step_time * 1000 * len(delta.token_ids))
                    last[delta.request_id] = now
                finished += delta.finished
    elapsed = time.perf_counter() - start
    hub_cpu = cpu_seconds(hub_pid) - hub0
    return {
        "streams": count,
        "finished": finished,
        "deltas": deltas,
        "seconds": round(elapsed, 3),
        "deltas_per_s": round(deltas / elapsed),
        "ideal_deltas_per_s": round(count / args.step_time),
        "hub_cpu_s": round(hub_cpu, 3),
        "hub_cpu_us_per_delta": round(hub_cpu / max(deltas, 1) * 1e6, 2),
        "hub_capacity_deltas_per_core_s": round(deltas / hub_cpu) if hub_cpu else None,
        "workers_cpu_s": round(sum(map(cpu_seconds, worker_pids)) - workers0, 3),
        "loadgen_cpu_s": round(time.process_time() - self0, 3),
        "first_delta_ms": {"p50": percentile(first_ms, 0.5), "p99": percentile(first_ms, 0.99)},
        "added_gap_ms": {"p50": percentile(gaps_ms, 0.5), "p99": percentile(gaps_ms, 0.99)},
    }


def percentile(values: list[float], q: float) -> float | None:
    data = sorted(values)
    return round(data[min(len(data) - 1, int(q * len(data)))], 3) if data else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--streams-per-worker", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    parser.add_argument("--step-time", type=float, default=0.05, help="each worker's step, seconds")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up on the phase after this long")
    parser.add_argument("--label", default="", help="a name for this tree in the JSON (e.g. before / after)")
    args = parser.parse_args()
    address, hub, workers = start_cluster(args)
    ctx = zmq.Context()
    try:
        sock = dealer(ctx, address)
        _wait_for_workers(sock, args.workers)
        result = stream_all(sock, args, hub.pid, [w.pid for w in workers])
        sock.close()
    finally:
        stop([hub, *workers])
        ctx.term()
    print(
        f"{args.workers} workers x {args.streams_per_worker} streams x {args.tokens} tokens, step "
        f"{args.step_time * 1000:g} ms: {result['deltas_per_s']} deltas/s relayed (ideal "
        f"{result['ideal_deltas_per_s']}), coordinator {result['hub_cpu_us_per_delta']} us CPU per delta "
        f"({result['hub_capacity_deltas_per_core_s']} deltas/s a core); added gap p50 "
        f"{result['added_gap_ms']['p50']} ms p99 {result['added_gap_ms']['p99']} ms; first delta p50 "
        f"{result['first_delta_ms']['p50']} ms p99 {result['first_delta_ms']['p99']} ms"
    )
    if result["finished"] < result["streams"]:
        print(f"only {result['finished']} of {result['streams']} streams finished within {args.timeout:g} s")
    print(f"wrote {write_result('coordinator_scale', {'config': vars(args), 'result': result})}")


if __name__ == "__main__":
    main()
