"""Shared benchmark plumbing: workloads, machine facts, result files."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]   # token ids (the same ids for every system)
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(name: str, vocab_size: int, seed: int = 0) -> Workload:
    """W1: 64 x (128 prompt, 128 out). W2: 200 x (16-1024 prompt, 16-512 out), fixed seed. Greedy, ignore EOS."""
    rng = random.Random(seed)
    if name == "W1":
        lens, outs = [128] * 64, [128] * 64
    elif name == "W2":
        lens = [rng.randint(16, 1024) for _ in range(200)]
        outs = [rng.randint(16, 512) for _ in range(200)]
    elif name == "tiny":   # smoke-test size
        lens, outs = [32] * 8, [16] * 8
    else:
        raise ValueError(f"unknown workload {name!r}")
    prompts = [[rng.randrange(100, vocab_size) for _ in range(n)] for n in lens]
    return Workload(name, prompts, outs)


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=Path(__file__).parent).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(kind: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    payload = {"benchmark": kind, "date": now.isoformat(timespec="seconds"), "machine": machine(),
               "git_revision": git_revision(), **payload}
    path = RESULTS / f"{kind}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
