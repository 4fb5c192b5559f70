#!/usr/bin/env bash
# Install, then run the whole test suite (CPU only; no network needed beyond the package registries).
# As root with apt-get, first installs Debian's Slurm and munge for tests/deploy/test_slurm.py (a real Slurm
# in network namespaces); without them that test fails or skips with its reason, the rest runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash deploy/local/install.sh
SLURM_PACKAGES="slurmctld slurmd slurm-client munge tini"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v slurmd >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq $SLURM_PACKAGES >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq $SLURM_PACKAGES >/dev/null; } \
        || echo "test.sh: could not install $SLURM_PACKAGES; the Slurm test will say why" >&2
fi
# The style the code follows (pyproject's [tool.ruff]; the C kernels' kernels/cpu/.clang-format) and types (every
# package), then the tests.
.venv/bin/python -m ruff check --quiet .
.venv/bin/clang-format --dry-run --Werror kernels/cpu/*.c kernels/cpu/*.h
.venv/bin/python -m mypy --no-error-summary protocol coordinator kernels client worker
exec .venv/bin/python -m pytest -q "$@"
