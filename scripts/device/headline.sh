#!/bin/bash
# headline.sh DIR OUT   (run ON the GPU machine, from the repo root, after setup.sh)
# The headline benchmark on the GPU, end to end, with the 27B-class synthetic model (random weights: speed only):
#   1. waits for setup.sh's llama.cpp build, writes the model (study-common.sh);
#   2. scripts/make_traces.py: the chat and agent traces (synthetic shapes of the public traces, Mooncake JSONL)
#      at LENGTH_SCALE, CHAT_REQUESTS and AGENT_REQUESTS arriving over DURATION seconds;           ~ seconds
#   3. per trace, the tuner's study on that trace (python -m tuning.search --offline, TRIALS trials of its first
#      STUDY_REQUESTS requests at STUDY_RATE_SCALE times the trace's rate, CONFIRM confirmation rounds) under SLO
#      and VRAM_BUDGET: its pick in OUT/tuned_NAME.yaml;              2026-12-07, H100: 1.3 min (chat), 1.8 min (agent)
#   4. scripts/bench_headline.py: llama-server's defaults, the article's flags and each trace's pick (on its own
#      trace), one at a time on the GPU, every trace replayed open loop at each RATE_SCALE, ROUNDS rounds,
#      llama-server seeing VRAM_BUDGET through --fit-target (a V100's 32 GiB emulated); per trace the highest
#      rate each target holds within the SLO.      2026-12-07, H100, one rate, 2 targets: 2 min; three rates planned
#      at ~8-10 min for 3 targets (not yet timed)
# The first run (2026-12-07, docs/log/2026-12-07-h100-door-headline.md) replayed the traces at their own rate only:
# 32 chat requests over 12 s, ~2.6 a second of ~100 output tokens at LENGTH_SCALE 0.5, two to three times what
# the 27B-class decodes on an H100 (108-133 output tok/s at 2-4 slots). Every target's TTFT p95 passed 13 s, and
# no trial of either study met the SLO, so no pick was written. Hence the rates: the studies run at
# STUDY_RATE_SCALE (0.4) of the trace's rate, and the benchmark at 0.3, 0.6 and 1 times it, where at least the
# lowest should be held by a good config and the highest by none.
# Settings (environment): BUILD (/tmp/lcpp), MODEL (/tmp/m27.gguf), VRAM_BUDGET (32GiB), TRIALS (3),
# CONFIRM (0), LENGTH_SCALE (0.5), CHAT_REQUESTS (32), AGENT_REQUESTS (16), DURATION (12), STUDY_REQUESTS (10),
# STUDY_RATE_SCALE (0.4), SLO (ttft_p95=2s,itl_p95=100ms), ROUNDS (1), RATE_SCALE (0.3,0.6,1: one or several),
# SPACE (configs/search_space_workloads.yaml).
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
    --requests "${STUDY_REQUESTS:-10}" --rate-scale "${STUDY_RATE_SCALE:-0.4}" --min-ctx-per-slot "$ctx" --vram-budget "$VRAM_BUDGET" --trials "${TRIALS:-3}" \
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
  --rate-scale "${RATE_SCALE:-0.3,0.6,1}" --out "$OUT/headline.json" > "$OUT/headline.txt" 2> "$OUT/headline.log"
RC=$?
say "headline rc=$RC"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
finish "$RC"
