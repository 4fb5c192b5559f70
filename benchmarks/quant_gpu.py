"""Weight-only quantized matmul on a CUDA GPU against the HBM floor (kernels/quant_triton.py), in one run:

- copy: a 1 GiB device-to-device copy, the practical peak bandwidth (read + write bytes / time); the H100
  SXM's spec is 3.35 TB/s.
- kernels: a 1B Llama's projections (qkv 3072x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192) at
  M = 1 and 8: GB/s of weight bytes read, as a fraction of the copy bandwidth, for torch's bf16 F.linear and
  each Triton kernel (gemv and dot, q8 and q4, with the planned K splits and with none). Every call reads a
  different copy of the weight (copies totalling >= 200 MB, beyond the 50 MB L2), as decode does; the calls
  of one round are one CUDA graph, timed with CUDA events, median of rounds. Each kernel's output is checked
  against the twin first (relative error in the table).
- decode: batch-1 decode of a 1B-shaped Llama with random weights (hidden 2048, 16 layers, 32 heads, 8 KV
  heads, intermediate 8192, vocab 128256): every linear layer of a token (16 x qkv, o, gate_up, down, and
  the lm_head) at M = 1, captured as one CUDA graph, in bf16 (torch), q8 (symmetric) and q4 (lm_head in the
  same format). Time per token against the HBM floor: the bytes a token must read (the weights plus the KV
  cache at context 128, 4 MiB) over the measured copy bandwidth. Attention, norms and sampling are left out:
  at context 128 they move ~0.2% of the bytes.

    python benchmarks/quant_gpu.py                 # on a CUDA GPU, ~1 minute
    python benchmarks/quant_gpu.py --smoke         # tiny shapes, Triton's interpreter on the CPU: proves the script

Writes benchmarks/results/quant_gpu-<date>.json (date, machine, GPU, git revision, torch / triton versions);
--out DIR writes it under DIR instead. Not a test.
"""

from __future__ import annotations

import sys

if "--smoke" in sys.argv:  # before anything imports infer.kernels: the kernels then run in the interpreter
    import os

    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from infer.kernels._triton import HAS_TRITON, triton  # noqa: E402
from infer.kernels.quant import BLOCK, QuantWeight  # noqa: E402
from infer.kernels.quant_triton import _plan, quant_matmul_torch, quant_matmul_triton  # noqa: E402

H100_SXM_SPEC_GBPS = 3350.0


@dataclass(frozen=True)
class Model:
    """The decode stack's shapes ([N, K] of each linear) and the KV bytes a token reads at context 128."""

    layers: int
    linears: dict[str, tuple[int, int]]
    lm_head: tuple[int, int]
    kv_bytes: int


def llama_1b() -> Model:
    hidden, inter, heads, kv_heads, layers, vocab, context = 2048, 8192, 32, 8, 16, 128256, 128
    head_dim = hidden // heads
    return Model(
        layers,
        {
            "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
            "o": (hidden, hidden),
            "gate_up": (2 * inter, hidden),
            "down": (hidden, inter),
        },
        (vocab, hidden),
        layers * 2 * kv_heads * head_dim * context * 2,
    )


def tiny() -> Model:
    return Model(
        2,
        {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)},
        (512, 64),
        2 * 2 * 2 * 16 * 128 * 2,
    )


# ---------------------------------------------------------------------------------------------------------
# Weights and timing


def random_quant(fmt: str, n: int, k: int, device: str, generator: torch.Generator) -> QuantWeight:
    """Random storage (speed does not depend on the values): q4 with mins, q8 symmetric."""
    blocks = k // BLOCK
    scales = (torch.rand(n, blocks, device=device, generator=generator) * 0.01 + 0.001).half()
    if fmt == "q4":
        qs = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.uint8, generator=generator)
        return QuantWeight("q4", qs, scales, (-8 * scales.float()).half())
    qs = torch.randint(-128, 128, (n, k), device=device, dtype=torch.int8, generator=generator)
    return QuantWeight("q8", qs, scales)


def random_dense(n: int, k: int, device: str, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(n, k, device=device, generator=generator) * 0.02).to(dtype)


def nbytes(weight: torch.Tensor | QuantWeight) -> int:
    return weight.nbytes if isinstance(weight, QuantWeight) else weight.numel() * weight.element_size()


