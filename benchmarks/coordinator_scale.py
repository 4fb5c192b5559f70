"""Coordinator at scale: many --benchmark-mode workers streaming long outputs, relayed through one
infer-coordinator or sent directly from the workers (docs/architecture.md, "Direct streams"), both in one run.

    relay:  load generator (a client without direct streams) -> infer-coordinator -> W x infer-worker --benchmark-mode
    direct: load generator -Submit-> infer-coordinator -> workers; Placement back; the load generator subscribes at
            each worker's stream socket (one DEALER a worker) and reads StreamBatches from there

The coordinator decides per request: a client whose Hello asks for direct streams gets them, any other is relayed
(what `--relay-streams` forces for everyone). So each case is one cluster, and the two paths alternate on it in
rounds (relay first in even rounds, direct first in odd ones; this VM drifts 10-20% between runs), each phase a
fresh client; the table gives each figure's median over the rounds, and the ratios are the medians of each
round's own direct / relay ratio.

A case is W x S @ T ms [: N tokens]: W workers, each running S requests of N tokens, one token per request per
step of T ms, so W x S / T deltas a second at most reach the load generator (the ideal). The load generator takes a
direct delta only when it continues its copy exactly (as InferenceClient does). Measured, per phase:

- deltas per second (token-carrying deltas that reached the load generator), over the whole phase and over its
  steady part (from the moment every stream has had its first delta to the first stream's end), against the ideal;
- the coordinator's CPU time per delta (from /proc), hence the deltas a second one coordinator core carries; and
  its CPU per stream beyond its idle rate (measured once per case with the workers connected and nothing
  running: heartbeats and timers), which is what a direct stream costs it (admission, placement, end);
- the workers' and the load generator's CPU per delta (where a direct stream's per-delta cost goes);
- the latency the coordinator adds: each stream's gap between consecutive deltas minus the step time T (p50,
  p99; the worker's own step is T), and time to the first delta (p50, p99);
- how busy the machine was (/proc/stat, every process on it): past ~90% the load generator, the workers and the
  coordinator starve each other, and the deltas a second measure the machine, not the coordinator. Such a phase is
  flagged `saturated`.

On a 2-core machine the workers, the coordinator and the load generator share the cores: the CPU per delta is
the figure that carries over; the latencies say how the hub behaves when the machine is loaded.

    .venv/bin/python benchmarks/coordinator_scale.py [--cases 64x8@50,64x32@20:100,256x8@200] [--rounds 3]
                                                      [--tokens 200] [--modes relay,direct]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result
from coordinator_overhead import _wait_for_workers, dealer, spawn, stop

from infer.protocol.messages import (
    Delta,
    DeltaBatch,
    Error,
    Hello,
    Placement,
    RequestSpec,
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
SATURATED = 0.9  # machine busy share past which a phase's rates measure the machine, not the coordinator
CASE = re.compile(r"^(\d+)x(\d+)@([\d.]+)(?::(\d+))?$")


@dataclass(frozen=True)
class Case:
    workers: int
    streams_per_worker: int
    step_time: float  # seconds
    tokens: int

    @classmethod
    def parse(cls, text: str, tokens: int) -> Case:
        """`WxS@MS[:TOKENS]`, e.g. 64x8@50 or 64x32@20:100; ValueError otherwise."""
        m = CASE.match(text.strip())
        if m is None:
            raise ValueError(f"a case is WORKERSxSTREAMS@STEP_MS[:TOKENS], e.g. 64x8@50, got {text!r}")
        case = cls(int(m[1]), int(m[2]), float(m[3]) / 1000, int(m[4]) if m[4] else tokens)
        if min(case.workers, case.streams_per_worker, case.tokens) < 1 or case.step_time <= 0:
            raise ValueError(f"every number of a case must be positive, got {text!r}")
        return case

    @property
    def name(self) -> str:
        return f"{self.workers}x{self.streams_per_worker}@{self.step_time * 1000:g}ms:{self.tokens}"

    @property
    def streams(self) -> int:
        return self.workers * self.streams_per_worker

    @property
    def ideal_deltas_per_s(self) -> float:
        return self.streams / self.step_time


def start_cluster(case: Case) -> tuple[str, subprocess.Popen, list[subprocess.Popen]]:
    """The coordinator and its workers as the README starts them (plus benchmark mode); (address, hub, workers)."""
    port = reserved_port()
    address = f"tcp://127.0.0.1:{port}"
    hub = spawn(
        "-m", "infer.coordinator.daemon", "--port", str(port), "--client-timeout", "600", "--log-level", "WARNING"
    )
    workers = [
        spawn(
            "-m",
            "infer.worker.service.daemon",
            "--coordinator",
            address,
            "--benchmark-mode",
            "--benchmark-step-time",
            str(case.step_time),
            "--max-num-seqs",
            str(case.streams_per_worker),
            "--log-level",
            "WARNING",
        )
        for _ in range(case.workers)
    ]
    return address, hub, workers


class Reader:
    """The load generator's side of every stream of one phase: relayed DeltaBatches, or Placements, Subscribes and
    the workers' StreamBatches (exact continuations only); the phase's counts and latencies."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, step_time: float) -> None:
        self.ctx, self.sock, self.step_time = ctx, sock, step_time
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.links: dict[str, zmq.Socket] = {}  # worker stream address -> its DEALER
        self.held: dict[str, tuple[int, int]] = {}  # request id -> tokens and characters taken
        self.sent: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.first_at: dict[str, float] = {}
        self.arrivals: list[float] = []  # every token-carrying delta's arrival
        self.first_ms: list[float] = []
        self.gaps_ms: list[float] = []
        self.deltas = self.finished = self.dropped = 0
        self.errors: list[str] = []  # Errors the coordinator answered (a refusal, or this client cut off as too slow)
        self.placed = 0  # Placements (and refusals) heard

    def submit(self, rid: str, params: SamplingParams) -> None:
        self.sent[rid], self.held[rid] = time.perf_counter(), (0, 0)
        self.sock.send(encode(Submit(request_id=rid, spec=RequestSpec(prompt_token_ids=PROMPT, sampling=params))))

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
        elif isinstance(msg, Error):
            self.errors.append(msg.message)
            self.placed += msg.request_id is not None
            if msg.request_id is None or msg.request_id in self.held:
                self.finished += msg.request_id is not None  # that stream ended (not exact)
        elif isinstance(msg, Placement) and msg.stream_address is not None and msg.stream_token is not None:
            self.placed += 1
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
        rid = delta.request_id
        num_tokens, text_len = self.held.get(rid, (0, 0))
        self.held[rid] = (num_tokens + len(delta.token_ids), text_len + len(delta.text))
        if delta.token_ids:
            self.deltas += 1
            self.arrivals.append(now)
            before = self.last.get(rid)
            if before is None:
                self.first_at[rid] = now
                self.first_ms.append((now - self.sent[rid]) * 1000)
            else:
                self.gaps_ms.append((now - before) * 1000 - self.step_time * 1000 * len(delta.token_ids))
            self.last[rid] = now
        self.finished += delta.finished

    def steady_deltas_per_s(self) -> float | None:
        """Deltas a second while every stream ran: from the last stream's first delta to the first stream's last."""
        if len(self.first_at) < len(self.sent):
            return None
        start, end = max(self.first_at.values()), min(self.last.values())
        if end - start < 5 * self.step_time:
            return None
        return sum(start <= t <= end for t in self.arrivals) / (end - start)

    def close(self) -> None:
        for link in self.links.values():
            link.close(0)
        self.sock.close(0)


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far, every thread's, to the nanosecond (/proc/PID/task/*/schedstat: /proc/PID/stat
    counts 10 ms ticks, too coarse for an idle coordinator)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return total / 1e9


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot (/proc/stat: every process, ours or not)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


