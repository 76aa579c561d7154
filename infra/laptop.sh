#!/usr/bin/env bash
# The deployed path on a laptop, in one command: local Prefect server + UI, deployments, and a worker whose
# runs use the local S3 server, stand-in SGLang servers and the fixture model (no GPU, no cloud).
#   bash infra/laptop.sh            # then start runs from the UI (printed URL) or the printed command
# Settings: .datagen/laptop/worker.env (DATAGEN_*, mode 0600); demo-sized run parameters:
# .datagen/laptop/run-spec.json. An existing server is used when PREFECT_API_URL is set (with its
# PREFECT_API_AUTH_STRING). The local server's auth string is generated once into .datagen/prefect-auth (0600):
# the UI asks for it, the CLI reads it from PREFECT_API_AUTH_STRING. Ctrl-C stops the worker;
# `bash infra/prefect-server.sh stop`, `.venv/bin/python -m datagen.alert_log stop` and `.venv/bin/datagen stack down`
# stop the rest. Failed runs: .datagen/laptop/alerts.log, one line each (with the local server).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=infra/prefect-auth.sh
. infra/prefect-auth.sh
bash infra/bootstrap.sh
.venv/bin/datagen laptop
if [ -z "${PREFECT_API_URL:-}" ]; then
  port=${DATAGEN_LAPTOP_PREFECT_PORT:-4200}
  echo "starting a local Prefect server on port $port (state in .datagen/prefect-server) ..."
  bash infra/prefect-server.sh start "$port"
  export PREFECT_API_URL="http://127.0.0.1:$port/api"
  # Failed runs are alerted as lines of .datagen/laptop/alerts.log (the local server reaches a loopback listener),
  # unless a team alert is set (DATAGEN_ALERT_WEBHOOK_URL / DATAGEN_ALERT_BLOCK).
  export DATAGEN_ALERT_LOG_DIR=${DATAGEN_ALERT_LOG_DIR:-.datagen/laptop}
fi
datagen_client_auth "$PWD" laptop.sh
echo "registering the deployments on $PREFECT_API_URL ..."
# The laptop's run spec becomes every deployment's defaults: each one runs from the UI's Quick run as it is.
DATAGEN_DEPLOY_RUN_SPEC=.datagen/laptop/run-spec.json bash infra/deploy.sh
set -a
# shellcheck disable=SC1091
. .datagen/laptop/worker.env
set +a
export DATAGEN_WORKER_NAME=${DATAGEN_WORKER_NAME:-laptop-worker}
auth_hint="PREFECT_API_AUTH_STRING=\"\$(cat $(datagen_auth_file "$PWD"))\""
[ -f "$(datagen_auth_file "$PWD")" ] || auth_hint="PREFECT_API_AUTH_STRING=<the server's auth string>"
echo "starting the worker; runs: UI ${PREFECT_API_URL%/api}/ (auth string: $(datagen_auth_file "$PWD"))"
echo "  -> Deployments -> any of them -> Run -> Quick run (the laptop's run spec is their default), or"
echo "  PREFECT_API_URL=$PREFECT_API_URL $auth_hint .venv/bin/prefect deployment run expand-dataset/manual --params \"\$(cat .datagen/laptop/run-spec.json)\" --watch"
exec bash infra/prefect-worker.sh
