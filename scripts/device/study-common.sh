# study-common.sh   (sourced by inplace-study.sh and workload-study.sh, ON the GPU machine, from the repo root)
# Needs DIR, OUT, BUILD and MODEL set. Defines say (a timestamped line to OUT/progress.log) and finish (OUT/done
# holds "rc=N"); sources setup.sh's env.sh, writes the 27B-class synthetic model (random weights: speed only)
# unless it is there, while llama.cpp builds, then waits for the build.
mkdir -p "$OUT"
say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/progress.log"; }
# The card's short name (h100, h200) for result files: the same scripts run on either kind.
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE 'H[0-9]+' | tr '[:upper:]' '[:lower:]')
GPU=${GPU:-gpu}
finish() { echo "rc=$1" > "$OUT/done"; say "done rc=$1"; exit "$1"; }

# shellcheck disable=SC1091
source "$BUILD/env.sh"  # setup.sh writes it at once; the build's libraries come later
say "model (while llama.cpp builds)"
[ -f "$MODEL" ] || python3 scripts/make_synthetic_gguf.py --preset qwen27b --tokenizer-from "$DIR/tokenizer.gguf" \
  --out "$MODEL" >> "$OUT/progress.log" 2>&1 || finish 4
until [ -f "$BUILD/build.done" ]; do sleep 5; done
grep -q "rc=0" "$BUILD/build.done" || { say "llama.cpp build failed: $(tail -5 "$BUILD/build.log")"; finish 3; }
say "build ready"
