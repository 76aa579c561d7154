#!/usr/bin/env bash
# Local S3 (SeaweedFS `weed mini`) on 127.0.0.1 with credentials enforced: a thin wrapper around
# `python -m datagen.local.localstack`. Usage: infra/s3-local.sh start|stop|status [--state-dir DIR] [--port N]
# After `start`, `source "$STATE_DIR/s3.env"` sets DATAGEN_S3_* for the pipeline.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${DATAGEN_PYTHON:-$repo_root/.venv/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)"

command="${1:-status}"
shift || true
state_dir="${DATAGEN_S3_STATE_DIR:-$repo_root/.datagen/s3}"
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --state-dir) state_dir="$2"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done

exec "$python" -m datagen.local.localstack "$command" --state-dir "$state_dir" "${args[@]}"
