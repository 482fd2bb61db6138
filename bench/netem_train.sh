#!/usr/bin/env bash
# Trains across tc-shaped links with the real daemons: a geofp8-coordinator and N geofp8-worker
# processes, each worker in its own network namespace joined by a veth to a bridge that lives in the
# coordinator's namespace. Every worker link is shaped both ways (tbf at --rate, netem --delay in
# front when non-zero); the workers advertise their namespace address (--advertise-host) and meet
# through the coordinator's rendezvous. The same job runs once per policy, one after another,
# submitted and watched with geofp8ctl; each job's progress stream, description and worker 0's
# step/exchange timing histograms are saved under --out for scripts/time_to_target.py.
#
# usage: bench/netem_train.sh [--workers N] [--rate 1gbit] [--delay 0] [--policies LIST]
#                             [--model llama-small] [--steps N] [--batch N] [--seq N] [--lr X]
#                             [--seed N] [--corpus DIR] [--build DIR] [--out DIR]
#   --workers   ranks, one worker each, 1..16 (default 4)
#   --rate      link rate each way, 1mbit..100gbit, as NUMBER{bit,kbit,mbit,gbit} (default 1gbit)
#   --delay     one-way added delay, 0..1000ms, as NUMBER{us,ms,s} or 0 (default 0)
#   --policies  comma list of fp32,bf16,fp8,geofp8,nvfp4,geonvfp4 (default: all six in that order;
#               the sections are those of geofp8-train's presets, PresetPolicyFile)
#   --corpus    text folder the workers train on (data.source file; default /usr/lib/python3.11)
#   --out       results folder (default ./netem-train-out; its run files are replaced)
# Root only. Everything it makes is named gft<pid>* and removed on exit, error, Ctrl-C or SIGTERM.
# example: sudo bench/netem_train.sh --workers 4 --rate 1gbit --steps 200 --out /tmp/ttt
set -euo pipefail

