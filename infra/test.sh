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
# The proxy's tests run Debian's nginx with its njs module: installed once here (pinned, infra/prefect-proxy.sh),
# not by several test processes at once.
bash infra/prefect-proxy.sh install
export PREFECT_SERVER_ANALYTICS_ENABLED=false
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/mypy
# The suite runs in DATAGEN_TEST_WORKERS processes (default 3; 0 runs it in this one process), a whole file per
# process at a time, longest files first (tests/conftest.py LONG_FILES_FIRST; docs/testing.md). Arguments given
# here come after these, so `bash infra/test.sh -n 0 tests/unit` also works.
workers=${DATAGEN_TEST_WORKERS:-3}
exec .venv/bin/pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
