#!/bin/bash
# live_study.sh OUT [TUNER ARGS...]   (from the repo root; CPU and the embedded model unless MODEL is set)
# An in-place study on the traffic the service records, as a user would run it, end to end:
#   1. `serve run serving.app:main` (MODEL=... for another GGUF);
#   2. CLIENTS clients stream chat completions back to back the whole time (scripts/stream_client.py), and
#      the service records their shapes (GET /traffic);
#   3. once /traffic holds RECORD requests, `python -m tuning.search` with TUNER ARGS (default: an SLO and a
#      short study) and no --workload: in place, the recorded traffic is the default workload;
#   4. stops the clients and saves what shows how it went: /slots and /traffic before and after (weight
#      loads, the config served), each client's count of ok and failed streams, the tuner's output and report.
# OUT/progress.log says where it is; OUT/done holds "rc=N" at the end.
set -uo pipefail
OUT=${1:?usage: live_study.sh OUT [TUNER ARGS...]}
shift
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--trials 4 --slo "ttft_p95=10s,itl_p95=300ms" --requests 40 --confirm-rounds 1)
CLIENTS=${CLIENTS:-2}
RECORD=${RECORD:-40}
URL=http://127.0.0.1:8000
mkdir -p "$OUT"
say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/progress.log"; }
# the clients stop on SIGINT and write their counts; `serve run`, started in the background of a script, has
# SIGINT ignored: SIGTERM shuts it down with the Ray it started
stop_all() { if [ ${#PIDS[@]} -gt 0 ]; then kill -INT "${PIDS[@]}" 2>/dev/null; wait "${PIDS[@]}" 2>/dev/null; fi
             kill -TERM "$SERVE" 2>/dev/null; wait "$SERVE" 2>/dev/null; }
finish() { echo "rc=$1" > "$OUT/done"; say "done rc=$1"; exit "$1"; }

say "serve run"
serve run serving.app:main ${MODEL:+model="$MODEL"} > "$OUT/serve.log" 2>&1 < /dev/null &
SERVE=$!
PIDS=()
for _ in $(seq 300); do
  curl -sf "$URL/health" > /dev/null && break
  sleep 1
done
curl -sf "$URL/health" > /dev/null || { say "the app did not become healthy"; tail -20 "$OUT/serve.log"; stop_all; finish 6; }
curl -s "$URL/slots" > "$OUT/slots_before.json"
for i in $(seq "$CLIENTS"); do
  python3 scripts/stream_client.py --url "$URL/v1" --out "$OUT/client$i.json" > /dev/null 2>&1 &
  PIDS+=($!)
done
say "healthy; $CLIENTS client(s) streaming; recording $RECORD requests"
until [ "$(curl -s "$URL/traffic?recent=0" | python3 -c 'import json,sys; print(json.load(sys.stdin)["recent"]["count"])')" -ge "$RECORD" ]; do
  sleep 2
done
curl -s "$URL/traffic" > "$OUT/traffic_before.json"
say "recorded; study: ${ARGS[*]}"
T0=$(date +%s)
python3 -m tuning.search --results-dir "$OUT/results" --out "$OUT/tuned.yaml" "${ARGS[@]}" > "$OUT/search.log" 2>&1
RC=$?
say "study rc=$RC in $(( $(date +%s) - T0 )) s"
kill -INT "${PIDS[@]}"; wait "${PIDS[@]}"
curl -s "$URL/slots" > "$OUT/slots_after.json"
curl -s "$URL/traffic?recent=0" > "$OUT/traffic_after.json"
cp "$OUT"/results/*/report.md "$OUT"/results/*/pareto.png "$OUT/" 2>/dev/null
python3 - "$OUT" <<'EOF' | tee -a "$OUT/progress.log"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
clients = [json.loads(p.read_text()) for p in sorted(out.glob("client*.json"))]
ok, failed = sum(c.get("ok", 0) for c in clients), sum(c.get("failed", 0) for c in clients)
before, after = (json.loads((out / f"slots_{w}.json").read_text()) for w in ("before", "after"))
loads = [s.get("weight_loads") for s in (before, after)]
print(f"clients: {ok} streams ok, {failed} failed; weight loads before/after the study: {loads[0]} / {loads[1]}")
EOF
PIDS=()
stop_all
finish "$RC"
