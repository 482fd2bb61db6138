#!/usr/bin/env bash
# Side-by-side CPU cost of the exchange algorithms at two commits (issue #28: "nothing else gets
# slower on CPU"): bench/plane_ab.cc compiled against the kernels/exchange sources of BASE and of
# the working tree, linked with the same codec, geometry and Gloo objects of BUILD, then run in
# alternation; prints the median over PAIRS of each pair's new/old ratio per mode, with quartiles.
# Usage: bench/plane_ab.sh [BASE (default HEAD~1)] [BUILD (default build-cpu)] [PAIRS (default 15)]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
base="${1:-HEAD~1}"
build="$(cd "${2:-$root/build-cpu}" && pwd)"
pairs="${3:-15}"
work="$(mktemp -d /tmp/plane-ab.XXXXXX)"
trap 'git -C "$root" worktree remove --force "$work/tree" > /dev/null 2>&1 || true; rm -rf "$work"' EXIT
git -C "$root" worktree add --detach "$work/tree" "$base" > /dev/null 2>&1
flags=(-I"$build/generated" -I/usr/include/x86_64-linux-gnu/openblas-pthread -isystem
       /usr/local/cuda/include -O3 -g -DNDEBUG -std=c++20)
cp "$build/kernels/exchange/libgeofp8_exchange.a" "$work/base.a"
ar d "$work/base.a" algorithms.cc.o exchanger.cc.o data_plane.cc.o 2> /dev/null || true
libs=("$work/base.a" "$build/kernels/geometry/libgeofp8_geometry.a"
      "$build/kernels/codec/libgeofp8_codec.a" -lopenblas /usr/lib/libgloo.so.0.5.0)
[ -e /usr/local/cuda/lib/libnccl.so ] && libs+=(/usr/local/cuda/lib/libnccl.so
                                                 /usr/local/cuda/lib/libcudart.so)
libs+=(-Wl,-rpath,/usr/local/cuda/lib -lpthread -ldl -lrt)
for side in old new; do
  tree="$work/tree"; [ "$side" = new ] && tree="$root"
  srcs=("$tree/kernels/exchange/algorithms.cc")
  [ -f "$tree/kernels/exchange/data_plane.cc" ] && srcs+=("$tree/kernels/exchange/data_plane.cc")
  c++ "${flags[@]}" -I"$tree" "$root/bench/plane_ab.cc" "${srcs[@]}" "${libs[@]}" -o "$work/$side"
done
for mode in "two_phase 0" "allgather 0" "two_phase 33554432" "allgather 33554432"; do
  set -- $mode
  ratios=()
  for _ in $(seq "$pairs"); do
    a=$("$work/old" 30 "$1" "$2"); b=$("$work/new" 30 "$1" "$2")
    ratios+=("$(python3 -c "print($b / $a)")")
  done
  python3 - "$1" "$2" "${ratios[@]}" <<'PY'
import statistics, sys
algo, inline, r = sys.argv[1], int(sys.argv[2]), sorted(float(x) for x in sys.argv[3:])
q = len(r) // 4
print("%-9s %-9s new/old median %.3f  quartiles %.3f-%.3f  (%d pairs)"
      % (algo, "inline" if inline else "pipelined", statistics.median(r), r[q], r[-1 - q], len(r)))
PY
done
