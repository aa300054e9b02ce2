#!/bin/bash
# door-study.sh DIR OUT   (run ON the GPU machine, from the repo root, after setup.sh; install-embedded.sh for step 2)
# What a user meets at the door, on the GPU, beside llama-server from the same llama.cpp build:
#   1. fit at start: placement-study.sh with our engine's own fit (`n_gpu_layers=auto` at the budget, as
#      `serve run model=big.gguf` starts) beside the memory model's placements and llama-server `--fit on`
#      seeing the same free memory: the 27B-class dense at 10 GiB and the 30B-A3B-class MoE at 8 GiB (synthetic
#      models, random weights: speed and memory only); ~4-6 min with both models written;
#   2. structured output that ends at full speed: scripts/bench_constrained.py on the embedded model (real
#      weights): a forced tool call and a json_schema answer whose schema holds nested arrays of objects, each
#      beside its unconstrained twin, streamed, ROUNDS rounds (default 8, ~1 min); skipped without the model;
#   3. the K/V type and flash attention at an agent's depth: scripts/bench_verify.py at DEPTH (default 65536)
#      cached tokens on the 27B-class model, one decoded token's time for f16 K/V with flash attention on and
#      off and q8_0 with it on (~1 min each: the prefill of DEPTH tokens dominates).
# STEPS (default "fit constrained longctx") picks the steps. OUT/progress.log says where it is; OUT/done holds
# "rc=N". Start it with setsid and poll in calls that follow at once: a lent machine left idle for ~30 s goes
# back with everything on it.
set -uo pipefail
DIR=${1:?usage: door-study.sh DIR OUT}
OUT=${2:?usage: door-study.sh DIR OUT}
BUILD=${BUILD:-/tmp/lcpp}
MODEL=${MODEL:-/tmp/m27.gguf}
HERE=$(dirname "$0")
# shellcheck source=scripts/device/study-common.sh
source "$HERE/study-common.sh"  # say, finish; the build waited for, the dense model written
STEPS=${STEPS:-fit constrained longctx}
RC=0
step() { [[ " $STEPS " == *" $1 "* ]]; }

if step fit; then
  say "fit at start (placement-study.sh)"
  EXTRA_moe="fit:n_gpu_layers=auto,vram_budget=${MOE_BUDGET:-8GiB}" \
    EXTRA_dense="fit:n_gpu_layers=auto,vram_budget=${DENSE_BUDGET:-10GiB}" TRIALS=0 SAME_FLAGS=0 \
    bash "$HERE/placement-study.sh" "$DIR" "$OUT/placement" > "$OUT/placement.txt" 2>&1 || RC=$?
  say "fit at start rc=$RC"
fi

SMOL=${SMOL:-$(python3 -c "from serving.engine.config import embedded_model_path as p; print(p())" 2>/dev/null)}
if step constrained; then
  if [ -f "$SMOL" ]; then
    say "forced tool call, nested (embedded model)"
    python3 scripts/bench_constrained.py --model "$SMOL" --rounds "${ROUNDS:-8}" --gen-tokens 160 \
      --modes json_schema_nested,tool_call_nested --no-gbnf --out "$OUT/bench_constrained_nested_$GPU.json" \
      > "$OUT/constrained.txt" 2>&1 || RC=$?
    say "constrained rc=$RC"
  else
    say "no embedded model at $SMOL: the constrained step skipped"
  fi
fi

if step longctx; then
  for pair in "f16 on" "f16 off" "q8_0 on"; do
    read -r kv fa <<< "$pair"
    say "depth ${DEPTH:-65536}: K/V $kv, flash attention $fa"
    python3 scripts/bench_verify.py --model "$MODEL" --depth "${DEPTH:-65536}" --max-k 1 --repeats 9 \
      --type-kv "$kv" --flash-attn "$fa" --out "$OUT/bench_verify_${kv}_fa${fa}_$GPU.json" \
      > "$OUT/longctx_${kv}_fa${fa}.txt" 2>&1 || RC=$?
    say "K/V $kv fa $fa rc=$RC"
  done
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
finish "$RC"
