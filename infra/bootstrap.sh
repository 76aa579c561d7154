#!/usr/bin/env bash
# Make ./.venv with the project and its dev tools installed (idempotent; re-installs when pyproject.toml changes).
# Sourced by demo.sh and test.sh; usable alone: `bash infra/bootstrap.sh`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.datagen-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
  echo "$want" > "$stamp"
fi
