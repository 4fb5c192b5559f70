"""Coordinator at scale: many --benchmark-mode workers streaming long outputs, relayed through one
infer-coordinator or sent directly from the workers (docs/architecture.md, "Direct streams"), both in one run.

    relay:  load generator (one DEALER) -> infer-coordinator --relay-streams -> W x infer-worker --benchmark-mode
    direct: load generator -Submit-> infer-coordinator -> workers; Placement back; the load generator subscribes at
            each worker's stream socket (one DEALER a worker) and reads StreamBatches from there

Each worker runs `--streams-per-worker` requests of `--tokens` tokens, one token per request per step of S
seconds, so W x streams / S deltas a second at most reach the load generator. The load generator takes a direct
delta only when it continues its copy exactly (as InferenceClient does). Measured, over the streaming phase:

- deltas per second (token-carrying deltas that reached the load generator);
- the coordinator's CPU time per delta (from /proc), hence the deltas a second one coordinator core can carry;
- the latency the coordinator adds: each stream's gap between consecutive deltas minus the step time S (p50,
  p99; the worker's own step is S), and time to the first delta (p50, p99).

On a 2-core machine the workers, the coordinator and the load generator share the cores: the CPU per delta is
the figure that carries over; the latencies say how the hub behaves when the machine is saturated.

    .venv/bin/python benchmarks/coordinator_scale.py [--workers 64] [--streams-per-worker 8] [--tokens 200]
                                                      [--step-time 0.05] [--modes relay,direct]

The table ends with direct / relay ratios (coordinator CPU per delta, deltas a second).
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

from infer.protocol.messages import (
    Delta,
    DeltaBatch,
    Hello,
    Placement,
    StreamBatch,
    Submit,
    Subscribe,
    TokenIds,
    decode,
    encode,
)
from infer.protocol.ports import reserved_port
from infer.protocol.sampling import SamplingParams

PROMPT = TokenIds(range(1, 17))


def start_cluster(args: argparse.Namespace, mode: str) -> tuple[str, list, list]:
    """The coordinator and its workers as the README starts them (plus benchmark mode); (address, hub, workers)."""
    port = reserved_port()
    address = f"tcp://127.0.0.1:{port}"
    relay = ("--relay-streams",) if mode == "relay" else ()
    hub = spawn(
        "-m",
        "infer.coordinator.daemon",
        "--port",
        str(port),
        "--client-timeout",
        "600",
        "--log-level",
        "WARNING",
        *relay,
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


class Reader:
    """The load generator's side of every stream: relayed DeltaBatches, or Placements, Subscribes and the workers'
    StreamBatches (exact continuations only); the phase's counts and latencies."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, step_time: float) -> None:
        self.ctx, self.sock, self.step_time = ctx, sock, step_time
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.links: dict[str, zmq.Socket] = {}  # worker stream address -> its DEALER
        self.held: dict[str, tuple[int, int]] = {}  # request id -> tokens and characters taken
        self.sent: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.first_ms: list[float] = []
        self.gaps_ms: list[float] = []
        self.deltas = self.finished = self.dropped = 0

    def submit(self, rid: str, params: SamplingParams) -> None:
        self.sent[rid], self.held[rid] = time.perf_counter(), (0, 0)
        self.sock.send(encode(Submit(request_id=rid, prompt_token_ids=PROMPT, sampling=params)))

    def read(self, timeout_ms: int) -> None:
        for sock in dict(self.poller.poll(timeout_ms)):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on(decode(frames[-1]), time.perf_counter())

    def _on(self, msg: object, now: float) -> None:
        if isinstance(msg, DeltaBatch):
            for delta in msg.deltas:
                self._take(delta, now)
        elif isinstance(msg, StreamBatch):
            for delta, token_start, text_start in zip(msg.deltas, msg.token_starts, msg.text_starts):
                if self.held.get(delta.request_id) == (token_start, text_start):
                    self._take(delta, now)
                else:
                    self.dropped += 1
        elif isinstance(msg, Placement) and msg.stream_address is not None and msg.stream_token is not None:
            num_tokens, text_len = self.held[msg.request_id]
            subscribe = Subscribe(
                request_id=msg.request_id, stream_token=msg.stream_token, num_tokens=num_tokens, text_len=text_len
            )
            self._link(msg.stream_address).send(encode(subscribe))

    def _link(self, address: str) -> zmq.Socket:
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = dealer(self.ctx, address)
            self.poller.register(link, zmq.POLLIN)
        return link

    def _take(self, delta: Delta, now: float) -> None:
        num_tokens, text_len = self.held.get(delta.request_id, (0, 0))
        self.held[delta.request_id] = (num_tokens + len(delta.token_ids), text_len + len(delta.text))
        if delta.token_ids:
            self.deltas += 1
            before = self.last.get(delta.request_id)
            if before is None:
                self.first_ms.append((now - self.sent[delta.request_id]) * 1000)
            else:
                self.gaps_ms.append((now - before) * 1000 - self.step_time * 1000 * len(delta.token_ids))
            self.last[delta.request_id] = now
        self.finished += delta.finished

    def close(self) -> None:
        for link in self.links.values():
            link.close(0)


