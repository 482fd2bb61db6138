#!/usr/bin/env bash
# Runs examples/pytorch/train_fsdp.py (FSDP2, a small Llama) with one rank per network namespace,
# each joined to a bridge by a veth link shaped with tc (tbf) to --rate each way, instead of
# loopback: FSDP2's own collectives (parameter all-gathers, and its reduce-scatter under
# --policy native) and GeoFP8's engine all move their bytes over that link. The ranks meet
# through a FileStore in a temporary folder; rank 0 prints the log and a `result:` line.
# Root only; touches only the namespaces it creates (named fsn<pid>*), removed on exit or error.
#
# usage: bench/fsdp_netem.sh [--ranks N] [--rate 1gbit] [--delay 0] [--python PY] [-- ARGS]
#   ARGS go to train_fsdp.py, e.g. --policy fp8 --layers 6 --d-model 512 --steps 8
#   example: PYTHONPATH=build/client/python bench/fsdp_netem.sh --ranks 2 -- --policy native
set -euo pipefail

ranks=2
rate=1gbit
delay=0
python="${GEOFP8_TORCH_PYTHON:-/usr/bin/python3}"
here="${BASH_SOURCE[0]}"; [[ "$here" == */* ]] || here="./$here"; here="$(cd "${here%/*}" && pwd)"
NETNS_PROG=fsdp_netem.sh
# shellcheck source-path=SCRIPTDIR source=../scripts/lib/netns.sh
source "$here/../scripts/lib/netns.sh"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "fsdp_netem.sh: error: $1: unknown option (see --help)" >&2; exit 2 ;;
  esac
done
if [[ $(id -u) -ne 0 ]]; then
  echo "fsdp_netem.sh: error: must run as root (uid $(id -u))" >&2; exit 2
fi
if ! [[ "$ranks" =~ ^[0-9]+$ ]] || (( ranks < 1 || ranks > 16 )); then
  echo "fsdp_netem.sh: error: --ranks: must be in [1, 16] ($ranks)" >&2; exit 2
fi
[[ -x "$python" ]] || { echo "fsdp_netem.sh: error: --python: not executable ($python)" >&2; exit 2; }
for tool in ip tc; do
  command -v "$tool" >/dev/null || {
    echo "fsdp_netem.sh: error: $tool: not installed (apt-get install iproute2)" >&2; exit 2; }
done

tag="fsn$$"
store_dir="$(mktemp -d /tmp/geofp8-fsdp-netem.XXXXXX)"
NETNS_REMOVE=("$store_dir")
trap netns_exit EXIT INT TERM
netns_setup --net 10.215.0.0/24 "$tag" "$ranks" "$rate" "$delay"

echo "fsdp_netem.sh: $ranks ranks in namespaces ${tag}r*, links $rate with $delay delay each way"
for ((r = 0; r < ranks; r++)); do
  # torch's gloo and GeoFP8's engine both listen on the namespace's eth0 address.
  ip netns exec "$(netns_rank_ns "$r")" env GLOO_SOCKET_IFNAME=eth0 \
    GEOFP8_HOSTNAME="$(netns_addr "$r")" OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
    RANK="$r" WORLD_SIZE="$ranks" \
    "$python" "$here/../examples/pytorch/train_fsdp.py" --init-method "file://$store_dir/store" \
    "$@" &
  NETNS_PIDS+=($!)
done
status=0
netns_wait || status=$?
exit $status
