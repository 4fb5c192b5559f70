"""Step graphs on vs off (enforce_eager), in the same run: decode tok/s, offline W1, fresh-engine TTFT.

    .venv/bin/python benchmarks/step_graphs.py                          # everything, bf16 + fp32
    .venv/bin/python benchmarks/step_graphs.py --parts decode --batches 1 8 --dtypes bfloat16

- decode: an eager and a compiled engine each hold `batch` requests (128-token prompts) in decode; single
  steps alternate between them (A, B, A, B, ...) and each side's median step gives tok/s. Alternating
  single steps is what survives a shared, noisy machine.
- offline: W1 (64 x 128 -> 128, greedy) through LLM.generate on each engine, rounds alternating; median.
- ttft: a fresh process builds an engine and serves one 128 -> 3 request; wall time from start to the first
  token, and the second and third tokens' gaps (the first decode steps), with the compile cache warm (what a
  restart costs) and cold (a first start).

Writes benchmarks/results/step_graphs-<date>.json (date, machine, git revision). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RANDOM_SHAPES, make_workload, random_model, write_result  # noqa: E402

PROMPT, KV_BYTES = 128, 1 << 30
MODEL: str | None = None  # --model / --random-model; None: the embedded model


def _engine(dtype: str, enforce_eager: bool, threads: int | None, max_num_seqs: int = 256):
    from infer.worker.engine.config import EngineConfig
    from infer.worker.engine.engine import Engine

    start = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=MODEL,
            dtype=dtype,
            max_model_len=2048,
            kv_cache_memory=KV_BYTES,
            num_threads=threads,
            enforce_eager=enforce_eager,
            max_num_seqs=max_num_seqs,
        )
    )
    return engine, time.perf_counter() - start


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(PROMPT)] for _ in range(n)]


def decode(dtype: str, batch: int, steps: int, threads: int | None) -> dict:
    """Median decode-step time of each side, single steps alternating."""
    from infer import SamplingParams

    engines = {name: _engine(dtype, name == "eager", threads)[0] for name in ("eager", "compiled")}
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for name, engine in engines.items():
        for i, prompt in enumerate(_prompts(batch, 0)):
            engine.add_request(f"{name}{i}", prompt, params)
        while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
            engine.step()
        engine.step()  # the first decode step of a bucket past the warm-up compiles it here
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[int]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            start = time.perf_counter()
            out = engine.step()
            times[name].append(time.perf_counter() - start)
            tokens[name].extend(t for o in out for t in o.token_ids)
    result = {
        name: {"median_step_ms": 1e3 * statistics.median(t), "tok_per_s": batch / statistics.median(t)}
        for name, t in times.items()
    }
    result["speedup"] = result["compiled"]["tok_per_s"] / result["eager"]["tok_per_s"]
    result["same_tokens"] = tokens["eager"] == tokens["compiled"]
    return result


def offline(dtype: str, rounds: int, threads: int | None) -> dict:
    """W1 through LLM.generate, rounds alternating between the two engines."""
    from infer import LLM, SamplingParams
    from infer.worker.loading.model_files import resolve_model

    path = MODEL or str(resolve_model(None))
    llms = {
        name: LLM(
            model=path,
            dtype=dtype,
            max_model_len=2048,
            kv_cache_memory=KV_BYTES,
            num_threads=threads,
            enforce_eager=(name == "eager"),
        )
        for name in ("eager", "compiled")
    }
    workload = make_workload("W1", 49152)  # SmolLM2's vocabulary (the random models share its tokenizer)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
    for llm in llms.values():  # warm-up: every decode bucket W1 reaches gets made here, not in the timing
        llm.generate(
            workload.prompts, [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)] * 64, use_tqdm=False
        )
    rates: dict[str, list[float]] = {name: [] for name in llms}
    outputs = {}
    for _ in range(rounds):
        for name, llm in llms.items():
            start = time.perf_counter()
            outputs[name] = [c.token_ids for c in llm.generate(workload.prompts, params, use_tqdm=False)]
            rates[name].append(workload.output_tokens / (time.perf_counter() - start))
    result = {name: {"tok_per_s": statistics.median(r), "rounds": r} for name, r in rates.items()}
    result["speedup"] = result["compiled"]["tok_per_s"] / result["eager"]["tok_per_s"]
    result["same_tokens"] = outputs["eager"] == outputs["compiled"]
    return result


def ttft_child(dtype: str, enforce_eager: bool, threads: int | None) -> None:
    from infer import SamplingParams

    start = time.perf_counter()
    engine, built = _engine(dtype, enforce_eager, threads)
    engine.add_request("r", _prompts(1, 1)[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    stamps = []  # when each step that gave the request a token ended
    while engine.has_unfinished():
        if any(delta.token_ids for delta in engine.step()):
            stamps.append(time.perf_counter())
    compile_s = sum(engine.runner.step_graphs.compile_seconds.values()) if engine.runner.step_graphs else 0.0
    result = {
        "ttft_s": stamps[0] - start,
        "engine_start_s": built,
        "compile_s": compile_s,
        # the first decode steps (batch 1): a graph made at the start replays here; one that fails its guards is
        # compiled again here, on the first request's path
        "second_token_s": stamps[1] - stamps[0],
        "third_token_s": stamps[2] - stamps[1],
    }
    print("RESULT " + json.dumps(result), flush=True)


def ttft(dtype: str, threads: int | None) -> dict:
    """Fresh processes: eager, compiled with the compile cache as it is (warm), compiled with an empty one."""
    result = {}
    with tempfile.TemporaryDirectory() as cold_cache:
        for name, eager, cache in (
            ("eager", True, None),
            ("compiled_warm_cache", False, None),
            ("compiled_cold_cache", False, cold_cache),
        ):
            env = dict(os.environ)
            if cache is not None:
                env["INFER_COMPILE_CACHE"] = cache
            cmd = [sys.executable, __file__, "--ttft-child", dtype, str(int(eager)), str(threads or 0)]
            if MODEL:
                cmd += ["--model", MODEL]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            result[name] = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-2000:]}
            print(f"   ttft {dtype} {name}: {result[name]}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts", nargs="+", default=["decode", "offline", "ttft"], choices=["decode", "offline", "ttft"]
    )
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--model", help="a safetensors model directory (default: the embedded model)")
    parser.add_argument(
        "--random-model",
        choices=sorted(RANDOM_SHAPES),
        help="a random-weight Llama of this shape, made with --tokenizer's tokenizer",
    )
    parser.add_argument("--tokenizer", help="the tokenizer folder of --random-model")
    parser.add_argument("--ttft-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global MODEL
    if args.random_model:
        if not args.tokenizer:
            parser.error("--random-model needs --tokenizer")
        MODEL = str(random_model(args.random_model, args.tokenizer, Path(tempfile.gettempdir())))
    else:
        MODEL = args.model
    if args.ttft_child:
        dtype, eager, threads = args.ttft_child
        ttft_child(dtype, eager == "1", int(threads) or None)
        return
    results: dict = {"threads": args.threads, "load_avg_start": os.getloadavg()}
    for dtype in args.dtypes:
        if "decode" in args.parts:
            for batch in args.batches:
                r = results.setdefault("decode", {}).setdefault(dtype, {})[str(batch)] = decode(
                    dtype, batch, args.steps, args.threads
                )
                print(
                    f"decode {dtype} batch {batch}: eager {r['eager']['tok_per_s']:.1f} tok/s, compiled "
                    f"{r['compiled']['tok_per_s']:.1f} tok/s ({r['speedup']:.2f}x), same tokens "
                    f"{r['same_tokens']}",
                    flush=True,
                )
        if "offline" in args.parts:
            r = results.setdefault("offline_W1", {})[dtype] = offline(dtype, args.rounds, args.threads)
            print(
                f"offline W1 {dtype}: eager {r['eager']['tok_per_s']:.1f} tok/s, compiled "
                f"{r['compiled']['tok_per_s']:.1f} tok/s ({r['speedup']:.2f}x), same tokens {r['same_tokens']}",
                flush=True,
            )
        if "ttft" in args.parts:
            results.setdefault("ttft_fresh_engine", {})[dtype] = ttft(dtype, args.threads)
    results["load_avg_end"] = os.getloadavg()
    model = args.random_model and f"random {args.random_model}" or MODEL or "SmolLM2-135M-Instruct"
    out = write_result("step_graphs", {"model": model, "prompt_tokens": PROMPT, **results})
    print("wrote", out)


if __name__ == "__main__":
    main()
