#!/bin/bash
# Do different workloads want different settings? One offline study per workload (each maximising goodput under
# the same SLO), then every pick replayed on every workload in one run (scripts/bench_workloads.py: rounds
# interleaved, goodput as ratios paired by round). Prints the cross table; everything lands in OUT_DIR.
#
#   scripts/workload_picks.sh [OUT_DIR]                       # the embedded model, CPU
#   MODEL=/models/qwen27b.gguf VRAM_BUDGET=32GiB LENGTH_SCALE=1 REQUESTS=100 scripts/workload_picks.sh results/picks-gpu
#
# Settings (environment): WORKLOADS ("chat rag"), SLO, TRIALS, REQUESTS (per replay), LENGTH_SCALE (token
# lengths times this: a small machine's quick run keeps each workload's mix), CONFIRM (confirmation rounds),
# ROUNDS (cross-table rounds), CONCURRENCY (closed-loop clients), MODEL, VRAM_BUDGET, SPACE (a search-space
# YAML: a short study over a narrower space, e.g. configs/search_space_workloads.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/workload_picks}
WORKLOADS=${WORKLOADS:-chat rag}
SLO=${SLO:-ttft_p95=30s,itl_p95=250ms}
TRIALS=${TRIALS:-6}
REQUESTS=${REQUESTS:-16}
LENGTH_SCALE=${LENGTH_SCALE:-0.5}
CONFIRM=${CONFIRM:-2}
ROUNDS=${ROUNDS:-3}
CONCURRENCY=${CONCURRENCY:-4}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"
extra=()
[ -n "${MODEL:-}" ] && extra+=(--model "$MODEL")
[ -n "${VRAM_BUDGET:-}" ] && extra+=(--vram-budget "$VRAM_BUDGET")
[ -n "${SPACE:-}" ] && extra+=(--space "$SPACE")
configs=()
for w in $WORKLOADS; do
  echo "== study: $w (slo $SLO, $TRIALS trials, $REQUESTS requests, lengths x$LENGTH_SCALE)" >&2
  python -m tuning.search --offline --no-apply --trials "$TRIALS" --workload "$w" --slo "$SLO" \
    --requests "$REQUESTS" --length-scale "$LENGTH_SCALE" --concurrency "$CONCURRENCY" \
    --confirm-rounds "$CONFIRM" --results-dir "$OUT" --study-name "picks-$w-$STAMP" --out "$OUT/tuned-$w.yaml" \
    "${extra[@]}"
  configs+=(--config "$w=$OUT/tuned-$w.yaml")
done
bench_extra=()
[ -n "${MODEL:-}" ] && bench_extra+=(--engine "model=$MODEL")
echo "== cross table" >&2
python scripts/bench_workloads.py "${configs[@]}" $(for w in $WORKLOADS; do echo --workload "$w"; done) \
  --slo "$SLO" --requests "$REQUESTS" --length-scale "$LENGTH_SCALE" --concurrency "$CONCURRENCY" \
  --rounds "$ROUNDS" --out "$OUT/cross.json" "${bench_extra[@]}"
