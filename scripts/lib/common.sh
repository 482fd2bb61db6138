# Shared by scripts/*.sh: install missing Debian packages, configure and build once.
# Sourced, not executed. Everything here is idempotent and quick when nothing changed.

GEOFP8_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
GEOFP8_BUILD="${GEOFP8_BUILD:-$GEOFP8_ROOT/build}"

# Debian 12 packages the build, tests and demo need. One list, one place.
GEOFP8_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libgloo-dev libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libabsl-dev
  prometheus-cpp-dev libyaml-cpp-dev libopenblas-dev libsqlite3-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-grpcio python3-grpc-tools python3-matplotlib python3-yaml python3-jsonschema
  python3-torch pybind11-dev python3-pybind11
  python3-setuptools python3-wheel python3-build python3-venv
  prometheus sqlite3 iproute2 hyperfine openssl clang-format
)

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

ensure_packages() {
  local missing=()
  for p in "${GEOFP8_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing Debian packages: ${missing[*]}" >&2
    echo "run as root, or: sudo apt-get install ${missing[*]}" >&2
    return 1
  fi
  log "installing ${#missing[@]} Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

configure_and_build() {
  local jobs; jobs="$(nproc)"
  if [ ! -f "$GEOFP8_BUILD/build.ninja" ]; then
    log "configuring $GEOFP8_BUILD"
    cmake -S "$GEOFP8_ROOT" -B "$GEOFP8_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
  fi
  # GEOFP8_BUILD_TARGETS (space-separated) limits the build to those targets, e.g. the demo's
  # three programs; unset builds everything.
  local targets=()
  [ -n "${GEOFP8_BUILD_TARGETS:-}" ] && read -r -a targets <<<"--target $GEOFP8_BUILD_TARGETS"
  log "building ${GEOFP8_BUILD_TARGETS:-everything} ($jobs jobs)"
  cmake --build "$GEOFP8_BUILD" -j "$jobs" "${targets[@]}"
}
