"""Speculative decoding (n-gram / prompt lookup) on vs off, in the same run: batch-1 tok/s and offline batch 64.

    .venv/bin/python benchmarks/speculative.py                          # everything, bf16, the embedded model
    .venv/bin/python benchmarks/speculative.py --parts batch1 --workloads rewrite --k 5 --rounds 5
    .venv/bin/python benchmarks/speculative.py --model BIG --draft-model SMALL    # a draft model instead of n-grams

- batch1: one request at a time on two engines of the same weights, one with `speculative_config` and one
  without, requests alternating between them (A, B, A, B, ...: what survives a shared, noisy machine); each
  side's median tok/s (output tokens / wall time of the request, prefill included) per workload, and the ratio.
  Workloads: "rewrite" (repeat a given passage: drafts copied from the prompt can be right), "code" (rewrite a
  given function with one name changed), "continue" (go on with a passage that repeats itself), "random"
  (random prompt tokens: drafts are mostly wrong, the cost of trying). Chat-formatted where the tokenizer has a
  template. Greedy, so the two sides must give the same tokens (checked: "same_tokens").
- offline: W1 (64 x 128 -> 128, greedy, random prompts) through LLM.generate on each engine, rounds alternating;
  with the default `disable_by_batch_size` (8) speculation switches itself off at this batch size, so the ratio
  should be ~1 (what must not regress).
Each result carries the acceptance counters (drafts, draft tokens, accepted, by position).

Writes benchmarks/results/speculative-<date>.json (date, machine, git revision). Not a test.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RANDOM_SHAPES, make_workload, random_model, write_result  # noqa: E402

KV_BYTES = 1 << 30
MODEL: str | None = None   # --model / --random-model; None: the embedded model

PASSAGE = ("The river ran high that spring. Every morning the ferryman checked the ropes, counted the planks and "
           "wrote the water level in a small notebook he kept in his coat. By April the notebook was full, and the "
           "village council asked him to read it aloud at the meeting, page by page, so that everyone would know "
           "how close the water had come to the mill.")
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    averages = []
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
'''
TEXTS = {
    "rewrite": f"Repeat the following passage exactly, word for word.\n\n{PASSAGE}",
    "code": f"Rewrite this Python function with the parameter `values` renamed to `samples`. Output only the "
            f"code.\n\n```python\n{CODE}```",
    "continue": f"{PASSAGE}\n\n{PASSAGE}\n\n{PASSAGE[:200]}",
}


def _engine(dtype: str, spec: dict | None, threads: int | None):
    from infer.worker.config import EngineConfig
    from infer.worker.engine import Engine

    return Engine(EngineConfig(model=MODEL, dtype=dtype, max_model_len=4096, kv_cache_memory=KV_BYTES,
                               num_threads=threads, speculative_config=spec))


def _prompt(engine, workload: str, rng: random.Random) -> list[int]:
    tokenizer = engine.tokenizer
    if workload == "random":
        return [rng.randrange(100, engine.vocab_size - 100) for _ in range(128)]
    text = TEXTS[workload]
    if getattr(tokenizer, "chat_template", None) and workload != "continue":
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(chat, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def _one(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    from infer import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    start = time.perf_counter()
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.token_ids
    return tokens, time.perf_counter() - start


def _counters(engine) -> dict:
    s = engine.stats
    return {"drafts": s.spec_decode_num_drafts, "draft_tokens": s.spec_decode_num_draft_tokens,
            "accepted_tokens": s.spec_decode_num_accepted_tokens,
            "accepted_per_position": list(s.spec_decode_num_accepted_tokens_per_pos),
            "acceptance_rate": s.spec_decode_num_accepted_tokens / max(1, s.spec_decode_num_draft_tokens)}


def batch1(dtype: str, spec: dict, workloads: list[str], rounds: int, max_tokens: int, threads: int | None) -> dict:
    engines = {"plain": _engine(dtype, None, threads), "speculative": _engine(dtype, spec, threads)}
    rng = random.Random(0)
    result = {}
    for workload in workloads:
        prompts = [_prompt(engines["plain"], workload, rng) for _ in range(rounds)]
        for name, engine in engines.items():   # warm-up (kernels built, first-step costs) outside the timing
            _one(engine, f"warm-{workload}-{name}", prompts[0], 4)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        same = True
        before = _counters(engines["speculative"])
        for i, prompt in enumerate(prompts):
            outputs = {}
            for name, engine in engines.items():
                outputs[name], seconds = _one(engine, f"{workload}-{i}-{name}", prompt, max_tokens)
                rates[name].append(len(outputs[name]) / seconds)
            same = same and outputs["plain"] == outputs["speculative"]
        after = _counters(engines["speculative"])
        r = {name: {"tok_per_s": statistics.median(v), "rounds": v} for name, v in rates.items()}
        r["ratio"] = r["speculative"]["tok_per_s"] / r["plain"]["tok_per_s"]
        r["same_tokens"] = same
        r["prompt_tokens"] = len(prompts[0])
        r["acceptance"] = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
        r["acceptance"]["rate"] = r["acceptance"]["accepted_tokens"] / max(1, r["acceptance"]["draft_tokens"])
        result[workload] = r
        print(f"batch1 {dtype} {workload}: plain {r['plain']['tok_per_s']:.1f} tok/s, speculative "
              f"{r['speculative']['tok_per_s']:.1f} tok/s ({r['ratio']:.2f}x), acceptance "
              f"{r['acceptance']['rate']:.2f}, same tokens {same}", flush=True)
    return result


def offline(dtype: str, spec: dict, rounds: int, threads: int | None) -> dict:
    from infer import LLM, SamplingParams
    from infer.worker.model_files import resolve_model

    path = MODEL or str(resolve_model(None))
    llms = {name: LLM(model=path, dtype=dtype, max_model_len=2048, kv_cache_memory=KV_BYTES, num_threads=threads,
                      speculative_config=spec if name == "speculative" else None)
            for name in ("plain", "speculative")}
    workload = make_workload("W1", 49152)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
    for llm in llms.values():
        llm.generate(workload.prompts[:4], [SamplingParams(temperature=0, max_tokens=2)] * 4, use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    outputs = {}
    for _ in range(rounds):
        for name, llm in llms.items():
            start = time.perf_counter()
            outputs[name] = [c.token_ids for c in llm.generate(workload.prompts, params, use_tqdm=False)]
            rates[name].append(workload.output_tokens / (time.perf_counter() - start))
    result = {name: {"tok_per_s": statistics.median(r), "rounds": r} for name, r in rates.items()}
    result["ratio"] = result["speculative"]["tok_per_s"] / result["plain"]["tok_per_s"]
    result["same_tokens"] = outputs["plain"] == outputs["speculative"]
    print(f"offline W1 {dtype}: plain {result['plain']['tok_per_s']:.1f} tok/s, speculative "
          f"{result['speculative']['tok_per_s']:.1f} tok/s ({result['ratio']:.2f}x), same tokens "
          f"{result['same_tokens']}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["batch1", "offline"], choices=["batch1", "offline"])
    parser.add_argument("--workloads", nargs="+", default=["rewrite", "code", "continue", "random"],
                        choices=["rewrite", "code", "continue", "random"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens of each batch-1 request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--model", help="a safetensors model directory or .gguf (default: the embedded model)")
    parser.add_argument("--draft-model", help="speculate with this draft model (method draft_model) instead of "
                                              "n-gram lookup")
    parser.add_argument("--random-model", choices=sorted(RANDOM_SHAPES),
                        help="a random-weight Llama of this shape, made with --tokenizer's tokenizer")
    parser.add_argument("--tokenizer", help="the tokenizer folder of --random-model")
    args = parser.parse_args()
    global MODEL
    if args.random_model:
        if not args.tokenizer:
            parser.error("--random-model needs --tokenizer")
        MODEL = str(random_model(args.random_model, args.tokenizer, Path(tempfile.gettempdir())))
    else:
        MODEL = args.model
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
    if args.draft_model:
        spec = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k}
    results: dict = {"threads": args.threads, "speculative_config": spec, "load_avg_start": os.getloadavg()}
    for dtype in args.dtypes:
        if "batch1" in args.parts:
            results.setdefault("batch1", {})[dtype] = batch1(dtype, spec, args.workloads, args.rounds,
                                                             args.max_tokens, args.threads)
        if "offline" in args.parts:
            results.setdefault("offline_W1", {})[dtype] = offline(dtype, spec, args.rounds, args.threads)
    results["load_avg_end"] = os.getloadavg()
    model = args.random_model and f"random {args.random_model}" or MODEL or "SmolLM2-135M-Instruct"
    out = write_result("speculative", {"model": model, **results})
    print("wrote", out)


if __name__ == "__main__":
    main()
