"""Pipeline parallelism on the CPU: decode throughput of a model split PP 2 across two processes pinned to one core
each, against one process with 2 threads (and one with 1 thread: one core's whole-model step, twice one stage's).

    .venv/bin/python benchmarks/pipeline.py                                # llama-0.6b shape, batch 32, 64 tokens
    .venv/bin/python benchmarks/pipeline.py --shape tiny --batch 8 --tokens 8    # a smoke run

Each configuration runs in a process of its own (its affinity and threads set before torch starts): `one-2t`
(LLM, 2 threads on cores 0-1), `one-1t` (1 thread on core 0), `pp2` (LLM with pipeline_parallel_size=2: stage 0
in that process on core 0, stage 1 its child on core 1, 1 thread each; two micro-batches in flight, the default)
and `pp2-1mb` (the same with pp_micro_batches=1: one batch at a time through the stages). Decode throughput =
batch x (tokens - 1) / (time of `tokens` tokens - time of 1 token), the prompts fresh each time (no prefix-cache
hits). Per step (all of the batch's sequences one token further):
`hand-off` = pp2-1mb's step - one-1t's step (one batch at a time, the two stages compute what one core computes
for the whole model one after the other, plus the hand-offs: hidden states to stage 1, logits back, the step
command); `bubble` = the share of pp2's step each stage idles, 1 - (one-1t's step / 2) / pp2's step (0 when the
micro-batches keep both cores busy and cost nothing more; pp2 then reaches 2x one-1t). The micro-batches' own
cost is in the bubble too: two half batches per step instead of one whole.

A random-weight Llama of benchmarks/common.py's RANDOM_SHAPES (or `tiny`) with the embedded model's tokenizer.
Writes benchmarks/results/pipeline-<date>.json (date, machine, git revision). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RANDOM_SHAPES, write_result  # noqa: E402

SHAPES = {
    **RANDOM_SHAPES,
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
}
CONFIGS = ("one-2t", "one-1t", "pp2-1mb", "pp2")


def make_model(shape: str, folder: Path) -> Path:
    """A Llama of SHAPES[shape], random bf16 weights, the embedded model's tokenizer; made once under `folder`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from infer.worker.loading.model_files import default_model_gguf

    path = folder / f"pp-random-{shape}"
    if (path / "config.json").exists():
        return path
    gguf = default_model_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _cores() -> tuple[set[int], set[int]]:
    """The cores of stage 0 (and one-process runs) and of stage 1: the first two this process may use."""
    allowed = sorted(os.sched_getaffinity(0))
    return {allowed[0]}, {allowed[1 % len(allowed)]}


def _children() -> list[int]:
    pid = os.getpid()
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def run_one(config: str, model: str, batch: int, tokens: int, prompt_len: int, dtype: str) -> dict:
    """One configuration, in this process: decode throughput and step time."""
    first, second = _cores()
    os.sched_setaffinity(0, first | second if config == "one-2t" else first)
    from infer import LLM, SamplingParams

    options = dict(
        dtype=dtype,
        max_model_len=prompt_len + tokens + 16,
        enable_prefix_caching=False,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(batch * prompt_len, 256),
        num_threads=2 if config == "one-2t" else 1,
    )
    if config.startswith("pp2"):
        options["pipeline_parallel_size"] = 2
        options["pp_micro_batches"] = 1 if config == "pp2-1mb" else 2
    llm = LLM(model=model, **options)
    if config.startswith("pp2"):
        for pid in _children():  # every thread of stage 1 (its torch and gloo threads exist by now)
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), second)
    rng = random.Random(0)

    def timed(max_tokens: int) -> float:
        prompts = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    timed(2)  # warm-up
    prefill, whole = timed(1), timed(tokens)
    step_s = (whole - prefill) / (tokens - 1)
    llm.close()
    return {"config": config, "decode_tok_s": batch / step_s, "step_ms": step_s * 1000}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-0.6b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence (>= 2)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--run", choices=CONFIGS, help=argparse.SUPPRESS)  # one configuration, in this process
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tokens < 2:
        p.error("--tokens must be >= 2")
    if args.run:
        print(json.dumps(run_one(args.run, args.model, args.batch, args.tokens, args.prompt_len, args.dtype)))
        return
    model = make_model(args.shape, Path(tempfile.gettempdir()))
    rows = {}
    for config in CONFIGS:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--run",
                config,
                "--model",
                str(model),
                "--batch",
                str(args.batch),
                "--tokens",
                str(args.tokens),
                "--prompt-len",
                str(args.prompt_len),
                "--dtype",
                args.dtype,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        rows[config] = json.loads(out.stdout.strip().splitlines()[-1])
    base = rows["one-2t"]["decode_tok_s"]
    print(f"{args.shape}, batch {args.batch}, {args.tokens} tokens, dtype {args.dtype}")
    print(f"{'config':8} {'decode tok/s':>13} {'step ms':>9} {'vs one-2t':>10}")
    for config, row in rows.items():
        print(f"{config:8} {row['decode_tok_s']:13.1f} {row['step_ms']:9.2f} {row['decode_tok_s'] / base:9.2f}x")
    one_step, v1_step, pp_step = (rows[c]["step_ms"] for c in ("one-1t", "pp2-1mb", "pp2"))
    handoff, bubble = v1_step - one_step, 1 - (one_step / 2) / pp_step
    speedup = rows["pp2"]["decode_tok_s"] / rows["one-1t"]["decode_tok_s"]
    print(
        f"pp2 per step: hand-off {handoff:.2f} ms (one batch at a time), each stage idle {bubble:.0%} of the step "
        f"with 2 micro-batches in flight; pp2 / one-1t {speedup:.2f}x (ideal 2x)"
    )
    path = write_result(
        "pipeline",
        {
            "shape": args.shape,
            "batch": args.batch,
            "tokens": args.tokens,
            "prompt_len": args.prompt_len,
            "dtype": args.dtype,
            "rows": list(rows.values()),
            "handoff_ms_per_step": handoff,
            "bubble": bubble,
            "pp2_over_one_1t": speedup,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
