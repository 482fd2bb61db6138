#!/usr/bin/env bash
# Tests of scripts/lib/netns.sh, the namespace setup the shaped-link benches share.
# usage: netns_lib_test.sh LIB MODE
#   bad_input  netns_setup rejects bad RANKS/RATE/DELAY with exit 2 naming the option and value,
#              before it makes anything (no root needed)
#   layout     as root: the names, addresses and tbf qdiscs bench/netem_train.sh's layout asks
#              for, then netns_cleanup leaves no namespace or veth; exits 77 (ctest SKIP) when not
#              root or `ip netns add` is refused
set -uo pipefail
lib="$1" mode="$2"
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }

expect_usage() {  # MESSAGE ARGS...: netns_setup ARGS exits 2 with exactly MESSAGE on stderr
  local want="$1"; shift
  local err rc
  err="$(bash -c 'set -euo pipefail; NETNS_PROG=t; source "$0"; trap netns_cleanup EXIT
    netns_setup "$@"; echo made' \
    "$lib" "$@" 2>&1)"; rc=$?
  [[ $rc -eq 2 ]] || fail "$* : exit $rc, want 2 ($err)"
  [[ "$err" == "t: error: $want" ]] || fail "$* : '$err', want 't: error: $want'"
}

case "$mode" in
  bad_input)
    expect_usage "--rate: expected NUMBER{bit,kbit,mbit,gbit}, e.g. 1gbit (fast)" t1 2 fast
    expect_usage "--rate: expected NUMBER{bit,kbit,mbit,gbit}, e.g. 1gbit (0gbit)" t1 2 0gbit
    expect_usage "--rate: expected NUMBER{bit,kbit,mbit,gbit}, e.g. 1gbit (-1gbit)" t1 2 -1gbit
    expect_usage "--delay: expected 0 or NUMBER{us,ms,s}, e.g. 0.5ms (5x)" t1 2 1gbit 5x
    expect_usage "--ranks: must be an integer in [1, 1000] (0)" t1 0 1gbit
    expect_usage "--ranks: must be an integer in [1, 1000] (1001)" t1 1001 1gbit
    expect_usage "--workers: must be an integer in [1, 1000] (x)" --ranks-option --workers t1 x 1gbit
    expect_usage "netns_setup: --net: 1000 ranks do not fit in 10.0.254.0/16" \
      --net 10.0.254.0/16 t1 1000 1gbit
    expect_usage "netns_setup: TAG: must be a letter then at most 10 letters or digits (1a)" \
      1a 2 1gbit
    expect_usage "netns_setup: TAG: must be a letter then at most 10 letters or digits (gft123456789)" \
      gft123456789 2 1gbit
    ;;
  layout)
    [[ $(id -u) -eq 0 ]] || { echo "SKIP: not root (uid $(id -u))"; exit 77; }
    command -v ip >/dev/null && command -v tc >/dev/null || { echo "SKIP: no ip/tc"; exit 77; }
    probe="nlprobe$$"
    ip netns add "$probe" 2>/dev/null || { echo "SKIP: ip netns add fails here"; exit 77; }
    ip netns del "$probe"
    tag="nlt$$"
    out="$(bash -c 'set -euo pipefail; source "$0"; trap netns_cleanup EXIT
      netns_setup --bridge-ns "$1c" --rank-ns "$1w" --net 10.214.1.0/16 \
        --bridge-addr 10.214.0.254/16 "$1" 2 100mbit
      echo "ns0 $(netns_rank_ns 0) addr1 $(netns_addr 1)"
      for ns in "$1c" "$1w0" "$1w1"; do
        echo "== $ns"; ip -n "$ns" -o -4 addr show; tc -n "$ns" qdisc show
      done' "$lib" "$tag" 2>&1)" || fail "setup failed: $out"
    [[ "$out" == *"ns0 ${tag}w0 addr1 10.214.1.2"* ]] || fail "names/addresses: $out"
    for want in "br0    inet 10.214.0.254/16" "eth0    inet 10.214.1.1/16" \
                "eth0    inet 10.214.1.2/16"; do
      [[ "$out" == *"$want"* ]] || fail "no '$want' in: $out"
    done
    # One tbf each way per rank: on eth0 in the rank and on its port ${tag}b<r> at the bridge.
    n="$(grep -c "qdisc tbf 1: dev .* root .*rate 100Mbit burst 256Kb lat 100ms" <<<"$out")"
    [[ "$n" -eq 4 ]] || fail "$n tbf qdiscs, want 4: $out"
    left="$( (ip netns list; ip -o link show) 2>/dev/null | grep "$tag" )"
    [[ -z "$left" ]] || fail "left behind: $left"
    ;;
  *) echo "usage: $0 LIB bad_input|layout" >&2; exit 2 ;;
esac
[[ $fails -eq 0 ]] || { echo "$fails failure(s)"; exit 1; }
echo "PASS $mode"
