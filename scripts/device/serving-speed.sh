#!/bin/bash
# serving-speed.sh DIR OUT   (run ON the GPU machine, from the repo root, after setup.sh)
# The serving-speed half of docs/performance.md on the GPU, end to end:
#   1. waits for setup.sh's llama.cpp build, writes the 27B-class synthetic model (random weights: speed only);
#   2. scripts/guide_costs.py (each llguidance call per token, no decoding), then
#      scripts/bench_constrained.py on the embedded model (SMOL, a real model): each constraint as the server
#      compiles it (llguidance) and as GBNF, beside its unconstrained twin, and llama-server on the same requests,
#      then the step thread's parts timed per token (--breakdown); with OLD_TREE=DIR (another checkout of this
#      repository, e.g. the commit before a change) the same benchmark of ours from there, right after: an A/B
#      in one run (OLD_HTTP_TREE=DIR: the same for the HTTP path below);
#   3. scripts/bench_http_path.py on the embedded model: TTFT and decode through the server (the relay, and
#      ingress=engine, through Serve's proxy; and ingress=engine under Serve's direct ingress, the thinnest path)
#      against the engine in-process, one stream and four, and the first-token probe, with llama-server on the
#      same model through the same client beside them (a client process per stream: HTTP_CLIENTS), then
#      HTTP_TRACE (default 6) traced rounds, each stream's TTFT split by our app's stamps (--server-trace);
#      HTTP_PROMPT_SET (default plain; chat: the instructions as chat messages: bench_http_path.py --prompt-set);
#      HTTP_PROBE probe requests (default 100), HTTP_PAUSE_MS idle before each round and probe request (default 100:
#      no target's idle work, or spinning threads, in another's time);
#   4. scripts/bench_conversations.py on the 27B-class model: six conversations over two slots, ours against
#      llama-server --cache-ram 8192 and 0, THINK_MS between turns (default 0) (CONVERSATIONS=0 skips it;
#      CONSTRAINED=0 skips step 2).
# SMOL: the embedded GGUF (default: where install-embedded.sh installed it). OUT/progress.log says
# where it is; OUT/done holds "rc=N". Start it with setsid and poll in calls that follow at once: a lent machine
# left idle for ~30 s goes back with everything on it (the build, the models, a run half done).
set -uo pipefail
DIR=${1:?usage: serving-speed.sh DIR OUT}
OUT=${2:?usage: serving-speed.sh DIR OUT}
BUILD=${BUILD:-/tmp/lcpp}
MODEL=${MODEL:-/tmp/m27.gguf}
# shellcheck source=scripts/device/study-common.sh
source "$(dirname "$0")/study-common.sh"  # say, finish; the build waited for, the model written
SERVER=$BUILD/build/bin/llama-server
SMOL=${SMOL:-$(python3 -c "from serving.engine.config import embedded_model_path as p; print(p())" 2>/dev/null)}
[ -f "$SMOL" ] || { say "no embedded model at $SMOL"; finish 6; }

if [ "${CONSTRAINED:-1}" != 0 ]; then
  say "guide costs (embedded model's vocabulary)"
  python3 scripts/guide_costs.py --model "$SMOL" --out "$OUT/guide_costs_$GPU.json" > "$OUT/guide_costs.txt" 2>&1
  say "guide costs rc=$?"

  say "constrained (embedded model)"
  python3 scripts/bench_constrained.py --model "$SMOL" --rounds "${ROUNDS:-5}" --llama-server "$SERVER" \
    --breakdown 3 --out "$OUT/bench_constrained_$GPU.json" > "$OUT/constrained.txt" 2>&1
  say "constrained rc=$?"
  if [ -n "${OLD_TREE:-}" ]; then
    (cd "$OLD_TREE" && python3 scripts/bench_constrained.py --model "$SMOL" --rounds "${ROUNDS:-5}" \
      --out "$OUT/bench_constrained_old_$GPU.json") > "$OUT/constrained_old.txt" 2>&1
    say "constrained from $OLD_TREE rc=$?"
  fi
fi

say "HTTP path (embedded model)"
# HTTP_PATHS: the paths measured (bench_http_path.py's --variant/--direct words); default: Serve's proxy with the
# relay and with ingress=engine, and ingress=engine under direct ingress
read -r -a PATHS <<< "${HTTP_PATHS:---variant default --variant engine:ingress=engine --direct direct-engine:ingress=engine}"
HTTP=(--engine model="$SMOL" --engine n_parallel=4 --engine n_ctx=4096 --max-tokens 64
      --prompt-set "${HTTP_PROMPT_SET:-plain}"
      --repeats "${HTTP_REPEATS:-10}" --probe "${HTTP_PROBE:-100}" --pause-ms "${HTTP_PAUSE_MS:-100}")
ray stop --force > /dev/null 2>&1
# llama-server on the same model, slots and context, through the same client: what any server's HTTP costs here
LS_PORT=18080
"$SERVER" -m "$SMOL" --host 127.0.0.1 --port $LS_PORT -np 4 -c 4096 -ngl 999 > "$OUT/llama_server_http.log" 2>&1 &
LS_PID=$!
for _ in $(seq 60); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$LS_PORT/health', timeout=2)" 2>/dev/null && break
  sleep 1
done
# HTTP_CLIENTS (default processes): how the --server and --direct targets' streams are run (bench_http_path.py
# --clients): a client process per stream, so no stream's TTFT holds another's client time
TRACE=()
[ "${HTTP_TRACE:-6}" != 0 ] && TRACE=(--trace "${HTTP_TRACE:-6}" --server-trace)
python3 scripts/bench_http_path.py "${PATHS[@]}" --server "llama-server=http://127.0.0.1:$LS_PORT/v1" "${HTTP[@]}" \
  --clients "${HTTP_CLIENTS:-processes}" "${TRACE[@]}" --json-out "$OUT/bench_http_path_$GPU.json" > "$OUT/http_path.txt" 2>&1
say "HTTP path rc=$?"
kill $LS_PID 2>/dev/null
ray stop --force > /dev/null 2>&1
if [ -n "${OLD_HTTP_TREE:-}" ]; then
  # its Ray's replicas import `serving` through PYTHONPATH, whose first entry (env.sh) is this tree
  (cd "$OLD_HTTP_TREE" && PYTHONPATH="$OLD_HTTP_TREE:${PYTHONPATH#*:}" python3 scripts/bench_http_path.py \
    "${PATHS[@]}" "${HTTP[@]}" \
    --json-out "$OUT/bench_http_path_old_$GPU.json") > "$OUT/http_path_old.txt" 2>&1
  say "HTTP path from $OLD_HTTP_TREE rc=$?"
  ray stop --force > /dev/null 2>&1
fi

RC=0
if [ "${CONVERSATIONS:-1}" != 0 ]; then
  say "conversations (27B-class)"
  python3 scripts/bench_conversations.py --model "$MODEL" --engine n_parallel=2 --engine n_ctx=8192 \
    --engine flash_attn=on --engine type_k=q8_0 --engine type_v=q8_0 --llama-server "$SERVER" \
    --server-args "-np 2 -c 8192 -fa on -ctk q8_0 -ctv q8_0 -ngl 999" --think-ms "${THINK_MS:-0}" \
    --out "$OUT/conversations_$GPU.json" \
    > "$OUT/conversations.txt" 2>&1
  RC=$?
  say "conversations rc=$RC"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
finish "$RC"
