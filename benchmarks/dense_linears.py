"""Dense bf16 linears on a CPU, one copy of the weights against two. Not a test.

    .venv/bin/python benchmarks/dense_linears.py              # 3 rounds
    .venv/bin/python benchmarks/dense_linears.py --rounds 1   # a quick check

"one copy" is what the engine does by default: every bf16 row goes to the native GEMV (1-8 rows) and its tiles
(more), which read the weights as the checkpoint stores them. "packed twin" is `--cpu-weight-prepack` (what an
AVX512-BF16 CPU did until 2026-12-01): the same for 1-8 rows, and a oneDNN-packed copy of every linear's weight, kept
beside it, for more rows. On a CPU without AVX512-BF16 oneDNN packs no bf16 weight and the two modes are the same.

The embedded model dequantized to bf16 (`quantization="none"`), LLM in direct mode, `--threads` threads (2), greedy,
EOS ignored, random prompt ids (fixed seed, the same for both modes). Each mode runs in its own process, one after
the other, the order alternating by round; the table shows medians. Per mode:

    prefill tok/s   one 512-token prompt, max_tokens 1 (its TTFT: the prefill, whose linears take 512 rows)
    offline tok/s   32 prompts x (128 -> 64) at once: output tokens / wall time (steps of 32 rows, chunked prefills)
    batch-1 tok/s   one 16-token prompt -> 128 tokens (the native decode step: 1 row, the same in both modes)
    peak RSS MiB    the child's high-water mark (ru_maxrss), the KV pool at its default size
    packed MiB      the bytes of the oneDNN-packed copies
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

MODES = ("one copy", "packed twin")


def child(mode: str, threads: int) -> dict:
    from infer import LLM, SamplingParams
    from infer.worker.loading.weights import packed_bytes

    llm = LLM(quantization="none", num_threads=threads, cpu_weight_prepack=mode == "packed twin")
    vocab = llm.engine.vocab_size
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    def run(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return time.perf_counter() - start

    run([ids(512)], 1)  # warm-up: every path once
    run([ids(128) for _ in range(32)], 4)
    prefill = run([ids(512)], 1)
    offline = run([ids(128) for _ in range(32)], 64)
    batch1 = run([ids(16)], 128)
    out = {
        "prefill_tok_s": 512 / prefill,
        "offline_tok_s": 32 * 64 / offline,
        "batch1_tok_s": 128 / batch1,
        "packed_mib": packed_bytes(llm.engine.model) / 2**20,
    }
    llm.close()
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.threads)))
        return
    rounds: list[dict] = []
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        got = {}
        for mode in order:
            done = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--threads", str(args.threads)],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if done.returncode != 0:
                raise SystemExit(f"{mode}: exit {done.returncode}\n{done.stderr[-3000:]}")
            got[mode] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"round {r + 1} {mode}: {got[mode]}", flush=True)
        rounds.append(got)
    keys = ("prefill_tok_s", "offline_tok_s", "batch1_tok_s", "peak_rss_mib", "packed_mib")
    median = {m: {k: statistics.median(rd[m][k] for rd in rounds) for k in keys} for m in MODES}
    print(f"\n{'':14}" + "".join(f"{k:>16}" for k in keys))
    for m in MODES:
        print(f"{m:14}" + "".join(f"{median[m][k]:16.1f}" for k in keys))
    ratio = {k: median["one copy"][k] / median["packed twin"][k] for k in keys[:4]}
    print("one copy / packed twin: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    path = write_result(
        "dense_linears",
        {"threads": args.threads, "rounds": rounds, "median": median, "one_copy_over_packed_twin": ratio},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
