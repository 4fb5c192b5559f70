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

# 2026-12-01, a whole run of acadd2e in the checkout (warm caches) on a 2-core Zen 3 VM (AVX2), nothing else running: the
# seconds are relative weights, not a budget.
FILE_SECONDS: dict[str, float] = {
    "tests/deploy/test_slurm.py": 193,
    "tests/cluster/test_disaggregated.py": 92,
    "tests/worker/test_quantized_gguf.py": 87,
    "tests/cluster/test_pipeline_parallel.py": 80,
    "tests/cluster/test_tensor_parallel.py": 68,
    "tests/cluster/test_self_healing.py": 66,
    "tests/cluster/test_drain_moves.py": 65,
    "tests/cluster/test_structured_outputs.py": 64,
    "tests/worker/test_native_decode.py": 60,
    "tests/client/test_family_entry_points.py": 59,
    "tests/cluster/test_images_cluster.py": 56,
    "tests/cluster/test_whisper_cluster.py": 55,  # added with Whisper (its own run, not a whole one)
    "tests/worker/test_speculative.py": 54,
    "tests/worker/test_engine.py": 46,
    "tests/worker/test_encoder_decoder.py": 45,
    "tests/worker/test_families.py": 44,
    "tests/cluster/test_serve.py": 44,
    "tests/cluster/test_peer_limits.py": 41,
    "tests/cluster/test_training_loop.py": 40,
    "tests/cluster/test_encdec_cluster.py": 39,
    "tests/cluster/test_security.py": 39,
    "tests/cluster/test_coordinator_restart.py": 38,
    "tests/cluster/test_direct_streams.py": 36,
    "tests/kernels/test_paged_attention.py": 35,
    "tests/cluster/test_drain_moves_ep.py": 34,  # added 2026-12-01 from runs of the file alone, not a whole run
    "tests/worker/test_refit.py": 34,
    "tests/worker/test_lora.py": 34,
    "tests/examples/test_rl_loop.py": 34,
    "tests/worker/test_images_tensor_parallel.py": 32,
    "tests/worker/test_pipeline_parallel.py": 32,
    "tests/worker/test_sliding_window_models.py": 31,
    "tests/client/test_worker_forks.py": 31,
    "tests/kernels/test_sliding_window.py": 29,
    "tests/kernels/test_cpu_kernels.py": 29,
    "tests/worker/test_structured_outputs.py": 28,
    "tests/worker/test_tensor_parallel.py": 27,
    "tests/cluster/test_expert_parallel.py": 27,
    "tests/cluster/test_several_coordinators.py": 27,
    "tests/client/test_api_params.py": 27,
    "tests/client/test_http_front.py": 26,
    "tests/worker/test_whisper.py": 20,  # added with Whisper (its own run, not a whole one)
    "tests/cluster/test_chaos.py": 26,
    "tests/worker/test_engine_kernels.py": 25,
    "tests/cluster/test_deepseek_moe_cluster.py": 25,
    "tests/cluster/test_families_cluster.py": 24,
    "tests/worker/test_resume.py": 24,
    "tests/kernels/test_native_softcap_sinks.py": 24,
    "tests/worker/test_daemon.py": 24,
    "tests/client/test_spmd.py": 24,
    "tests/worker/test_expert_parallel.py": 23,
    "tests/worker/test_fp8_checkpoints.py": 23,
    "tests/cluster/test_traces.py": 23,
    "tests/worker/test_qwen2_vl.py": 22,
    "tests/cluster/test_faults.py": 21,
    "tests/client/test_demo.py": 21,
    "tests/client/test_chat_images.py": 21,
    "tests/cluster/test_openai_front.py": 21,
    "tests/client/test_model_defaults.py": 20,
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
