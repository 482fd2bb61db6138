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

# torch 2.x for the Python tests: a pinned wheel from PyPI, installed once into a virtual
# environment cached outside the clone (CI's fresh clones reuse it), on Debian's python3 with its
# packages visible (python3-grpcio, -yaml, -numpy, -matplotlib). Debian's own python3-torch (1.13)
# stays installed: the oldest supported torch, which a subset of the tests still runs on.
# GEOFP8_TORCH=off skips it (the tests then run on Debian's torch 1.13 alone).
GEOFP8_TORCH_VERSION="${GEOFP8_TORCH_VERSION:-2.15.0}"
if [ "$(id -u)" -eq 0 ]; then GEOFP8_CACHE="${GEOFP8_CACHE:-/var/cache/geofp8}"
else GEOFP8_CACHE="${GEOFP8_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/geofp8}"; fi

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

# Sets GEOFP8_TORCH_PYTHON to the interpreter of the cached torch venv, installing it first if
# needed (about 3 GB from PyPI, a few minutes, once per machine); empty when GEOFP8_TORCH=off.
ensure_torch_venv() {
  GEOFP8_TORCH_PYTHON=""
  [ "${GEOFP8_TORCH:-on}" = off ] && return 0
  local pyver venv
  pyver="$(/usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  venv="$GEOFP8_CACHE/torch-$GEOFP8_TORCH_VERSION-py$pyver"
  if [ ! -f "$venv/.geofp8-ready" ]; then
    log "installing torch==$GEOFP8_TORCH_VERSION from PyPI into $venv (once per machine)"
    rm -rf "$venv"
    mkdir -p "$GEOFP8_CACHE"
    /usr/bin/python3 -m venv --system-site-packages "$venv"
    if ! "$venv/bin/pip" install --disable-pip-version-check --progress-bar off \
        "torch==$GEOFP8_TORCH_VERSION" >"$venv.log" 2>&1; then
      tail -n 20 "$venv.log" >&2
      echo "torch==$GEOFP8_TORCH_VERSION: pip install failed (log: $venv.log);" \
           "GEOFP8_TORCH=off runs the tests on Debian's torch 1.13 alone" >&2
      return 1
    fi
    "$venv/bin/python" -c "import torch, torch.distributed as d; assert d.is_gloo_available()"
    touch "$venv/.geofp8-ready"
  fi
  GEOFP8_TORCH_PYTHON="$venv/bin/python"
}

configure_and_build() {
  local jobs; jobs="$(nproc)"
  # The torch venv's interpreter runs the python tests (tests/python/CMakeLists.txt).
  local torch_py=() cached=""
  [ -n "${GEOFP8_TORCH_PYTHON+x}" ] && torch_py=("-DGEOFP8_TORCH_PYTHON=$GEOFP8_TORCH_PYTHON")
  if [ -f "$GEOFP8_BUILD/CMakeCache.txt" ]; then
    cached="$(sed -n 's/^GEOFP8_TORCH_PYTHON:[A-Z]*=//p' "$GEOFP8_BUILD/CMakeCache.txt")"
  fi
  if [ ! -f "$GEOFP8_BUILD/build.ninja" ]; then
    log "configuring $GEOFP8_BUILD"
    cmake -S "$GEOFP8_ROOT" -B "$GEOFP8_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      "${torch_py[@]}" "$@"
  elif [ -n "${GEOFP8_TORCH_PYTHON+x}" ] && [ "$cached" != "$GEOFP8_TORCH_PYTHON" ]; then
    log "reconfiguring $GEOFP8_BUILD for GEOFP8_TORCH_PYTHON=$GEOFP8_TORCH_PYTHON"
    cmake -S "$GEOFP8_ROOT" -B "$GEOFP8_BUILD" "${torch_py[@]}" >/dev/null
  fi
  # GEOFP8_BUILD_TARGETS (space-separated) limits the build to those targets, e.g. the demo's
  # three programs; unset builds everything.
  local targets=()
  [ -n "${GEOFP8_BUILD_TARGETS:-}" ] && read -r -a targets <<<"--target $GEOFP8_BUILD_TARGETS"
  log "building ${GEOFP8_BUILD_TARGETS:-everything} ($jobs jobs)"
  cmake --build "$GEOFP8_BUILD" -j "$jobs" "${targets[@]}"
}