def stream_all(reader: Reader, args: argparse.Namespace, hub_pid: int, worker_pids: list[int]) -> dict:
    """Submit every stream at once and read deltas until each has finished (or --timeout); the phase's figures."""
    count = args.workers * args.streams_per_worker
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    hub0, workers0, self0 = cpu_seconds(hub_pid), sum(map(cpu_seconds, worker_pids)), time.process_time()
    start = time.perf_counter()
    for i in range(count):
        reader.submit(f"s{i}", params)
    deadline = start + args.timeout
    while reader.finished < count and time.perf_counter() < deadline:
        reader.read(1000)
    elapsed = time.perf_counter() - start
    hub_cpu = cpu_seconds(hub_pid) - hub0
    deltas = reader.deltas
    return {
        "streams": count,
        "finished": reader.finished,
        "exact": reader.finished == count and all(n == args.tokens for n, _ in reader.held.values()),
        "deltas": deltas,
        "repeats_dropped": reader.dropped,
        "seconds": round(elapsed, 3),
        "deltas_per_s": round(deltas / elapsed),
        "ideal_deltas_per_s": round(count / args.step_time),
        "hub_cpu_s": round(hub_cpu, 3),
        "hub_cpu_us_per_delta": round(hub_cpu / max(deltas, 1) * 1e6, 2),
        "hub_capacity_deltas_per_core_s": round(deltas / hub_cpu) if hub_cpu else None,
        "workers_cpu_s": round(sum(map(cpu_seconds, worker_pids)) - workers0, 3),
        "loadgen_cpu_s": round(time.process_time() - self0, 3),
        "first_delta_ms": {"p50": percentile(reader.first_ms, 0.5), "p99": percentile(reader.first_ms, 0.99)},
        "added_gap_ms": {"p50": percentile(reader.gaps_ms, 0.5), "p99": percentile(reader.gaps_ms, 0.99)},
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
    parser.add_argument("--modes", default="relay,direct", help="comma-separated: relay, direct (in this order)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("relay", "direct") for m in modes):
        parser.error(f"--modes takes relay and / or direct, got {args.modes!r}")
    results = {mode: run_mode(args, mode) for mode in modes}
    for mode, result in results.items():
        print(
            f"{mode:6}: {args.workers} workers x {args.streams_per_worker} streams x {args.tokens} tokens, step "
            f"{args.step_time * 1000:g} ms: {result['deltas_per_s']} deltas/s (ideal {result['ideal_deltas_per_s']}), "
            f"coordinator {result['hub_cpu_us_per_delta']} us CPU per delta "
            f"({result['hub_capacity_deltas_per_core_s']} deltas/s a core); added gap p50 "
            f"{result['added_gap_ms']['p50']} ms p99 {result['added_gap_ms']['p99']} ms; first delta p50 "
            f"{result['first_delta_ms']['p50']} ms p99 {result['first_delta_ms']['p99']} ms; exact {result['exact']}"
        )
        if result["finished"] < result["streams"]:
            print(f"only {result['finished']} of {result['streams']} streams finished within {args.timeout:g} s")
    ratios = {}
    if "relay" in results and "direct" in results:
        relay, direct = results["relay"], results["direct"]
        ratios = {
            "hub_cpu_per_delta_direct_over_relay": round(
                direct["hub_cpu_us_per_delta"] / relay["hub_cpu_us_per_delta"], 4
            )
            if relay["hub_cpu_us_per_delta"]
            else None,
            "deltas_per_s_direct_over_relay": round(direct["deltas_per_s"] / max(relay["deltas_per_s"], 1), 3),
        }
        print(f"direct / relay: {ratios}")
    payload = {"config": vars(args), "results": results, "ratios": ratios}
    print(f"wrote {write_result('coordinator_scale', payload)}")


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    """One cluster, one streaming phase: relayed through the coordinator, or direct from the workers."""
    address, hub, workers = start_cluster(args, mode)
    ctx = zmq.Context()
    reader = None
    try:
        sock = dealer(ctx, address)
        _wait_for_workers(sock, args.workers)
        sock.send(encode(Hello(role="client", peer_id="bench", streams=mode == "direct")))
        reader = Reader(ctx, sock, args.step_time)
        result = stream_all(reader, args, hub.pid, [w.pid for w in workers])
        sock.close()
        return result
    finally:
        if reader is not None:
            reader.close()
        stop([hub, *workers])
        ctx.term()


if __name__ == "__main__":
    main()
