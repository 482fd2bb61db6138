#!/usr/bin/env bash
# The main demo: a local coordinator, N CPU workers on loopback, a GeoFP8 training job watched
# live, a policy changed mid-run, then the final job description and where the metrics are.
#
# Usage: scripts/demo.sh            (as root on a fresh Debian 12 machine: installs, builds, runs)
# Environment:
#   GEOFP8_DEMO_WORKERS  workers and ranks, 2..4 (default 2)
#   GEOFP8_DEMO_JOB      job spec (default examples/jobs/demo-local.yaml)
#   GEOFP8_DEMO_OUT      state, logs, checkpoints (default ./demo-out; cleared on each run)
#   GEOFP8_DEMO_POLICY_STEP  step after which the policy is changed (default 100)
#   GEOFP8_DEMO_KEEP=1   leave coordinator and workers running after the job (Ctrl-C stops them)
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
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

# The spec's world size follows the number of workers.
SPEC="$OUT/job.yaml"
sed -E "s/^world_size: *[0-9]+/world_size: $WORKERS/" "$JOB_SPEC" >"$SPEC"
log "submitting $(basename "$JOB_SPEC") (world size $WORKERS)"
JOB_ID="$("$CTL" submit -f "$SPEC" --idempotency-key "demo-$$" | sed -nE 's#^job/([^ ]+) .*#\1#p')"
[ -n "$JOB_ID" ] || { echo "demo.sh: error: submit returned no job id" >&2; exit 1; }

# Mid-run, switch the MLP matrices to NVFP4 (geometry stays on): the coordinator picks the
# effective step, every worker applies it exactly there.
(
  for _ in $(seq 1200); do
    step="$("$CTL" get job "$JOB_ID" -o json 2>/dev/null |
      python3 -c 'import json,sys; j=json.load(sys.stdin); print(j.get("progress",{}).get("step",0), j["state"])' || true)"
    case "$step" in
      *SUCCEEDED*|*FAILED*|*CANCELLED*) exit 0 ;;
    esac
    if [ "${step%% *}" -ge "$POLICY_STEP" ] 2>/dev/null; then
      echo
      "$CTL" policy set "$JOB_ID" --layer 'layers.*.mlp.*' --format nvfp4 \
        --reason "demo: NVFP4 on the MLP matrices" || true
      exit 0
    fi
    sleep 0.2
  done
) >"$OUT/policy-change.log" 2>&1 &
POLICY_PID=$!

log "watching $JOB_ID (policy change after step $POLICY_STEP; Ctrl-C stops the demo)"
status=0
"$CTL" watch "$JOB_ID" || status=$?
wait "$POLICY_PID" 2>/dev/null || true
log "policy change"
cat "$OUT/policy-change.log"

log "final job description"
"$CTL" describe job "$JOB_ID" || true

log "metrics"
echo "coordinator: $COORD_METRICS"
for ((i = 0; i < WORKERS; i++)); do echo "worker $i:    ${WORKER_METRICS[$i]}"; done
python3 - "${WORKER_METRICS[0]}" <<'EOF' || true
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
keep = ("geofp8_worker_step{", "geofp8_worker_loss{", "geofp8_worker_policy_version{",
        "geofp8_exchange_seconds_sum", "geofp8_exchange_seconds_count",
        'geofp8_exchange_bytes_total{format="nvfp4",layer="layers.0.mlp.w1"}',
        'geofp8_exchange_bytes_total{format="fp8_e4m3",layer="layers.0.mlp.w1"}',
        'geofp8_quantization_rel_error{layer="layers.0.mlp.w1"}',
        'geofp8_quantization_rel_error{layer="layers.0.attn.wq"}')
print("worker 0, a few series:")
for line in text.splitlines():
    if line.startswith(keep):
        print("  " + line)
EOF
echo "checkpoints and results: $OUT/worker-*/"

if [ "${GEOFP8_DEMO_KEEP:-0}" = "1" ]; then
  log "GEOFP8_DEMO_KEEP=1: coordinator at $SERVER; Ctrl-C stops everything"
  while true; do sleep 3600; done
fi
exit "$status"
