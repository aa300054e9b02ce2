#!/bin/bash
# inplace-study.sh DIR OUT [EXTRA TUNER FLAGS...]   (run ON the GPU machine, from the repo root, after setup.sh)
# The README's tuning command as a new user on one GPU runs it beside a serving app, end to end:
#   1. waits for setup.sh's llama.cpp build, writes the 27B-class synthetic model (random weights: speed only);
#   2. starts Ray, then `serve run serving.app:main` on that model (the article's cache types, 4 slots);
#   3. streams chat completions back to back the whole time (scripts/stream_client.py), and waits until the app
#      has recorded as many client requests as the tuner replays by default (tuning/options.py LIVE_MIN_REQUESTS;
#      fewer: it measures the fixed benchmark instead), at most WAIT_TRAFFIC_S (600) seconds;
#   4. runs `python -m tuning.search --trials 40` as written: with an app serving it tunes in place, on the
#      app's recorded traffic; EXTRA TUNER FLAGS are added after it, none by default (the 2026-12-04 study of
#      docs/performance.md added --vram-budget 32GiB --min-stream-tok-s 20 --repeats 2 --confirm-rounds 2).
#      The device adds only its environment: setup.sh's env.sh, and `python` for python3 where the image has
#      no `python`. The results go where the command puts them (results/, configs/tuned.yaml; a results/optuna.db
#      left by an earlier run on a warm machine is resumed, as the command does) and are copied to OUT;
#   5. stops the client and saves what shows the study ran in place and on what: /slots before and after (weight
#      loads, the config served), the client's count of ok and failed streams, the workload the tuner measured
#      (its `workload:` line, also in OUT/progress.log), nvidia-smi, the tuner's report.
# Each step writes OUT/progress.log; OUT/done holds "rc=N" at the end. Start it with setsid so it outlives the
# call that started it (the machine must stay warm: poll it in calls that follow at once).
set -uo pipefail
DIR=${1:?usage: inplace-study.sh DIR OUT [EXTRA TUNER FLAGS...]}
OUT=${2:?usage: inplace-study.sh DIR OUT [EXTRA TUNER FLAGS...]}
shift 2
BUILD=${BUILD:-/tmp/lcpp}
MODEL=${MODEL:-/tmp/m27.gguf}
WAIT_TRAFFIC_S=${WAIT_TRAFFIC_S:-600}
URL=http://127.0.0.1:8000
# shellcheck source=scripts/device/study-common.sh
source "$(dirname "$0")/study-common.sh"  # say, finish; the build waited for, the model written
command -v python > /dev/null || python() { python3 "$@"; }

# recorded_requests: the client requests the app's /traffic holds now (what the tuner would replay); 0 if no answer
recorded_requests() {
  curl -sf "$URL/traffic?recent=0" | python3 -c "import json, sys; print(json.load(sys.stdin)['recent']['count'])" \
    2> /dev/null || echo 0
}

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
say "healthy; client"
python3 scripts/stream_client.py --url "$URL/v1" --out "$OUT/client.json" > /dev/null 2>&1 &
CLIENT=$!
NEED=$(python3 -c "from tuning.options import LIVE_MIN_REQUESTS; print(LIVE_MIN_REQUESTS)")
WAITED=0
until [ "$(recorded_requests)" -ge "$NEED" ] || [ "$WAITED" -ge "$WAIT_TRAFFIC_S" ]; do
  sleep 5
  WAITED=$((WAITED + 5))
done
say "recorded traffic: $(recorded_requests) client requests after ${WAITED} s (the tuner replays it from $NEED on)"
[ -f results/optuna.db ] && say "results/optuna.db is there already: the study resumes it (remove it for a fresh one)"
say "study: python -m tuning.search --trials 40 $*"
T0=$(date +%s)
python -m tuning.search --trials 40 "$@" > "$OUT/search.log" 2>&1
RC=$?
say "study rc=$RC in $(( $(date +%s) - T0 )) s; measured $(grep -m1 '^workload: ' "$OUT/search.log" || echo 'workload: (no workload line: see search.log)')"
kill -INT "$CLIENT"; wait "$CLIENT"
curl -s "$URL/slots" > "$OUT/slots_after.json"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
REPORT=$(ls -td results/*/report.md 2> /dev/null | head -1)
[ -n "$REPORT" ] && cp "$(dirname "$REPORT")"/*.md "$(dirname "$REPORT")"/*.png "$OUT/" 2> /dev/null
cp configs/tuned.yaml "$OUT/" 2> /dev/null
finish "$RC"
