# shellcheck shell=bash
# Network namespaces for the shaped-link benches (bench/netem.sh, bench/netem_train.sh,
# bench/torch_hooks_netem.sh): one bridge namespace, one namespace per rank joined to it by a veth
# pair, every link shaped with tc each way. Sourced, not executed; the caller runs as root under
# `set -e`, so a failing ip/tc command ends it (and its EXIT trap cleans up).
#
#   netns_setup [--bridge-ns NAME] [--rank-ns PREFIX] [--net A.B.C.D/LEN] [--bridge-addr ADDR/LEN]
#               [--ranks-option NAME] TAG RANKS RATE [DELAY]
#     TAG       names all it makes: the bridge namespace (default ${TAG}br, holding bridge br0),
#               rank r's namespace (default ${TAG}r<r>) and the veth pair ${TAG}v<r> (eth0 in the
#               rank's namespace) / ${TAG}b<r> (a port of br0)
#     RANKS     how many rank namespaces, 1..1000
#     RATE      token bucket (tbf) rate each way, NUMBER[.FRACTION]{bit,kbit,mbit,gbit,...},
#               e.g. 1gbit
#     DELAY     netem delay in front of the tbf each way, NUMBER[.FRACTION]{us,ms,s}; 0 (the
#               default) shapes with tbf only. A delay needs the sch_netem kernel module (checked first).
#     --net     rank r's address is A.B.(C + r/250).(D + r%250 + 1)/LEN (default 10.213.0.0/16)
#     --bridge-addr  an address for br0 itself (default none)
#     --ranks-option the caller's name for RANKS in error messages (default --ranks)
#   netns_rank_ns R, netns_addr R   print rank R's namespace and address (without /LEN)
#   netns_cleanup                   kills what still runs in the namespaces netns_setup made,
#                                   deletes them (their veths go with them) and any veth it left
#                                   in this namespace
#   netns_exit                      an EXIT/INT/TERM trap: stops NETNS_PIDS, netns_cleanup, removes
#                                   the paths in NETNS_REMOVE, exits with the status it was given
#   netns_wait                      waits for NETNS_PIDS; returns the last non-zero status, else 0
# Errors name the option and the value and exit 2, prefixed with $NETNS_PROG (default: $0's name).

NETNS_PROG="${NETNS_PROG:-${0##*/}}"
NETNS_TAG=""
NETNS_RANKS=0
NETNS_CREATED=()  # namespaces made so far, bridge first
NETNS_PIDS=()     # the caller's per-rank processes, for netns_exit and netns_wait
NETNS_REMOVE=()   # the caller's temporary paths, for netns_exit

netns_die() { echo "$NETNS_PROG: error: $*" >&2; exit 2; }

