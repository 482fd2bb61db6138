#!/usr/bin/env bash
# Runs bench/torch_hooks.py with one rank per network namespace, each joined to a bridge by a veth
# link shaped with tc (tbf) to --rate each way, instead of loopback: torch's gloo and GeoFP8's
# engine both move their bytes over that link. The ranks meet through a FileStore in a temporary
# folder (a file system, not the network, so no rendezvous port); rank 0 prints the table.
# Root only; touches only the namespaces it creates (named thk<pid>*), removed on exit or error.
#
# usage: bench/torch_hooks_netem.sh [--ranks N] [--rate 1gbit] [--delay 0] [-- TORCH_HOOKS ARGS]
#   --delay adds a netem delay each way (needs the sch_netem kernel module); 0 shapes with tbf only.
#   example: PYTHONPATH=build/client/python bench/torch_hooks_netem.sh --rate 1gbit -- --steps 40
set -euo pipefail

ranks=2
rate=1gbit
delay=0
# No dirname: the "not installed" check below must still be reached with nothing on PATH.
here="${BASH_SOURCE[0]}"; [[ "$here" == */* ]] || here="./$here"; here="$(cd "${here%/*}" && pwd)"
NETNS_PROG=torch_hooks_netem.sh
# shellcheck source-path=SCRIPTDIR source=../scripts/lib/netns.sh
source "$here/../scripts/lib/netns.sh"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "torch_hooks_netem.sh: error: $1: unknown option (see --help)" >&2; exit 2 ;;
  esac
done
if [[ $(id -u) -ne 0 ]]; then
  echo "torch_hooks_netem.sh: error: must run as root (uid $(id -u))" >&2; exit 2
fi
if ! [[ "$ranks" =~ ^[0-9]+$ ]] || (( ranks < 1 || ranks > 16 )); then
  echo "torch_hooks_netem.sh: error: --ranks: must be in [1, 16] ($ranks)" >&2; exit 2
fi
if ! [[ "$rate" =~ ^[0-9]+(bit|kbit|mbit|gbit)$ ]]; then
  echo "torch_hooks_netem.sh: error: --rate: must be NUMBER{bit,kbit,mbit,gbit} ($rate)" >&2; exit 2
fi
for tool in ip tc; do
  command -v "$tool" >/dev/null || {
    echo "torch_hooks_netem.sh: error: $tool: not installed (apt-get install iproute2)" >&2; exit 2; }
done

tag="thk$$"
store_dir="$(mktemp -d /tmp/geofp8-hooks-netem.XXXXXX)"
NETNS_REMOVE=("$store_dir")
trap netns_exit EXIT INT TERM
netns_setup --net 10.214.0.0/24 "$tag" "$ranks" "$rate" "$delay"

echo "torch_hooks_netem.sh: $ranks ranks in namespaces ${tag}r*, links $rate with $delay delay each way"
for ((r = 0; r < ranks; r++)); do
  # torch's gloo and GeoFP8's engine both listen on the namespace's eth0 address.
  ip netns exec "$(netns_rank_ns "$r")" env GLOO_SOCKET_IFNAME=eth0 \
    GEOFP8_HOSTNAME="$(netns_addr "$r")" OMP_NUM_THREADS=1 /usr/bin/python3 "$here/torch_hooks.py" --ranks "$ranks" --rank "$r" \
    --store-dir "$store_dir" "$@" &
  NETNS_PIDS+=($!)
done
status=0
netns_wait || status=$?
exit $status
