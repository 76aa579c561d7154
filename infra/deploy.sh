#!/usr/bin/env bash
# Register datagen's deployments (prefect.yaml) with a Prefect server. Idempotent: safe to re-run after
# every change to prefect.yaml or to a flow's parameters.
#   PREFECT_API_URL=http://prefect-host:4200/api bash infra/deploy.sh
# The server's auth string: PREFECT_API_AUTH_STRING, else the auth file (infra/prefect-auth.sh).
# Then pins what was deployed on this box (`datagen pin`, DATAGEN_PIN_FILE): run it on the GPU box, or run
# `datagen pin` there afterwards. Optional: DATAGEN_WORK_POOL (default gpu-box-1, the pool prefect.yaml names), PREFECT_BIN;
# DATAGEN_ALERT_WEBHOOK_URL or DATAGEN_ALERT_BLOCK (type/name): install the failed-run automation too; without
# either, DATAGEN_ALERT_LOG_DIR=<dir> (laptop.sh): the automation posts to a loopback listener writing <dir>/alerts.log;
# DATAGEN_DEPLOY_RUN_SPEC=<run-spec.json>: its fields become every deployment's `spec` defaults (laptop.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=infra/prefect-auth.sh
. infra/prefect-auth.sh
if [ -z "${PREFECT_API_URL:-}" ]; then
  # Without it every prefect command silently talks to a throwaway ephemeral server.
  echo "deploy.sh: set PREFECT_API_URL to the server's API, e.g. http://127.0.0.1:4200/api" >&2
  exit 2
fi
datagen_client_auth "$PWD" deploy.sh
# The run and deployment URLs Prefect prints open the V2 UI that DEPLOY.md describes (V1 without /v2).
export PREFECT_UI_URL="${PREFECT_UI_URL:-${PREFECT_API_URL%/api}/v2}"
# Prefect's client retries 408/429/502/503 and connection errors with 2**n s backoff; 7 tries (~4 min) ride out
# a server whose SQLite is busy under load (default 5, ~1 min). An explicit setting wins.
export PREFECT_CLIENT_MAX_RETRIES="${PREFECT_CLIENT_MAX_RETRIES:-7}"
prefect_bin=${PREFECT_BIN:-}
if [ -z "$prefect_bin" ]; then
  if [ -x .venv/bin/prefect ]; then prefect_bin=.venv/bin/prefect; else prefect_bin=prefect; fi
fi
pool=${DATAGEN_WORK_POOL:-gpu-box-1}
# The pool must exist before `prefect deploy`: with a missing pool it exits 1 and creates nothing. Its base job
# template gives runs no job variables at all (no command, env or working_dir; the server refuses any with 422):
# a flow run's environment is the worker's, i.e. the box's (docs/security.md).
"$prefect_bin" work-pool create "$pool" --type process --base-job-template infra/work-pool-template.json --overwrite
# prefect.yaml's pull step says "{{ $DATAGEN_HOME }}". `prefect deploy` substitutes env placeholders it can
# resolve at deploy time, so with DATAGEN_HOME set here the deploying machine's path would be baked into
# every deployment. Unset, the placeholder is stored as is and each worker resolves its own checkout.
env -u DATAGEN_HOME "$prefect_bin" deploy --all --no-prompt
python_bin="$(dirname "$prefect_bin")/python"
[ -x "$python_bin" ] || python_bin=python3
if [ -n "${DATAGEN_DEPLOY_RUN_SPEC:-}" ]; then
  # Right after `prefect deploy` reset each deployment's parameters to prefect.yaml's: theirs win over the file's.
  "$python_bin" -m datagen.operations.deploy_defaults "$DATAGEN_DEPLOY_RUN_SPEC"
fi
# What this box's worker may run, as just deployed (docs/security.md). Another box runs `datagen pin` itself.
"$python_bin" -m flows.cli pin --pool "$pool"
if [ -n "${DATAGEN_ALERT_WEBHOOK_URL:-}" ] || [ -n "${DATAGEN_ALERT_BLOCK:-}" ]; then
  if [ -n "${DATAGEN_ALERT_WEBHOOK_URL:-}" ]; then
    "$python_bin" -m datagen.operations.alerts install --webhook-url "$DATAGEN_ALERT_WEBHOOK_URL"
  else
    "$python_bin" -m datagen.operations.alerts install --block "$DATAGEN_ALERT_BLOCK"
  fi
elif [ -n "${DATAGEN_ALERT_LOG_DIR:-}" ]; then
  # A laptop (laptop.sh): a listener on loopback writes each alert as a line of $DATAGEN_ALERT_LOG_DIR/alerts.log.
  "$python_bin" -m datagen.operations.alert_log start --state-dir "$DATAGEN_ALERT_LOG_DIR"
else
  echo "deploy.sh: no DATAGEN_ALERT_WEBHOOK_URL / DATAGEN_ALERT_BLOCK: failed runs notify nobody (infra/DEPLOY.md, section 7)"
fi
