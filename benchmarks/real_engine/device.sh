#!/usr/bin/env bash
# device.sh: on the lent GPU machine, from the root of the checkout the device tool sends, with the folder pack.sh
# filled carried (its path is this script's folder). Unpacks SGLang 0.5.17 (/tmp/sgl), datagen's wheels and source
# (/tmp/dg) once per warm machine, writes $OUT/env.txt, then runs the parts named in order:
#   trial      engine_trial.py: defaults, then the plan for 456-token requests recalibrated from the defaults' log;
#              benches 200x256x48 and 3840x256x24 (item 1 and 3 of issue 37)
#   trial4k    engine_trial.py: defaults (no bench), then the plan for 4096-token requests, bench 3840x256x24
#   multiturn  multiturn.py: the plan's radix-cache choice for an every-turn run, both candidates measured on a
#              multi-turn workload (issue 36; MULTITURN_ARGS adds its options)
#   depth      depth.py: datagen's Dispatcher at queue_depth 4, 2, 1 on one server (--max-running-requests 32), single
#              requests and multi-step chains, interleaved (DEPTH_ARGS adds its options); console in console-depth.txt
#   headroom   headroom.py: the plan's fraction against SGLang's generic one and an expert's (issue 45): today's plan,
#              its measured headroom, the new plan from it with a worst-case burst (HEADROOM_ARGS: its phases and sizes)
#   datagen    datagen_on_engine.py --engine sglang: datagen's launcher (plan for 4096-token requests from its own
#              GPU probe, pool check and recalibrated relaunch), client, dispatcher, cancel, hang detector (item 2)
# Everything ends by start + SGL_BUDGET_S (default 570 s). Example (tool `run`, carry [".dev37"]):
#   SGL_BUDGET_S=570 bash .dev37/device.sh trial
set -uo pipefail
D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
S=/tmp/sgl
G=/tmp/dg
t0=$(date +%s)
export SGL_UNTIL=$(( t0 + ${SGL_BUDGET_S:-570} ))
mkdir -p "$S" "$G"
if [ ! -f "$S/site/.unpacked" ]; then
  rm -rf "$S/site"; mkdir -p "$S/site"
  tar -C "$S/site" -I 'xz -T0' -xf "$D/site.tar.xz" || { echo "unpacking site.tar.xz failed"; exit 1; }
  touch "$S/site/.unpacked"
fi
if [ ! -f "$S/model/config.json" ]; then
  rm -rf "$S/model"; mkdir -p "$S/model"
  tar -C "$S/model" -I 'xz -T0' -xf "$D/model.tar.xz" || { echo "unpacking model.tar.xz failed"; exit 1; }
fi
rm -rf "$G/src" && mkdir -p "$G/src" && tar -C "$G/src" -I 'xz -T0' -xf "$D/src.tar.xz" || { echo "src.tar.xz"; exit 1; }
if [ ! -f "$G/site/.unpacked" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$G/site" "$D"/whl/*.whl \
    || { echo "installing datagen's wheels failed"; exit 1; }
  touch "$G/site/.unpacked"
fi
echo "unpacked in $(( $(date +%s) - t0 )) s"
export SGL_SITE=$S/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRITON_CACHE_AUTOTUNING=1
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then export CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); fi
OUT=${OUT:-/tmp/sgl/out}; mkdir -p "$OUT"; export OUT
R=$G/src/benchmarks/real_engine
{
  date -u; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
  python3 -c 'import torch, sys; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)); f, t = torch.cuda.mem_get_info(); print("free", f, "total", t)'
  PYTHONPATH=$S/site python3 -c 'import sglang, transformers, triton; print("sglang", sglang.__version__, "transformers", transformers.__version__, "triton", triton.__version__)'
  echo "CUDA_HOME=${CUDA_HOME:-}"; nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for part in "$@"; do
  case "$part" in
    trial)
      PYTHONPATH=$S/site:$G/site:$G/src python3 "$R/engine_trial.py" --model "$S/model" --out "$OUT" \
        --phase defaults --phase plan:456 --bench 200x256x48 --bench 3840x256x24 \
        --then-datagen "$G/site:$G/src:$S/site" ;;
    trial4k)
      PYTHONPATH=$S/site:$G/site:$G/src python3 "$R/engine_trial.py" --model "$S/model" --out "$OUT" \
        --phase defaults --phase plan:4096 --bench 3840x256x24 --port 30200 ;;
    depth)
      PYTHONPATH=$S/site:$G/site:$G/src python3 "$R/depth.py" --model "$S/model" --out "$OUT" ${DEPTH_ARGS:-} 2>&1 \
        | tee "$OUT/console-depth.txt" ;;
    headroom)
      PYTHONPATH=$S/site:$G/site:$G/src python3 "$R/headroom.py" --model "$S/model" --out "$OUT" \
        --calibrate-log "$D/defaults.log" ${HEADROOM_ARGS:---phase today --phase new} 2>&1 | tee "$OUT/console-headroom.txt" ;;
    datagen)
      DATAGEN_ENGINE_PYTHON=$R/sglang-python.sh PYTHONPATH=$G/site:$G/src:$S/site \
        python3 "$R/datagen_on_engine.py" --engine sglang --model "$S/model" --out "$OUT" --work "$G/work" ;;
    multiturn)
      PYTHONPATH=$S/site:$G/site:$G/src python3 "$R/multiturn.py" --model "$S/model" --out "$OUT" \
        --calibrate-log "$D/defaults.log" --calibrate-card "H100 80GB HBM3" ${MULTITURN_ARGS:-} ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
  echo "part $part ended at +$(( $(date +%s) - t0 )) s"
done
