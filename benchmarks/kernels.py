"""Kernel benchmarks: the PyTorch twins on CPU, the Triton kernels' achieved bandwidth on a CUDA GPU.

CPU (always): SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head dim 64, 30 layers, block 16,
bf16). Per decode step (30 layers) at batch 1, 16, 64 and context 128-2048, three formulations in the same
run:
  twin      infer.kernels.paged_attention.paged_decode_attention_torch (the engine's CPU path)
  previous  the engine's path before the kernels: [blocks, bs, Hkv, D] pool, whole-batch gather,
            transpose, SDPA
  plain     infer.kernels.reference: one sequence at a time, the simplest correct formulation
plus the KV append twin against plain advanced-index assignment.

GPU (when CUDA is available): the device's copy bandwidth and bf16 matmul rate first, then decode attention
and KV append at batch 64-256, context 1k-32k, head dim 128, bf16: achieved bandwidth = bytes the kernel
must move / time, as a fraction of the measured copy bandwidth, and decode attention against SDPA on the
same data laid out dense.

Before / after (--w1-before REV): the engine's offline throughput on --workload (W1: 64 x 128 prompt, 128 out;
B1: one request, 128 -> 128, batch-1 decoding) in each of --dtypes (bf16 by default), at git revision REV and at the working tree, each in its own
process, alternating for --w1-rounds rounds (medians compared).

    .venv/bin/python benchmarks/kernels.py                         # CPU table (and GPU when present)
    .venv/bin/python benchmarks/kernels.py --w1-before 31df831     # + W1 before/after
    .venv/bin/python benchmarks/kernels.py --no-cpu --w1-before main --workload B1   # batch 1 only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import git_revision, write_result  # noqa: E402

from infer.kernels.dispatch import kernels_for  # noqa: E402
from infer.kernels.kv_append import append_kv_torch  # noqa: E402
from infer.kernels.paged_attention import (  # noqa: E402
    paged_decode_attention_torch,
    plan_decode,
)
from infer.kernels.reference import paged_attention_reference  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS, BLOCK_SIZE = 9, 3, 64, 30, 16
REPO = Path(__file__).resolve().parent.parent


def _time_cpu(fn, min_time: float = 0.3, repeats: int = 5) -> float:
    """Median seconds per call over `repeats` rounds of at least `min_time` each."""
    fn()
    rounds = []
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time / repeats:
                break
        rounds.append(elapsed / n)
    return statistics.median(rounds)


def _decode_case(
    batch: int,
    context: int,
    dtype: torch.dtype,
    device: str,
    num_kv_heads: int = NUM_KV_HEADS,
    num_heads: int = NUM_HEADS,
    head_dim: int = HEAD_DIM,
    seed: int = 0,
):
    """A pool with `batch` sequences of `context` tokens in random blocks, and one query each."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 8
    k_cache = torch.randn(num_kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=generator).to(dtype).to(device)
    v_cache = torch.randn(num_kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=generator).to(dtype).to(device)
    tables = torch.randperm(num_blocks, generator=generator)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    q = torch.randn(batch, num_heads, head_dim, generator=generator).to(dtype).to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables.to(torch.int32).to(device), seq_lens


