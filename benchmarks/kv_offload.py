"""The KV tiers beyond the pool: a multi-turn chat workload on one engine whose KV pool is too small for the working
set, with the disk tier (--kv-offload-dir), with the host-memory tier (--kv-offload-host-gb) and without either, and
a pool that holds everything as the ceiling.

Workload (fixed seed): `--conversations` conversations (12) of `--turns` turns (4); a turn of every conversation is
submitted at once, the next when all of its answers are in. A shared 32-token system prefix, a `--first` (192) token
first user message, then 48 new user tokens a turn; every prompt is the whole conversation so far (prompts, answers,
the new turn), answers 16 tokens (greedy, ignore_eos). `--max-num-seqs` (4) run at once, so a turn's requests queue
and the conversations served early in a turn are evicted by the later ones before their next turn comes. The model
is the embedded SmolLM2-135M in float32 (a real prefill cost to save; float32 keeps greedy outputs comparable across
the runs, whose prefill chunks differ).

Reported per run: prefix-cache hit rate (prompt tokens served from the pool, including the blocks read back from
disk / prompt tokens looked up), prompt tokens prefilled, TTFT (add_request -> first token, in-process, queueing
included) p50 / p99, wall time, the tiers' counters, the machine's load average around the run (the dev machine is
shared); and whether every answer equals the big pool's. `--tier-first` runs the tiers before the run without one.

    .venv/bin/python benchmarks/kv_offload.py [--conversations 12] [--turns 4] [--pool-blocks 160] [--host-gb 2]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

from common import write_result

from infer.protocol.sampling import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

VOCAB_LOW, VOCAB_HIGH = 100, 49000
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def workload(args: argparse.Namespace) -> list[list[list[int]]]:
    """Each conversation's user turns as token ids (the first with the shared system prefix)."""
    rng = random.Random(45)
    system = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(32)]
    conversations = []
    for _ in range(args.conversations):
        first = system + [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.first)]
        later = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(48)] for _ in range(args.turns - 1)]
        conversations.append([first, *later])
    return conversations


