#!/bin/bash
# inplace-study.sh DIR OUT [TUNER ARGS...]   (run ON the GPU machine, from the repo root, after setup.sh)
# An in-place study on the GPU that serves, as a new user on one GPU would run it, end to end:
#   1. waits for setup.sh's llama.cpp build, writes the 27B-class synthetic model (random weights: speed only);
#   2. starts Ray, then `serve run serving.app:main` on that model (the article's cache types, 4 slots);
#   3. streams chat completions back to back the whole time (scripts/stream_client.py);
#   4. runs `python -m tuning.search --in-place` with TUNER ARGS (default: the study of docs/log/2026-12-04-h200-inplace-study.md,
#      40 trials, a V100's 32 GiB, capacity floor 20, 2 repeats, 2 confirmation rounds);
#   5. stops the client and saves what shows the study ran in place: /slots before and after (weight loads,
#      the config served), the client's count of ok and failed streams, nvidia-smi, the tuner's report.
# Each step writes OUT/progress.log; OUT/done holds "rc=N" at the end. Start it with setsid so it outlives
# the call that started it (the machine must stay warm: poll it in calls that follow at once).
set -uo pipefail
DIR=${1:?usage: inplace-study.sh DIR OUT [TUNER ARGS...]}
OUT=${2:?usage: inplace-study.sh DIR OUT [TUNER ARGS...]}
shift 2
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--trials 40 --vram-budget 32GiB --min-stream-tok-s 20 --repeats 2 --confirm-rounds 2)
BUILD=${BUILD:-/tmp/lcpp}
MODEL=${MODEL:-/tmp/m27.gguf}
URL=http://127.0.0.1:8000
# shellcheck source=scripts/device/study-common.sh
source "$(dirname "$0")/study-common.sh"  # say, finish; the build waited for, the model written
ray stop --force > /dev/null 2>&1
ray start --head --include-dashboard=false --num-gpus 1 > "$OUT/ray.log" 2>&1 || finish 5
say "serve run"
setsid nohup serve run serving.app:main model="$MODEL" n_parallel=4 n_ctx=8192 type_k=q8_0 type_v=q8_0 \
  flash_attn=on > "$OUT/serve.log" 2>&1 < /dev/null &
for _ in $(seq 300); do
  curl -sf "$URL/health" > /dev/null && break
  sleep 1
done
curl -sf "$URL/health" > /dev/null || { say "the app did not become healthy"; tail -20 "$OUT/serve.log"; finish 6; }
curl -s "$URL/slots" > "$OUT/slots_before.json"
say "healthy; client and study"
python3 scripts/stream_client.py --url "$URL/v1" --out "$OUT/client.json" > /dev/null 2>&1 &
CLIENT=$!
T0=$(date +%s)
python3 -m tuning.search --in-place --results-dir "$OUT/results" --out "$OUT/tuned.yaml" "${ARGS[@]}" \
  > "$OUT/search.log" 2>&1
RC=$?
say "study rc=$RC in $(( $(date +%s) - T0 )) s"
kill -INT "$CLIENT"; wait "$CLIENT"
curl -s "$URL/slots" > "$OUT/slots_after.json"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
cp "$OUT"/results/*/report.md "$OUT"/results/*/pareto.png "$OUT/" 2>/dev/null
finish "$RC"
