"""The collective cost of tensor parallelism per engine step, so that the GPU figure can be predicted.

    .venv/bin/python benchmarks/tp_collectives.py                      # T=2 on this machine (gloo, CPU)
    .venv/bin/python benchmarks/tp_collectives.py --tokens 1 64 --models llama-1b

A TP step runs, per decoder layer, two all-reduces of the [tokens, hidden] activations (after o_proj and
after down_proj; MoE layers: after the experts instead), plus one all-reduce after the vocab-parallel
embedding and one gather of the sampled rows' logits ([sequences, vocab / T] per rank) on TP rank 0. This
program measures, on T processes joined with gloo (NCCL on a GPU: --device cuda), the median time of one
all-reduce of each step's shape and of the logits gather, for model shapes from benchmarks/common.py, and
reports bytes and time per layer and per step. On a 2-core CPU, T=2 cannot beat T=1 (the two processes
share the cores): the figures there are the collective's cost only. With --device cuda and a lent GPU,
`--step` also times one decode step of a random model at T=1 and T=2 (one process per GPU).

Writes benchmarks/results/tp_collectives-<date>.json (date, machine, git revision). Not a test.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RANDOM_SHAPES, write_result  # noqa: E402

VOCAB = 49152


def _median_s(fn, repeats: int) -> float:
    for _ in range(3):  # warm-up
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank_main(rank: int, size: int, port: int, cases: list[dict], device: str, repeats: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, False)  # the one measure() hosts
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")

    def synced(fn):
        def run():
            fn()
            if device == "cuda":
                torch.cuda.synchronize()

        return run

    out = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        x = torch.randn(case["tokens"], case["hidden"], dtype=dtype, device=dev)
        logits = torch.randn(case["sequences"], case["vocab"] // size, dtype=torch.float32, device=dev)
        parts = [torch.empty_like(logits) for _ in range(size)] if rank == 0 else None
        dist.barrier()
        reduce_s = _median_s(synced(lambda: dist.all_reduce(x)), repeats)
        dist.barrier()
        gather_s = _median_s(synced(lambda: dist.gather(logits, parts, dst=0)), repeats)
        out.append({**case, "all_reduce_s": reduce_s, "gather_s": gather_s})
    results.put((rank, out))
    dist.destroy_process_group()


def measure(size: int, cases: list[dict], device: str, repeats: int) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # the OS's port, held until the end
    procs = [
        ctx.Process(target=_rank_main, args=(r, size, store.port, cases, device, repeats, results)) for r in range(size)
    ]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return got[0]  # rank 0's view (it waits for the slowest member)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-1b"], choices=sorted(RANDOM_SHAPES))
    p.add_argument(
        "--tokens",
        nargs="+",
        type=int,
        default=[1, 8, 64, 256],
        help="tokens per step (a decode batch of N sequences: N tokens)",
    )
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--note", default="", help="recorded with the result (e.g. how loaded the machine was)")
    args = p.parse_args()
    cases = [
        dict(
            model=m,
            hidden=RANDOM_SHAPES[m]["hidden_size"],
            layers=RANDOM_SHAPES[m]["num_hidden_layers"],
            vocab=VOCAB,
            tokens=n,
            sequences=min(n, 64),
            dtype=d,
        )
        for m in args.models
        for d in args.dtypes
        for n in args.tokens
    ]
    rows = measure(args.tp_size, cases, args.device, args.repeats)
    print(
        f"T={args.tp_size} on {args.device} ({'gloo' if args.device == 'cpu' else 'nccl'}); per layer: 2 all-reduces "
        f"of [tokens, hidden]; per step: + 1 (embedding) + the logits gather"
    )
    print(
        f"{'model':14} {'dtype':9} {'tokens':>6} {'AR bytes':>9} {'AR us':>8} {'per layer us':>12} "
        f"{'gather us':>9} {'per step ms':>11}"
    )
    for row in rows:
        size = 2 if row["dtype"] in ("bfloat16", "float16") else 4
        row["all_reduce_bytes"] = row["tokens"] * row["hidden"] * size
        row["per_layer_s"] = 2 * row["all_reduce_s"]
        row["per_step_s"] = (2 * row["layers"] + 1) * row["all_reduce_s"] + row["gather_s"]
        print(
            f"{row['model']:14} {row['dtype']:9} {row['tokens']:>6} {row['all_reduce_bytes']:>9} "
            f"{row['all_reduce_s'] * 1e6:>8.1f} {row['per_layer_s'] * 1e6:>12.1f} {row['gather_s'] * 1e6:>9.1f} "
            f"{row['per_step_s'] * 1e3:>11.2f}"
        )
    path = write_result(
        "tp_collectives",
        {"tp_size": args.tp_size, "device": args.device, "repeats": args.repeats, "note": args.note, "rows": rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
