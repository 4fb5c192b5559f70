"""Offline generation on the embedded default model: `python -m infer.client.demo`.

Prints the model's answers to a few chat prompts, run together in one continuous batch.
"""

from __future__ import annotations

import argparse
import time

from infer.client.llm import LLM
from infer.protocol.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Explain what a KV cache is in one sentence.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="safetensors dir or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    llm = LLM(model=args.model, dtype=args.dtype)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    completions = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for question, completion in zip(QUESTIONS, completions):
        print(f"\n>>> {question}\n{completion.text.strip()}  [{completion.finish_reason}]")
    tokens = sum(len(c.token_ids) for c in completions)
    print(f"\n{len(completions)} answers, {tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.0f} tok/s)")


if __name__ == "__main__":
    main()