@dataclass
class Cluster:
    address: str
    hub_pid: int
    worker_pids: list[int]

    def cpu(self) -> tuple[float, float]:
        return cpu_seconds(self.hub_pid), sum(map(cpu_seconds, self.worker_pids))


def idle_rate(cluster: Cluster, seconds: float) -> dict:
    """The coordinator's and the workers' CPU a second with every worker connected and nothing running."""
    hub0, workers0 = cluster.cpu()
    busy0 = machine_busy_ticks()
    time.sleep(seconds)
    hub1, workers1 = cluster.cpu()
    busy1 = machine_busy_ticks()
    return {
        "seconds": seconds,
        "hub_cpu_ms_per_s": round((hub1 - hub0) / seconds * 1000, 3),
        "workers_cpu_ms_per_s": round((workers1 - workers0) / seconds * 1000, 3),
        "machine_busy": round((busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1), 3),
    }


def run_phase(ctx: zmq.Context, cluster: Cluster, case: Case, mode: str, tag: str, idle: dict, timeout: float) -> dict:
    """One phase: a fresh client (direct streams or not) submits every stream at once and reads until each has
    finished (or `timeout`); the phase's figures."""
    sock = dealer(ctx, cluster.address)
    sock.send(encode(Hello(role="client", peer_id=f"bench-{tag}", streams=mode == "direct")))
    reader = Reader(ctx, sock, case.step_time)
    params = SamplingParams(max_tokens=case.tokens, ignore_eos=True)
    try:
        hub0, workers0 = cluster.cpu()
        self0, busy0 = time.process_time(), machine_busy_ticks()
        start = time.perf_counter()
        for i in range(case.streams):
            reader.submit(f"{tag}-{i}", params)
            # 256 at a time, each batch's answers read before the next goes: a client that has more than PEER_SNDHWM
            # (1,000) answers waiting for it is cut off as too slow, and 2,048 Submits at once were (at 64 x 32)
            while (
                mode == "direct" and i % 256 == 255 and reader.placed < i + 1 and time.perf_counter() < start + timeout
            ):
                reader.read(100)
        deadline = start + timeout
        while reader.finished < case.streams and time.perf_counter() < deadline:
            reader.read(1000)
        elapsed = time.perf_counter() - start
        hub1, workers1 = cluster.cpu()
        self1, busy1 = time.process_time(), machine_busy_ticks()
    finally:
        reader.close()
    hub_cpu, deltas = hub1 - hub0, max(reader.deltas, 1)
    hub_beyond_idle = hub_cpu - idle["hub_cpu_ms_per_s"] / 1000 * elapsed
    steady = reader.steady_deltas_per_s()
    busy = (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1)
    return {
        "mode": mode,
        "streams": case.streams,
        "finished": reader.finished,
        "exact": reader.finished == case.streams and all(n == case.tokens for n, _ in reader.held.values()),
        "deltas": reader.deltas,
        "repeats_dropped": reader.dropped,
        "errors": len(reader.errors),
        "first_error": reader.errors[0] if reader.errors else None,
        "seconds": round(elapsed, 3),
        "deltas_per_s": round(reader.deltas / elapsed),
        "steady_deltas_per_s": round(steady) if steady is not None else None,
        "ideal_deltas_per_s": round(case.ideal_deltas_per_s),
        "share_of_ideal": round(reader.deltas / elapsed / case.ideal_deltas_per_s, 4),
        "steady_share_of_ideal": round(steady / case.ideal_deltas_per_s, 4) if steady is not None else None,
        "hub_cpu_s": round(hub_cpu, 3),
        "hub_cpu_us_per_delta": round(hub_cpu / deltas * 1e6, 3),
        "hub_capacity_deltas_per_core_s": round(deltas / hub_cpu) if hub_cpu > 0 else None,
        "hub_cpu_beyond_idle_us_per_stream": round(hub_beyond_idle / case.streams * 1e6, 1),
        "hub_cpu_beyond_idle_us_per_delta": round(hub_beyond_idle / deltas * 1e6, 3),
        "workers_cpu_us_per_delta": round((workers1 - workers0) / deltas * 1e6, 2),
        "loadgen_cpu_us_per_delta": round((self1 - self0) / deltas * 1e6, 2),
        "machine_busy": round(busy, 3),
        "saturated": busy >= SATURATED,
        "first_delta_ms": {"p50": percentile(reader.first_ms, 0.5), "p99": percentile(reader.first_ms, 0.99)},
        "added_gap_ms": {"p50": percentile(reader.gaps_ms, 0.5), "p99": percentile(reader.gaps_ms, 0.99)},
    }


