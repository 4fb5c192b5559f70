"""Coordinator overhead: one-token requests per second and their latency through infer-coordinator, against a
bare pyzmq ROUTER relay doing no work, in the same run, on this machine (loopback TCP).

    coordinator path: load generator -> infer-coordinator -> N x infer-worker --benchmark-mode (no model)
    relay path:       load generator -> relay (forwards raw frames, decodes nothing) -> N x echo worker

The load generator is the same for both: a DEALER sending pre-encoded Submit frames (max_tokens=1) and
reading replies without validation. Throughput: a closed loop keeping `--concurrency` requests outstanding
for `--seconds`. Latency: a closed loop with one request outstanding (p50 / p99). Each hub's CPU time per
request (from /proc) gives its single-core capacity, which is what the coordinator itself costs: on a
2-core machine the load generator and workers share the cores and bound the end-to-end rate.

    .venv/bin/python benchmarks/coordinator_overhead.py [--seconds 5] [--concurrency 512] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result

from infer.protocol.messages import Hello, RequestSpec, Submit, TokenIds, Welcome, decode, encode
from infer.protocol.ports import reserved_port
from infer.protocol.sampling import SamplingParams

PROMPT = TokenIds(range(1, 17))
RELAY = """
import sys, zmq
ctx = zmq.Context()
front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
for s in (front, back):
    s.setsockopt(zmq.SNDHWM, 0); s.setsockopt(zmq.RCVHWM, 0); s.setsockopt(zmq.LINGER, 0)
front.bind(sys.argv[1]); back.bind(sys.argv[2])
workers, turn = [], 0
poller = zmq.Poller(); poller.register(front, zmq.POLLIN); poller.register(back, zmq.POLLIN)
while True:
    events = dict(poller.poll(1000))
    if back in events:
        for _ in range(1024):
            try: worker, *rest = back.recv_multipart(zmq.NOBLOCK)
            except zmq.Again: break
            if len(rest) == 1: workers.append(worker); continue      # a worker saying hello
            front.send_multipart(rest)                                # [client, reply]
    if front in events and workers:
        for _ in range(1024):
            try: client, frame = front.recv_multipart(zmq.NOBLOCK)
            except zmq.Again: break
            turn = (turn + 1) % len(workers)
            back.send_multipart([workers[turn], client, frame])
"""
ECHO = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.SNDHWM, 0); s.setsockopt(zmq.RCVHWM, 0)
s.connect(sys.argv[1]); s.send(b"hello")
while True:
    s.poll()
    for _ in range(1024):
        try: client, frame = s.recv_multipart(zmq.NOBLOCK)
        except zmq.Again: break
        s.send_multipart([client, frame])       # the request comes back: one reply per request
"""


@dataclass
class Phase:
    requests: int
    seconds: float
    latencies_ms: list[float]
    hub_cpu_s: float
    workers_cpu_s: float
    loadgen_cpu_s: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        data = sorted(self.latencies_ms)
        return data[min(len(data) - 1, int(q * len(data)))] if data else float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def submit_frames(count: int, tag: str) -> list[bytes]:
    return [
        encode(
            Submit(
                request_id=f"{tag}{i}", spec=RequestSpec(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=1))
            )
        )
        for i in range(count)
    ]


def finished_ids(frame: bytes) -> list[str]:
    """Request ids a reply finishes: a DeltaBatch's finished deltas, or an echoed Submit."""
    outer = msgpack.unpackb(frame, raw=False)
    body = outer["body"]
    if outer["type"] == "delta_batch":
        return [d["request_id"] for d in body["deltas"] if d["finished"]]
    if outer["type"] == "submit":
        return [body["request_id"]]
    return []


def closed_loop(
    sock: zmq.Socket,
    frames: list[bytes],
    concurrency: int,
    seconds: float,
    hub_pid: int,
    worker_pids: list[int],
    record_latency: bool,
) -> Phase:
    ids = [msgpack.unpackb(f, raw=False)["body"]["request_id"] for f in frames] if record_latency else None
    sent_at: dict[str, float] = {}
    latencies: list[float] = []
    next_frame, done = 0, 0
    hub0, workers0, self0 = cpu_seconds(hub_pid), sum(map(cpu_seconds, worker_pids)), time.process_time()
    start = time.perf_counter()
    end = start + seconds
    for _ in range(concurrency):
        if record_latency:
            sent_at[ids[next_frame]] = time.perf_counter()
        sock.send(frames[next_frame], zmq.NOBLOCK)
        next_frame += 1
    while True:
        now = time.perf_counter()
        if now >= end or next_frame >= len(frames):
            break
        if not sock.poll(max(1, int((end - now) * 1000))):
            continue
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            for rid in finished_ids(frame):
                done += 1
                if record_latency:
                    latencies.append((time.perf_counter() - sent_at.pop(rid)) * 1000)
                if next_frame < len(frames):
                    if record_latency:
                        sent_at[ids[next_frame]] = time.perf_counter()
                    sock.send(frames[next_frame], zmq.NOBLOCK)
                    next_frame += 1
    elapsed = time.perf_counter() - start
    phase = Phase(
        done,
        elapsed,
        latencies,
        cpu_seconds(hub_pid) - hub0,
        sum(map(cpu_seconds, worker_pids)) - workers0,
        time.process_time() - self0,
    )
    _drain(sock, concurrency)
    return phase


def _drain(sock: zmq.Socket, outstanding: int) -> None:
    """Let the requests still out finish before the next phase (bounded wait)."""
    deadline = time.monotonic() + 10
    while outstanding > 0 and time.monotonic() < deadline:
        if sock.poll(200):
            outstanding -= len(finished_ids(sock.recv()))


def dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    for opt in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
        sock.setsockopt(opt, 0)
    sock.connect(address)
    return sock


def run_path(name: str, args: argparse.Namespace, ctx: zmq.Context) -> tuple[Phase, Phase]:
    port = reserved_port()
    address = f"tcp://127.0.0.1:{port}"
    if name == "coordinator":
        hub = spawn(
            "-m", "infer.coordinator.daemon", "--port", str(port), "--client-timeout", "120", "--log-level", "WARNING"
        )
        workers = [
            spawn(
                "-m",
                "infer.worker.service.daemon",
                "--coordinator",
                address,
                "--dp-rank",
                str(r),
                "--benchmark-mode",
                "--max-num-seqs",
                "1024",
                "--log-level",
                "WARNING",
            )
            for r in range(args.workers)
        ]
    else:
        back = f"tcp://127.0.0.1:{reserved_port()}"
        hub = spawn("-c", RELAY, address, back)
        workers = [spawn("-c", ECHO, back) for _ in range(args.workers)]
    procs = [hub, *workers]
    try:
        sock = dealer(ctx, address)
        if name == "coordinator":
            _wait_for_workers(sock, args.workers)
        else:
            time.sleep(1.0)  # the echo workers' hellos reach the relay (nothing to ask it)
        warm = submit_frames(args.concurrency * 4, "warm")
        closed_loop(sock, warm, args.concurrency, 1.0, hub.pid, [w.pid for w in workers], False)
        frames = submit_frames(args.max_requests, "t")
        throughput = closed_loop(sock, frames, args.concurrency, args.seconds, hub.pid, [w.pid for w in workers], False)
        latency = closed_loop(
            sock, submit_frames(args.latency_requests, "l"), 1, 60.0, hub.pid, [w.pid for w in workers], True
        )
        sock.close()
        return throughput, latency
    finally:
        stop(procs)


def _wait_for_workers(sock: zmq.Socket, count: int) -> None:
    from infer.protocol.messages import ClusterStats, StatsRequest

    sock.send(encode(Hello(role="client", peer_id="bench")))
    assert isinstance(decode(sock.recv()), Welcome)
    sock.send(encode(StatsRequest(min_healthy_workers=count, timeout_s=60)))
    stats = decode(sock.recv())
    if not isinstance(stats, ClusterStats) or stats.num_healthy_workers < count:
        raise RuntimeError(f"the workers did not register: {stats}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="throughput phase length")
    parser.add_argument("--concurrency", type=int, default=512, help="requests outstanding (throughput phase)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--latency-requests", type=int, default=2000)
    parser.add_argument("--max-requests", type=int, default=400_000, help="frames prepared for the throughput phase")
    args = parser.parse_args()
    ctx = zmq.Context()
    results = {name: run_path(name, args, ctx) for name in ("relay", "coordinator")}
    ctx.term()

    rows = []
    print(
        f"\none-token requests, {args.workers} workers, {args.concurrency} outstanding, {args.seconds:g} s "
        f"(latency: 1 outstanding)\n"
    )
    print(
        f"{'path':<12} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'hub cpu us/req':>15} {'hub capacity req/s':>19} "
        f"{'workers cpu us/req':>19} {'loadgen cpu us/req':>19}"
    )
    for name, (tp, lat) in results.items():
        hub_us = tp.hub_cpu_s / tp.requests * 1e6
        row = {
            "path": name,
            "requests_per_s": round(tp.rate),
            "latency_p50_ms": round(lat.percentile(0.5), 3),
            "latency_p99_ms": round(lat.percentile(0.99), 3),
            "hub_cpu_us_per_request": round(hub_us, 2),
            "hub_capacity_requests_per_core_s": round(1e6 / hub_us),
            "workers_cpu_us_per_request": round(tp.workers_cpu_s / tp.requests * 1e6, 2),
            "loadgen_cpu_us_per_request": round(tp.loadgen_cpu_s / tp.requests * 1e6, 2),
            "requests": tp.requests,
        }
        rows.append(row)
        print(
            f"{name:<12} {row['requests_per_s']:>9} {row['latency_p50_ms']:>8} {row['latency_p99_ms']:>8} "
            f"{row['hub_cpu_us_per_request']:>15} {row['hub_capacity_requests_per_core_s']:>19} "
            f"{row['workers_cpu_us_per_request']:>19} {row['loadgen_cpu_us_per_request']:>19}"
        )
    relay, coord = rows
    ratios = {
        "rate_vs_relay": round(coord["requests_per_s"] / relay["requests_per_s"], 3),
        "hub_capacity_vs_relay": round(
            coord["hub_capacity_requests_per_core_s"] / relay["hub_capacity_requests_per_core_s"], 3
        ),
        "added_latency_p50_ms": round(coord["latency_p50_ms"] - relay["latency_p50_ms"], 3),
        "added_latency_p99_ms": round(coord["latency_p99_ms"] - relay["latency_p99_ms"], 3),
    }
    print(
        f"\ncoordinator / relay: rate {ratios['rate_vs_relay']:.2f}x, hub capacity "
        f"{ratios['hub_capacity_vs_relay']:.2f}x; added latency p50 {ratios['added_latency_p50_ms']:.3f} ms, "
        f"p99 {ratios['added_latency_p99_ms']:.3f} ms"
    )
    path = write_result(
        "coordinator_overhead",
        {
            "config": vars(args),
            "rows": rows,
            "ratios": ratios,
            "targets": {"rate_vs_relay": 0.5, "requests_per_s": 20_000},
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