netns_setup() {
  local bridge_ns="" rank_prefix="" net="10.213.0.0/16" bridge_addr="" ranks_option="--ranks"
  while [[ $# -gt 0 && "$1" == --* ]]; do
    [[ $# -ge 2 ]] || netns_die "netns_setup: $1: needs a value"
    case "$1" in
      --bridge-ns) bridge_ns="$2" ;;
      --rank-ns) rank_prefix="$2" ;;
      --net) net="$2" ;;
      --bridge-addr) bridge_addr="$2" ;;
      --ranks-option) ranks_option="$2" ;;
      *) netns_die "netns_setup: $1: unknown option" ;;
    esac
    shift 2
  done
  [[ $# -eq 3 || $# -eq 4 ]] ||
    netns_die "netns_setup: usage: netns_setup [OPTIONS] TAG RANKS RATE [DELAY] ($*)"
  local tag="$1" ranks="$2" rate="$3" delay="${4:-0}"

  # --- checks, all before anything is made ---
  # Interface names hold 15 characters: TAG, then v or b, then a rank of up to 3 digits.
  [[ "$tag" =~ ^[A-Za-z][A-Za-z0-9]{0,10}$ ]] ||
    netns_die "netns_setup: TAG: must be a letter then at most 10 letters or digits ($tag)"
  [[ "$ranks" =~ ^[0-9]{1,6}$ ]] && (( 10#$ranks >= 1 && 10#$ranks <= 1000 )) ||
    netns_die "$ranks_option: must be an integer in [1, 1000] ($ranks)"
  ranks=$((10#$ranks))
  local rate_lc="${rate,,}"
  [[ "$rate_lc" =~ ^[0-9]+(\.[0-9]+)?([kmgt]?bit|[kmgt]?bps)$ && "$rate_lc" =~ [1-9] ]] ||
    netns_die "--rate: expected NUMBER{bit,kbit,mbit,gbit}, e.g. 1gbit ($rate)"
  [[ "$delay" == 0 || "$delay" =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)$ ]] ||
    netns_die "--delay: expected 0 or NUMBER{us,ms,s}, e.g. 0.5ms ($delay)"
  [[ "$net" =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})/([0-9]{1,2})$ ]] ||
    netns_die "netns_setup: --net: expected A.B.C.D/LEN ($net)"
  NETNS_NET=("${BASH_REMATCH[@]:1:5}")
  (( NETNS_NET[2] + (ranks - 1) / 250 <= 255 && NETNS_NET[3] + 250 <= 255 )) ||
    netns_die "netns_setup: --net: $ranks ranks do not fit in $net"

  NETNS_TAG="$tag"
  NETNS_RANKS="$ranks"
  NETNS_BRIDGE_NS="${bridge_ns:-${tag}br}"
  NETNS_RANK_PREFIX="${rank_prefix:-${tag}r}"
  NETNS_RATE="$rate"
  NETNS_DELAY="$delay"

  # --- the bridge ---
  ip netns add "$NETNS_BRIDGE_NS"; NETNS_CREATED+=("$NETNS_BRIDGE_NS")
  ip -n "$NETNS_BRIDGE_NS" link set lo up
  ip -n "$NETNS_BRIDGE_NS" link add br0 type bridge
  [[ -z "$bridge_addr" ]] || ip -n "$NETNS_BRIDGE_NS" addr add "$bridge_addr" dev br0
  ip -n "$NETNS_BRIDGE_NS" link set br0 up
  if [[ "$delay" != 0 ]]; then
    tc -n "$NETNS_BRIDGE_NS" qdisc add dev lo root netem delay 1us 2>/dev/null ||
      netns_die "--delay: $delay needs the sch_netem kernel module, which this kernel lacks (modprobe sch_netem; --delay 0 shapes with tbf only)"
    tc -n "$NETNS_BRIDGE_NS" qdisc del dev lo root
  fi

  # --- one namespace per rank ---
  local r ns
  for ((r = 0; r < ranks; r++)); do
    ns="$(netns_rank_ns "$r")"
    ip netns add "$ns"; NETNS_CREATED+=("$ns")
    ip link add "${tag}v$r" type veth peer name "${tag}b$r"
    ip link set "${tag}v$r" netns "$ns"
    ip link set "${tag}b$r" netns "$NETNS_BRIDGE_NS"
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "${tag}v$r" name eth0
    ip -n "$ns" addr add "$(netns_addr "$r")/${NETNS_NET[4]}" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$NETNS_BRIDGE_NS" link set "${tag}b$r" master br0
    ip -n "$NETNS_BRIDGE_NS" link set "${tag}b$r" up
    netns_shape "$ns" eth0                         # rank -> bridge
    netns_shape "$NETNS_BRIDGE_NS" "${tag}b$r"     # bridge -> rank
  done
}

# Shapes egress of one interface: a token bucket at NETNS_RATE, behind a netem delay if asked for.
netns_shape() {
  local ns="$1" dev="$2"
  if [[ "$NETNS_DELAY" == 0 ]]; then
    tc -n "$ns" qdisc add dev "$dev" root handle 1: tbf rate "$NETNS_RATE" burst 256kb latency 100ms
  else
    tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$NETNS_DELAY" limit 100000
    tc -n "$ns" qdisc add dev "$dev" parent 1: handle 2: tbf rate "$NETNS_RATE" burst 256kb latency 100ms
  fi
}

netns_rank_ns() { echo "${NETNS_RANK_PREFIX}$1"; }

netns_addr() {
  local r="$1"
  echo "${NETNS_NET[0]}.${NETNS_NET[1]}.$((NETNS_NET[2] + r / 250)).$((NETNS_NET[3] + r % 250 + 1))"
}

netns_cleanup() {
  local ns pid r
  for ns in "${NETNS_CREATED[@]}"; do
    # Anything still running inside (a straggling rank, a scrape) goes with the namespace.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  NETNS_CREATED=()
  # A veth not yet moved into a namespace when setup stopped is still here.
  for ((r = 0; r < NETNS_RANKS; r++)); do ip link del "${NETNS_TAG}v$r" 2>/dev/null || true; done
  NETNS_RANKS=0
}

netns_exit() {
  local status=$? pid
  for pid in "${NETNS_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  netns_cleanup
  rm -rf "${NETNS_REMOVE[@]}"
  exit $status
}

netns_wait() {
  local pid status=0
  for pid in "${NETNS_PIDS[@]}"; do wait "$pid" || status=$?; done
  NETNS_PIDS=()
  return $status
}
