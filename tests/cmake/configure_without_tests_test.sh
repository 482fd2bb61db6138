#!/usr/bin/env bash
# usage: configure_without_tests_test.sh CMAKE SOURCE GENERATOR CXX
# Configures SOURCE afresh with -DGEOFP8_BUILD_TESTS=OFF (CPU only) in a temporary folder: it must
# succeed, still generate the programs, and generate no test binary.
set -uo pipefail
cmake="$1" src="$2" generator="$3" cxx="$4"
dir="$(mktemp -d /tmp/geofp8-notests.XXXXXX)"
trap 'rm -rf "$dir"' EXIT
if ! "$cmake" -S "$src" -B "$dir" -G "$generator" -DCMAKE_CXX_COMPILER="$cxx" \
     -DGEOFP8_ENABLE_CUDA=OFF -DGEOFP8_BUILD_TESTS=OFF >"$dir/configure.log" 2>&1; then
  echo "FAIL: configure with GEOFP8_BUILD_TESTS=OFF failed:" >&2
  tail -40 "$dir/configure.log" >&2
  exit 1
fi
fails=0
for target in geofp8-coordinator geofp8-worker geofp8ctl; do
  "$cmake" --build "$dir" --target help 2>/dev/null | grep -q "$target" ||
    { echo "FAIL: no target $target" >&2; fails=$((fails + 1)); }
done
tests="$("$cmake" --build "$dir" --target help 2>/dev/null | grep -E '_test(:|$)' | head -5)"
[[ -z "$tests" ]] || { echo "FAIL: test targets generated: $tests" >&2; fails=$((fails + 1)); }
[[ $fails -eq 0 ]] || exit 1
echo "PASS configure with GEOFP8_BUILD_TESTS=OFF"
