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
# No dirname: the "not installed" check below must still be reached with nothing on PATH.
here="${BASH_SOURCE[0]}"; [[ "$here" == */* ]] || here="./$here"; here="$(cd "${here%/*}" && pwd)"
NETNS_PROG=netem.sh
# shellcheck source-path=SCRIPTDIR source=../scripts/lib/netns.sh
source "$here/../scripts/lib/netns.sh"
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
store_dir="$(mktemp -d /tmp/geofp8-netem.XXXXXX)"
NETNS_REMOVE=("$store_dir")
trap netns_exit EXIT INT TERM
netns_setup --net 10.213.0.0/16 "$tag" "$ranks" "$rate" "$delay"

# The ranks share this machine's cores: one BLAS thread each unless the caller says otherwise.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
echo "netem.sh: $ranks ranks in namespaces ${tag}r*, links $rate with $delay delay each way"
for ((r = 0; r < ranks; r++)); do
  ip netns exec "$(netns_rank_ns "$r")" "$bench" "$command" --ranks "$ranks" --rank "$r" \
    --store-dir "$store_dir" --hostname "$(netns_addr "$r")" "${bench_args[@]}" &
  NETNS_PIDS+=($!)
done
status=0
netns_wait || status=$?
exit $status
