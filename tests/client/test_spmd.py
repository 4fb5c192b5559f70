"""SPMD ranks under torchrun (2 ranks on CPU, real processes): with a coordinator, rank 0 hosts it, every rank
hosts an engine, rank 0 feeds 20 prompts that spread over both engines and only rank 0 is primary; without
one, every rank is primary and serves its own prompts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hf_reference import transformers_greedy
from ports import reserved_port

PROGRAM = Path(__file__).with_name("spmd_program.py")
PROMPTS = [[7 + i, 100 + i, 5] for i in range(20)]


def _torchrun(mode: str, model: Path, out: Path) -> list[dict]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    env["INFER_COORDINATOR_PORT"] = str(reserved_port())
    done = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(reserved_port()),
            str(PROGRAM),
            mode,
            str(model),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_with_a_coordinator_share_the_prompts(tiny_model_dir, tmp_path) -> None:
    model = tiny_model_dir("llama")
    rank0, rank1 = _torchrun("coordinator", model, tmp_path)
    assert rank0["primary"] is True and rank1["primary"] is False
    assert rank0["tokens"] == transformers_greedy(model, PROMPTS, 4)
    assert rank0["workers"] == 2
    assert rank0["served_here"] > 0 and rank1["served_here"] > 0  # both engines served some
    assert rank0["served_here"] + rank1["served_here"] == len(PROMPTS)
    assert "rank 1 of 2 SPMD ranks" in rank1["refused"]


def test_two_ranks_without_a_coordinator_each_serve_their_own(tiny_model_dir, tmp_path) -> None:
    model = tiny_model_dir("llama")
    rank0, rank1 = _torchrun("direct", model, tmp_path)
    assert rank0["primary"] is True and rank1["primary"] is True
    assert [rank0["tokens"][0], rank1["tokens"][0]] == transformers_greedy(model, PROMPTS[:2], 4)


@pytest.fixture(autouse=True)
def _no_rank_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
