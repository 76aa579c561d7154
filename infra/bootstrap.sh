#!/usr/bin/env bash
# Make ./.venv with the project and its dev tools installed (idempotent; re-installs when pyproject.toml changes).
# Sourced by demo.sh and test.sh; usable alone: `bash infra/bootstrap.sh`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $("$PYTHON" --version 2>&1) ..."
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.datagen-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # Quiet pip, so say what is happening: the first install takes a minute or two.
  echo "bootstrap: installing datagen and its dev tools into .venv (pip install -e '.[dev]'; a minute or two the first time) ..."
  start=$SECONDS
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
  echo "$want" > "$stamp"
  echo "bootstrap: done in $((SECONDS - start)) s"
fi
