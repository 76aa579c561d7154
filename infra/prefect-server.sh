#!/usr/bin/env bash
# Start (or stop) a real local Prefect server with its UI, for those who want to watch runs.
#   bash infra/prefect-server.sh start [PORT]   -> prints the PREFECT_API_URL to export
#   bash infra/prefect-server.sh stop
# SQLite under .datagen/prefect-server by default; for production point PREFECT_API_DATABASE_CONNECTION_URL
# at PostgreSQL (>= 14.9 with pg_trgm), see README.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
state=.datagen/prefect-server
mkdir -p "$state"
case "${1:-start}" in
  start)
    port=${2:-4200}
    if [ -f "$state/pid" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null; then
      echo "already running (pid $(cat "$state/pid"))"; exit 0
    fi
    # The UI computes its API URL from these settings, not from CLI flags: set them before starting.
    PREFECT_HOME="$PWD/$state" PREFECT_SERVER_API_HOST=127.0.0.1 PREFECT_SERVER_API_PORT="$port" \
      PREFECT_SERVER_ANALYTICS_ENABLED=false \
      nohup .venv/bin/prefect server start > "$state/server.log" 2>&1 &
    echo $! > "$state/pid"
    for _ in $(seq 1 120); do
      if curl -sf "http://127.0.0.1:$port/api/health" >/dev/null; then
        echo "export PREFECT_API_URL=http://127.0.0.1:$port/api"
        echo "UI: http://127.0.0.1:$port/"
        exit 0
      fi
      sleep 0.5
    done
    echo "Prefect server did not become healthy; see $state/server.log" >&2; exit 1 ;;
  stop)
    if [ -f "$state/pid" ]; then kill -INT "$(cat "$state/pid")" 2>/dev/null || true; rm -f "$state/pid"; fi ;;
  *) echo "usage: $0 start [PORT] | stop" >&2; exit 2 ;;
esac
