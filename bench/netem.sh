#!/usr/bin/env bash
# Runs `geofp8-bench exchange` (or another multi-rank subcommand) with one rank per network
# namespace, each joined to a bridge by a veth link shaped with tc to 1 Gbit/s each way. Root only;
# touches only namespaces it creates.
#
# usage: bench/netem.sh [--ranks N] [--rate 1gbit] [--delay 0] [--bench PATH] [--command NAME]
#                       [-- BENCH ARGS]
#   --delay adds a netem delay each way (needs the sch_netem kernel module); 0 shapes with tbf only.
#   --command is the geofp8-bench subcommand: exchange (default) or collectives.
#   BENCH ARGS go to it (default for exchange: --mib 64 --iters 5).
#   example: sudo bench/netem.sh --ranks 4 -- --mib 64 --iters 5
set -euo pipefail

ranks=4
rate=1gbit
delay=0
bench=""
command=exchange
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;
    --bench) bench="$2"; shift 2 ;;
    --command) command="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "netem.sh: error: $1: unknown option (see --help)" >&2; exit 2 ;;
  esac
done
bench_args=("$@")
case "$command" in
  exchange) [[ ${#bench_args[@]} -gt 0 ]] || bench_args=(--mib 64 --iters 5) ;;
  collectives) ;;
  *) echo "netem.sh: error: --command: must be exchange or collectives ($command)" >&2; exit 2 ;;
esac

if [[ $(id -u) -ne 0 ]]; then echo "netem.sh: error: must run as root (uid $(id -u))" >&2; exit 2; fi
if ! [[ "$ranks" =~ ^[0-9]+$ ]] || (( ranks < 1 || ranks > 200 )); then
  echo "netem.sh: error: --ranks: must be in [1, 200] ($ranks)" >&2; exit 2
fi
if [[ -z "$bench" ]]; then
  for candidate in "$here"/../build-*/bench/geofp8-bench "$here"/../build/bench/geofp8-bench; do
    [[ -x "$candidate" ]] && bench="$candidate" && break
  done
fi
if [[ -z "$bench" || ! -x "$bench" ]]; then
  echo "netem.sh: error: --bench: geofp8-bench not found or not executable (${bench:-none})" >&2; exit 2
fi
for tool in ip tc; do
  command -v "$tool" >/dev/null || { echo "netem.sh: error: $tool: not installed (apt-get install iproute2)" >&2; exit 2; }
done

tag="gfp8$$"
bridge_ns="${tag}br"
store_dir="$(mktemp -d /tmp/geofp8-netem.XXXXXX)"
created=()
pids=()

cleanup() {
  local status=$?
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for ns in "${created[@]}"; do ip netns del "$ns" 2>/dev/null || true; done  # veths go with them
  rm -rf "$store_dir"
  exit $status
}
trap cleanup EXIT INT TERM

# Shapes egress of one interface: a token bucket at $rate, behind a netem delay if asked for.
shape() {
  local ns="$1" dev="$2"
  if [[ "$delay" == "0" ]]; then
    tc -n "$ns" qdisc add dev "$dev" root handle 1: tbf rate "$rate" burst 256kb latency 100ms
  else
    tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$delay" limit 100000
    tc -n "$ns" qdisc add dev "$dev" parent 1: handle 2: tbf rate "$rate" burst 256kb latency 100ms
  fi
}

ip netns add "$bridge_ns"; created+=("$bridge_ns")
ip -n "$bridge_ns" link add br0 type bridge
ip -n "$bridge_ns" link set br0 up
for ((r = 0; r < ranks; r++)); do
  ns="${tag}r$r"
  ip netns add "$ns"; created+=("$ns")
  ip link add "${tag}v$r" type veth peer name "${tag}b$r"
  ip link set "${tag}v$r" netns "$ns"
  ip link set "${tag}b$r" netns "$bridge_ns"
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "${tag}v$r" name eth0
  ip -n "$ns" addr add "10.213.$((r / 250)).$((r % 250 + 1))/16" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$bridge_ns" link set "${tag}b$r" master br0
  ip -n "$bridge_ns" link set "${tag}b$r" up
  shape "$ns" eth0                     # rank -> bridge
  shape "$bridge_ns" "${tag}b$r"       # bridge -> rank
done

# The ranks share this machine's cores: one BLAS thread each unless the caller says otherwise.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
echo "netem.sh: $ranks ranks in namespaces ${tag}r*, links $rate with $delay delay each way"
for ((r = 0; r < ranks; r++)); do
  ip netns exec "${tag}r$r" "$bench" "$command" --ranks "$ranks" --rank "$r" --store-dir "$store_dir" \
    --hostname "10.213.$((r / 250)).$((r % 250 + 1))" "${bench_args[@]}" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
pids=()
exit $status
