#!/usr/bin/env bash
# Quickstart 1: the whole pipeline end to end on this machine (no GPU needed):
# local S3 (SeaweedFS), stand-in SGLang servers, embedded Prefect, the bundled prompt set.
# Prints the s3:// location of the published dataset.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash infra/bootstrap.sh
exec .venv/bin/datagen demo "$@"
