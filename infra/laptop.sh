#!/usr/bin/env bash
# The deployed path on a laptop, in one command: local Prefect server + UI, deployments, and a worker whose
# runs use the local S3 server, stand-in SGLang servers and the fixture model (no GPU, no cloud).
#   bash infra/laptop.sh            # then start runs from the UI (printed URL) or the printed command
# Settings: .datagen/laptop/worker.env (DATAGEN_*, mode 0600); demo-sized run parameters:
# .datagen/laptop/run-spec.json. An existing server is used when PREFECT_API_URL is set (with its
# PREFECT_API_AUTH_STRING). The local server's auth string is generated once into .datagen/prefect-auth (0600):
# the worker uses it through the proxy (infra/prefect-proxy.sh, port 4300), where people log in with the
# runner or operator credential in .datagen/prefect-proxy/credentials/. Ctrl-C stops the worker;
# `bash infra/prefect-server.sh stop`, `bash infra/prefect-proxy.sh stop`, `.venv/bin/python -m datagen.operations.alert_log stop` and `.venv/bin/datagen stack down`
# stop the rest. Failed runs: .datagen/laptop/alerts.log, one line each (with the local server).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=infra/prefect-auth.sh
. infra/prefect-auth.sh
bash infra/bootstrap.sh
.venv/bin/datagen laptop
if [ -z "${PREFECT_API_URL:-}" ]; then
  port=${DATAGEN_LAPTOP_PREFECT_PORT:-4200}
  proxy_port=${DATAGEN_LAPTOP_PROXY_PORT:-4300}
  echo "starting a local Prefect server on port $port (state in .datagen/prefect-server) ..."
  # The UI is opened through the proxy (nginx, infra/prefect-proxy.sh): it calls the API there too.
  DATAGEN_PROXY_URL="http://127.0.0.1:$proxy_port" bash infra/prefect-server.sh start "$port"
  echo "starting the proxy on port $proxy_port (operator and runner credentials in .datagen/prefect-proxy/credentials) ..."
  export DATAGEN_PROXY_LISTEN="127.0.0.1:$proxy_port" DATAGEN_PROXY_UPSTREAM="127.0.0.1:$port"
  for who in operator:operator runner:runner; do
    [ -f ".datagen/prefect-proxy/credentials/${who%%:*}" ] || bash infra/prefect-proxy.sh add-user "${who%%:*}" "${who##*:}"
  done
  bash infra/prefect-proxy.sh start
  # The worker and deploy.sh go through the proxy too; the worker with the box credential (the server's string).
  export PREFECT_API_URL="http://127.0.0.1:$proxy_port/api"
  # Failed runs are alerted as lines of .datagen/laptop/alerts.log (the local server reaches a loopback listener),
  # unless a team alert is set (DATAGEN_ALERT_WEBHOOK_URL / DATAGEN_ALERT_BLOCK).
  export DATAGEN_ALERT_LOG_DIR=${DATAGEN_ALERT_LOG_DIR:-.datagen/laptop}
fi
datagen_client_auth "$PWD" laptop.sh
echo "registering the deployments on $PREFECT_API_URL ..."
# The laptop's run spec becomes every deployment's defaults: each one runs from the UI's Quick run as it is.
# Through the local proxy, deploying is the operator's: deploy.sh (and the pin it writes) use that credential.
operator_auth=$PREFECT_API_AUTH_STRING
if [ -n "${proxy_port:-}" ]; then operator_auth=$(cat .datagen/prefect-proxy/credentials/operator); fi
PREFECT_API_AUTH_STRING=$operator_auth DATAGEN_DEPLOY_RUN_SPEC=.datagen/laptop/run-spec.json bash infra/deploy.sh
set -a
# shellcheck disable=SC1091
. .datagen/laptop/worker.env
set +a
export DATAGEN_WORKER_NAME=${DATAGEN_WORKER_NAME:-laptop-worker}
if [ -n "${proxy_port:-}" ]; then
  auth_hint="PREFECT_API_AUTH_STRING=\"\$(cat .datagen/prefect-proxy/credentials/runner)\""
  ui_login="the runner credential: .datagen/prefect-proxy/credentials/runner"
else
  auth_hint="PREFECT_API_AUTH_STRING=<your credential>"
  ui_login="your credential"
fi
echo "starting the worker; runs: UI ${PREFECT_API_URL%/api}/ (log in with $ui_login)"
echo "  -> Deployments -> any of them -> Run -> Quick run (the laptop's run spec is their default), or"
echo "  PREFECT_API_URL=$PREFECT_API_URL $auth_hint .venv/bin/prefect deployment run expand-dataset/manual --params \"\$(cat .datagen/laptop/run-spec.json)\""
echo "  (no --watch through the proxy: its websocket takes the server's own string only; see docs/security.md)"
exec bash infra/prefect-worker.sh
