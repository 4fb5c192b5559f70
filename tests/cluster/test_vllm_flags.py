"""vLLM's flag names (protocol/options.py: VLLM_ALIASES, VLLM_REFUSED) on the daemons, started as the README starts
them: an alias means what our flag means; a vLLM flag without an equivalent stops the command at once with the
reason (exit 2), unless its value means what infer does anyway."""

from __future__ import annotations

import subprocess
import sys

import pytest
from serve_harness import Served

from infer.client import InferenceClient
from infer.client.serve import build_parser, worker_args
from infer.worker.service.cli import build_parser as worker_parser


async def test_infer_serve_takes_vllms_names_for_data_and_tensor_parallel_sizes(tmp_path):
    """The harness says --workers 2 first; vLLM's --data-parallel-size 3 after it is the same flag, so it wins."""
    served = Served(
        None,
        tmp_path / "serve.log",
        "m",
        [
            "--benchmark-mode",
            "--data-parallel-size",
            "3",
            "--tensor-parallel-size",
            "1",
            "--kv-cache-dtype",
            "auto",
            "--enable-auto-tool-choice",
        ],
    )
    try:
        async with InferenceClient(served.address) as client:
            assert (await client.stats()).num_healthy_workers == 3
    finally:
        served.stop()


@pytest.mark.parametrize(
    "command, flags, reason",
    [
        (
            "infer.client.serve",
            ["--kv-cache-dtype", "fp8"],
            "--kv-cache-dtype fp8: not supported by infer: the KV cache is kept in the model's dtype",
        ),
        ("infer.client.serve", ["--gpu-memory-utilization", "0.9"], "--kv-cache-memory-fraction"),
        ("infer.client.serve", ["--swap-space", "4"], "recomputes"),
        (
            "infer.worker.service.cli",
            ["--coordinator", "tcp://127.0.0.1:9", "--kv-cache-dtype", "fp8_e5m2"],
            "only 'auto'",
        ),
        ("infer.worker.service.cli", ["--coordinator", "tcp://127.0.0.1:9", "--enable-expert-parallel"], "--ep-size N"),
        ("infer.client.api.server", ["--coordinator", "tcp://127.0.0.1:9", "--cpu-offload-gb", "8"], "--quantization"),
    ],
)
def test_a_vllm_flag_without_an_equivalent_stops_the_command_with_the_reason(command, flags, reason):
    done = subprocess.run([sys.executable, "-m", command, *flags], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and reason in done.stderr, done.stderr[-500:]


def test_aliases_parse_into_our_fields_and_reach_the_workers():
    args = build_parser().parse_args(
        ["-tp", "2", "-dp", "3", "--kv-cache-memory-bytes", "1000000", "--pipeline-parallel-size", "1"]
    )
    assert (args.tp_size, args.workers, args.kv_cache_memory, args.pp_size) == (2, 3, 1000000, 1)
    assert build_parser().parse_args(["-pp", "3"]).pp_size == 3
    assert worker_args(args, []) == ["--kv-cache-memory", "1000000", "--tp-size", "2"]
    worker = worker_parser().parse_args(
        ["--coordinator", "tcp://h:1", "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", "5"]
    )
    assert (worker.tp_size, worker.kv_cache_memory) == (2, 5)
    # the host-memory KV tier: vLLM's --kv-offloading-size (GiB) is our --kv-offload-host-gb
    offloading = build_parser().parse_args(["--kv-offloading-size", "2.5"])
    assert worker_args(offloading, []) == ["--kv-offload-host-gb", "2.5"]
    assert (
        worker_parser().parse_args(["--coordinator", "tcp://h:1", "--kv-offloading-size", "4"]).kv_offload_host_gb == 4
    )
