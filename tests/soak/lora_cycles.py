"""Soak: LoRA adapter load / unload cycles on an idle worker; its resident memory must stay flat. A program (not a
test, not in CI; tests/cluster/test_lora_hardening.py runs 40 cycles in CI).

1. A coordinator and one infer-worker --enable-lora on a tiny random Llama (hidden 64, 2 layers, SmolLM2's
   tokenizer), and a PEFT adapter on all seven projections of rank --rank (512: about 4 MiB of fp32 weights).
2. --cycles load + unload cycles through an InferenceClient (the administrator's path: LoraCommand to every
   worker), no request between them; the worker's VmRSS read after each unload.
3. Verdict: the worker's RSS after the last cycle is within --tolerance (10%) of its RSS before the first
   (issue 43: 287 cycles of a 5 MB adapter added 2,142 MiB to each worker: the unloaded weights waited for a
   forward step that never came).

    .venv/bin/python tests/soak/lora_cycles.py                 # 1,000 cycles
    .venv/bin/python tests/soak/lora_cycles.py --cycles 100    # a proof run

Prints a table and writes benchmarks/results/lora-cycles-<UTC time>.json (date, machine, git revision).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `soak`, `lora_cases` import as a script
from cluster.conftest import Cluster  # noqa: E402 - after the path
from lora_cases import ALL_TARGETS, load_unload_cycles, make_adapter  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

from infer.client.inference_client import InferenceClient  # noqa: E402
from soak.harness import read_memory_kb, write_result  # noqa: E402


def make_tiny_llama(folder: Path) -> Path:
    """tests/conftest.py's tiny "llama" with SmolLM2's tokenizer, saved in `folder`."""
    from transformers import AutoTokenizer

    from infer.worker.loading.model_files import resolve_model

    return save_tiny_model("llama", folder, AutoTokenizer.from_pretrained(str(resolve_model(None))))


async def cycle(address: str, adapter: Path, cycles: int, pid: int) -> tuple[int, list[int], float]:
    """(RSS before, RSS after each cycle, seconds) of the worker `pid`, in bytes."""
    async with InferenceClient(address, connect_timeout=30) as client:
        await client.wait_for_workers(1, timeout=300)
        before = read_memory_kb(pid)[0] * 1024
        started = time.monotonic()
        samples = await load_unload_cycles(client, "soak", adapter, cycles, lambda: read_memory_kb(pid)[0] * 1024)
        return before, samples, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--rank", type=int, default=512, help="the adapter's rank (its size grows with it)")
    parser.add_argument("--tolerance", type=float, default=0.10, help="the RSS growth allowed, relative")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lora-cycles-") as tmp:
        root = Path(tmp)
        model = make_tiny_llama(root / "tiny-llama")
        adapter = root / "adapter"
        make_adapter(model, adapter, 1, r=args.rank, lora_alpha=args.rank, target_modules=ALL_TARGETS)
        size = (adapter / "adapter_model.safetensors").stat().st_size
        cluster = Cluster(logs=root)
        try:
            cluster.coordinator()
            worker = cluster.worker(
                0,
                "--dtype",
                "float32",
                "--max-model-len",
                "256",
                "--kv-cache-memory",
                "8000000",
                "--threads",
                "1",
                "--enable-lora",
                "--max-lora-rank",
                str(args.rank),
                model=model,
            )
            before, samples, seconds = asyncio.run(cycle(cluster.address, adapter, args.cycles, worker.popen.pid))
        except BaseException:
            print(cluster.dump(), file=sys.stderr)
            raise
        finally:
            cluster.teardown()
    mib = 2**20
    growth = samples[-1] - before
    flat = growth <= args.tolerance * before
    every = max(1, args.cycles // 10)
    print(f"{args.cycles} cycles of a {size / mib:.1f} MiB adapter (rank {args.rank}) in {seconds:.0f} s")
    print(f"{'cycle':>6} {'worker RSS MiB':>15}")
    print(f"{0:>6} {before / mib:>15.1f}")
    for i in range(every - 1, args.cycles, every):
        print(f"{i + 1:>6} {samples[i] / mib:>15.1f}")
    print(
        f"growth {growth / mib:+.1f} MiB ({100 * growth / before:+.1f}%), limit {100 * args.tolerance:.0f}%: ", end=""
    )
    print("flat" if flat else "NOT FLAT")
    path = write_result(
        "lora-cycles",
        {
            "cycles": args.cycles,
            "adapter_bytes": size,
            "rank": args.rank,
            "seconds": round(seconds, 1),
            "rss_before_bytes": before,
            "rss_after_bytes": samples[-1],
            "rss_max_bytes": max(samples),
            "rss_median_bytes": statistics.median(samples),
            "rss_every_bytes": samples[every - 1 :: every],
            "growth_fraction": round(growth / before, 4),
            "tolerance": args.tolerance,
            "memory_flat": flat,
        },
    )
    print(f"wrote {path}")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
