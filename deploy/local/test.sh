#!/usr/bin/env bash
# Install, then run the whole test suite (CPU only; no network needed beyond the package registries).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash deploy/local/install.sh
exec .venv/bin/python -m pytest -q "$@"
