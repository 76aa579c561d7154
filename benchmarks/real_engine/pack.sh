#!/usr/bin/env bash
# pack.sh DEST: fill DEST with what device.sh needs, from this worktree (run here, where PyPI answers).
# DEST must be a folder of the checkout the device tool sends that git ignores (named in the call's `carry`);
# the device tool sends the session's own checkout, so from a helper's worktree DEST lies in that checkout.
# Needs .sgl/ from ../shared/tools/sglang-on-device/fetch.sh (SGLang 0.5.17 trimmed, the fixture model folder).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEST=${1:?usage: pack.sh DEST}
SGL=${SGL_DIR:-$ROOT/.sgl}
[ -f "$SGL/site.tar.xz" ] && [ -f "$SGL/model.tar.xz" ] || { echo "no $SGL/site.tar.xz: run fetch.sh first" >&2; exit 1; }
mkdir -p "$DEST/whl"
cp "$SGL/site.tar.xz" "$SGL/model.tar.xz" "$DEST/"
cp "$ROOT/benchmarks/real_engine/device.sh" "$DEST/device.sh"
# The H100 defaults server's log of issue 37: multiturn.py calibrates its plan from it (on that card only).
cp "$ROOT/benchmarks/results/real-engine-h100-80gb-hbm3/defaults.log" "$DEST/defaults.log"
# datagen's client needs (the lent machine has pydantic through SGLang's site, not these): the venv's versions.
pins=$("$ROOT/.venv/bin/python" -m pip list --format=freeze 2>/dev/null \
  | grep -i -E '^(httpx|httpcore|anyio|certifi|idna|h11|pydantic-settings|pydantic_settings|python-dotenv|python_dotenv)==')
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: -d "$DEST/whl" $pins
tar -C "$ROOT" --exclude=__pycache__ -cf - datagen benchmarks/real_engine | xz -T0 -9 > "$DEST/src.tar.xz"
du -sh "$DEST"/* "$DEST"
