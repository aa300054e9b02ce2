#!/bin/bash
# placement-study.sh DIR OUT   (run ON the GPU machine, from the repo root, after setup.sh)
# Models that do not fit, on the GPU, end to end (synthetic models, random weights: speed and memory only):
#   1. waits for setup.sh's llama.cpp build, writes the 27B-class dense model and a 30B-A3B-class mixture of
#      experts (qwen3moe: 48 layers of 128 experts, 8 used);
#   2. per model and VRAM budget (the MoE at MOE_BUDGET, the dense one at DENSE_BUDGET): what fits by the memory
#      model (python -m tuning.fit: the most layers; for the MoE the fewest layers' experts in host memory), and
#      the tuner's own pick (python -m tuning.search --offline, TRIALS trials at that budget; TRIALS=0 skips it),
#      then scripts/bench_device.py on those placements (ours in-process, llama-server with the same flags) and
#      llama-server --fit on seeing the same free memory; predicted against measured VRAM and host RAM for each.
# JOBS (default "moe dense") picks the models; EXTRA_moe / EXTRA_dense add placements of your own to its bench
# (space-separated NAME:KEY=VALUE[,KEY=VALUE], as bench_device.py's --placement); SAME_FLAGS=0 runs llama-server
# only with --fit, not also with each placement's own flags. OUT/progress.log says where it
# is; OUT/done holds "rc=N"; OUT/placement_NAME.json grows placement by placement. Start it with setsid and poll
# in calls that follow at once: a lent machine left idle for ~30 s goes back with everything on it.
set -uo pipefail
DIR=${1:?usage: placement-study.sh DIR OUT}
OUT=${2:?usage: placement-study.sh DIR OUT}
BUILD=${BUILD:-/tmp/lcpp}
MODEL=${MODEL:-/tmp/m27.gguf}
MOE=${MOE:-/tmp/moe30.gguf}
MOE_BUDGET=${MOE_BUDGET:-8GiB}
DENSE_BUDGET=${DENSE_BUDGET:-10GiB}
BENCH=(--max-tokens "${MAX_TOKENS:-64}" --repeats "${REPEATS:-2}" --skip-http --bw-gib 2)
[ "${SAME_FLAGS:-1}" != 0 ] || BENCH+=(--fit-only)  # llama-server with --fit only, not with each placement's flags
# shellcheck source=scripts/device/study-common.sh
source "$(dirname "$0")/study-common.sh"  # say, finish; the build waited for, the dense model written
SERVER=$BUILD/build/bin/llama-server
[[ " ${JOBS:-moe dense} " != *" moe "* ]] || [ -f "$MOE" ] || python3 scripts/make_synthetic_gguf.py --preset qwen3moe30b --tokenizer-from "$DIR/tokenizer.gguf" \
  --out "$MOE" >> "$OUT/progress.log" 2>&1 || finish 4
RC=0
declare -A MODELS=([moe]="$MOE $MOE_BUDGET" [dense]="$MODEL $DENSE_BUDGET")
for name in ${JOBS:-moe dense}; do
  read -r model budget <<< "${MODELS[$name]}"
  fit=$(python3 -m tuning.fit --model "$model" --vram-budget "$budget")
  echo "$fit" > "$OUT/fit_$name.json"
  layers=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['n_gpu_layers'])" "$fit")
  experts=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['n_cpu_moe'])" "$fit")
  say "$name at $budget: most layers $layers, fewest experts moved $experts"
  places=(--placement "layers:n_gpu_layers=$layers")
  if [ "$experts" != "None" ]; then
    places+=(--placement "experts:n_cpu_moe=$experts" --placement "experts-t8:n_cpu_moe=$experts,n_threads=8")
  fi
  extra_var="EXTRA_$name"
  for extra in ${!extra_var:-}; do places+=(--placement "$extra"); done
  if [ "${TRIALS:-8}" -gt 0 ]; then
    python3 -m tuning.search --offline --no-apply --model "$model" --vram-budget "$budget" --trials "${TRIALS:-8}" \
      --out "$OUT/tuned_$name.yaml" --results-dir "$OUT/study_$name" > "$OUT/study_$name.txt" 2>&1
    say "$name study rc=$?"
    pick=$(python3 scripts/device/pick-settings.py "$OUT/tuned_$name.yaml") && places+=(--placement "tuned:$pick")
  fi
  python3 scripts/bench_device.py --model "$model" --llama-server "$SERVER" --configs "" "${places[@]}" \
    --fit-budget "$budget" "${BENCH[@]}" --json-out "$OUT/placement_$name.json" > "$OUT/placement_$name.txt" 2>&1
  rc=$?
  say "$name rc=$rc"
  [ "$rc" = 0 ] || RC=$rc
done
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
finish "$RC"
