"""Where a decode step's time goes: W1's shape (64 sequences, 128-token prompts) on SmolLM2.

    .venv/bin/python benchmarks/profile_step.py [--dtype bfloat16] [--steps 20]

Prefills 64 requests, then profiles `--steps` pure-decode engine steps with torch.profiler and prints the
top operators plus the share of the step spent in the model forward, sampling and Python bookkeeping.
"""

from __future__ import annotations

import argparse
import random
import time

from torch.profiler import ProfilerActivity, profile, record_function

from infer import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    engine = Engine(EngineConfig(dtype=args.dtype, max_model_len=2048))
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(args.prompt)], params)
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()

    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    per_step = (time.perf_counter() - start) / args.steps
    print(
        f"decode step, batch {args.batch}, {args.dtype}: {per_step * 1e3:.1f} ms -> {args.batch / per_step:.0f} tok/s"
    )

    runner_execute = engine.runner.execute
    model_forward = engine.model.forward

    def timed_execute(chunks):
        with record_function("runner.execute"):
            return runner_execute(chunks)

    def timed_forward(*a, **k):
        with record_function("model.forward"):
            return model_forward(*a, **k)

    engine.runner.execute = timed_execute
    engine.model.forward = timed_forward
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with record_function("engine.step"):
                engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    totals = {
        e.key: e.cpu_time_total
        for e in prof.key_averages()
        if e.key in ("engine.step", "runner.execute", "model.forward")
    }
    step = totals.get("engine.step", 1)
    for key, value in totals.items():
        print(f"{key:16s} {value / args.steps / 1e3:8.1f} ms/step  {100 * value / step:5.1f}%")


if __name__ == "__main__":
    main()
