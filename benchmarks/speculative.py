"""Speculative decoding (n-gram / prompt lookup) on vs off, in the same run: batch-1 tok/s and offline batch 64;
llama.cpp's prompt-lookup decoding (`llama-lookup`) on the same GGUF and prompts as the peer.

    .venv/bin/python benchmarks/speculative.py --llama-cpp-bin $LLAMA_CPP_BIN   # everything, bf16, embedded model
    .venv/bin/python benchmarks/speculative.py --parts batch1 --workloads rewrite --k 5 --rounds 5
    .venv/bin/python benchmarks/speculative.py --model BIG --draft-model SMALL    # a draft model instead of n-grams

- batch1: one request at a time on two engines of the same weights, one with `speculative_config` and one
  without, requests alternating between them (A, B, A, B, ...: what survives a shared, noisy machine); each
  side's median tok/s (output tokens / wall time of the request, prefill included) per workload, and the ratio.
  Workloads: "rewrite" (repeat a given passage of two paragraphs, longer than the output, so that the output is
  the rewrite throughout: drafts copied from the prompt can be right), "code" (rewrite a given function with one
  name changed), "continue" (go on with a passage that repeats itself), "random" (random prompt tokens: drafts
  are mostly wrong, the cost of trying). Chat-formatted where the tokenizer has a template. Greedy, so the two sides must give the same tokens (checked: "same_tokens").
- the peer (with `--llama-cpp-bin`, or $LLAMA_CPP_BIN): llama.cpp's `llama-lookup` example (prompt lookup over
  n-grams of 1..4 tokens, its fixed LLAMA_NGRAM_MIN / _MAX, drafting up to `--spec-draft-n-max` = our k) on the
  GGUF our engine reads (`--peer-gguf` when --model is not one), greedy (`--temp 0`), EOS ignored, the same
  threads, context 4096, a fresh lookup cache each run: third in each round of the alternation. Compared on
  decode tok/s, defined alike: the tokens after the first over the time after the first (ours: from the step
  that gave the first token to the end; its: (generated - 1) / its "decoded ... in T seconds", the loop after
  its prompt encoding, whose logits give the first token). Not on the whole request: the rounds repeat one
  prompt (the warm-up's), so ours comes from the prefix cache while llama-lookup encodes it every run (its
  e2e tok/s, encoding included, is recorded too). "ratio_vs_llama_cpp": our speculative decode tok/s over its.
  It reads the prompt as text (chat-formatted as ours; the random workload's ids decoded), so its prompt token
  count is recorded beside ours; its acceptance too; it stops up to k tokens past -n, so its generated count
  is recorded as well. Build it in the tree llamacpp.py builds: `cmake --build build --target llama-lookup`.
- offline: W1 (64 x 128 -> 128, greedy, random prompts) through LLM.generate on each engine, rounds alternating;
  with the default `disable_by_batch_size` (8) speculation switches itself off at this batch size, so the ratio
  should be ~1 (what must not regress).
Each result carries the acceptance counters (drafts, draft tokens, accepted, by position) and the proposal hit rate
(the share of the speculating side's steps after each request's first token that had drafts to verify); batch-1
results also the verification steps the native CPU decode step ran ("native_verification_steps") and those that
replayed step graphs ("graph_verification_replays": CUDA graphs, the default on a GPU).

Writes benchmarks/results/speculative-<date>.json (date, machine, git revision). Not a test.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RANDOM_SHAPES, make_workload, random_model, write_result  # noqa: E402

from infer.worker.loading.tokenizer import transformers_tokenizer  # noqa: E402

KV_BYTES = 1 << 30
MODEL: str | None = None  # --model / --random-model; None: the embedded model

PASSAGE = (
    "The river ran high that spring. Every morning the ferryman checked the ropes, counted the planks and "
    "wrote the water level in a small notebook he kept in his coat. By April the notebook was full, and the "
    "village council asked him to read it aloud at the meeting, page by page, so that everyone would know "
    "how close the water had come to the mill."
)
# the rewrite workload's second paragraph: the passage alone is shorter than the 128 tokens asked for (the
# embedded model rewrites it in ~75 and then, EOS ignored, starts a conversation of its own, with nothing to copy)
SEQUEL = (
    "In May the water fell again. The ferryman mended the torn rope, painted the landing stage green and "
    "bought a new notebook at the market in town. He wrote the date on the first page, then the level of the "
    "river, then the names of the passengers he carried across that morning: the baker, the schoolteacher, "
    "two boys with a dog, and an old woman who paid him with a loaf of bread."
)
CODE = """def moving_average(values, window):
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
"""
TEXTS = {
    "rewrite": f"Repeat the following passage exactly, word for word.\n\n{PASSAGE}\n\n{SEQUEL}",
    "code": f"Rewrite this Python function with the parameter `values` renamed to `samples`. Output only the "
    f"code.\n\n```python\n{CODE}```",
    "continue": f"{PASSAGE}\n\n{PASSAGE}\n\n{PASSAGE[:200]}",
}


def _engine(dtype: str, spec: dict | None, threads: int | None):
    from infer.worker.engine.config import EngineConfig
    from infer.worker.engine.engine import Engine

    return Engine(
        EngineConfig(
            model=MODEL,
            dtype=dtype,
            max_model_len=4096,
            kv_cache_memory=KV_BYTES,
            num_threads=threads,
            speculative_config=spec,
        )
    )


def _prompt(engine, workload: str, rng: random.Random) -> tuple[list[int], str]:
    """The workload's prompt: our token ids, and the text they come from (the peer's prompt)."""
    tokenizer = transformers_tokenizer(engine.tokenizer)  # a chat template: transformers'
    if workload == "random":
        ids = [rng.randrange(100, engine.vocab_size - 100) for _ in range(128)]
        return ids, tokenizer.decode(ids)
    text = TEXTS[workload]
    if getattr(tokenizer, "chat_template", None) and workload != "continue":
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(chat, add_special_tokens=False)["input_ids"], chat
    return tokenizer(text)["input_ids"], text


def _one(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """(the tokens, the request's seconds, its decode tok/s: the tokens after the first over the time after it)."""
    from infer import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    start = time.perf_counter()
    first_at, first = start, 0
    while engine.has_unfinished():
        for delta in engine.step():
            if not tokens and delta.token_ids:
                first_at, first = time.perf_counter(), len(delta.token_ids)
            tokens += delta.token_ids
    end = time.perf_counter()
    return tokens, end - start, (len(tokens) - first) / max(end - first_at, 1e-9)


class LlamaLookup:
    """llama.cpp's `llama-lookup` on `gguf`: one greedy request per call, k drafts (module docstring)."""

    TIMEOUT_S = 600

    def __init__(self, bin_dir: Path, gguf: Path, k: int, threads: int | None) -> None:
        self.exe = bin_dir / "llama-lookup"
        if not self.exe.is_file():
            raise SystemExit(
                f"{self.exe} not found: build it in llama.cpp's build folder with "
                f"`cmake --build build --target llama-lookup`"
            )
        import torch

        self.gguf, self.k = gguf, k
        self.threads = threads or torch.get_num_threads()  # ours: torch's threads, when --threads is not given

    def run(self, text: str, max_tokens: int) -> dict:
        with tempfile.TemporaryDirectory() as folder:
            prompt = Path(folder) / "prompt.txt"
            prompt.write_text(text)
            cmd = [
                str(self.exe),
                "-m",
                str(self.gguf),
                "-f",
                str(prompt),
                "-n",
                str(max_tokens - 1),  # it makes n+1
                "--spec-draft-n-max",
                str(self.k),
                "-t",
                str(self.threads),
                "--temp",
                "0",
                "--ignore-eos",
                "-c",
                "4096",
                "-lcd",
                str(Path(folder) / "cache.bin"),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.TIMEOUT_S, errors="replace")
        if done.returncode != 0:
            raise RuntimeError(f"llama-lookup exited {done.returncode}: {done.stderr[-2000:]}")
        return _lookup_figures(done.stderr)


def _lookup_figures(log: str) -> dict:
    """What llama-lookup's log says: prompt tokens, generated tokens, encode / decode seconds, drafted, accepted."""

    def grab(pattern: str) -> list[str]:
        found = re.search(pattern, log)
        if found is None:
            raise RuntimeError(f"llama-lookup's log has no {pattern!r}: {log[-2000:]}")
        return list(found.groups())

    prompt_tokens, encode_s = grab(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
    tokens, decode_s = grab(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
    (drafted,), (accepted,) = grab(r"n_drafted\s+=\s+(\d+)"), grab(r"n_accept\s+=\s+(\d+)")
    return {
        "prompt_tokens": int(prompt_tokens),
        "tokens": int(tokens),
        "seconds": float(encode_s) + float(decode_s),
        "decode_tok_per_s": (int(tokens) - 1) / float(decode_s),
        "draft_tokens": int(drafted),
        "accepted_tokens": int(accepted),
    }


def _native_verifications(engine) -> int:
    """Verification steps the native CPU decode step ran (worker/models/native_decode.py; 0 where it does not
    serve the model)."""
    decoder = getattr(getattr(engine.model, "model", None), "native_decode", None)
    return getattr(decoder, "verification_steps", 0) if decoder else 0


def _graph_verifications(engine) -> int:
    """Verification steps that replayed a step graph (worker/engine/step_graphs.py: CUDA graphs on a GPU; 0 where the
    engine runs eagerly, a CPU's default)."""
    graphs = engine.runner.step_graphs
    return graphs.verification_replays if graphs is not None else 0


def _counters(engine) -> dict:
    s = engine.stats
    return {
        "native_verification_steps": _native_verifications(engine),
        "graph_verification_replays": _graph_verifications(engine),
        "drafts": s.spec_decode_num_drafts,
        "draft_tokens": s.spec_decode_num_draft_tokens,
        "accepted_tokens": s.spec_decode_num_accepted_tokens,
        "accepted_per_position": list(s.spec_decode_num_accepted_tokens_per_pos),
        "acceptance_rate": s.spec_decode_num_accepted_tokens / max(1, s.spec_decode_num_draft_tokens),
    }


def batch1(
    dtype: str,
    spec: dict,
    workloads: list[str],
    rounds: int,
    max_tokens: int,
    threads: int | None,
    peer: LlamaLookup | None,
) -> dict:
    engines = {"plain": _engine(dtype, None, threads), "speculative": _engine(dtype, spec, threads)}
    rng = random.Random(0)
    result = {}
    for workload in workloads:
        prompts = [_prompt(engines["plain"], workload, rng) for _ in range(rounds)]
        for name, engine in engines.items():  # warm-up (kernels built, first-step costs) outside the timing
            _one(engine, f"warm-{workload}-{name}", prompts[0][0], 4)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        decode_rates: dict[str, list[float]] = {name: [] for name in engines}
        same = True
        before = _counters(engines["speculative"])
        theirs, generated = [], 0
        for i, (prompt, text) in enumerate(prompts):
            outputs = {}
            for name, engine in engines.items():
                outputs[name], seconds, decode = _one(engine, f"{workload}-{i}-{name}", prompt, max_tokens)
                generated += len(outputs[name]) if name == "speculative" else 0
                rates[name].append(len(outputs[name]) / seconds)
                decode_rates[name].append(decode)
            same = same and outputs["plain"] == outputs["speculative"]
            if peer is not None:
                theirs.append(peer.run(text, max_tokens))
        after = _counters(engines["speculative"])
        r = {
            name: {
                "tok_per_s": statistics.median(v),
                "rounds": v,
                "decode_tok_per_s": statistics.median(decode_rates[name]),
            }
            for name, v in rates.items()
        }
        r["ratio"] = r["speculative"]["tok_per_s"] / r["plain"]["tok_per_s"]
        r["same_tokens"] = same
        r["prompt_tokens"] = len(prompts[0][0])
        r["acceptance"] = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
        # steps that verified through the native CPU decode step (a new decoder after a weight change starts at 0)
        for key in ("native_verification_steps", "graph_verification_replays"):
            r[key] = max(0, after[key] - before[key])
        r["acceptance"]["rate"] = r["acceptance"]["accepted_tokens"] / max(1, r["acceptance"]["draft_tokens"])
        per_pos = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"] + [0] * 16)]
        r["acceptance"]["accepted_per_position"] = per_pos
        # the share of the speculating engine's steps after each first token that had drafts to verify
        steps = generated - rounds - r["acceptance"]["accepted_tokens"]
        r["acceptance"]["proposal_hit_rate"] = r["acceptance"]["drafts"] / max(1, steps)
        line = (
            f"batch1 {dtype} {workload}: plain {r['plain']['tok_per_s']:.1f} tok/s, speculative "
            f"{r['speculative']['tok_per_s']:.1f} tok/s ({r['ratio']:.2f}x), acceptance "
            f"{r['acceptance']['rate']:.2f}, same tokens {same}"
        )
        if theirs:
            r["llama_cpp_lookup"] = _peer_result(theirs)
            r["ratio_vs_llama_cpp"] = r["speculative"]["decode_tok_per_s"] / r["llama_cpp_lookup"]["decode_tok_per_s"]
            line += (
                f"; decode: ours {r['speculative']['decode_tok_per_s']:.1f} tok/s, llama.cpp lookup "
                f"{r['llama_cpp_lookup']['decode_tok_per_s']:.1f} tok/s, ours / theirs "
                f"{r['ratio_vs_llama_cpp']:.2f}x (its acceptance {r['llama_cpp_lookup']['acceptance_rate']:.2f})"
            )
        result[workload] = r
        print(line, flush=True)
    return result


def _peer_result(runs: list[dict]) -> dict:
    drafted, accepted = sum(r["draft_tokens"] for r in runs), sum(r["accepted_tokens"] for r in runs)
    rates = [r["tokens"] / r["seconds"] for r in runs]
    return {
        "tok_per_s": statistics.median(rates),
        "rounds": rates,
        "decode_tok_per_s": statistics.median(r["decode_tok_per_s"] for r in runs),
        "prompt_tokens": runs[0]["prompt_tokens"],
        "tokens": runs[0]["tokens"],
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / max(1, drafted),
    }


def offline(dtype: str, spec: dict, rounds: int, threads: int | None) -> dict:
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
            speculative_config=spec if name == "speculative" else None,
        )
        for name in ("plain", "speculative")
    }
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
    print(
        f"offline W1 {dtype}: plain {result['plain']['tok_per_s']:.1f} tok/s, speculative "
        f"{result['speculative']['tok_per_s']:.1f} tok/s ({result['ratio']:.2f}x), same tokens "
        f"{result['same_tokens']}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["batch1", "offline"], choices=["batch1", "offline"])
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["rewrite", "code", "continue", "random"],
        choices=["rewrite", "code", "continue", "random"],
    )
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens of each batch-1 request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--model", help="a safetensors model directory or .gguf (default: the embedded model)")
    parser.add_argument(
        "--draft-model", help="speculate with this draft model (method draft_model) instead of n-gram lookup"
    )
    parser.add_argument(
        "--random-model",
        choices=sorted(RANDOM_SHAPES),
        help="a random-weight Llama of this shape, made with --tokenizer's tokenizer",
    )
    parser.add_argument("--tokenizer", help="the tokenizer folder of --random-model")
    parser.add_argument(
        "--llama-cpp-bin",
        type=Path,
        default=os.environ.get("LLAMA_CPP_BIN"),
        help="llama.cpp's build/bin with llama-lookup: the peer, on batch1 (default: $LLAMA_CPP_BIN; neither: no peer)",
    )
    parser.add_argument(
        "--peer-gguf",
        type=Path,
        help="the GGUF llama-lookup reads (default: --model when it is a .gguf, else the embedded model's)",
    )
    args = parser.parse_args()
    global MODEL
    if args.random_model:
        if not args.tokenizer:
            parser.error("--random-model needs --tokenizer")
        MODEL = str(random_model(args.random_model, args.tokenizer, Path(tempfile.gettempdir())))
    else:
        MODEL = args.model
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
    }
    if args.draft_model:
        spec = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k}
    peer = None
    if args.llama_cpp_bin and "batch1" in args.parts:
        gguf = args.peer_gguf or _model_gguf(parser)
        peer = LlamaLookup(args.llama_cpp_bin, gguf, args.k, args.threads)
    results: dict = {
        "threads": args.threads,
        "speculative_config": spec,
        "load_avg_start": os.getloadavg(),
        "peer": None
        if peer is None
        else {
            "llama_cpp_lookup": str(peer.exe),
            "gguf": str(peer.gguf),
            "ngram_min_max": [1, 4],
            "draft_max": args.k,
            "threads": peer.threads,
        },
    }
    for dtype in args.dtypes:
        if "batch1" in args.parts:
            results.setdefault("batch1", {})[dtype] = batch1(
                dtype, spec, args.workloads, args.rounds, args.max_tokens, args.threads, peer
            )
        if "offline" in args.parts:
            results.setdefault("offline_W1", {})[dtype] = offline(dtype, spec, args.rounds, args.threads)
    results["load_avg_end"] = os.getloadavg()
    model = args.random_model and f"random {args.random_model}" or MODEL or "SmolLM2-135M-Instruct"
    out = write_result("speculative", {"model": model, **results})
    print("wrote", out)


def _model_gguf(parser: argparse.ArgumentParser) -> Path:
    """The GGUF our engine reads (the peer's file): --model's, or the embedded model's."""
    if MODEL is None:
        from infer.worker.loading.model_files import default_model_gguf

        return default_model_gguf()
    if MODEL.endswith(".gguf"):
        return Path(MODEL)
    parser.error("the peer reads a GGUF: give --peer-gguf (the same weights as --model)")


if __name__ == "__main__":
    main()
