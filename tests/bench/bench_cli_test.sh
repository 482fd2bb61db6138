#!/bin/sh
# geofp8-bench parses its flags with CLI11 like the project's other programs: --help exits 0, and
# a bad command line exits 2 with an error naming the offending flag or command (issue 14).
# Usage: bench_cli_test.sh GEOFP8_BENCH
bench="$1"
fail=0
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# expect CODE TEXT ARGS...: the run exits CODE and its output contains TEXT.
expect() {
  code="$1"; text="$2"; shift 2
  "$bench" "$@" >"$out" 2>&1
  rc=$?
  if [ "$rc" -ne "$code" ] || ! grep -qF -- "$text" "$out"; then
    echo "FAIL: geofp8-bench $*: exit $rc (want $code), output lacks '$text':"
    cat "$out"
    fail=1
  fi
}

expect 0 "exchange" --help
expect 2 "subcommand"
expect 2 "nosuch" nosuch
for cmd in cluster codec collectives coordinator exchange geometry grad_dtype model shard_geometry \
    trajectory; do
  expect 0 "--help" "$cmd" --help
  expect 2 "--no-such-flag" "$cmd" --no-such-flag
done
expect 2 "--coordinator" cluster --coordinator /nonexistent/geofp8-coordinator
expect 2 "--ranks" collectives --ranks 0
expect 2 "--sizes" collectives --sizes 64,x
expect 2 "--ops" collectives --ops allreduce,nosuch
expect 2 "--channels" exchange --channels 3
expect 2 "--iters" exchange --iters two
expect 2 "--mode" geometry --mode fast
expect 2 "--families" geometry --families spectral,nosuch
expect 2 "--band-k" trajectory somedir --steps 1-2 --band-k 0
expect 2 "--steps" trajectory somedir --steps 5
expect 2 "--shapes" shard_geometry --shapes 1x64
expect 2 "--formats" shard_geometry --formats fp8,nosuch
expect 2 "--grads" shard_geometry --grads /nonexistent
exit $fail
