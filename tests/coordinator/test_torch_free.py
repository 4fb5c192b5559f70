"""The coordinator (and the client library) never import torch."""

from __future__ import annotations

import subprocess
import sys


def test_coordinator_and_client_import_without_torch():
    code = (
        "import sys, infer.coordinator.daemon, infer.client.inference_client, infer.client.serve; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
