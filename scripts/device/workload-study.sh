#!/bin/bash
# workload-study.sh DIR OUT   (run ON the GPU machine, from the repo root, after setup.sh)
# The traffic half of docs/performance.md on the GPU, end to end, with the 27B-class synthetic model (random
# weights: speed only):
#   1. waits for setup.sh's llama.cpp build, writes the model;
#   2. scripts/bench_agreement.py: the tuner's capacity figure against bench_serving's, per stream count, on
#      one np4 config, as loaded and after a context rebuild;
#   3. scripts/workload_picks.sh: one study per workload (chat, rag) under one SLO and a V100's 32 GiB, then
#      each pick replayed on both workloads (the cross table).
# Settings: the environment of workload_picks.sh (defaults below: a study that fits a lent machine's 30 minutes).
# OUT/progress.log says where it is; OUT/done holds "rc=N" at the end. Start it with setsid so it outlives the
# call that started it (poll it in calls that follow at once: the machine must stay warm).
set -uo pipefail
DIR=${1:?usage: workload-study.sh DIR OUT}
OUT=${2:?usage: workload-study.sh DIR OUT}
BUILD=${BUILD:-/tmp/lcpp}
MODEL=${MODEL:-/tmp/m27.gguf}
# shellcheck source=scripts/device/study-common.sh
source "$(dirname "$0")/study-common.sh"  # say, finish; the build waited for, the model written

say "agreement"
python3 scripts/bench_agreement.py --engine model="$MODEL" --engine n_parallel=4 --engine n_ctx=8192 \
  --engine type_k=q8_0 --engine type_v=q8_0 --engine flash_attn=on --engine n_batch=512 --engine n_ubatch=512 \
  --from n_parallel=2 --from n_ctx=4096 --out "$OUT/bench_agreement.json" > "$OUT/agreement.txt" 2>&1
say "agreement rc=$?"

say "workload picks"
ray stop --force > /dev/null 2>&1
ray start --head --include-dashboard=false --num-gpus 1 > "$OUT/ray.log" 2>&1 || finish 5
MODEL=$MODEL VRAM_BUDGET=${VRAM_BUDGET:-32GiB} SPACE=${SPACE:-configs/search_space_workloads.yaml} \
  TRIALS=${TRIALS:-6} REQUESTS=${REQUESTS:-32} LENGTH_SCALE=${LENGTH_SCALE:-0.5} CONCURRENCY=${CONCURRENCY:-8} \
  SLO=${SLO:-ttft_p95=20s,itl_p95=250ms} CONFIRM=${CONFIRM:-1} ROUNDS=${ROUNDS:-2} \
  bash scripts/workload_picks.sh "$OUT/picks" > "$OUT/picks.txt" 2> "$OUT/picks.log"
RC=$?
say "workload picks rc=$RC"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
finish "$RC"
