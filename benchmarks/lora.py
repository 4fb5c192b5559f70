"""LoRA adapters mixed in one batch vs the base model alone, in the same run: offline throughput and the ratio.

    .venv/bin/python benchmarks/lora.py                                  # the embedded model, batch 32, 8 adapters
    .venv/bin/python benchmarks/lora.py --random-model llama-1b --dtype bfloat16
    .venv/bin/python benchmarks/lora.py --tiny --rounds 1                # smoke: a tiny random model, seconds

Three sides, rounds alternating (A, B, C, A, B, C, ...: what survives a shared, noisy machine), each a batch of
`--batch` requests (`--prompt-len` random prompt tokens -> `--max-tokens` greedy tokens, EOS ignored) through one
engine's step loop:
- base: an engine without LoRA;
- lora: an engine with --enable-lora, request i runs adapter i % `--adapters` (rank `--rank` on q, k, v, o, gate,
  up, down; random A and B in PEFT's files), so every step mixes every adapter (worker/engine/lora.py's batched path);
- lora-base-rows: the LoRA engine with no adapter in the batch (the cost of enabling LoRA alone).
Output tokens per second (wall time of the whole batch, prefill included): each side's median and the ratios to
base. The issue's target: lora / base >= 0.8.

Writes benchmarks/results/lora-<date>.json (date, machine, git revision). Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_model, write_result  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: str, folder: Path, rank: int, seed: int) -> Path:
    """A random LoRA adapter of the model in `model_dir` in PEFT's files (no peft needed to write them)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name in TARGETS:
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            n_in, n_out = shapes[name]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)})
    )
    return folder


def tiny_model(folder: Path) -> Path:
    """A two-layer random Llama with the embedded model's tokenizer (the smoke run's model)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from infer.worker.loading.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    path = folder / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def run_batch(engine, prompts: list[list[int]], max_tokens: int, loras: list[str | None], tag: str) -> float:
    """Output tokens per second of one batch through the engine's step loop."""
    from infer import SamplingParams

    start = time.perf_counter()
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(
            f"{tag}-{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora_name=lora)
        )
    tokens = 0
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.error:
                raise RuntimeError(delta.error)
            tokens += len(delta.token_ids)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory or GGUF (default: the embedded model)")
    parser.add_argument("--random-model", help="a shape of benchmarks/common.py's RANDOM_SHAPES instead")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (a smoke run)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from infer.worker.engine.config import EngineConfig
    from infer.worker.engine.engine import Engine

    work = Path(tempfile.mkdtemp(prefix="infer-lora-bench-"))
    model = args.model
    if args.tiny:
        model = str(tiny_model(work))
    elif args.random_model:
        from infer.worker.loading.model_files import resolve_model

        model = str(random_model(args.random_model, str(resolve_model(None)), Path(__file__).parent / ".peers"))
    from infer.worker.loading.model_files import resolve_model

    model_dir = str(resolve_model(model))
    adapters = {f"a{i}": str(write_adapter(model_dir, work / f"a{i}", args.rank, seed=i)) for i in range(args.adapters)}
    options = dict(
        model=model,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        kv_cache_memory=1 << 30,
        num_threads=args.threads,
        max_num_seqs=max(args.batch, 1),
    )
    base = Engine(EngineConfig(**options))
    lora = Engine(
        EngineConfig(
            **options, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, lora_modules=adapters
        )
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(100, base.vocab_size - 100) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    names = list(adapters)
    sides = {
        "base": (base, [None] * args.batch),
        "lora": (lora, [names[i % len(names)] for i in range(args.batch)]),
        "lora-base-rows": (lora, [None] * args.batch),
    }
    for side, (engine, loras) in sides.items():  # warm-up: kernels built, adapters in their slots
        run_batch(engine, prompts[:2], 2, loras[:2], f"warm-{side}")
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side, (engine, loras) in sides.items():
            # each round's prompts differ in their first token, so the prefix cache serves nothing
            batch = [[(p[0] + r + 1) % base.vocab_size, *p[1:]] for p in prompts]
            rates[side].append(run_batch(engine, batch, args.max_tokens, loras, f"{side}-{r}"))
    medians = {side: statistics.median(v) for side, v in rates.items()}
    ratios = {side: medians[side] / medians["base"] for side in sides if side != "base"}
    print(f"{'side':16} {'tok/s (median)':>14} {'ratio':>7}   rounds")
    for side in sides:
        print(
            f"{side:16} {medians[side]:14.1f} {medians[side] / medians['base']:7.2f}   "
            + " ".join(f"{x:.1f}" for x in rates[side])
        )
    path = write_result(
        "lora",
        {
            "model": model or "embedded SmolLM2-135M-Instruct (Q4_1 GGUF)",
            "dtype": str(base.dtype),
            "batch": args.batch,
            "adapters": args.adapters,
            "rank": args.rank,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "threads": args.threads,
            "tiny": args.tiny,
            "tok_per_s": rates,
            "median_tok_per_s": medians,
            "ratio_to_base": ratios,
            "note": "a smoke run (tiny random model): the ratio means nothing" if args.tiny else "",
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
