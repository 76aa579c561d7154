#!/usr/bin/env bash
# Quickstart 2 (and CI): quality gates, then the whole test suite against real local processes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash infra/bootstrap.sh
# The browser test drives Debian's chromium (test tools' own browser downloads do not work offline).
if [ ! -x /usr/bin/chromium ] && [ -z "${DATAGEN_CHROMIUM:-}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "infra/test.sh: the browser test needs Debian's chromium: sudo apt-get install -y chromium" >&2
  fi
fi
export PREFECT_SERVER_ANALYTICS_ENABLED=false
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/pytest "$@"