class Timer:
    """Seconds per call of `fn`: on CUDA one CUDA graph of it (eager when capture fails, or when asked), CUDA
    events around `replays` calls, median of `rounds`; on the CPU (--smoke) wall time."""

    def __init__(self, device: str, rounds: int) -> None:
        self.device, self.rounds = device, rounds

    def __call__(self, fn: Callable[[], object], replays: int = 5, graph: bool = True) -> tuple[float, bool]:
        if self.device != "cuda":
            fn()
            times = []
            for _ in range(self.rounds):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times), False
        run, graphed = self._graph(fn) if graph else (fn, False)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / replays)
        return statistics.median(times), graphed

    @staticmethod
    def _graph(fn: Callable[[], object]) -> tuple[Callable[[], object], bool]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles, and warms the allocator outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except Exception as error:  # noqa: BLE001 - report and time eagerly rather than lose the row
            print(f"  (CUDA graph capture failed, timing eagerly: {error})", flush=True)
            torch.cuda.synchronize()
            return fn, False
        return graph.replay, True


def copy_bandwidth(device: str, timer: Timer) -> float:
    """Bytes per second of a device-to-device copy, read + write."""
    size = (1 << 30) if device == "cuda" else (8 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds, _ = timer(lambda: dst.copy_(src))
    return 2 * size / seconds


# ---------------------------------------------------------------------------------------------------------
# Kernels at M = 1 and 8


def _impls() -> list[tuple[str, str, dict]]:
    """(name, format, options of quant_matmul_triton); format "dense" is torch's F.linear on x's dtype."""
    out = [("torch dense", "dense", {})]
    for fmt in ("q8", "q4"):
        for kernel in ("gemv", "dot"):
            out.append((f"{fmt} {kernel}", fmt, {"kernel": kernel}))
            out.append((f"{fmt} {kernel} 1-split", fmt, {"kernel": kernel, "splits": 1}))
    return out


def kernel_table(
    model: Model,
    device: str,
    timer: Timer,
    copy_bps: float,
    rows_list: list[int],
    rotate_bytes: int,
    dtype: torch.dtype,
) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(0)
    table = []
    for name, (n, k) in model.linears.items():
        xs = {m: torch.randn(m, k, device=device, generator=generator).to(dtype) for m in rows_list}
        for fmt in ("dense", "q8", "q4"):
            make = (
                (lambda: random_dense(n, k, device, generator, dtype))
                if fmt == "dense"
                else (lambda: random_quant(fmt, n, k, device, generator))
            )
            first = make()
            count = min(100, max(2, math.ceil(rotate_bytes / nbytes(first))))
            copies = [first] + [make() for _ in range(count - 1)]
            for impl, impl_fmt, options in _impls():
                if impl_fmt != fmt:
                    continue
                for m in rows_list:
                    table.append(_kernel_row(name, n, k, m, impl, fmt, options, xs[m], copies, timer, copy_bps))
            del copies, first
    return table


def _kernel_row(
    name: str,
    n: int,
    k: int,
    m: int,
    impl: str,
    fmt: str,
    options: dict,
    x: torch.Tensor,
    copies: list,
    timer: Timer,
    copy_bps: float,
) -> dict:
    row = {"layer": name, "N": n, "K": k, "M": m, "impl": impl, "copies": len(copies)}
    try:
        if fmt == "dense":

            def call(w):
                return F.linear(x, w)
        else:
            plan = _plan(m, n, k // BLOCK, x.device, options.get("kernel"), options.get("splits"))
            row.update(kernel=plan.kernel, splits=plan.splits)

            def call(w):
                return quant_matmul_triton(x, w, **options)

            ref = quant_matmul_torch(x, copies[0]).float()
            row["rel_err"] = float((call(copies[0]).float() - ref).norm() / ref.norm())
        seconds, graphed = timer(lambda: [call(w) for w in copies])
        per_call = seconds / len(copies)
        weight_bytes = nbytes(copies[0])
        row.update(
            us=per_call * 1e6,
            weight_bytes=weight_bytes,
            GBps=weight_bytes / per_call / 1e9,
            of_copy=weight_bytes / per_call / copy_bps,
            graph=graphed,
        )
        print(
            f"  {name:8s} {n:6d}x{k:<5d} M={m:<2d} {impl:20s} {per_call * 1e6:9.1f} us {row['GBps']:8.0f} GB/s "
            f"{row['of_copy']:6.1%} of copy"
            + (f"  rel err {row['rel_err']:.1e}" if "rel_err" in row else "")
            + (f"  [{row['kernel']}, {row['splits']} splits]" if "splits" in row else ""),
            flush=True,
        )
    except Exception as error:  # noqa: BLE001 - one failing launch must not cost the rest of the run
        row["error"] = f"{type(error).__name__}: {error}"
        print(f"  {name:8s} {n:6d}x{k:<5d} M={m:<2d} {impl:20s} FAILED {row['error'][:300]}", flush=True)
    return row


# ---------------------------------------------------------------------------------------------------------
# Batch-1 decode: the linear layers of a token


def decode_table(model: Model, device: str, timer: Timer, copy_bps: float, dtype: torch.dtype) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(1)
    hidden = model.lm_head[1]
    inputs = {
        k: torch.randn(1, k, device=device, generator=generator).to(dtype)
        for k in {k for _, k in model.linears.values()} | {hidden}
    }
    table = []
    for fmt in ("dense", "q8", "q4"):
        row = {"format": fmt, "dtype": str(dtype).removeprefix("torch.")}
        try:

            def make(n, k):
                return (
                    random_dense(n, k, device, generator, dtype)
                    if fmt == "dense"
                    else random_quant(fmt, n, k, device, generator)
                )

            layers = [{name: make(n, k) for name, (n, k) in model.linears.items()} for _ in range(model.layers)]
            lm_head = make(*model.lm_head)
            if fmt == "dense":

                def linear(x, w):
                    return F.linear(x, w)
            else:

                def linear(x, w):
                    return quant_matmul_triton(x, w)

            def token():
                for layer in layers:
                    for w in layer.values():
                        linear(inputs[w.shape[1]], w)
                return linear(inputs[hidden], lm_head)

            weight_bytes = sum(nbytes(w) for layer in layers for w in layer.values()) + nbytes(lm_head)
            seconds, graphed = timer(token, replays=3)
            eager, _ = timer(token, replays=3, graph=False)
            floor = (weight_bytes + model.kv_bytes) / copy_bps
            row.update(
                ms_per_token=seconds * 1e3,
                eager_ms_per_token=eager * 1e3,
                graph=graphed,
                weight_bytes=weight_bytes,
                kv_bytes=model.kv_bytes,
                floor_ms=floor * 1e3,
                of_floor=floor / seconds,
                tokens_per_s=1 / seconds,
            )
            print(
                f"  {fmt:5s} {weight_bytes / 1e6:8.1f} MB/token  {seconds * 1e3:7.3f} ms/token "
                f"(eager {eager * 1e3:7.3f})  floor {floor * 1e3:7.3f} ms  {floor / seconds:6.1%} of floor  "
                f"{1 / seconds:7.0f} tok/s",
                flush=True,
            )
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {error}"
            print(f"  {fmt:5s} FAILED {row['error'][:300]}", flush=True)
        table.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()
    return table


# ---------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in Triton's interpreter")
    parser.add_argument("--parts", nargs="+", choices=["kernels", "decode"], default=["kernels", "decode"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8], help="M of the kernel table")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", help="folder for the result JSON (default benchmarks/results)")
    args = parser.parse_args()
    if not HAS_TRITON:
        sys.exit("triton is not installed")
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke to check the script on a CPU")
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float16 if args.smoke else torch.bfloat16  # bf16 tl.dot is broken in the interpreter
    model = tiny() if args.smoke else llama_1b()
    timer = Timer(device, 1 if args.smoke else args.rounds)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none (smoke: Triton interpreter on the CPU)"
    print(
        f"{gpu}; torch {torch.__version__}, triton {triton.__version__}; activations and dense weights "
        f"{str(dtype).removeprefix('torch.')}",
        flush=True,
    )
    copy_bps = copy_bandwidth(device, timer)
    print(
        f"copy: {copy_bps / 1e9:.0f} GB/s ({copy_bps / 1e9 / H100_SXM_SPEC_GBPS:.1%} of the H100 SXM's "
        f"{H100_SXM_SPEC_GBPS:.0f} GB/s spec)",
        flush=True,
    )
    payload = {
        "smoke": args.smoke,
        "gpu": gpu,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_GBps": copy_bps / 1e9,
        "h100_sxm_spec_GBps": H100_SXM_SPEC_GBPS,
    }
    if "kernels" in args.parts:
        print("kernels (weight bytes read per call; each call a different copy of the weight):", flush=True)
        payload["kernels"] = kernel_table(
            model, device, timer, copy_bps, args.rows, 0 if args.smoke else 200 << 20, dtype
        )
    if "decode" in args.parts:
        print(
            f"batch-1 decode, linear layers only ({model.layers} layers + lm_head), "
            f"floor = (weights + {model.kv_bytes / 2**20:.1f} MiB KV) / copy bandwidth:",
            flush=True,
        )
        payload["decode"] = decode_table(model, device, timer, copy_bps, dtype)
    if args.out:
        common.RESULTS = Path(args.out)
    path = common.write_result("quant_gpu" + ("-smoke" if args.smoke else ""), payload)
    print(f"wrote {path}", flush=True)
    failed = [r for part in ("kernels", "decode") for r in payload.get(part, []) if "error" in r]
    if failed:
        sys.exit(f"{len(failed)} rows failed (see 'error' in the JSON)")


if __name__ == "__main__":
    main()
