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

# 2026-11-30, a whole run of 4100f7d in the checkout (warm caches) on a 2-core Zen 3 VM (AVX2), nothing else running: the
# seconds are relative weights, not a budget.
FILE_SECONDS: dict[str, float] = {
    "tests/deploy/test_slurm.py": 231,
    "tests/cluster/test_pipeline_parallel.py": 189,
    "tests/cluster/test_disaggregated.py": 183,
    "tests/cluster/test_tensor_parallel.py": 182,
    "tests/worker/test_quantized_gguf.py": 106,
    "tests/cluster/test_drain_moves.py": 102,
    "tests/cluster/test_training_loop.py": 97,
    "tests/cluster/test_structured_outputs.py": 85,
    "tests/worker/test_families.py": 77,
    "tests/cluster/test_images_cluster.py": 76,
    "tests/cluster/test_self_healing.py": 76,
    "tests/worker/test_native_decode.py": 71,
    "tests/worker/test_pipeline_parallel.py": 68,
    "tests/cluster/test_expert_parallel.py": 68,
    "tests/client/test_family_entry_points.py": 65,
    "tests/worker/test_engine.py": 64,
    "tests/worker/test_speculative.py": 61,
    "tests/cluster/test_kv_routing.py": 60,
    "tests/cluster/test_coordinator_restart.py": 60,
    "tests/worker/test_encoder_decoder.py": 56,
    "tests/cluster/test_encdec_cluster.py": 53,
    "tests/cluster/test_peer_limits.py": 48,
    "tests/worker/test_sliding_window_models.py": 47,
    "tests/cluster/test_serve.py": 46,
    "tests/worker/test_qwen2_vl.py": 43,
    "tests/cluster/test_faults.py": 42,
    "tests/worker/test_images_tensor_parallel.py": 42,
    "tests/kernels/test_sliding_window.py": 42,
    "tests/worker/test_lora.py": 41,
    "tests/examples/test_rl_loop.py": 39,
    "tests/cluster/test_deepseek_moe_cluster.py": 39,
    "tests/kernels/test_paged_attention.py": 39,
    "tests/cluster/test_speculative_groups.py": 38,
    "tests/client/test_http_front.py": 37,
    "tests/kernels/test_cpu_kernels.py": 36,
    "tests/cluster/test_direct_streams.py": 36,
    "tests/cluster/test_gpt_oss_cluster.py": 35,
    "tests/worker/test_engine_kernels.py": 34,
    "tests/worker/test_tensor_parallel.py": 32,
    "tests/worker/test_worker_imports.py": 30,
    "tests/cluster/test_sliding_window_cluster.py": 29,
    "tests/worker/test_fp8_checkpoints.py": 29,
    "tests/client/test_api_params.py": 29,
    "tests/cluster/test_chaos.py": 29,
    "tests/client/test_demo.py": 28,
    "tests/worker/test_step_graphs.py": 28,
    "tests/worker/test_daemon.py": 27,
    "tests/cluster/test_traces.py": 27,
    "tests/cluster/test_several_coordinators.py": 26,
    "tests/worker/test_resume.py": 26,
    "tests/cluster/test_openai_front.py": 26,
    "tests/client/test_chat_images.py": 26,
    "tests/cluster/test_security.py": 26,
    "tests/cluster/test_hostile_prompts.py": 26,
    "tests/kernels/test_native_softcap_sinks.py": 25,
    "tests/cluster/test_families_cluster.py": 25,
    "tests/client/test_llm.py": 25,
    "tests/worker/test_refit.py": 24,
    "tests/worker/test_structured_outputs.py": 24,
    "tests/client/test_spmd.py": 24,
    "tests/worker/test_expert_parallel.py": 23,
    "tests/client/test_model_defaults.py": 23,
    "tests/worker/test_images_speculative.py": 23,
    "tests/cluster/test_http_health.py": 23,
    "tests/cluster/test_speculative_faults.py": 21,
    "tests/worker/test_gguf.py": 20,
    "tests/worker/test_model.py": 20,
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
