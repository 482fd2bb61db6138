#!/bin/sh
# geofp8-bench cluster end to end at a small scale: the coordinator daemon and 50 simulated
# workers; every worker registers and opens its session, every recorded heartbeat is acked and
# every rank of the placement job gets its assignment.
# Usage: cluster_bench_test.sh GEOFP8_BENCH GEOFP8_COORDINATOR
bench="$1"
coordinator="$2"
out=$(mktemp)
trap 'rm -f "$out"' EXIT

if ! "$bench" cluster --coordinator "$coordinator" --workers 50 --job-ranks 20 --seconds 2 \
    --settle-seconds 0.5 --update-seconds 1 --baseline-seconds 0.2 >"$out" 2>&1; then
  echo "FAIL: geofp8-bench cluster exited $?:"
  cat "$out"
  exit 1
fi
line=$(grep '^result ' "$out")
# field NAME: the value of NAME=... on the result line.
field() { echo "$line" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
fail=0
check() {
  if [ "$(field "$1")" != "$2" ]; then
    echo "FAIL: $1=$(field "$1"), want $2"
    fail=1
  fi
}
check workers 50
check registered 50
check sessions 50
check register_failed 0
check sessions_lost 0
check beats_unacked 0
check assigned 20/20
# Two seconds of 1 Hz heartbeats from 50 workers: about 100 recorded, each acked.
sent=$(field beats_sent)
if [ -z "$sent" ] || [ "$sent" -lt 50 ] || [ "$sent" != "$(field beats_acked)" ]; then
  echo "FAIL: beats_sent=$sent beats_acked=$(field beats_acked), want at least 50, all acked"
  fail=1
fi
if [ "$fail" -ne 0 ]; then cat "$out"; fi
exit $fail
