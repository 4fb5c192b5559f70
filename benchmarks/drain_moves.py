"""A drain under load: moved requests' time to their next token with their KV shipped, against re-prefill.

One cluster for the whole run, started by `infer-serve --workers 1 --kv-roles kv_both` (the embedded default model
unless `--model`; `--threads` torch threads a worker): its worker B is where moved requests go on. Each round starts
one more worker A, runs `--streams` greedy streams on it (random `--prompt-len`-token prompts, new each round, so B
holds none of their blocks), and once every stream has `--before` tokens sends A SIGTERM. Rounds alternate:

    kv         A has a KV port (--kv-transfer-config kv_both): its requests move with their KV (full blocks of prompt
               and generated tokens) to B, which prefills only the last partial block
    recompute  the same move with no blocks: A's kv_transfer_timeout is 1 ms, so each transfer ends before any block
               leaves and B prefills prompt + tokens. The rest of the path (the coordinator's targets, the hand-off,
               the client's re-attach) is the same, so the difference is the KV shipped against the re-prefill.

A drain without a KV port is not the baseline: its requests finish on A, and only those left at --drain-timeout are
re-prefilled (on this machine such a give-back stalled the stream ~5 s, a stall of its own, not the prefill's). The
client's silence timeout is 60 s: a re-prefill longer than half the default 10 s had the client re-attach its streams
from their copies again and again (a long wait at the new worker, not a lost one).

Measured per stream: the move's gap, the longest gap between consecutive tokens from the SIGTERM on (the stream's
next token after the move; tokens A still made before it moved come earlier). Medians over every stream of a mode,
B's KV counters per round; benchmarks/results/drain_moves-*.json holds every gap.

    .venv/bin/python benchmarks/drain_moves.py [--rounds 3] [--streams 2] [--prompt-len 1024] [--before 16]
                                               [--tokens 48] [--chunk 256] [--model M] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import start_serve, stop_serve, write_result

from infer.client.inference_client import InferenceClient
from infer.protocol.sampling import SamplingParams

MODES = {
    "kv": ["--kv-transfer-config", json.dumps({"kv_role": "kv_both"}), "--drain-timeout", "60"],
    "recompute": [
        "--kv-transfer-config",
        json.dumps({"kv_role": "kv_both", "kv_transfer_timeout": 0.001}),
        "--drain-timeout",
        "60",
    ],
}


def engine_flags(args: argparse.Namespace) -> list[str]:
    """Every worker's: room for a stream, and prefill in chunks of --chunk tokens, so that no step outlasts the
    streams' silence checks (a worker beats on its stream socket between steps)."""
    return ["--max-model-len", str(args.prompt_len + args.tokens + 64), "--max-num-batched-tokens", str(args.chunk)]


def start_worker(address: str, worker_id: str, flags: list[str], args: argparse.Namespace) -> subprocess.Popen:
    argv = [sys.executable, "-m", "infer.worker.service.daemon", "--coordinator", address, "--worker-id", worker_id]
    argv += ["--threads", str(args.threads), *engine_flags(args), *flags]
    if args.model:
        argv += ["--model", args.model]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


async def rank_of(client: InferenceClient, worker_id: str, timeout: float = 300.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in (await client.stats()).workers:
            if w.worker_id == worker_id and w.healthy:
                return w.dp_rank
        await asyncio.sleep(0.2)
    raise RuntimeError(f"worker {worker_id} did not register within {timeout:g} s")


async def b_load(client: InferenceClient, worker_id: str):
    await asyncio.sleep(1.0)  # a heartbeat: the counters of the last step
    return next(w.load for w in (await client.stats()).workers if w.worker_id == worker_id)


async def one_round(client: InferenceClient, address: str, mode: str, index: int, b_id: str, args, rng) -> dict:
    worker_id = f"drain-a-{index}"
    proc = start_worker(address, worker_id, MODES[mode], args)
    try:
        rank = await rank_of(client, worker_id)
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        times: list[list[float]] = [[] for _ in range(args.streams)]
        ends: list[str] = ["" for _ in range(args.streams)]
        ready = asyncio.Event()

        async def stream(i: int, prompt: list[int]) -> None:
            async for delta in client.stream(prompt, params, pin_rank=rank):
                if delta.token_ids:
                    times[i] += [time.perf_counter()] * len(delta.token_ids)
                if all(len(t) >= args.before for t in times):
                    ready.set()
                if delta.finish_reason is not None:
                    ends[i] = f"{delta.finish_reason}{f': {delta.error}' if delta.error else ''}"

        before = await b_load(client, b_id)
        prompts = [[rng.randrange(3, 30000) for _ in range(args.prompt_len)] for _ in range(args.streams)]
        tasks = [asyncio.create_task(stream(i, p)) for i, p in enumerate(prompts)]
        await asyncio.wait_for(ready.wait(), 600)
        sigterm_at = time.perf_counter()
        os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), 600)
        proc.wait(timeout=120)
        after = await b_load(client, b_id)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    gaps = []
    for t in times:
        later = [i for i in range(1, len(t)) if t[i] > sigterm_at]
        gaps.append(max((t[i] - t[i - 1] for i in later), default=float("nan")))
    return {
        "mode": mode,
        "move_gaps_s": gaps,
        "received_blocks": after.kv_transfer_received_blocks - before.kv_transfer_received_blocks,
        "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "tokens": [len(t) for t in times],
        "ends": ends,
    }


async def measure(address: str, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(0)
    async with InferenceClient(address, silence_timeout=60.0) as client:  # a re-prefill's wait is no silence
        (b,) = (await client.stats()).workers
        await client.generate([1, 2, 3], SamplingParams(max_tokens=2))  # warm B
        rounds = []
        for index in range(2 * args.rounds):
            mode = ("kv", "recompute")[index % 2]
            rounds.append(await one_round(client, address, mode, index, b.worker_id, args, rng))
            r = rounds[-1]
            print(
                f"round {index} {mode:9} move gaps {', '.join(f'{g * 1000:.0f}' for g in r['move_gaps_s'])} ms; "
                f"B received {r['received_blocks']} blocks, hit {r['prefix_cache_hits']} tokens; ends {r['ends']}",
                flush=True,
            )
    return rounds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of each mode, alternating")
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--before", type=int, default=16, help="tokens each stream has when A drains")
    p.add_argument("--tokens", type=int, default=48, help="max_tokens of each stream")
    p.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens of every worker")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    flags = ["--workers", "1", "--kv-roles", "kv_both", "--threads", str(args.threads)]
    flags += engine_flags(args)
    if args.model:
        flags += ["--model", args.model]
    proc, address = start_serve(flags)
    try:
        rounds = asyncio.run(measure(address, args))
    finally:
        stop_serve(proc)
    medians = {
        mode: statistics.median(g for r in rounds if r["mode"] == mode for g in r["move_gaps_s"]) for mode in MODES
    }
    print(f"{'mode':10} {'move gap p50 ms':>16}")
    for mode, median in medians.items():
        print(f"{mode:10} {median * 1000:16.0f}")
    ratio = medians["kv"] / medians["recompute"]
    print(f"move gap, kv / recompute: {ratio:.2f}")
    path = write_result(
        "drain_moves", {"args": vars(args), "rounds": rounds, "median_move_gap_s": medians, "kv_over_recompute": ratio}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
