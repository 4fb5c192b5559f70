"""The RL-loop example (examples/rl_loop.py) as CI runs it: generate -> score -> train -> update_weights ->
generate on the tiny model, in direct mode and through a coordinator (suspend while training, refit over gloo).
The policy learns (the toy reward rises), every step pushes a new version, and the served weights equal the
trained ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"


@pytest.mark.parametrize("flags", [[], ["--coordinator"]], ids=["direct", "coordinator"])
def test_the_rl_loop_learns_and_serves_each_new_version(tiny_model_dir, flags) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--model", str(tiny_model_dir("llama")), "--steps", "8", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    rewards = summary["rewards"]
    assert max(rewards[-3:]) > rewards[0] + 0.2, rewards
    assert summary["versions"] == list(range(1, 9))
    assert summary["served_equals_trained"] is True
    if flags:
        assert summary["bytes_released_while_training"] > 8 << 20  # the KV pool at least, while training
