#!/bin/bash
# headline.sh DIR OUT   (run ON the GPU machine, from the repo root, after setup.sh)
# The headline benchmark on the GPU, end to end, with the 27B-class synthetic model (random weights: speed only):
#   1. waits for setup.sh's llama.cpp build, writes the model (study-common.sh);
#   2. scripts/make_traces.py: the chat and agent traces (synthetic shapes of the public traces, Mooncake JSONL)
#      at LENGTH_SCALE, CHAT_REQUESTS and AGENT_REQUESTS arriving over DURATION seconds;           ~ seconds
#   3. per trace, the tuner's study on that trace (python -m tuning.search --offline, TRIALS trials of its first
#      STUDY_REQUESTS requests, CONFIRM confirmation rounds) under SLO and VRAM_BUDGET: its pick in
#      OUT/tuned_NAME.yaml;                                             estimated ~1.5-2.5 min a trace (a load, short trials)
#   4. scripts/bench_headline.py: llama-server's defaults, the article's flags and each trace's pick (on its own
#      trace), one at a time on the GPU, every trace replayed open loop, ROUNDS rounds, llama-server seeing
#      VRAM_BUDGET through --fit-target (a V100's 32 GiB emulated).     estimated ~5-6 min (4 loads, 6 replays of ~DURATION s)
# The arrival rates are meant to load llama-server's default slots past what they serve within the SLO (a trace
# every target serves within it says nothing: goodput is then the offered rate for all): 32 chat requests over
# 12 s is ~2.7 a second of ~100-200 output tokens each at LENGTH_SCALE 0.5, several times what 4 slots of a
# 27B-class model decode (~200 tok/s together on an H100); RATE_SCALE scales both traces' rates.
# The estimates are planned, not yet timed: the whole is meant to end in about 9 minutes on an H100 after the
# build (a lent GPU's 30 minutes hold the build, the model and this); lower TRIALS, DURATION or the request counts if
# it does not. Settings (environment): BUILD (/tmp/lcpp), MODEL (/tmp/m27.gguf), VRAM_BUDGET (32GiB), TRIALS (3),
# CONFIRM (0), LENGTH_SCALE (0.5), CHAT_REQUESTS (32), AGENT_REQUESTS (16), DURATION (12), STUDY_REQUESTS (10),
# SLO (ttft_p95=2s,itl_p95=100ms), ROUNDS (1), RATE_SCALE (1), SPACE (configs/search_space_workloads.yaml).
# OUT/progress.log says where it is; OUT/done holds "rc=N" at the end; OUT/headline.{json,md,png} are the result.
# Start it with setsid so it outlives the call that started it (poll it in calls that follow at once: the machine
# must stay warm).
set -uo pipefail
DIR=${1:?usage: headline.sh DIR OUT}
OUT=${2:?usage: headline.sh DIR OUT}
BUILD=${BUILD:-/tmp/lcpp}
MODEL=${MODEL:-/tmp/m27.gguf}
VRAM_BUDGET=${VRAM_BUDGET:-32GiB}
SLO=${SLO:-ttft_p95=2s,itl_p95=100ms}
# shellcheck source=scripts/device/study-common.sh
source "$(dirname "$0")/study-common.sh"  # say, finish; the build waited for, the model written
SERVER=$BUILD/build/bin/llama-server

say "traces"
python3 scripts/make_traces.py --out-dir "$OUT/traces" --shape chat --requests "${CHAT_REQUESTS:-32}" \
  --duration "${DURATION:-12}" --length-scale "${LENGTH_SCALE:-0.5}" >> "$OUT/progress.log" 2>&1 || finish 6
python3 scripts/make_traces.py --out-dir "$OUT/traces" --shape agent --requests "${AGENT_REQUESTS:-16}" \
  --duration "${DURATION:-12}" --length-scale "${LENGTH_SCALE:-0.5}" >> "$OUT/progress.log" 2>&1 || finish 6

picks=()
for name in chat agent; do
  # trials replay the trace's first requests; every slot must still hold the whole trace's largest request
  ctx=$(python3 -c "import sys; from pathlib import Path; from measure.replay import load_file
print(load_file(Path(sys.argv[1])).max_context)" "$OUT/traces/$name.jsonl") || finish 6
  say "study $name (slots of at least $ctx tokens)"
  python3 -m tuning.search --offline --no-apply --model "$MODEL" --workload "$OUT/traces/$name.jsonl" --slo "$SLO" \
    --requests "${STUDY_REQUESTS:-10}" --min-ctx-per-slot "$ctx" --vram-budget "$VRAM_BUDGET" --trials "${TRIALS:-3}" \
    --confirm-rounds "${CONFIRM:-0}" --space "${SPACE:-configs/search_space_workloads.yaml}" \
    --study-name "headline-$name-$GPU" --out "$OUT/tuned_$name.yaml" --results-dir "$OUT/study_$name" \
    > "$OUT/study_$name.txt" 2>&1
  say "study $name rc=$?"
  [ -f "$OUT/tuned_$name.yaml" ] && picks+=(--ours "$name=$OUT/tuned_$name.yaml")
done
ray stop --force > /dev/null 2>&1  # the bench starts a Ray of its own for our server

say "headline"
targets=defaults,article
[ ${#picks[@]} -gt 0 ] && targets+=,ours
python3 scripts/bench_headline.py --model "$MODEL" --llama-server "$SERVER" \
  --trace "chat=$OUT/traces/chat.jsonl" --trace "agent=$OUT/traces/agent.jsonl" --slo "$SLO" \
  --targets "$targets" "${picks[@]}" --vram-budget "$VRAM_BUDGET" --rounds "${ROUNDS:-1}" \
  --rate-scale "${RATE_SCALE:-1}" --out "$OUT/headline.json" > "$OUT/headline.txt" 2> "$OUT/headline.log"
RC=$?
say "headline rc=$RC"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
finish "$RC"
