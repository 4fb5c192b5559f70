"""Streamed-weight bandwidth of the quantized matmul (kernels/cpu/quant.c) on SmolLM2-135M's matrices, per ISA build.

A decode step at batch 1-8 is a walk through every weight byte, so its speed is the bandwidth at which the matmul
streams W. Each case cycles through copies of one matrix totalling COPIES_BYTES (past the last-level cache), calls
quant_matmul on the next copy each time, and reports weight bytes per second (qs + scales + mins) and the time per
call; torch's F.linear on the dense bf16 weight (oneDNN) runs the same way, and a sum over one large tensor gives
the machine's read bandwidth. Builds: kernels/cpu/quant.c compiled here with -march=native / x86-64-v3 / x86-64
(those this CPU runs). Prints a table, writes benchmarks/results/quant_gemv-<date>.json with the load average.
Indicative only on a shared machine: keep --seconds short. On the busy 2-core dev VM, 2-thread runs with OpenMP's
default (spinning) waits lost whole scheduler slices per call, for gemv.c's bf16 GEMV as for this kernel; use
--threads 1, or OMP_WAIT_POLICY=passive for the 2-thread picture (torch's F.linear runs under the same policy).

    .venv/bin/python benchmarks/quant_gemv.py [--seconds 0.2] [--rows 1 4 8] [--formats q4 q8]
        [--builds native x86-64-v3 x86-64] [--matrices ...]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from infer.kernels import cpu_kernels  # noqa: E402
from infer.kernels.quant import QuantWeight, bind, quant_matmul, quantize  # noqa: E402

# SmolLM2-135M's matrices, [N, K]
MATRICES = {
    "o_proj 576x576": (576, 576),
    "qkv 576->960": (960, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 49152x576": (49152, 576),
}
BUILD_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=fast")  # cpu_kernels.FLAGS
MARCHES = {"native": (), "x86-64-v3": ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"), "x86-64": ()}
COPIES_BYTES = 192 << 20


def builds(out: Path, names: list[str]) -> dict[str, ctypes.CDLL]:
    flags, libs = set(cpu_kernels._cpu_flags().split()), {}
    source = Path(cpu_kernels.__file__).resolve().parent / "cpu" / "quant.c"
    for march, needs in MARCHES.items():
        if march in names and set(needs) <= flags:
            target = out / f"quant-{march}.so"
            subprocess.run(
                [
                    cpu_kernels._compiler() or "cc",
                    *BUILD_FLAGS,
                    f"-march={march}",
                    "-o",
                    str(target),
                    str(source),
                    "-lm",
                ],
                check=True,
                timeout=120,
            )
            libs[march] = bind(ctypes.CDLL(str(target)))
    return libs


def copies_of(weight: QuantWeight, nbytes: int) -> list[QuantWeight]:
    count = max(2, COPIES_BYTES // nbytes)
    return [QuantWeight(weight.format, *(t.clone() for t in weight.tensors().values())) for _ in range(count)]


def seconds_per_call(call, items: list, budget: float) -> float:
    """Median over 5 rounds of the mean time of calls cycling through items (each round at least budget / 5)."""
    call(items[0])
    rounds = []
    for _ in range(5):
        calls, start = 0, time.perf_counter()
        while True:
            call(items[calls % len(items)])
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= budget / 5 and calls >= len(items):
                break
        rounds.append(elapsed / calls)
    return sorted(rounds)[2]


def read_bandwidth() -> float:
    big = torch.ones(64 << 20)  # 256 MB
    big.sum()
    start, repeats = time.perf_counter(), 4
    for _ in range(repeats):
        big.sum()
    return big.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=0.2, help="time per case")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--formats", nargs="+", default=["q4", "q8"])
    parser.add_argument("--builds", nargs="+", default=list(MARCHES), choices=list(MARCHES))
    parser.add_argument("--matrices", nargs="+", default=list(MATRICES), choices=list(MATRICES))
    parser.add_argument("--threads", type=int, default=None, help="torch's (and the kernel's) threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_out, sum_gbs = [], read_bandwidth()
    print(f"torch sum over 256 MB: {sum_gbs:.1f} GB/s; {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        libs = builds(Path(tmp), args.builds)
        print(f"{'matrix':20s} {'M':>2s} {'what':16s} {'us/call':>9s} {'GB/s':>6s} {'vs bf16':>8s}")
        for name in args.matrices:
            n, k = MATRICES[name]
            dense = torch.randn(n, k) / k**0.5
            linear_weights = [dense.to(torch.bfloat16) for _ in range(max(2, COPIES_BYTES // (n * k * 2)))]
            quantized = {fmt: quantize(dense, fmt) for fmt in args.formats}
            copies = {fmt: copies_of(weight, weight.nbytes) for fmt, weight in quantized.items()}
            for m in args.rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                t_bf16 = seconds_per_call(lambda w: F.linear(x, w), linear_weights, args.seconds)
                cases = [("torch bf16", n * k * 2, t_bf16)]
                for fmt, weight in quantized.items():
                    for march, lib in libs.items():
                        t = seconds_per_call(lambda w, lib=lib: quant_matmul(x, w, lib=lib), copies[fmt], args.seconds)
                        cases.append((f"{fmt} {march}", weight.nbytes, t))
                for what, nbytes, t in cases:
                    row = {
                        "matrix": name,
                        "n": n,
                        "k": k,
                        "rows": m,
                        "what": what,
                        "weight_bytes": nbytes,
                        "us_per_call": t * 1e6,
                        "gb_per_s": nbytes / t / 1e9,
                        "speedup_vs_bf16": t_bf16 / t,
                    }
                    rows_out.append(row)
                    print(
                        f"{name:20s} {m:2d} {what:16s} {t * 1e6:9.1f} {row['gb_per_s']:6.1f} "
                        f"{row['speedup_vs_bf16']:7.2f}x"
                    )
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    path = write_result(
        "quant_gemv",
        {
            "git_head": head,
            "load_average": os.getloadavg(),
            "cpu_flags": cpu_kernels._cpu_flags().split(),
            "threads": torch.get_num_threads(),
            "torch_sum_gb_per_s": sum_gbs,
            "seconds_per_case": args.seconds,
            "rows": rows_out,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
