"""The order the test files start in: the slowest first, so that under pytest-xdist (deploy/local/test.sh: `-n 2
--dist loadfile --no-loadscope-reorder`) the run does not end with one process working through a long file while
the others wait. xdist's own order (most tests first) put the few long tests of the Slurm, pipeline and coordinator
restart files last. FILE_SECONDS holds each slow file's seconds of test time from one whole run; the files it does
not name keep their collection order after those it names.

Regenerate after the suite's shape changes, from a run that lists every duration:
    bash deploy/local/test.sh --durations=0 > run.log; .venv/bin/python tests/file_durations.py run.log
which prints the new FILE_SECONDS to paste here (files of 20 s or more)."""

from __future__ import annotations

import collections
import json
import re
import sys

# 2026-11-30, a fresh clone of 07c5722 with empty model and compile caches on a 2-core Zen 3 VM (AVX2), nothing else
# running: the seconds are relative weights, not a budget.
FILE_SECONDS: dict[str, float] = {
    "tests/deploy/test_slurm.py": 256,
    "tests/cluster/test_pipeline_parallel.py": 253,
    "tests/cluster/test_disaggregated.py": 134,
    "tests/cluster/test_tensor_parallel.py": 127,
    "tests/cluster/test_drain_moves.py": 105,
    "tests/worker/test_quantized_gguf.py": 104,
    "tests/cluster/test_structured_outputs.py": 102,
    "tests/worker/test_speculative.py": 93,
    "tests/client/test_family_entry_points.py": 90,
    "tests/worker/test_native_decode.py": 90,
    "tests/worker/test_step_graphs.py": 89,
    "tests/worker/test_families.py": 86,
    "tests/cluster/test_images_cluster.py": 85,
    "tests/cluster/test_self_healing.py": 79,
    "tests/worker/test_engine.py": 75,
    "tests/cluster/test_coordinator_restart.py": 72,
    "tests/worker/test_sliding_window_models.py": 70,
    "tests/kernels/test_sliding_window.py": 66,
    "tests/cluster/test_encdec_cluster.py": 64,
    "tests/worker/test_gguf.py": 62,
    "tests/cluster/test_training_loop.py": 59,
    "tests/cluster/test_expert_parallel.py": 58,
    "tests/worker/test_encoder_decoder.py": 56,
    "tests/worker/test_worker_imports.py": 55,
    "tests/kernels/test_paged_attention.py": 55,
    "tests/worker/test_pipeline_parallel.py": 47,
    "tests/cluster/test_faults.py": 46,
    "tests/cluster/test_peer_limits.py": 45,
    "tests/cluster/test_families_cluster.py": 44,
    "tests/worker/test_refit.py": 44,
    "tests/cluster/test_deepseek_moe_cluster.py": 43,
    "tests/cluster/test_speculative_groups.py": 42,
    "tests/cluster/test_sliding_window_cluster.py": 40,
    "tests/examples/test_rl_loop.py": 40,
    "tests/cluster/test_http_health.py": 38,
    "tests/cluster/test_direct_streams.py": 36,
    "tests/cluster/test_gpt_oss_cluster.py": 35,
    "tests/cluster/test_kv_routing.py": 34,
    "tests/cluster/test_serve.py": 33,
    "tests/worker/test_tensor_parallel.py": 32,
    "tests/worker/test_lora.py": 32,
    "tests/cluster/test_chaos.py": 32,
    "tests/kernels/test_cpu_kernels.py": 32,
    "tests/kernels/test_quant.py": 31,
    "tests/client/test_chat_images.py": 31,
    "tests/cluster/test_security.py": 31,
    "tests/worker/test_expert_parallel.py": 30,
    "tests/client/test_api_params.py": 30,
    "tests/client/test_http_front.py": 29,
    "tests/cluster/test_traces.py": 29,
    "tests/worker/test_resume.py": 28,
    "tests/worker/test_engine_kernels.py": 28,
    "tests/client/test_demo.py": 27,
    "tests/cluster/test_hostile_prompts.py": 27,
    "tests/worker/test_fp8_checkpoints.py": 26,
    "tests/worker/test_qwen2_vl.py": 26,
    "tests/worker/test_daemon.py": 26,
    "tests/client/test_spmd.py": 26,
    "tests/client/test_llm.py": 26,
    "tests/worker/test_images_tensor_parallel.py": 26,
    "tests/cluster/test_several_coordinators.py": 25,
    "tests/client/test_model_defaults.py": 24,
    "tests/kernels/test_native_softcap_sinks.py": 24,
    "tests/worker/test_structured_outputs.py": 23,
}


def order_key(nodeid: str) -> float:
    """Sort key of a test id: its file's recorded seconds, negated (slowest first; unknown files 0)."""
    return -FILE_SECONDS.get(nodeid.split("::", 1)[0], 0.0)


def seconds_by_file(log_lines) -> dict[str, float]:
    seconds: collections.Counter[str] = collections.Counter()
    for line in log_lines:
        match = re.match(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+?)::", line)
        if match:
            seconds[match[2]] += float(match[1])
    return {name: round(total) for name, total in seconds.most_common() if total >= 20}


def cpu_summary(cpu_by_file: dict[str, float], top: int = 25) -> str:
    """The `top` costliest files by CPU seconds (tests/conftest.py counts them), and the whole run's total."""
    total = sum(cpu_by_file.values())
    costliest = sorted(cpu_by_file.items(), key=lambda pair: -pair[1])[:top]
    lines = [f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}" for path, seconds in costliest]
    return "\n".join([*lines, f"{total:8.1f}s in all, {len(cpu_by_file)} files"])


if __name__ == "__main__":
    with open(sys.argv[1]) as log:
        print("FILE_SECONDS = " + json.dumps(seconds_by_file(log), indent=4))
