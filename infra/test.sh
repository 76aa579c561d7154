#!/usr/bin/env bash
# Quickstart 2 (and CI): quality gates, then the whole test suite against real local processes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash infra/bootstrap.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/pytest "$@"
