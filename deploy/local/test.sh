#!/usr/bin/env bash
# Install, then run the whole test suite (CPU only; no network needed beyond the package registries).
# As root with apt-get, first installs Debian's Slurm and munge for tests/deploy/test_slurm.py (a real Slurm
# in network namespaces); without them that test fails or skips with its reason, the rest runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash deploy/local/install.sh
# The venv install.sh made (INFER_VENV, .venv by default; deploy/local/test-latest.sh passes .venv-latest).
BIN=$(cd "${INFER_VENV:-.venv}" && pwd)/bin
SLURM_PACKAGES="slurmctld slurmd slurm-client munge tini"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v slurmd >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq $SLURM_PACKAGES >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq $SLURM_PACKAGES >/dev/null; } \
        || echo "test.sh: could not install $SLURM_PACKAGES; the Slurm test will say why" >&2
fi
# The style the code follows (pyproject's [tool.ruff]; the C kernels' src/infer/kernels/cpu/.clang-format) and types
# (the whole package), then the tests.
"$BIN"/python -m ruff check --quiet .
"$BIN"/python -m ruff format --check --quiet .
"$BIN"/clang-format --dry-run --Werror src/infer/kernels/cpu/*.c src/infer/kernels/cpu/*.h
# mypy reads src/infer as the package `infer` (pyproject's mypy_path), so that every `infer.*` import is followed and
# checked. It runs niced beside the tests (on a fresh clone it takes ~90 s of one core; the tests wait on daemons
# and timeouts often enough to leave some free), and its verdict is the run's with theirs.
MYPY_LOG=$(mktemp) STATUS=0
nice -n 10 "$BIN/python" -m mypy --no-error-summary --config-file pyproject.toml --cache-dir .mypy_cache -p infer \
    > "$MYPY_LOG" 2>&1 &
MYPY_PID=$!
# Python may write its bytecode caches (some environments set PYTHONDONTWRITEBYTECODE): each of the many daemons
# the tests start would otherwise compile the package's modules again (~0.5 s of CPU a process).
unset PYTHONDONTWRITEBYTECODE
# In 2 (up to 4, one a core) processes (pytest-xdist): much of the suite waits on daemons, sockets and timeouts.
# A test file is one unit of work (--dist loadfile): its module-scoped clusters, engines and HTTP fronts are built
# once, and what a file's tests share (the Slurm sandbox, fixed ports) is used by one process at a time. (Not
# loadgroup: with pytest 9.2 its xdist_group marks are silently ignored, pytest-xdist 3.8 renames nodes in a way
# pytest no longer reads.) Torch threads: tests/conftest.py. Arguments come last: `test.sh tests/some_file.py`
# runs one file, `test.sh -n 0` runs in this one process. Files start slowest first (tests/file_durations.py;
# xdist's own reordering, most tests first, is off), so that the run does not end on one long file. The 25 slowest
# tests close every run (--durations; `--durations=0` after it lists them all), so that a run that outgrows the
# 30-minute budget says where.
CORES=$(nproc)
WORKERS=$(( CORES < 2 ? 2 : (CORES > 4 ? 4 : CORES) ))
"$BIN"/python -m pytest -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder --durations=25 "$@" || STATUS=$?
if ! wait "$MYPY_PID"; then
    cat "$MYPY_LOG"
    echo "test.sh: mypy found the errors above" >&2
    STATUS=1
fi
rm -f "$MYPY_LOG"
exit "$STATUS"