def percentile(values: list[float], q: float) -> float | None:
    data = sorted(values)
    return round(data[min(len(data) - 1, int(q * len(data)))], 3) if data else None


MEDIAN_FIELDS = (
    "deltas_per_s",
    "steady_deltas_per_s",
    "share_of_ideal",
    "steady_share_of_ideal",
    "hub_cpu_us_per_delta",
    "hub_capacity_deltas_per_core_s",
    "hub_cpu_beyond_idle_us_per_stream",
    "hub_cpu_beyond_idle_us_per_delta",
    "workers_cpu_us_per_delta",
    "loadgen_cpu_us_per_delta",
    "machine_busy",
)


def medians(phases: list[dict]) -> dict:
    """Each figure's median over the rounds (latency percentiles included)."""
    out: dict = {}
    for name in MEDIAN_FIELDS:
        values = [p[name] for p in phases if p[name] is not None]
        out[name] = round(statistics.median(values), 4) if values else None
    for name in ("added_gap_ms", "first_delta_ms"):
        out[name] = {
            q: round(statistics.median(v), 3) if (v := [p[name][q] for p in phases if p[name][q] is not None]) else None
            for q in ("p50", "p99")
        }
    out["rounds"] = len(phases)
    out["all_exact"] = all(p["exact"] for p in phases)
    out["saturated_rounds"] = sum(p["saturated"] for p in phases)
    return out


