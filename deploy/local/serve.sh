#!/usr/bin/env bash
# The one-machine equivalent of deploy/slurm/infer.sbatch: a coordinator, N workers and the HTTP front on
# this machine, on loopback unless told otherwise (--host / --coordinator-host). Installs first if needed.
#   bash deploy/local/serve.sh [--workers 2] [--port 8000] [--model M] [engine options] [-- worker options]
# Ctrl-C / SIGTERM drains and stops everything. For services that outlive a shell: systemd/*.service.
# Off loopback: --keys-dir D, a key set with roles from `.venv/bin/infer-keygen --cluster --dir D` (the workers
# get D/workers/worker, the HTTP front D/clients/client, infer-serve itself D/admins/admin; README "Security").
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/infer-serve ] || bash deploy/local/install.sh
exec .venv/bin/infer-serve "$@"
