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

# 2026-11-29, a 2-core Zen 3 VM (AVX2) under other load: the seconds are relative weights, not a budget. test_engine,
# test_quantized_gguf, test_gguf and kernels/test_sliding_window: that run's figures scaled by what their cuts saved
# (branch suite-trim, measured file by file, alone). 2026-11-30: test_native_decode and test_engine scaled again by
# the CPU seconds their files took alone before and after short OpenMP spins (conftest) and test_engine's smaller
# preemption case (294 -> 97 and ~311 -> 114). Later on 2026-11-30: the files whose cases were cut or merged
# (test_step_graphs, the cluster family files, test_images_cluster, test_engine, test_slurm, test_faults) less the
# seconds of what they dropped in the cold-cache run of 43656f7.
FILE_SECONDS: dict[str, float] = {
    "tests/deploy/test_slurm.py": 235,
    "tests/cluster/test_pipeline_parallel.py": 242,
    "tests/worker/test_quantized_gguf.py": 217,
    "tests/cluster/test_tensor_parallel.py": 204,
    "tests/worker/test_speculative.py": 153,
    "tests/cluster/test_disaggregated.py": 150,  # new: 124 s of -n 2 wall with test_kv_routing, loaded
    "tests/cluster/test_coordinator_restart.py": 131,
    "tests/worker/test_sliding_window_models.py": 90,  # step graphs: one bucket for the mixed model (-35 s)
    "tests/cluster/test_structured_outputs.py": 123,
    "tests/client/test_family_entry_points.py": 121,
    "tests/cluster/test_drain_moves.py": 120,  # new: its tests alone (-n 0), 2026-11-30, loaded
    "tests/cluster/test_encdec_cluster.py": 120,  # new: ~120 s alone (-n 0) on the loaded shared 2-core Zen 3
    "tests/worker/test_native_decode.py": 118,
    "tests/worker/test_engine.py": 80,
    "tests/cluster/test_self_healing.py": 111,
    "tests/cluster/test_sliding_window_cluster.py": 75,
    "tests/kernels/test_sliding_window.py": 105,
    "tests/worker/test_pipeline_parallel.py": 105,
    "tests/kernels/test_paged_attention.py": 104,
    "tests/cluster/test_training_loop.py": 103,
    "tests/kernels/test_cpu_kernels.py": 101,
    "tests/cluster/test_deepseek_moe_cluster.py": 75,
    "tests/worker/test_families.py": 60,  # step graphs: one bucket a family (154 -> 45 s of a cold-cache run)
    "tests/cluster/test_faults.py": 85,
    "tests/worker/test_gguf.py": 97,
    "tests/kernels/test_quant.py": 96,
    "tests/kernels/test_native_softcap_sinks.py": 94,
    "tests/cluster/test_gpt_oss_cluster.py": 80,
    "tests/worker/test_engine_kernels.py": 89,
    "tests/worker/test_fp8_checkpoints.py": 88,
    "tests/worker/test_refit.py": 87,
    "tests/worker/test_worker_imports.py": 85,
    "tests/cluster/test_http_health.py": 84,
    "tests/cluster/test_expert_parallel.py": 84,
    "tests/worker/test_step_graphs.py": 50,  # one model's buckets (-70 s of a cold run)
    "tests/cluster/test_peer_limits.py": 78,
    "tests/worker/test_lora.py": 74,
    "tests/client/test_demo.py": 72,
    "tests/worker/test_resume.py": 72,
    "tests/worker/test_encoder_decoder.py": 70,  # new: ~70 s alone (-n 0), same machine
    "tests/cluster/test_speculative_groups.py": 66,
    "tests/cluster/test_images_cluster.py": 125,  # LLaVA, Qwen2-VL, Gemma 3: 216 s alone (-n 0), loaded
    "tests/worker/test_gemma3_vision.py": 30,
    "tests/worker/test_images_tensor_parallel.py": 25,  # new: ~30 s alone (-n 0), loaded  # new: 22 s of test time alone (-n 0), quiet
    "tests/worker/test_qwen2_vl.py": 60,  # new: 59 s of test time alone (-n 0), loaded
    "tests/cluster/test_serve.py": 57,
    "tests/examples/test_rl_loop.py": 56,
    "tests/worker/test_expert_parallel.py": 55,
    "tests/cluster/test_security.py": 54,
    "tests/client/test_http_front.py": 53,
    "tests/worker/test_daemon.py": 53,
    "tests/cluster/test_openai_front.py": 51,
    "tests/worker/test_structured_outputs.py": 51,
    "tests/cluster/test_lora_cluster.py": 51,
    "tests/cluster/test_families_cluster.py": 35,
    "tests/cluster/test_traces.py": 44,
    "tests/worker/test_phi3.py": 30,  # its shared checks moved to test_families
    "tests/kernels/test_sampling.py": 42,
    "tests/client/test_spmd.py": 41,
    "tests/client/test_model_defaults.py": 41,
    "tests/worker/test_awq_gptq.py": 40,
    "tests/worker/test_model.py": 37,
    "tests/client/test_inference_client.py": 36,
    "tests/worker/test_rust_tokenizer.py": 33,
    "tests/kernels/test_softcap.py": 33,
    "tests/worker/test_quantized.py": 32,
    "tests/client/test_api_params.py": 31,
    "tests/client/test_beam_search_api.py": 31,
    "tests/client/test_async_llm.py": 30,
    "tests/client/test_llm.py": 29,
    "tests/cluster/test_chaos.py": 27,
    "tests/cluster/test_direct_streams.py": 27,
    "tests/cluster/test_hostile_prompts.py": 25,
    "tests/worker/test_tensor_parallel.py": 24,
    "tests/kernels/test_rotary.py": 24,
    "tests/cluster/test_speculative_faults.py": 24,
    "tests/cluster/test_vllm_flags.py": 23,
    "tests/deploy/test_grafana_dashboard.py": 23,
    "tests/cluster/test_several_coordinators.py": 23,
    "tests/worker/test_beam_search.py": 22,
    "tests/cluster/test_lora_hardening.py": 20,
    "tests/worker/test_llava.py": 20,  # new: 12-20 s alone (-n 0)
    "tests/client/test_chat_images.py": 36,  # LLaVA and Qwen2-VL: 36 s alone (-n 0), loaded
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


if __name__ == "__main__":
    with open(sys.argv[1]) as log:
        print("FILE_SECONDS = " + json.dumps(seconds_by_file(log), indent=4))
