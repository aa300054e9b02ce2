#!/bin/bash
# kv-layout.sh DIR OUT   (run ON the GPU machine, from the repo root, after setup.sh)
# One K/V buffer per slot (the default) against one for all (kv_unified), where llama.cpp's micro-batch split
# should cost most: each micro-batch of a step reads the weights again on a GPU.
#   1. the 27B-class synthetic model (random weights: speed only) in process, both layouts as two engines of one
#      process (scripts/bench_http_path.py --local), 4 slots, the article's cache: one stream and four, TTFT and
#      decode, interleaved rounds; n_threads=4 keeps both engines' CPU threads under the cores (libgomp slows
#      both once its teams outnumber them: the script's help);
#   2. the embedded model (SMOL) through the thinnest HTTP path, each layout as its own app under Serve's
#      direct ingress, against the engine in process: the engine's own TTFT beside the client's (a client process
#      per stream, bench_http_path.py --clients processes).
# PAUSE_MS: idle time before each round (default 0), so each engine's idle saves finish before the next round.
# OUT/progress.log says where it is; OUT/done holds "rc=N". Start it with setsid and poll in calls that follow
# at once: a lent machine left idle for ~30 s goes back with everything on it.
set -uo pipefail
DIR=${1:?usage: kv-layout.sh DIR OUT}
OUT=${2:?usage: kv-layout.sh DIR OUT}
BUILD=${BUILD:-/tmp/lcpp}
MODEL=${MODEL:-/tmp/m27.gguf}
# shellcheck source=scripts/device/study-common.sh
source "$(dirname "$0")/study-common.sh"  # say, finish; the build waited for, the model written
SMOL=${SMOL:-$(python3 -c "from serving.engine.config import embedded_model_path as p; print(p())" 2>/dev/null)}
RC=0
ray stop --force > /dev/null 2>&1
say "27B-class in process, per-slot against unified"
python3 scripts/bench_http_path.py --engine model="$MODEL" --engine n_parallel=4 --engine n_ctx=8192 \
  --engine flash_attn=on --engine type_k=q8_0 --engine type_v=q8_0 --engine n_batch=512 --engine n_ubatch=512 \
  --engine n_threads=4 --local unified:kv_unified=true --levels 1,4 --max-tokens 64 --repeats "${REPEATS:-6}" \
  --pause-ms "${PAUSE_MS:-0}" \
  --json-out "$OUT/kv_layout_27b_$GPU.json" > "$OUT/kv_layout_27b.txt" 2>&1 || RC=$?
say "27B-class rc=$RC"
if [ -f "$SMOL" ]; then
  say "embedded model through the thinnest path, both layouts"
  python3 scripts/bench_http_path.py --engine model="$SMOL" --engine n_parallel=4 --engine n_ctx=4096 \
    --direct direct-engine:ingress=engine --direct direct-unified:ingress=engine,kv_unified=true \
    --max-tokens 64 --repeats "${REPEATS:-8}" --probe 50 --pause-ms "${PAUSE_MS:-0}" --clients processes \
    --json-out "$OUT/kv_layout_http_$GPU.json" > "$OUT/kv_layout_http.txt" 2>&1 || RC=$?
  say "embedded rc=$RC"
  ray stop --force > /dev/null 2>&1
else
  say "no embedded model at $SMOL: the HTTP half skipped"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
finish "$RC"