def _previous_engine_decode(q, old_k, old_v, tables, seq_lens, scale):
    """The engine's decode path before the kernels: token-major pool [blocks, bs, Hkv, D], one gather of
    whole blocks for the batch, transpose to [B, Hkv, L, D], SDPA with the GQA group as query rows."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = old_k.shape[2]
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // old_k.shape[1])
    flat = tables[:, :num_blocks].flatten()
    keys = old_k.view(old_k.shape[0], -1).index_select(0, flat).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = (
        old_v.view(old_v.shape[0], -1).index_select(0, flat).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    )
    valid = torch.arange(keys.shape[2])[None, :] < seq_lens[:, None]
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=valid[:, None, None, :], scale=scale)


def cpu_decode_table(batches: list[int], contexts: list[int]) -> list[dict]:
    rows = []
    scale = HEAD_DIM**-0.5
    for batch in batches:
        for context in contexts:
            q, k_cache, v_cache, tables, seq_lens = _decode_case(batch, context, torch.bfloat16, "cpu")
            old_k = k_cache.permute(1, 2, 0, 3).contiguous()  # [blocks, bs, Hkv, D], same contents
            old_v = v_cache.permute(1, 2, 0, 3).contiguous()
            starts = torch.arange(batch + 1, dtype=torch.int32)
            # the engine plans the twin's tiles once per step and every layer reuses the plan
            plan = plan_decode(tables, seq_lens, k_cache)
            twin = (
                _time_cpu(lambda: paged_decode_attention_torch(q, k_cache, v_cache, tables, seq_lens, scale, plan=plan))
                + _time_cpu(lambda: plan_decode(tables, seq_lens, k_cache)) / NUM_LAYERS
            )
            previous = _time_cpu(lambda: _previous_engine_decode(q, old_k, old_v, tables, seq_lens, scale))
            plain = _time_cpu(lambda: paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, starts, scale))
            row = {
                "batch": batch,
                "context": context,
                "twin_step_ms": twin * NUM_LAYERS * 1e3,
                "previous_step_ms": previous * NUM_LAYERS * 1e3,
                "plain_step_ms": plain * NUM_LAYERS * 1e3,
                "plain_over_twin": plain / twin,
                "previous_over_twin": previous / twin,
            }
            rows.append(row)
            print(
                f"decode  B={batch:3d} ctx={context:5d}  twin {row['twin_step_ms']:8.2f} ms/step  "
                f"previous {row['previous_step_ms']:8.2f} ({row['previous_over_twin']:.2f}x)  "
                f"plain {row['plain_step_ms']:8.2f} ({row['plain_over_twin']:.2f}x)",
                flush=True,
            )
    return rows


def cpu_append_table(token_counts: list[int]) -> list[dict]:
    rows = []
    for tokens in token_counts:
        generator = torch.Generator().manual_seed(tokens)
        num_blocks = 4096
        k_cache = torch.zeros(NUM_KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM, dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).bfloat16()
        v = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).bfloat16()
        slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=generator)[:tokens]
        blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE

        def plain():
            k_cache[:, blocks, offsets] = k.transpose(0, 1)
            v_cache[:, blocks, offsets] = v.transpose(0, 1)

        twin = _time_cpu(lambda: append_kv_torch(k, v, k_cache, v_cache, slots))
        base = _time_cpu(plain)
        rows.append(
            {
                "tokens": tokens,
                "twin_step_ms": twin * NUM_LAYERS * 1e3,
                "plain_step_ms": base * NUM_LAYERS * 1e3,
                "plain_over_twin": base / twin,
            }
        )
        print(
            f"append  T={tokens:5d}  twin {twin * NUM_LAYERS * 1e3:7.3f} ms/step  plain "
            f"{base * NUM_LAYERS * 1e3:7.3f} ({base / twin:.2f}x)",
            flush=True,
        )
    return rows


# ---------------------------------------------------------------------------------------------------------
# GPU


def _time_cuda(fn, repeats: int = 20) -> float:
    """Median seconds per call, CUDA events around each call after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gpu_tables() -> dict:
    device = "cuda"
    kernels = kernels_for(device)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    copy_s = _time_cuda(lambda: dst.copy_(big))
    copy_bw = 2 * big.numel() / copy_s  # read + write
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    matmul_s = _time_cuda(lambda: a @ a)
    matmul_flops = 2 * 8192**3 / matmul_s
    del big, dst, a
    print(f"gpu: copy {copy_bw / 1e9:.0f} GB/s, bf16 matmul {matmul_flops / 1e12:.0f} TFLOP/s", flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "bf16_matmul_TFLOPs": matmul_flops / 1e12,
        "decode": [],
        "append": [],
    }
    heads, kv_heads, head_dim, scale = 32, 8, 128, 128**-0.5
    for batch in (64, 256):
        for context in (1024, 8192, 32768):
            if batch * context * kv_heads * head_dim * 2 * 2 > 24 << 30:  # K + V over 24 GiB: skip
                continue
            q, k_cache, v_cache, tables, seq_lens = _decode_case(
                batch, context, torch.bfloat16, device, kv_heads, heads, head_dim
            )
            seconds = _time_cuda(lambda: kernels.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale))
            moved = 2 * batch * context * kv_heads * head_dim * 2 + 2 * q.numel() * 2
            dense_k = torch.randn(batch, kv_heads, context, head_dim, dtype=torch.bfloat16, device=device)
            dense_v = torch.randn_like(dense_k)
            dense_q = q.view(batch, heads, 1, head_dim)
            sdpa = _time_cuda(
                lambda: F.scaled_dot_product_attention(dense_q, dense_k, dense_v, scale=scale, enable_gqa=True)
            )
            row = {
                "batch": batch,
                "context": context,
                "ms": seconds * 1e3,
                "GBps": moved / seconds / 1e9,
                "fraction_of_copy": moved / seconds / copy_bw,
                "sdpa_dense_ms": sdpa * 1e3,
                "sdpa_over_kernel": sdpa / seconds,
            }
            result["decode"].append(row)
            print(
                f"decode B={batch} ctx={context}: {row['ms']:.3f} ms, {row['GBps']:.0f} GB/s "
                f"({row['fraction_of_copy']:.0%} of copy), SDPA dense {row['sdpa_dense_ms']:.3f} ms",
                flush=True,
            )
            del q, k_cache, v_cache, dense_k, dense_v
            torch.cuda.empty_cache()
    for tokens in (256, 4096, 65536):
        k_cache = torch.zeros(kv_heads, 65536, BLOCK_SIZE, head_dim, dtype=torch.bfloat16, device=device)
        v_cache = torch.zeros_like(k_cache)
        k = torch.randn(tokens, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
        v = torch.randn_like(k)
        slots = torch.randperm(65536 * BLOCK_SIZE, device=device)[:tokens]
        seconds = _time_cuda(lambda: kernels.append_kv(k, v, k_cache, v_cache, slots))
        moved = 2 * 2 * k.numel() * 2 + slots.numel() * 8
        row = {
            "tokens": tokens,
            "ms": seconds * 1e3,
            "GBps": moved / seconds / 1e9,
            "fraction_of_copy": moved / seconds / copy_bw,
        }
        result["append"].append(row)
        print(
            f"append T={tokens}: {row['ms']:.4f} ms, {row['GBps']:.0f} GB/s ({row['fraction_of_copy']:.0%})", flush=True
        )
    return result


# ---------------------------------------------------------------------------------------------------------
# W1 before / after


def _w1_child(
    python_path: str | None, workload: str = "W1", dtype: str = "bfloat16", threads: int | None = None
) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if python_path:
        env["PYTHONPATH"] = python_path
    # throughput.py and common.py from a folder of their own: with benchmarks/ on sys.path, this file would
    # answer transformers' probe for a package named `kernels`
    helpers = Path(tempfile.mkdtemp(prefix="w1-"))
    for name in ("throughput.py", "common.py"):
        shutil.copy(Path(__file__).parent / name, helpers / name)
    peers = Path(__file__).resolve().parent / ".peers"  # the dense model, converted once, not once per child
    peers.mkdir(exist_ok=True)
    (helpers / ".peers").symlink_to(peers)
    code = (
        "import sys, json; sys.path.insert(0, %r); import throughput, infer; throughput.THREADS = %r; "
        "from common import make_workload; from transformers import AutoConfig; "
        "p = throughput.model_dir(); w = make_workload(%r, AutoConfig.from_pretrained(p).vocab_size); "
        "r = throughput.run_infer(p, %r, w); r['tok_per_s'] = w.output_tokens / r['elapsed_s']; "
        "r['infer_from'] = infer.__file__; print('RESULT ' + json.dumps(r))"
    ) % (str(helpers), threads, workload, dtype)
    # cwd outside the repository, whose kernels/ folder would answer the same probe
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600, cwd=tempfile.gettempdir()
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": f"exit {proc.returncode}", "log_tail": (proc.stdout + proc.stderr)[-2000:]}


def w1_before_after(
    revision: str, rounds: int, workload: str = "W1", dtype: str = "bfloat16", threads: int | None = None
) -> dict:
    """`workload` (W1 or B1) in `dtype` at `revision` (a git worktree, imported as `infer` through a PYTHONPATH shim) and here,
    alternating for `rounds` rounds: this VM's throughput drifts by 10-20% between runs minutes apart, so
    one before/after pair can mislead; the medians are compared."""
    before, after = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), revision], cwd=REPO, check=True, capture_output=True
        )
        try:
            shim = Path(tmp) / "shim"
            shim.mkdir()
            package = tree / "src" / "infer"  # the src layout; a revision before it is the package at its root
            (shim / "infer").symlink_to(package if package.is_dir() else tree)
            for i in range(rounds):
                pair = [("before", str(shim), before), ("after", None, after)]
                for name, path, samples in pair if i % 2 == 0 else pair[::-1]:
                    samples.append(_w1_child(path, workload, dtype, threads))
                    print(
                        f"{workload} {dtype} round {i + 1} {name}: {samples[-1].get('tok_per_s', float('nan')):.1f} tok/s",
                        flush=True,
                    )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    medians = {
        name: statistics.median(r.get("tok_per_s", float("nan")) for r in samples)
        for name, samples in (("before", before), ("after", after))
    }
    print(
        f"{workload} {dtype} medians of {rounds}: before ({revision}) {medians['before']:.1f} tok/s, "
        f"after {medians['after']:.1f} tok/s ({medians['after'] / medians['before']:.2f}x)",
        flush=True,
    )
    return {
        "revision_before": revision,
        "workload": workload,
        "dtype": dtype,
        "threads": threads,
        "rounds": rounds,
        "before": before,
        "after": after,
        "median_tok_per_s": medians,
        "after_over_before": medians["after"] / medians["before"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--w1-before", metavar="REV", help="also measure W1 throughput at REV and here")
    parser.add_argument("--w1-rounds", type=int, default=3, help="alternating before/after rounds")
    parser.add_argument("--workload", default="W1", choices=["W1", "B1"], help="the before/after workload")
    parser.add_argument(
        "--dtypes", nargs="+", default=["bfloat16"], help="the before/after dtypes, one after the other"
    )
    parser.add_argument("--threads", type=int, help="the before/after engines' torch threads (default: the engine's)")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU tables")
    args = parser.parse_args()
    torch.manual_seed(0)
    payload: dict = {"revision": git_revision(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if not args.no_cpu:
        payload["cpu_decode"] = cpu_decode_table(args.batches, args.contexts)
        payload["cpu_append"] = cpu_append_table([1, 64, 2048])
    if torch.cuda.is_available():
        payload["gpu"] = gpu_tables()
    else:
        payload["gpu"] = None
        print("no CUDA device: GPU tables skipped", flush=True)
    if args.w1_before:
        for dtype in args.dtypes:
            key = "w1" if args.workload == "W1" and dtype == "bfloat16" else f"{args.workload.lower()}_{dtype}"
            payload[key] = w1_before_after(args.w1_before, args.w1_rounds, args.workload, dtype, args.threads)
    print("wrote", write_result("kernels", payload))


if __name__ == "__main__":
    main()