def paired_ratios(phases: list[dict]) -> dict:
    """Median over rounds of each round's direct / relay ratio (the two ran back to back on one cluster)."""
    by_round: dict[int, dict[str, dict]] = {}
    for p in phases:
        by_round.setdefault(p["round"], {})[p["mode"]] = p
    pairs = [r for r in by_round.values() if "relay" in r and "direct" in r]
    if not pairs:
        return {}

    def ratio(name: str) -> float | None:
        values = [r["direct"][name] / r["relay"][name] for r in pairs if r["relay"][name] and r["direct"][name]]
        return round(statistics.median(values), 4) if values else None

    return {
        "hub_cpu_per_delta_direct_over_relay": ratio("hub_cpu_us_per_delta"),
        "deltas_per_s_direct_over_relay": ratio("deltas_per_s"),
        "per_round_hub_cpu_per_delta_direct_over_relay": [
            round(r["direct"]["hub_cpu_us_per_delta"] / r["relay"]["hub_cpu_us_per_delta"], 4) for r in pairs
        ],
    }


def run_case(case: Case, args: argparse.Namespace, modes: list[str]) -> dict:
    """One cluster for the case; its idle rate, then `args.rounds` rounds of every mode, alternating the order."""
    started = time.perf_counter()
    address, hub, workers = start_cluster(case)
    ctx = zmq.Context()
    try:
        control = dealer(ctx, address)
        _wait_for_workers(control, case.workers)
        cluster = Cluster(address, hub.pid, [w.pid for w in workers])
        print(f"{case.name}: {case.workers} workers up in {time.perf_counter() - started:.1f} s", flush=True)
        time.sleep(1.0)  # the workers' start-up tails off
        idle = idle_rate(cluster, args.idle_seconds)
        phases = []
        for rnd in range(args.rounds):
            for mode in modes if rnd % 2 == 0 else modes[::-1]:
                phase = run_phase(ctx, cluster, case, mode, f"r{rnd}{mode[0]}", idle, args.timeout)
                phase["round"] = rnd
                phases.append(phase)
                print(f"  round {rnd} {_line(phase)}", flush=True)
        control.close(0)
    finally:
        stop([hub, *workers])
        ctx.term()
    summary = {m: medians([p for p in phases if p["mode"] == m]) for m in modes}
    return {
        "case": case.name,
        "workers": case.workers,
        "streams_per_worker": case.streams_per_worker,
        "step_ms": case.step_time * 1000,
        "tokens": case.tokens,
        "ideal_deltas_per_s": round(case.ideal_deltas_per_s),
        "idle": idle,
        "median": summary,
        "ratios": paired_ratios(phases),
        "saturated": any(p["saturated"] for p in phases),
        "phases": phases,
    }