def run(name: str, args: argparse.Namespace, pool_blocks: int, offload: dict) -> dict:
    """One run of the workload; `offload`: the engine's KV tier options (none: {})."""
    block_bytes = 2 * 30 * 3 * 64 * 16 * 4  # SmolLM2-135M: 30 layers, 3 KV heads of 64, 16-token blocks, float32
    engine = Engine(
        EngineConfig(
            dtype="float32",
            max_model_len=4096,
            max_num_seqs=args.max_num_seqs,
            kv_cache_memory=pool_blocks * block_bytes,
            num_threads=args.threads,
            **offload,
        )
    )
    conversations = workload(args)
    history: list[list[int]] = [[] for _ in conversations]
    answers: list[list[int]] = []
    ttfts: list[float] = []
    before = engine.load()
    prefilled = engine.stats.prefill_tokens_computed
    load_avg_before = os.getloadavg()[0]
    start = time.perf_counter()
    for turn in range(args.turns):
        submitted: dict[str, float] = {}
        out: dict[str, list[int]] = {}
        for i, conversation in enumerate(conversations):
            history[i] += conversation[turn]
            rid = f"c{i}-t{turn}"
            engine.add_request(rid, list(history[i]), PARAMS)
            submitted[rid], out[rid] = time.perf_counter(), []
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.token_ids and not out[delta.request_id]:
                    ttfts.append(time.perf_counter() - submitted[delta.request_id])
                out[delta.request_id].extend(delta.token_ids)
        for i in range(len(conversations)):
            answer = out[f"c{i}-t{turn}"]
            history[i] += answer
            answers.append(answer)
    wall = time.perf_counter() - start
    load = engine.load()
    engine.close()
    queries = load.prefix_cache_queries - before.prefix_cache_queries
    hits = load.prefix_cache_hits - before.prefix_cache_hits
    ttfts.sort()
    return {
        "run": name,
        "pool_blocks": engine.num_kv_blocks,
        "hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens": queries,
        "prefilled_tokens": engine.stats.prefill_tokens_computed - prefilled,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "wall_s": wall,
        "load_avg_1m": [load_avg_before, os.getloadavg()[0]],  # the machine's, before / after: others' jobs share it
        "spilled_blocks": load.kv_offload_spilled_blocks,
        "loaded_blocks": load.kv_offload_loaded_blocks,
        "dropped_blocks": load.kv_offload_dropped_blocks,
        "corrupt_blocks": load.kv_offload_corrupt_blocks,
        "host_spilled_blocks": load.kv_offload_host_spilled_blocks,
        "host_loaded_blocks": load.kv_offload_host_loaded_blocks,
        "host_dropped_blocks": load.kv_offload_host_dropped_blocks,
        "host_corrupt_blocks": load.kv_offload_host_corrupt_blocks,
        "answers": answers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first", type=int, default=192, help="tokens of each conversation's first user message")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--pool-blocks", type=int, default=160, help="the small pool, in 16-token blocks")
    parser.add_argument("--offload-gb", type=float, default=2.0, help="the disk tier's bound")
    parser.add_argument("--host-gb", type=float, default=2.0, help="the host-memory tier's bound")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tier-first", action="store_true", help="run the tiers before the run without one")
    args = parser.parse_args()
    working_set = args.conversations * (32 + args.first + (args.turns - 1) * 48 + args.turns * 16) // 16 + 1
    results = []
    with tempfile.TemporaryDirectory(prefix="kv-offload-bench-") as directory:
        disk = {"kv_offload_dir": directory, "kv_offload_gb": args.offload_gb}
        runs: list[tuple[str, int, dict]] = [
            ("small pool, no tier", args.pool_blocks, {}),
            ("small pool + disk tier", args.pool_blocks, disk),
            ("small pool + host tier", args.pool_blocks, {"kv_offload_host_gb": args.host_gb}),
            ("pool holding everything", working_set + 64 * args.max_num_seqs, {}),
        ]
        if args.tier_first:
            runs[:3] = [*runs[1:3], runs[0]]
        for name, blocks, offload in runs:
            results.append(run(name, args, blocks, offload))
            print(f"  {name}: done in {results[-1]['wall_s']:.1f} s", file=sys.stderr)
    reference = results[-1]["answers"]
    print(f"working set ~{working_set} blocks; {args.conversations} conversations x {args.turns} turns")
    print(
        f"{'run':26} {'pool':>5} {'hit rate':>8} {'prefilled':>9} {'TTFT p50':>9} {'p99':>8} {'wall':>7} "
        f"{'spilled':>7} {'loaded':>6} {'same':>5}  (spilled / loaded: disk + host)"
    )
    for r in results:
        r["answers_equal_reference"] = r.pop("answers") == reference
        print(
            f"{r['run']:26} {r['pool_blocks']:>5} {r['hit_rate']:>8.1%} {r['prefilled_tokens']:>9} "
            f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>6.0f}ms {r['wall_s']:>6.1f}s "
            f"{r['spilled_blocks'] + r['host_spilled_blocks']:>7} {r['loaded_blocks'] + r['host_loaded_blocks']:>6} "
            f"{str(r['answers_equal_reference']):>5}"
        )
    by_name = {r["run"]: r for r in results}
    without = by_name["small pool, no tier"]
    ratios: dict[str, float | None] = {}
    for tier, key in (("disk", "tier"), ("host", "host")):  # "tier": the disk's, as named in the first results
        r = by_name[f"small pool + {tier} tier"]
        ratios[f"hit_rate_{key}_over_none"] = r["hit_rate"] / without["hit_rate"] if without["hit_rate"] else None
        ratios[f"ttft_p50_{key}_over_none"] = r["ttft_p50_ms"] / without["ttft_p50_ms"]
        ratios[f"ttft_p99_{key}_over_none"] = r["ttft_p99_ms"] / without["ttft_p99_ms"]
        ratios[f"wall_{key}_over_none"] = r["wall_s"] / without["wall_s"]
    print("  ".join(f"{k} {v:.2f}" for k, v in ratios.items() if v is not None))
    path = write_result(
        "kv_offload", {"args": vars(args), "working_set_blocks": working_set, "runs": results, **ratios}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
