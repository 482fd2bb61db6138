#!/usr/bin/env bash
# The main demo: a local coordinator, N CPU workers on loopback, and the same training job run
# twice at the same bytes on the wire: once with Euclidean FP8 (geometry none) and once with
# GeoFP8 (the spec's geometry). Each is watched live and gets the same policy change mid-run (the
# MLP matrices to NVFP4). It ends with a per-layer table of exchange error, Euclidean against
# GeoFP8, the wire bytes against fp32, the validation loss of each on held-out data, and a PNG of
# validation loss and per-layer error (scripts/demo_compare.py). About 5-6 minutes on 2 cores after the build.
#
# Usage: scripts/demo.sh            (as root on a fresh Debian 12 machine: installs, builds, runs)
# Environment:
#   GEOFP8_DEMO_WORKERS  workers and ranks, 2..4 (default 2)
#   GEOFP8_DEMO_JOB      job spec with a geometry (default examples/jobs/demo-local.yaml); the
#                        Euclidean run is the same spec with every `geometry:` set to none
#   GEOFP8_DEMO_OUT      state, logs, checkpoints (default ./demo-out; cleared on each run)
#   GEOFP8_DEMO_POLICY_STEP  step after which the policy is changed (default 100)
#   GEOFP8_DEMO_KEEP=1   leave coordinator and workers running after the job (Ctrl-C stops them)
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# Debian's interpreter (python3-matplotlib), not one earlier on PATH.
PY=/usr/bin/python3; [ -x "$PY" ] || PY=python3
cd "$GEOFP8_ROOT"

WORKERS="${GEOFP8_DEMO_WORKERS:-2}"
JOB_SPEC="${GEOFP8_DEMO_JOB:-$GEOFP8_ROOT/examples/jobs/demo-local.yaml}"
OUT="${GEOFP8_DEMO_OUT:-$GEOFP8_ROOT/demo-out}"
POLICY_STEP="${GEOFP8_DEMO_POLICY_STEP:-100}"
case "$WORKERS" in
  2|3|4) ;;
  *) echo "demo.sh: error: GEOFP8_DEMO_WORKERS: must be 2, 3 or 4 ($WORKERS)" >&2; exit 2 ;;
esac
[ -f "$JOB_SPEC" ] || { echo "demo.sh: error: GEOFP8_DEMO_JOB: no such file ($JOB_SPEC)" >&2; exit 2; }

ensure_packages
# Only the three programs the demo runs (the tests and benchmarks are scripts/test.sh's).
GEOFP8_BUILD_TARGETS="${GEOFP8_BUILD_TARGETS:-geofp8-coordinator geofp8-worker geofp8ctl}" \
  configure_and_build

COORDINATOR="$GEOFP8_BUILD/server/coordinator/geofp8-coordinator"
WORKER="$GEOFP8_BUILD/worker/daemon/geofp8-worker"
CTL="$GEOFP8_BUILD/client/ctl/geofp8ctl"
for bin in "$COORDINATOR" "$WORKER" "$CTL"; do
  [ -x "$bin" ] || { echo "demo.sh: error: build did not produce $bin" >&2; exit 1; }
done

