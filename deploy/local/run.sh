#!/usr/bin/env bash
# Install, then run the main job on the embedded default model and show it answering.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash deploy/local/install.sh
exec .venv/bin/python -m infer.client.demo "$@"
