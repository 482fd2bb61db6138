#!/usr/bin/env bash
# Tests of bench/netem_train.sh (issue 15). usage: netem_train_test.sh SCRIPT BUILD MODE
#   bad_input  usage errors exit 2 naming the field (no root needed; "not root" runs as nobody
#              when we are root)
#   sigterm    SIGTERM to the script mid-job leaves no namespace, veth or process behind
#   e2e        llama-tiny, 2 workers, 20 steps of fp8 succeed and time_to_target.py reads the run
# sigterm and e2e exit 77 (ctest SKIP) when not root or network namespaces are unavailable.
set -uo pipefail
script="$1" build="$2" mode="$3"
root="$(cd "$(dirname "$script")/.." && pwd)"
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }

expect_usage() {  # MESSAGE-SUBSTRING ARGS...: exit 2 with the substring on stderr
  local want="$1"; shift
  local err rc
  err="$("$script" --build "$build" "$@" 2>&1 >/dev/null)"; rc=$?
  [[ $rc -eq 2 ]] || fail "$* : exit $rc, want 2 ($err)"
  [[ "$err" == *"$want"* ]] || fail "$* : stderr '$err' lacks '$want'"
}

need_netns() {
  [[ $(id -u) -eq 0 ]] || { echo "SKIP: not root (uid $(id -u))"; exit 77; }
  command -v ip >/dev/null && command -v tc >/dev/null || { echo "SKIP: ip/tc not installed"; exit 77; }
  local probe="gftprobe$$"
  ip netns add "$probe" 2>/dev/null || { echo "SKIP: ip netns add fails here (no CAP_SYS_ADMIN?)"; exit 77; }
  ip netns del "$probe"
}

leftovers() {  # TAG: namespaces, links and processes named after one run
  local tag="$1"
  ip netns list 2>/dev/null | grep "$tag" || true
  ip -o link show 2>/dev/null | grep "$tag" || true
  ps -eo pid=,args= | grep "/tmp/$tag\." | grep -v grep || true
}

case "$mode" in
  bad_input)
    expect_usage "--rate: must be in [1mbit, 100gbit] (200gbit)" --rate 200gbit
    expect_usage "--rate: must be in [1mbit, 100gbit] (10kbit)" --rate 10kbit
    expect_usage "--rate: expected NUMBER{bit,kbit,mbit,gbit}" --rate fast
    expect_usage "--delay: must be in [0, 1000ms] (2s)" --delay 2s
    expect_usage "--delay: expected 0 or NUMBER{us,ms,s}" --delay -1ms
    expect_usage "--workers: must be an integer in [1, 16] (0)" --workers 0
    expect_usage "--workers: must be an integer in [1, 16] (17)" --workers 17
    expect_usage "--policies: unknown policy (fp16)" --policies fp32,fp16
    expect_usage "--steps: must be an integer in [1, 1000000] (0)" --steps 0
    expect_usage "--corpus: no such folder" --corpus /nonexistent/geofp8
    expect_usage "--bogus: unknown option" --bogus 1
    # ip and tc missing: a PATH with nothing on it (bash itself is started by path).
    empty="$(mktemp -d)"
    err="$(env PATH="$empty" /bin/bash "$script" --build "$build" 2>&1)"; rc=$?
    rmdir "$empty"
    [[ $rc -eq 2 && "$err" == *"ip: not installed"* ]] || fail "no ip on PATH: exit $rc ($err)"
    if [[ $(id -u) -eq 0 ]] && command -v setpriv >/dev/null; then
      err="$(setpriv --reuid=65534 --regid=65534 --clear-groups /bin/bash "$script" --build "$build" 2>&1)"; rc=$?
      [[ $rc -eq 2 && "$err" == *"must run as root"* ]] || fail "as nobody: exit $rc ($err)"
    elif [[ $(id -u) -ne 0 ]]; then
      err="$("$script" --build "$build" 2>&1)"; rc=$?
      [[ $rc -eq 2 && "$err" == *"must run as root"* ]] || fail "not root: exit $rc ($err)"
    fi
    ;;
  sigterm)
    need_netns
    out="$(mktemp -d)"
    "$script" --build "$build" --workers 2 --model llama-tiny --steps 100000 --policies fp8 \
      --out "$out" >"$out/script.log" 2>&1 &
    pid=$!
    tag="gft$pid"
    for _ in $(seq 600); do  # up to 60 s for training to start
      grep -qs " running " "$out/fp8.progress" && break
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    grep -qs " running " "$out/fp8.progress" || { cat "$out/script.log" >&2; fail "job never ran"; }
    [[ -n "$(ip netns list | grep "$tag")" ]] || fail "no namespace $tag* while running"
    kill -TERM "$pid"
    for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then fail "script still running 30 s after SIGTERM"; kill -KILL "$pid"; fi
    wait "$pid"; rc=$?
    [[ $rc -eq 143 ]] || fail "exit $rc after SIGTERM, want 143"
    left="$(leftovers "$tag")"
    [[ -z "$left" ]] || fail "left behind: $left"
    rm -rf "$out"
    ;;
  e2e)
    need_netns
    out="$(mktemp -d)"
    "$script" --build "$build" --workers 2 --model llama-tiny --steps 20 --batch 4 --seq 64 \
      --policies fp8 --rate 100mbit --out "$out" >"$out/script.log" 2>&1 &
    pid=$!
    wait "$pid"; rc=$?
    [[ $rc -eq 0 ]] || { cat "$out/script.log" >&2; fail "exit $rc"; }
    grep -q "fp8: succeeded 20" "$out/script.log" || fail "no success line: $(cat "$out/script.log")"
    left="$(leftovers "gft$pid")"
    [[ -z "$left" ]] || fail "left behind: $left"
    table="$(/usr/bin/python3 "$root/scripts/time_to_target.py" "$out" --baseline fp8 --window 3 \
      --png "$out/loss.png")" || fail "time_to_target.py failed"
    [[ "$table" == *"| fp8 | SUCCEEDED |"* ]] || fail "no fp8 row: $table"
    [[ -s "$out/loss.png" ]] || fail "no PNG"
    rm -rf "$out"
    ;;
  *) echo "usage: $0 SCRIPT BUILD bad_input|sigterm|e2e" >&2; exit 2 ;;
esac
[[ $fails -eq 0 ]] || { echo "$fails failure(s)"; exit 1; }
echo "PASS $mode"