prog=netem_train.sh
die() { echo "$prog: error: $*" >&2; exit 2; }
# No dirname: the "not installed" check below must still be reached with nothing on PATH.
here="${BASH_SOURCE[0]}"; [[ "$here" == */* ]] || here="./$here"; here="$(cd "${here%/*}" && pwd)"
NETNS_PROG="$prog"
# shellcheck source-path=SCRIPTDIR source=../scripts/lib/netns.sh
source "$here/../scripts/lib/netns.sh"

workers=4
rate=1gbit
delay=0
policies=fp32,bf16,fp8,geofp8,nvfp4,geonvfp4
model=llama-small
steps=200
batch=8
seq=128
lr=0.001
seed=1
corpus=/usr/lib/python3.11
build=""
out="$PWD/netem-train-out"
while [[ $# -gt 0 ]]; do
  [[ $# -ge 2 || "$1" == -h || "$1" == --help ]] || die "$1: needs a value"
  case "$1" in
    --workers) workers="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;
    --policies) policies="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --seq) seq="$2"; shift 2 ;;
    --lr) lr="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --corpus) corpus="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) die "$1: unknown option (see --help)" ;;
  esac
done

# --- input checks (all before anything is created) ---
[[ "$workers" =~ ^[0-9]+$ ]] && (( workers >= 1 && workers <= 16 )) ||
  die "--workers: must be an integer in [1, 16] ($workers)"
# Rate in bit/s, by integer arithmetic on NUMBER[.FRACTION]UNIT.
if [[ "$rate" =~ ^([0-9]{1,6})(\.([0-9]{1,3}))?(bit|kbit|mbit|gbit)$ ]]; then
  frac="${BASH_REMATCH[3]}"; frac="${frac}000"; frac="${frac:0:3}"
  case "${BASH_REMATCH[4]}" in bit) mult=1 ;; kbit) mult=1000 ;; mbit) mult=1000000 ;; gbit) mult=1000000000 ;; esac
  rate_bps=$(( (10#${BASH_REMATCH[1]} * 1000 + 10#$frac) * mult / 1000 ))
  (( rate_bps >= 1000000 && rate_bps <= 100000000000 )) ||
    die "--rate: must be in [1mbit, 100gbit] ($rate)"
else
  die "--rate: expected NUMBER{bit,kbit,mbit,gbit}, e.g. 1gbit ($rate)"
fi
if [[ "$delay" == 0 ]]; then
  delay_us=0
elif [[ "$delay" =~ ^([0-9]{1,7})(\.([0-9]{1,3}))?(us|ms|s)$ ]]; then
  frac="${BASH_REMATCH[3]}"; frac="${frac}000"; frac="${frac:0:3}"
  case "${BASH_REMATCH[4]}" in us) mult=1 ;; ms) mult=1000 ;; s) mult=1000000 ;; esac
  delay_us=$(( (10#${BASH_REMATCH[1]} * 1000 + 10#$frac) * mult / 1000 ))
  (( delay_us <= 1000000 )) || die "--delay: must be in [0, 1000ms] ($delay)"
else
  die "--delay: expected 0 or NUMBER{us,ms,s}, e.g. 0.5ms ($delay)"
fi
IFS=, read -r -a policy_list <<<"$policies"
(( ${#policy_list[@]} > 0 )) || die "--policies: must name at least one policy ($policies)"
for p in "${policy_list[@]}"; do
  case "$p" in fp32|bf16|fp8|geofp8|nvfp4|geonvfp4) ;;
    *) die "--policies: unknown policy ($p); accepted: fp32,bf16,fp8,geofp8,nvfp4,geonvfp4" ;; esac
done
case "$model" in llama-tiny|llama-small|llama-300m|llama-600m) ;;
  *) die "--model: must be llama-tiny, llama-small, llama-300m or llama-600m ($model)" ;; esac
for pair in "steps:$steps:1:1000000" "batch:$batch:1:4096" "seq:$seq:1:8192" "seed:$seed:0:999999999"; do
  IFS=: read -r field value lo hi <<<"$pair"
  [[ "$value" =~ ^[0-9]+$ ]] && (( value >= lo && value <= hi )) ||
    die "--$field: must be an integer in [$lo, $hi] ($value)"
done
[[ "$lr" =~ ^[0-9]*\.?[0-9]+([eE]-?[0-9]+)?$ ]] || die "--lr: expected a positive number ($lr)"
[[ -d "$corpus" ]] || die "--corpus: no such folder ($corpus)"
for tool in ip tc; do
  command -v "$tool" >/dev/null || die "$tool: not installed (apt-get install iproute2)"
done
[[ $(id -u) -eq 0 ]] || die "must run as root (uid $(id -u)): network namespaces need CAP_NET_ADMIN"
if [[ -z "$build" ]]; then
  for candidate in "$here"/../build-cpu "$here"/../build "$here"/../build-*; do
    [[ -x "$candidate/worker/daemon/geofp8-worker" ]] && build="$candidate" && break
  done
fi
COORDINATOR="$build/server/coordinator/geofp8-coordinator"
WORKER="$build/worker/daemon/geofp8-worker"
CTL="$build/client/ctl/geofp8ctl"
for bin in "$COORDINATOR" "$WORKER" "$CTL"; do
  [[ -n "$build" && -x "$bin" ]] || die "--build: no geofp8-coordinator/geofp8-worker/geofp8ctl under ${build:-any build-* folder} ($bin)"
done
PY=/usr/bin/python3; [[ -x "$PY" ]] || PY=python3

# --- resources: everything below is named $tag and removed by cleanup ---
tag="gft$$"
cns="${tag}c"            # coordinator + bridge namespace
state="$(mktemp -d "/tmp/$tag.XXXXXX")"
pids=()
aux=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  for pid in "${aux[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  # Workers first (the coordinator sees them leave), then the coordinator; then the namespaces,
  # which take their veths and the bridge with them.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[$i]}" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  netns_cleanup  # anything still inside (a watch, a scrape) goes with the namespaces
  rm -rf "$state"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

mkdir -p "$out"
# Workers in ${tag}w<r> at 10.214.1.<r+1>/16; the bridge (10.214.0.254) in the coordinator's $cns.
netns_setup --bridge-ns "$cns" --rank-ns "${tag}w" --net 10.214.1.0/16 \
  --bridge-addr 10.214.0.254/16 --ranks-option --workers \
  "$tag" "$workers" "$rate" "$( ((delay_us == 0)) && echo 0 || echo "$delay")"
echo "$prog: $workers workers in namespaces ${tag}w*, coordinator in $cns; links $rate each way, delay $delay"

wait_ready() {  # READY PID LOG: waits up to 60 s for a --ready-file
  local ready="$1" pid="$2" log="$3"
  for _ in $(seq 600); do
    [[ -s "$ready" ]] && return 0
    kill -0 "$pid" 2>/dev/null || { echo "$prog: error: daemon exited; its log $log:" >&2; cat "$log" >&2; exit 1; }
    sleep 0.1
  done
  echo "$prog: error: timed out waiting for $ready" >&2; exit 1
}
field() { "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }

ip netns exec "$cns" "$COORDINATOR" --listen 0.0.0.0:0 --metrics-listen 127.0.0.1:0 \
  --data-dir "$state/coordinator" --heartbeat-timeout-ms 10000 \
  --ready-file "$state/coordinator.ready.json" >"$out/coordinator.log" 2>&1 &
pids+=($!)
wait_ready "$state/coordinator.ready.json" "$!" "$out/coordinator.log"
port="$(field "$state/coordinator.ready.json" grpc)"; port="${port##*:}"
ctl() { ip netns exec "$cns" "$CTL" -s "127.0.0.1:$port" "$@"; }

export OPENBLAS_NUM_THREADS=1   # the ranks share this machine's cores
for ((r = 0; r < workers; r++)); do
  mkdir -p "$state/worker-$r"
  ln -s "$(realpath "$corpus")" "$state/worker-$r/corpus"
  ip netns exec "$(netns_rank_ns "$r")" "$WORKER" --coordinator "10.214.0.254:$port" --name "w$r" \
    --advertise-host "$(netns_addr "$r")" --metrics-host 127.0.0.1 --metrics-port 0 \
    --blas-threads 1 --data-dir "$state/worker-$r" --ready-file "$state/worker-$r.ready.json" \
    >"$out/worker-$r.log" 2>&1 &
  pids+=($!)
  wait_ready "$state/worker-$r.ready.json" "$!" "$out/worker-$r.log"
done
metrics0="$(field "$state/worker-0.ready.json" metrics)"
for _ in $(seq 300); do
  idle="$(ctl get workers 2>/dev/null | grep -c ' IDLE ' || true)"
  (( idle >= workers )) && break
  sleep 0.2
done
(( idle >= workers )) || { echo "$prog: error: only $idle of $workers workers registered" >&2; exit 1; }

scrape() {  # worker 0's /metrics, from inside its namespace
  ip netns exec "${tag}w0" "$PY" -c 'import sys,urllib.request
sys.stdout.write(urllib.request.urlopen("http://"+sys.argv[1]+"/metrics",timeout=10).read().decode())' \
    "$metrics0" >"$1" || echo "$prog: warning: could not scrape worker 0 metrics" >&2
}

spec() {  # POLICY NAME: the job spec; policy sections as in geofp8-train's presets
  local p="$1" name="$2" alg fmt geo=0
  case "$p" in
    fp32) alg=fp32; fmt=fp32 ;; bf16) alg=bf16; fmt=bf16 ;;
    fp8) alg=two_phase; fmt=fp8_e4m3 ;; geofp8) alg=two_phase; fmt=fp8_e4m3; geo=1 ;;
    nvfp4) alg=two_phase; fmt=nvfp4 ;; geonvfp4) alg=two_phase; fmt=nvfp4; geo=1 ;;
  esac
  cat <<EOF
name: $name
world_size: $workers
backend: gloo
model: {preset: $model}
data: {source: file, path: corpus, seed: $seed}
training: {steps: $steps, batch_size: $batch, seq_len: $seq, lr: $lr, warmup_steps: $((steps / 10)), seed: $seed}
exchange: {algorithm: $alg, bucket_mb: 4, timeout_s: 300}
policy:
  default: {format: $fmt}
EOF
  if (( geo )); then
    printf '  layers:\n    - {match: "*", geometry: lowrank, rank: 8}\n'
    printf 'geometry_refresh: {estimator: ema, interval: 1}\n'
  fi
}

cat >"$out/run.json" <<EOF
{"workers": $workers, "rate": "$rate", "delay": "$delay", "model": "$model", "steps": $steps,
 "batch": $batch, "seq": $seq, "lr": "$lr", "seed": $seed, "corpus": "$corpus",
 "policies": "$policies", "nproc": $(nproc), "started_unix": $(date +%s)}
EOF
status=0
for p in "${policy_list[@]}"; do
  name="$p-$tag"
  spec "$p" "$name" >"$out/$p.yaml"
  scrape "$out/$p.metrics.before"
  echo "$prog: $p: submitting $name"
  ctl submit -f "$out/$p.yaml" >/dev/null
  # One line per progress update, stamped here (EPOCHREALTIME) and by the coordinator.
  # In the background and waited for: bash runs a trap (SIGTERM, Ctrl-C) only between commands,
  # and `wait` is one it interrupts.
  ctl watch "$name" -o 'jsonpath={.job.state} {.job.progress.step} {.job.progress.loss} {.job.progress.updated_time}{"\n"}' |
    while read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done >"$out/$p.progress" &
  aux+=($!)
  wait "$!" || true
  aux=()
  ctl describe job "$name" -o json >"$out/$p.describe.json" || true
  scrape "$out/$p.metrics.after"
  final="$(ctl get job "$name" -o 'jsonpath={.state} {.progress.step}' 2>/dev/null || echo unknown)"
  echo "$prog: $p: $final"
  [[ "$final" == succeeded* ]] || status=1
done
exit "$status"
