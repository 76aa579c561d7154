#!/usr/bin/env bash
# Run a Prefect process worker for datagen on this box (one per GPU box; it runs one flow run at a time,
# and that run uses every GPU of the box). Stop it with SIGINT (Ctrl-C, systemd KillSignal=SIGINT).
#   PREFECT_API_URL=http://prefect-host:4200/api bash infra/prefect-worker.sh
# The server's auth string: PREFECT_API_AUTH_STRING, else the auth file (infra/prefect-auth.sh); flow runs
# inherit it from the worker.
# The worker's environment is the flow runs' environment: export the DATAGEN_* settings (or put them in
# $DATAGEN_HOME/.env) before starting it. Optional: DATAGEN_WORK_POOL (default gpu-box-1),
# DATAGEN_WORKER_NAME (default gpu-worker-<hostname>), DATAGEN_WORKER_LIMIT (default 1), PREFECT_BIN,
# DATAGEN_PYTHON, DATAGEN_PIN_FILE, DATAGEN_WORK_QUEUE (multi-box: the box's own queue, named like DATAGEN_BOX_NAME; see docs/multi-box.md).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=infra/prefect-auth.sh
. "$here/infra/prefect-auth.sh"
if [ -z "${PREFECT_API_URL:-}" ]; then
  echo "prefect-worker.sh: set PREFECT_API_URL to the server's API, e.g. http://127.0.0.1:4200/api" >&2
  exit 2
fi
datagen_client_auth "$here" prefect-worker.sh
# The run and deployment URLs Prefect prints open the V2 UI that DEPLOY.md describes (V1 without /v2).
export PREFECT_UI_URL="${PREFECT_UI_URL:-${PREFECT_API_URL%/api}/v2}"
# prefect.yaml's pull step moves each flow run into $DATAGEN_HOME: the checkout with datagen installed.
export DATAGEN_HOME="${DATAGEN_HOME:-$here}"
if [ ! -f "$DATAGEN_HOME/prefect.yaml" ]; then
  echo "prefect-worker.sh: DATAGEN_HOME=$DATAGEN_HOME is not a datagen checkout (no prefect.yaml)" >&2
  exit 2
fi
# Prefect's client retries 408/429/502/503 and connection errors with 2**n s backoff; 7 tries (~4 min) ride out
# a server whose SQLite is busy under load (default 5, ~1 min). An explicit setting wins.
export PREFECT_CLIENT_MAX_RETRIES="${PREFECT_CLIENT_MAX_RETRIES:-7}"
python_bin=${DATAGEN_PYTHON:-}
if [ -z "$python_bin" ]; then
  if [ -x "$DATAGEN_HOME/.venv/bin/python" ]; then python_bin="$DATAGEN_HOME/.venv/bin/python"; else python_bin=python3; fi
fi
cd "$DATAGEN_HOME"
queue_args=()
if [ -n "${DATAGEN_WORK_QUEUE:-}" ]; then queue_args=(--work-queue "$DATAGEN_WORK_QUEUE"); fi
# datagen's own worker (datagen/worker.py): a process worker that runs only what `datagen pin` recorded on this
# box (DATAGEN_PIN_FILE, default $DATAGEN_HOME/.datagen/pin/pin.json), with a command of its own.
# exec: the worker gets this script's pid, so signals (SIGINT from systemd or a test) reach it directly.
exec "$python_bin" -m datagen.worker \
  --pool "${DATAGEN_WORK_POOL:-gpu-box-1}" \
  --name "${DATAGEN_WORKER_NAME:-gpu-worker-$(hostname -s)}" \
  --limit "${DATAGEN_WORKER_LIMIT:-1}" \
  "${queue_args[@]}"
