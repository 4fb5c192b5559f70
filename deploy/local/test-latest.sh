#!/usr/bin/env bash
# The test command against the newest versions pyproject.toml allows, not the lock: installs them into
# ./.venv-latest (INFER_VENV to change it), prints how they differ from deploy/local/requirements.lock, then runs
# what deploy/local/test.sh runs (lint, types, the suite; arguments go to pytest). Not part of CI: upgrading is a
# decision, taken by regenerating the lock (`bash deploy/local/lock.sh`) once this passes, with the diff reviewed.
set -euo pipefail
cd "$(dirname "$0")/../.."
export INFER_VENV=${INFER_VENV:-.venv-latest} INFER_RESOLVE=latest
exec bash deploy/local/test.sh "$@"
