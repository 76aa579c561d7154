#!/usr/bin/env bash
# sglang-python.sh: the "engine interpreter" datagen's launcher is given on the lent GPU machine
# (DATAGEN_ENGINE_PYTHON). It is python3 with the carried SGLang 0.5.17 site as its only extra path (datagen's
# own packages stay out of the server, as in a separate engine venv); a server start (`-m sglang.launch_server
# ...`) gets two flags the run spec may not set (datagen.checks.tuning refuses them), because the lent machine has no
# weights and a trimmed sglang-kernel: random weights (--load-format dummy) and Triton vision attention (no FA3).
# Everything else, the GPU probe included, runs as datagen asks.
export PYTHONPATH=/tmp/sgl/site
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "sglang.launch_server" ]; then
  exec python3 "$@" --load-format dummy --mm-attention-backend triton_attn
fi
exec python3 "$@"
