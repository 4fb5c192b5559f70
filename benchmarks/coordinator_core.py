"""The coordinator's logic at 64 to 1,000 workers, in one process and no sockets: what its core (`Coordinator.handle
/ tick / take_outgoing`, as the daemon drives it) costs per heartbeat, per direct request and per relayed delta, as
the number of workers grows. benchmarks/coordinator_scale.py measures the whole daemon with real worker processes
(sockets and all), but a 2-core machine holds a few hundred of those at most; this one registers W workers by
their Hello frames and plays their frames to the core, so the part of the cost that grows with W is measured where
the processes cannot go.

Each frame goes in encoded (the core decodes it, as in the daemon) and every message the core queues is encoded
(as the daemon does before its send). Per W, one after the other, timed with perf_counter over many repetitions:

    heartbeat   every worker's Heartbeat with its load, then the timers (tick) once a second
    direct      one direct request's whole life at the coordinator: the Submit (routing, Dispatch and Placement
                out), the worker's StepBatch reporting the admission (its load; no deltas), and its end (the
                finished delta stripped of tokens and text, with the load)
    relayed     one relayed request's admission and end as above, plus its deltas: StepBatches of one delta per
                request per step (`--streams` requests a worker), each relayed to the client as a DeltaBatch

Workers report equal loads (every rank's score is computed on each admission anyway). The socket's share (zmq,
the system calls; ~100 us a frame on this VM's coordinator_scale runs) is not in these figures: add it per frame.

    .venv/bin/python benchmarks/coordinator_core.py [--workers 64,256,1000] [--streams 8] [--tokens 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result

from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.core import Coordinator
from infer.protocol.messages import (
    Delta,
    Dispatch,
    Heartbeat,
    Hello,
    Load,
    RequestSpec,
    StepBatch,
    Submit,
    TokenIds,
    encode,
)
from infer.protocol.sampling import SamplingParams

MODEL = "bench-model"
CLIENT = b"client-bench"


class Cluster:
    """A core with `workers` registered workers (stream sockets advertised) and one client; the clock is ours."""

    def __init__(self, workers: int, direct: bool, streams: int) -> None:
        self.now = 1000.0
        self.streams = streams
        self.core = Coordinator(CoordinatorConfig(), self.now)
        self.ids = [f"w{i}".encode() for i in range(workers)]
        for i, identity in enumerate(self.ids):
            hello = Hello(
                role="worker",
                peer_id=identity.decode(),
                model_id=MODEL,
                num_kv_blocks=streams * 256,
                block_size=16,
                max_num_seqs=streams,
                max_model_len=4096,
                stream_address=f"tcp://127.0.0.1:{20000 + i}",
            )
            self.feed(identity, encode(hello))
        self.feed(CLIENT, encode(Hello(role="client", peer_id="bench", streams=direct)))

    def feed(self, identity: bytes, frame: bytes) -> list[tuple[bytes, object]]:
        """One frame in; what the core queued, each message encoded as the daemon sends it."""
        self.core.handle(identity, [frame], self.now)
        out = self.core.take_outgoing()
        for _identity, msg in out:
            encode(msg)
        return out

    def load(self, running: int) -> Load:
        return Load(
            num_waiting=0,
            num_running=running,
            num_free_blocks=self.streams * 256 - running * 2,
            num_total_blocks=self.streams * 256,
            num_queued_tokens=running * 100,
        )


def time_heartbeats(workers: int, rounds: int) -> float:
    """us per heartbeat, the once-a-second tick included (amortized over the workers' heartbeats)."""
    cluster = Cluster(workers, direct=True, streams=8)
    frames = [encode(Heartbeat(sent_at=0.0, load=cluster.load(0))) for _ in cluster.ids]
    start = time.perf_counter()
    for _ in range(rounds):
        for identity, frame in zip(cluster.ids, frames):
            cluster.feed(identity, frame)
        cluster.now += 1.0
        cluster.core.tick(cluster.now)
        cluster.core.take_outgoing()
    return (time.perf_counter() - start) / (rounds * workers) * 1e6


def time_requests(workers: int, direct: bool, streams: int, tokens: int) -> dict:
    """One batch of `streams` requests a worker, from Submit to end; us per request by stage, and per delta."""
    cluster = Cluster(workers, direct, streams)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    count = workers * streams
    submits = [
        encode(Submit(request_id=f"r{i}", spec=RequestSpec(prompt_token_ids=TokenIds(range(1, 17)), sampling=params)))
        for i in range(count)
    ]
    placed: dict[bytes, list[str]] = {}
    start = time.perf_counter()
    for frame in submits:
        for identity, msg in cluster.feed(CLIENT, frame):
            if isinstance(msg, Dispatch):
                placed.setdefault(identity, []).append(msg.request_id)
    submit_s = time.perf_counter() - start
    if sum(map(len, placed.values())) != count:
        raise RuntimeError(f"{sum(map(len, placed.values()))} of {count} requests dispatched")
    admitted = {w: encode(StepBatch(deltas=[], load=cluster.load(len(rids)))) for w, rids in placed.items()}
    start = time.perf_counter()
    for identity, frame in admitted.items():
        cluster.feed(identity, frame)
    admit_s = time.perf_counter() - start
    relay_s = 0.0
    if not direct:  # every step: one delta per request, all but the last token
        steps = {
            w: [
                encode(StepBatch(deltas=[_delta(r, t) for r in rids], load=cluster.load(len(rids))))
                for t in range(tokens - 1)
            ]
            for w, rids in placed.items()
        }
        start = time.perf_counter()
        for t in range(tokens - 1):
            for identity, frames in steps.items():
                cluster.feed(identity, frames[t])
        relay_s = time.perf_counter() - start
    ends = {
        w: encode(StepBatch(deltas=[_end(r, tokens, direct) for r in rids], load=cluster.load(0)))
        for w, rids in placed.items()
    }
    start = time.perf_counter()
    for identity, frame in ends.items():
        cluster.feed(identity, frame)
    end_s = time.perf_counter() - start
    per_request = (submit_s + admit_s + end_s) / count * 1e6
    return {
        "requests": count,
        "submit_us": round(submit_s / count * 1e6, 2),
        "admission_report_us": round(admit_s / count * 1e6, 2),
        "end_us": round(end_s / count * 1e6, 2),
        "request_us": round(per_request, 2),
        "relayed_delta_us": round(relay_s / (count * (tokens - 1)) * 1e6, 3) if not direct else None,
    }


def _delta(rid: str, t: int) -> Delta:
    return Delta(request_id=rid, token_ids=TokenIds([t % 1000]), text="", num_prompt_tokens=16)


def _end(rid: str, tokens: int, direct: bool) -> Delta:
    if direct:  # as a worker sends a direct stream's end to the coordinator: no tokens, their count
        return Delta.final(rid, "length", num_prompt_tokens=16, num_output_tokens=tokens)
    return Delta.final(rid, "length", token_ids=[tokens % 1000], num_prompt_tokens=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="64,256,1000", help="comma-separated worker counts")
    parser.add_argument("--streams", type=int, default=8, help="requests a worker (one batch)")
    parser.add_argument("--tokens", type=int, default=20, help="tokens a relayed request (deltas relayed)")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions per figure (the median is kept)")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",") if w]
    rows = []
    print(
        f"{'workers':>7} {'heartbeat us':>12} {'direct req us':>13} {'(submit':>8} {'admit':>6} {'end)':>6} "
        f"{'relayed req us':>14} {'relayed delta us':>16}"
    )
    for w in counts:
        beats = statistics.median(time_heartbeats(w, max(2, 2000 // w)) for _ in range(args.repeats))
        direct = [time_requests(w, True, args.streams, args.tokens) for _ in range(args.repeats)]
        relayed = [time_requests(w, False, args.streams, args.tokens) for _ in range(args.repeats)]
        row = {
            "workers": w,
            "heartbeat_us": round(beats, 2),
            "direct": {
                k: round(statistics.median(r[k] for r in direct), 3) for k in direct[0] if k != "relayed_delta_us"
            },
            "relayed": {k: round(statistics.median(r[k] for r in relayed), 3) for k in relayed[0]},
        }
        rows.append(row)
        d, r = row["direct"], row["relayed"]
        print(
            f"{w:>7} {row['heartbeat_us']:>12} {d['request_us']:>13} {d['submit_us']:>8} {d['admission_report_us']:>6} "
            f"{d['end_us']:>6} {r['request_us']:>14} {r['relayed_delta_us']:>16}",
            flush=True,
        )
    print(f"wrote {write_result('coordinator_core', {'config': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
