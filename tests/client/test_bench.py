"""infer-bench as a user runs it: against a live `infer-serve` front it sends every request of its seeded
schedule, all complete with their output lengths, and --result-json holds the summary; bad options exit 2
naming them; a server that cannot be reached exits 1 saying so."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ports import reserved_port
from serve_harness import Served

BENCH = (
    [str(Path(sys.executable).parent / "infer-bench")]
    if shutil.which("infer-bench", path=str(Path(sys.executable).parent))
    else [sys.executable, "-m", "infer.client.bench"]
)


@pytest.mark.slow
def test_a_run_against_infer_serve_completes_every_request(tiny_model_dir, tmp_path):
    served = Served(tiny_model_dir("llama"), tmp_path / "serve.log", "tiny", ["--dtype", "float32", "--threads", "1"])
    try:
        out = tmp_path / "bench.json"
        done = subprocess.run(
            [
                *BENCH,
                "--url",
                served.url,
                "--num-prompts",
                "6",
                "--input-len",
                "4",
                "12",
                "--output-len",
                "3",
                "6",
                "--vocab-size",
                "1000",
                "--request-rate",
                "20",
                "--result-json",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        served.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and result["completed"] == 6 and result["failed"] == 0
    assert result["short_outputs"] == 0 and result["output_throughput"] > 0
    assert result["ttft_ms"]["p50"] is not None and len(result["requests"]) == 6
    assert "completed / failed        6 / 0" in done.stdout
    assert result["config"]["request_rate"] == 20 and "api_key" not in result["config"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--url", "localhost:8000"], "--url must be http(s)://HOST[:PORT]"),
        (["--url", "http://h:1", "--input-len", "9", "3"], "--input-len 9 3: need 1 <= MIN <= MAX"),
        (["--url", "http://h:1", "--request-rate", "0"], "a request rate must be > 0 or inf"),
        (["--url", "http://h:1", "--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    ],
)
def test_bad_options_exit_2_naming_them(argv, message):
    done = subprocess.run([*BENCH, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_server_that_cannot_be_reached_exits_1_saying_so():
    port = reserved_port()  # nothing listens there, and nothing else may bind it
    done = subprocess.run([*BENCH, "--url", f"http://127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"cannot benchmark http://127.0.0.1:{port}" in done.stderr, done.stderr