# A fresh state directory each run: the demo is idempotent.
rm -rf "$OUT"
mkdir -p "$OUT"
PIDS=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  if [ ${#PIDS[@]} -gt 0 ]; then
    log "shutting down (logs in $OUT)"
    # Workers first, so the coordinator sees them leave; then the coordinator.
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill -TERM "${PIDS[$i]}" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    done
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Waits (up to 30 s) for a daemon's --ready-file READY and prints its field KEY (grpc, metrics).
wait_for_ready() {
  local ready="$1" key="$2" pid="$3" log="$4"
  for _ in $(seq 300); do
    if [ -s "$ready" ]; then
      python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$ready" "$key"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "demo.sh: error: process exited; see $log" >&2; cat "$log" >&2; return 1; }
    sleep 0.1
  done
  echo "demo.sh: error: timed out waiting for $ready; see $log" >&2
  return 1
}

log "starting geofp8-coordinator (SQLite in $OUT/coordinator)"
rm -f "$OUT"/*.ready.json
"$COORDINATOR" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data-dir "$OUT/coordinator" \
  --heartbeat-timeout-ms 5000 --ready-file "$OUT/coordinator.ready.json" >"$OUT/coordinator.log" 2>&1 &
PIDS+=($!)
SERVER="$(wait_for_ready "$OUT/coordinator.ready.json" grpc "${PIDS[0]}" "$OUT/coordinator.log")"
COORD_METRICS="http://$(wait_for_ready "$OUT/coordinator.ready.json" metrics "${PIDS[0]}" "$OUT/coordinator.log")/metrics"
export GEOFP8_SERVER="$SERVER"

log "starting $WORKERS geofp8-worker processes"
WORKER_METRICS=()
for ((i = 0; i < WORKERS; i++)); do
  "$WORKER" --coordinator "$SERVER" --name "demo-worker-$i" --metrics-port 0 \
    --data-dir "$OUT/worker-$i" --ready-file "$OUT/worker-$i.ready.json" >"$OUT/worker-$i.log" 2>&1 &
  PIDS+=($!)
  WORKER_METRICS+=("http://$(wait_for_ready "$OUT/worker-$i.ready.json" metrics "$!" "$OUT/worker-$i.log")/metrics")
done
for _ in $(seq 300); do
  idle="$("$CTL" get workers 2>/dev/null | grep -c ' IDLE ' || true)"
  [ "$idle" -ge "$WORKERS" ] && break
  sleep 0.1
done
"$CTL" get workers

# Two specs from one: the world size follows the number of workers; the Euclidean run sets every
# `geometry:` to none and changes nothing else, so both put the same bytes on the wire.
GEO_SPEC="$OUT/geofp8.yaml"
EUC_SPEC="$OUT/euclid-fp8.yaml"
sed -E -e "s/^world_size: *[0-9]+/world_size: $WORKERS/" -e "s/^name: .*/name: demo-geofp8/" \
  "$JOB_SPEC" >"$GEO_SPEC"
sed -E -e "s/^( *)geometry: *[a-z_]+/\1geometry: none/" -e "s/^name: .*/name: demo-euclid-fp8/" \
  "$GEO_SPEC" >"$EUC_SPEC"
if ! grep -Eq '^ *geometry: *(diag|lowrank)' "$GEO_SPEC"; then
  echo "demo.sh: warning: $JOB_SPEC sets no geometry: both runs are Euclidean" >&2
fi
PLOT="$OUT/geofp8-vs-fp8.png"

# Mid-run, switch the MLP matrices to NVFP4 (geometry stays as it is): the coordinator picks the
# effective step, every worker applies it exactly there. Both runs get the same change.
change_policy() {
  local job="$1"
  for _ in $(seq 3000); do
    step="$("$CTL" get job "$job" -o 'jsonpath={.progress.step} {.state}' 2>/dev/null || true)"
    case "$step" in
      *succeeded*|*failed*|*cancelled*) return 0 ;;
    esac
    if [ "${step%% *}" -ge "$POLICY_STEP" ] 2>/dev/null; then
      "$CTL" policy set "$job" --layer 'layers.*.mlp.*' --format nvfp4 \
        --reason "demo: NVFP4 on the MLP matrices" || true
      return 0
    fi
    sleep 0.2
  done
}

# Both jobs are submitted now; the second waits (PENDING) until the first frees the workers.
for spec in "$EUC_SPEC" "$GEO_SPEC"; do
  log "submitting $(basename "$spec") (world size $WORKERS)"
  "$CTL" submit -f "$spec" --idempotency-key "demo-$$-$(basename "$spec")"
done
"$CTL" get jobs

status=0
for name in demo-euclid-fp8 demo-geofp8; do
  change_policy "$name" >"$OUT/$name.policy-change.log" 2>&1 &
  POLICY_PID=$!
  "$PY" "$GEOFP8_ROOT/scripts/demo_compare.py" record "$CTL" "$name" "$OUT/$name.jsonl" \
    >"$OUT/$name.record.log" 2>&1 &
  RECORD_PID=$!
  log "watching $name (jobs by name; policy change after step $POLICY_STEP; Ctrl-C stops the demo)"
  "$CTL" watch "$name" || status=$?
  wait "$POLICY_PID" 2>/dev/null || true
  wait "$RECORD_PID" || { echo "demo.sh: error: recording $name failed:" >&2; cat "$OUT/$name.record.log" >&2; status=1; }
  log "policy change of $name"
  cat "$OUT/$name.policy-change.log"
done

log "final description of demo-geofp8"
"$CTL" describe job demo-geofp8 || true

log "Euclidean FP8 against GeoFP8, same job, same bytes"
"$PY" "$GEOFP8_ROOT/scripts/demo_compare.py" report --euclid "$OUT/demo-euclid-fp8.jsonl" \
  --geo "$OUT/demo-geofp8.jsonl" --png "$PLOT" --json "$OUT/comparison.json" || status=1

log "metrics"
echo "coordinator: $COORD_METRICS"
for ((i = 0; i < WORKERS; i++)); do echo "worker $i:    ${WORKER_METRICS[$i]}"; done
python3 - "${WORKER_METRICS[0]}" <<'EOF' || true
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
# The jobs have ended, so their gauges (step, loss, per-layer error) are gone; their counters
# (labelled job_id) stay for the last few jobs.
keep = ("geofp8_build_info", "geofp8_worker_jobs_total", "geofp8_worker_steps_total",
        "geofp8_exchange_seconds_sum", "geofp8_exchange_seconds_count")
print("worker 0, a few series:")
for line in text.splitlines():
    if line.startswith(keep) or (line.startswith("geofp8_exchange_bytes_total{")
                                 and 'layer="layers.0.mlp.w1"' in line):
        print("  " + line)
EOF
echo "checkpoints and results: $OUT/worker-*/"
echo "comparison: $OUT/comparison.json; plot of validation loss and per-layer error: $PLOT"

if [ "${GEOFP8_DEMO_KEEP:-0}" = "1" ]; then
  log "GEOFP8_DEMO_KEEP=1: coordinator at $SERVER; Ctrl-C stops everything"
  while true; do sleep 3600; done
fi
exit "$status"