def _line(p: dict) -> str:
    steady = "-" if p["steady_share_of_ideal"] is None else f"{p['steady_share_of_ideal']:.1%}"
    return (
        f"{p['mode']:6} {p['deltas_per_s']:>7} deltas/s ({p['share_of_ideal']:.1%} of ideal, steady {steady}), "
        f"hub {p['hub_cpu_us_per_delta']:.2f} us/delta, {p['hub_cpu_beyond_idle_us_per_stream']:.0f} us/stream "
        f"beyond idle; gap +{p['added_gap_ms']['p50']} / +{p['added_gap_ms']['p99']} ms; "
        f"machine {p['machine_busy']:.0%} busy; exact {p['exact']}"
        + (f"; {p['errors']} errors, the first: {p['first_error']}" if p["errors"] else "")
    )


def print_table(results: list[dict], modes: list[str]) -> None:
    print(
        f"\n{'case':<22} {'mode':<6} {'deltas/s':>9} {'of ideal':>8} {'steady':>7} {'hub us/delta':>12} "
        f"{'us/stream':>9} {'gap p50':>8} {'gap p99':>8} {'busy':>5}  (medians)"
    )
    for r in results:
        for mode in modes:
            m = r["median"][mode]
            steady = "-" if m["steady_share_of_ideal"] is None else f"{m['steady_share_of_ideal']:.1%}"
            print(
                f"{r['case']:<22} {mode:<6} {m['deltas_per_s']:>9.0f} {m['share_of_ideal']:>8.1%} {steady:>7} "
                f"{m['hub_cpu_us_per_delta']:>12.2f} {m['hub_cpu_beyond_idle_us_per_stream']:>9.0f} "
                f"{m['added_gap_ms']['p50']:>8} {m['added_gap_ms']['p99']:>8} {m['machine_busy']:>5.0%}"
            )
        if r["ratios"]:
            print(f"{'':<22} direct / relay: {r['ratios']['hub_cpu_per_delta_direct_over_relay']}x CPU per delta")
        if r["saturated"]:
            print(f"{'':<22} saturated: the machine was >= {SATURATED:.0%} busy in some phases (see the JSON)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases",
        default="64x8@50,64x32@20:100,256x8@200",
        help="comma-separated WORKERSxSTREAMS@STEP_MS[:TOKENS] (default: %(default)s)",
    )
    parser.add_argument("--tokens", type=int, default=200, help="tokens per stream where a case names none")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per case, each running every mode once")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="seconds of the idle measurement, per case")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up on a phase after this long")
    parser.add_argument("--label", default="", help="a name for this tree in the JSON (e.g. before / after)")
    parser.add_argument("--modes", default="relay,direct", help="comma-separated: relay, direct")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("relay", "direct") for m in modes):
        parser.error(f"--modes takes relay and / or direct, got {args.modes!r}")
    try:
        cases = [Case.parse(text, args.tokens) for text in args.cases.split(",") if text]
    except ValueError as e:
        parser.error(str(e))
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    results = [run_case(case, args, modes) for case in cases]
    print_table(results, modes)
    payload = {"config": vars(args), "saturated_threshold": SATURATED, "cases": results}
    print(f"wrote {write_result('coordinator_scale', payload)}")


if __name__ == "__main__":
    main()
