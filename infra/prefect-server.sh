#!/usr/bin/env bash
# A real Prefect server with its UI, authenticated (docs/security.md).
#   bash infra/prefect-server.sh start [PORT]   # in the background; SQLite under .datagen/prefect-server
#   bash infra/prefect-server.sh run            # in the foreground (systemd); settings from the environment
#   bash infra/prefect-server.sh stop           # the one `start` started
# Always: basic auth (PREFECT_SERVER_API_AUTH_STRING, else the auth file of infra/prefect-auth.sh, generated
# once), CSRF protection on, CORS limited to the UI's own origin, loopback unless PREFECT_SERVER_API_HOST says
# otherwise; DATAGEN_PROXY_URL (the proxy's URL, infra/prefect-proxy.sh): the UI calls the API through it. For
# production point PREFECT_API_DATABASE_CONNECTION_URL at PostgreSQL (infra/DEPLOY.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=infra/prefect-auth.sh
. "$root/infra/prefect-auth.sh"
state="$root/.datagen/prefect-server"

origin_of() { local rest=${1#*://}; printf '%s://%s\n' "${1%%://*}" "${rest%%/*}"; }

# The server's settings come from the environment, set before start: the UI computes its API URL from them.
secure_server_env() {
  export PREFECT_SERVER_API_HOST="${PREFECT_SERVER_API_HOST:-127.0.0.1}"
  export PREFECT_SERVER_API_PORT="${PREFECT_SERVER_API_PORT:-4200}"
  export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
  local host=$PREFECT_SERVER_API_HOST port=$PREFECT_SERVER_API_PORT file
  auth_file=""
  if [ -z "${PREFECT_SERVER_API_AUTH_STRING:-}" ]; then
    file=$(datagen_auth_file "$root")
    auth_file=$file
    if ! datagen_ensure_auth_file "$file" 2>/dev/null; then
      echo "prefect-server.sh: no PREFECT_SERVER_API_AUTH_STRING and $file cannot be written: set it in the" \
        "server's environment (docs/security.md)" >&2
      exit 2
    fi
    PREFECT_SERVER_API_AUTH_STRING=$(datagen_read_auth_file "$file" prefect-server.sh)
    export PREFECT_SERVER_API_AUTH_STRING
  fi
  # Behind infra/prefect-proxy.sh: browsers open the UI through the proxy, and the UI must call the API there too
  # (it reads its API URL from the server); the proxy's origin is then the UI's origin.
  if [ -n "${DATAGEN_PROXY_URL:-}" ]; then
    export PREFECT_UI_API_URL="${PREFECT_UI_API_URL:-${DATAGEN_PROXY_URL%/}/api}"
    export PREFECT_UI_URL="${PREFECT_UI_URL:-${DATAGEN_PROXY_URL%/}/v2}"
  fi
  # Not a default but a rule: turning CSRF protection off means editing this script, on purpose.
  export PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED=true
  if [ -z "${PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS:-}" ]; then
    if [ -n "${PREFECT_UI_URL:-}" ]; then
      PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS=$(origin_of "$PREFECT_UI_URL")
    elif [ "$host" = 127.0.0.1 ] || [ "$host" = localhost ]; then
      PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS="http://127.0.0.1:$port,http://localhost:$port"
    else
      echo "prefect-server.sh: binding $host: set PREFECT_UI_URL to the URL browsers open (e.g." \
        "https://prefect.example.internal); the API accepts cross-origin requests from that origin only" >&2
      exit 2
    fi
    export PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS
  fi
  # The links the server renders (an alert's `flow_run|ui_url`) need PREFECT_UI_URL; on loopback it is known.
  # /v2: Prefect serves V1 under every path but "/", so links without it open the V1 UI (DEPLOY.md, section 2).
  if [ -z "${PREFECT_UI_URL:-}" ] && { [ "$host" = 127.0.0.1 ] || [ "$host" = localhost ]; }; then
    export PREFECT_UI_URL="http://127.0.0.1:$port/v2"
  fi
  case ",$PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS," in
    *,\*,*) echo "prefect-server.sh: PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS must name origins, not *" >&2; exit 2 ;;
  esac
}

prefect_bin=${PREFECT_BIN:-}
if [ -z "$prefect_bin" ]; then
  if [ -x "$root/.venv/bin/prefect" ]; then prefect_bin="$root/.venv/bin/prefect"; else prefect_bin=prefect; fi
fi

case "${1:-start}" in
  run)
    secure_server_env
    exec "$prefect_bin" server start ;;
  start)
    cd "$root"
    port=${2:-4200}
    mkdir -p "$state" && chmod 700 "$state"
    if [ -f "$state/pid" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null; then
      # A server started by an older checkout may run without auth: say so rather than use it.
      if curl -sf "http://127.0.0.1:$port/ui-settings" | grep -q '"auth":"BASIC"'; then
        echo "already running (pid $(cat "$state/pid"))"; exit 0
      fi
      echo "prefect-server.sh: the running server (pid $(cat "$state/pid")) does not require auth on port $port:" \
        "stop it with \`bash infra/prefect-server.sh stop\` and start it again" >&2
      exit 2
    fi
    export PREFECT_HOME="$state" PREFECT_SERVER_API_PORT="$port"
    secure_server_env
    nohup "$prefect_bin" server start > "$state/server.log" 2>&1 &
    echo $! > "$state/pid"
    for _ in $(seq 1 240); do
      if curl -sf "http://127.0.0.1:$port/api/health" >/dev/null; then
        echo "export PREFECT_API_URL=http://127.0.0.1:$port/api"
        if [ -n "$auth_file" ]; then echo "export PREFECT_API_AUTH_STRING=\"\$(cat $auth_file)\""; fi
        echo "UI: http://127.0.0.1:$port/ (it asks for the auth string once)"
        exit 0
      fi
      sleep 0.5
    done
    echo "Prefect server did not become healthy; see $state/server.log" >&2; exit 1 ;;
  stop)
    if [ -f "$state/pid" ]; then kill -INT "$(cat "$state/pid")" 2>/dev/null || true; rm -f "$state/pid"; fi ;;
  *) echo "usage: $0 start [PORT] | run | stop" >&2; exit 2 ;;
esac
