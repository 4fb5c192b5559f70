"""What a static, fixed-shape latency mode could buy over the dynamic engine: per decode step, the dynamic engine's
whole step against the part any engine must run (the model's forward and its logits), measured inside the same
steps, at batch 1 and batch N.

A static engine (Megatron's StaticInferenceEngine, a fixed batch run to the end with fixed shapes) saves the
dynamic engine's bookkeeping: scheduling, building the step's batch, the sampler's general path, detokenizing and
output processing. It cannot save the forward. So `step / (forward + logits)` bounds from above what it could gain:
1.00 would mean nothing to gain. Both sides are timed inside the same steps (a wrapper around the runner's forward
and logits), so the ratio survives a noisy machine that moves every absolute figure.

Workload: `--batch` requests (128-token prompts, greedy, ignore_eos), prefilled first; then `--steps` pure-decode
steps are measured. On the embedded model's file (Q4_1) and on its dense copy (common.dense_model_dir: float32
safetensors, run in the engine's default dtype), each with the engine's defaults (what `infer-worker` runs: on a CPU
the native decode step) and with step graphs forced on (`enforce_eager=False`; the JSON's `step_graphs` says whether
the engine made them: a model whose linears are native quantized kernels cannot be compiled, and runs eagerly).

    .venv/bin/python benchmarks/static_mode.py [--batch 1 8 32] [--steps 40]

Writes benchmarks/results/static_mode-<date>.json (date, machine, git revision). Not a test.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import dense_model_dir, write_result

from infer.protocol.sampling import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

PROMPT = 128


def measure(model: str | None, batch: int, steps: int, enforce_eager: bool | None) -> dict:
    config = EngineConfig(model=model, max_model_len=1024, max_num_seqs=max(batch, 8), enforce_eager=enforce_eager)
    engine = Engine(config)
    runner = engine.runner
    inner: list[float] = []  # seconds of forward + logits in the current step
    forward, logits = runner._forward, runner._logits

    def timed(fn):
        def call(*args, **kwargs):
            began = time.perf_counter()
            out = fn(*args, **kwargs)
            inner.append(time.perf_counter() - began)
            return out

        return call

    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(PROMPT)], params)
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    graphs = runner.step_graphs
    if graphs is not None:  # a replayed graph runs the forward and logits inside it: time the replay
        graphs.run = timed(graphs.run)
    runner._forward, runner._logits = timed(forward), timed(logits)
    whole, model = [], []
    for _ in range(steps):
        inner.clear()
        began = time.perf_counter()
        engine.step()
        whole.append(time.perf_counter() - began)
        model.append(sum(inner))
    engine.close()
    step_ms, model_ms = statistics.median(whole) * 1e3, statistics.median(model) * 1e3
    ratios = [w / m for w, m in zip(whole, model) if m > 0]
    return {
        "dtype": str(engine.dtype).removeprefix("torch."),
        "batch": batch,
        "step_graphs": graphs is not None,
        "step_ms_median": round(step_ms, 3),
        "forward_logits_ms_median": round(model_ms, 3),
        "bookkeeping_ms_median": round(statistics.median(w - m for w, m in zip(whole, model)) * 1e3, 3),
        "step_over_forward_median": round(statistics.median(ratios), 4),
        "tok_s_dynamic": round(batch / (step_ms / 1e3), 1),
        "tok_s_static_bound": round(batch / (model_ms / 1e3), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    runs = []
    for model_name, model in (("embedded (Q4_1)", None), ("dense copy", str(dense_model_dir()))):
        for enforce_eager in (None, False):
            for batch in args.batch:
                r = measure(model, batch, args.steps, enforce_eager)
                r["model"] = model_name
                r["engine"] = "defaults" if enforce_eager is None else "step graphs asked"
                runs.append(r)
                print(
                    f"{model_name}, {r['engine']} (made: {r['step_graphs']}), {r['dtype']}, batch {batch:>3}: "
                    f"step {r['step_ms_median']:.2f} ms, forward + logits "
                    f"{r['forward_logits_ms_median']:.2f} ms, bookkeeping {r['bookkeeping_ms_median']:.2f} ms, "
                    f"step / forward {r['step_over_forward_median']:.3f}  ({r['tok_s_dynamic']:.0f} tok/s; a static "
                    f"engine at best {r['tok_s_static_bound']:.0f})",
                    flush=True,
                )
    path = write_result("static_mode", {"config": {"prompt": PROMPT, "steps": args.steps}, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
