#!/usr/bin/env bash
# Builds GeoFP8's images with podman from deploy/docker/Dockerfile: geofp8-worker (daemons,
# CLI, trainer, python3, torch, geofp8), geofp8-coordinator (no Python, no torch) and, on request,
# geofp8-worker-cuda (the worker with geofp8's CUDA build, for GPU workers).
# Usage: scripts/image.sh [--only worker|coordinator|worker-cuda] [--cuda] [--tag TAG] [--rebuild]
#   --only     build one of them (default: worker and coordinator)
#   --cuda     build geofp8-worker-cuda too (it compiles the CUDA kernels: longer)
#   --tag      the images' tag (default: the CMake project's version, e.g. 0.1.0)
#   --rebuild  build again even when an image of that tag exists for this source tree
# As root, on Debian 12: installs podman, runc and debootstrap when missing. The base is BASE when
# set, else localhost/geofp8-debian:12 when it exists, else debian:12 from a registry, else one
# made here with debootstrap (kept as localhost/geofp8-debian:12 and reused). torch's wheels are
# downloaded once into $GEOFP8_CACHE/wheels and installed from there; geofp8-worker-cuda's build
# adds the nvcc wheels of torch's CUDA version there (about 0.1 GB more) and compiles against
# torch's CUDA and NCCL wheels, not a CUDA toolkit of the host's. Without --rebuild an image
# built here from the same sources (a hash kept in $GEOFP8_CACHE/podman) is not built again.
# Podman runs with runc and default_ulimits = [] (CONTAINERS_CONF, written by this script), and
# builds with chroot isolation: where setting RLIMIT_NPROC is refused, podman's defaults fail.
# Run the images: docs/deploy.md, "Image".
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"

usage() { sed -n '5,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
only="" tag="" rebuild=0 cuda=0
while [ $# -gt 0 ]; do
  case "$1" in
    --only) [ $# -ge 2 ] || usage; only="$2"; shift 2 ;;
    --tag) [ $# -ge 2 ] || usage; tag="$2"; shift 2 ;;
    --rebuild) rebuild=1; shift ;;
    --cuda) cuda=1; shift ;;
    -h|--help) usage ;;
    *) echo "image.sh: error: unknown argument ($1)" >&2; usage ;;
  esac
done
case "$only" in
  "") targets=(worker coordinator) ;;
  worker|coordinator|worker-cuda) targets=("$only") ;;
  *) echo "image.sh: error: --only: must be worker, coordinator or worker-cuda ($only)" >&2
     exit 2 ;;
esac
if [ "$cuda" = 1 ] && [[ " ${targets[*]} " != *" worker-cuda "* ]]; then
  targets+=(worker-cuda)
fi
[ -n "$tag" ] || tag="$(sed -n 's/^project(geofp8 VERSION \([0-9.]*\).*/\1/p' \
                          "$GEOFP8_ROOT/CMakeLists.txt")"
torch_version="$GEOFP8_TORCH_VERSION"

# Podman's configuration for this script and for running the images (image_env prints it).
image_setup() {
  local missing=()
  for p in podman runc debootstrap; do
    command -v "$p" >/dev/null || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
      echo "image.sh: error: missing ${missing[*]}; as root: apt-get install podman runc debootstrap" >&2
      exit 1
    fi
    log "installing podman, runc and debootstrap"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends podman runc debootstrap >/dev/null
  fi
  mkdir -p "$GEOFP8_CACHE/podman"
  export CONTAINERS_CONF="$GEOFP8_CACHE/podman/containers.conf"
  cat >"$CONTAINERS_CONF.tmp" <<'EOF'
# Written by GeoFP8's scripts/image.sh. runc, and no default ulimits: podman's default (nproc)
# and crun fail where setting RLIMIT_NPROC is not permitted (docs/deploy.md, "Image").
[containers]
default_ulimits = []

[engine]
runtime = "runc"
EOF
  mv "$CONTAINERS_CONF.tmp" "$CONTAINERS_CONF"
}

# GEOFP8_PODMAN_STORAGE=vfs where podman's overlay storage does not work (each vfs layer is a
# full copy of the tree: more disk and time); empty: podman's configured driver.
storage=()
[ -z "${GEOFP8_PODMAN_STORAGE:-}" ] || storage=(--storage-driver "$GEOFP8_PODMAN_STORAGE")
pod() { nice -n 15 podman "${storage[@]}" "$@"; }

# A Debian 12 base image: BASE, the local one, debian:12, or a new one from debootstrap.
ensure_base() {
  if [ -n "${BASE:-}" ]; then echo "$BASE"; return; fi
  local local_base=localhost/geofp8-debian:12
  if pod image exists "$local_base"; then echo "$local_base"; return; fi
  if pod image exists docker.io/library/debian:12 \
      || timeout 120 podman "${storage[@]}" pull -q docker.io/library/debian:12 >/dev/null 2>&1; then
    echo docker.io/library/debian:12; return
  fi
  log "no registry: making $local_base with debootstrap (about a minute)"
  local root
  root="$(mktemp -d "$GEOFP8_CACHE/podman/rootfs.XXXXXX")"
  if ! nice -n 15 debootstrap --variant=minbase bookworm "$root" \
      "${GEOFP8_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$root.log" 2>&1; then
    tail -n 20 "$root.log" >&2
    rm -rf "$root"
    echo "image.sh: error: debootstrap failed (log: $root.log)" >&2
    exit 1
  fi
  # debootstrap leaves its package cache and the host's resolv.conf.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root/etc/resolv.conf"
  tar -C "$root" -c . | pod import -q - "$local_base" >/dev/null
  rm -rf "$root" "$root.log"
  echo "$local_base"
}

# pip's wheel, and torch's and its dependencies', downloaded once per torch version (about
# 2.8 GB) for the image's Python (Debian 12: CPython 3.11, glibc 2.36), whatever the host's.
# With "nvcc" (worker-cuda), also the nvcc wheels of the CUDA version torch pins (its
# cuda-toolkit wheel's nvcc extra: nvcc, the crt headers, nvvm), into the same directory.
ensure_wheels() {
  local dir="$GEOFP8_CACHE/wheels/torch-$torch_version-cp311" reqs=(pip "torch==$torch_version")
  local ready=.geofp8-ready
  if [ "${1:-}" = nvcc ]; then reqs+=("cuda-toolkit[nvcc]"); ready=.geofp8-nvcc-ready; fi
  if [ ! -f "$dir/$ready" ]; then
    log "downloading ${reqs[*]} and their dependencies into $dir (once)"
    local pipenv="$GEOFP8_CACHE/wheels/pip-venv" platforms=() v
    [ -x "$pipenv/bin/pip" ] || /usr/bin/python3 -m venv "$pipenv" >&2
    # What pip on Debian 12 accepts: manylinux_2_5 to manylinux_2_36, and the legacy names of
    # 2_5, 2_12 and 2_17, which some wheels carry alone.
    for v in $(seq 5 36); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
    for v in 1 2010 2014; do platforms+=(--platform "manylinux${v}_x86_64"); done
    # The nvcc wheels join torch's: pip keeps the files already there.
    [ -f "$dir/.geofp8-ready" ] || rm -rf "$dir"
    "$pipenv/bin/pip" download --disable-pip-version-check --progress-bar off --quiet \
      --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
      "${platforms[@]}" -d "$dir" "${reqs[@]}" >&2
    touch "$dir/$ready" "$dir/.geofp8-ready"
  fi
  echo "$dir"
}

# What the images are built from: the git blob of every file in the build context that git
# tracks or would track, committed or not, docs/ and tests/ excepted (.dockerignore leaves them
# out), and the torch version. Outside git: a new id every time.
source_id() {
  ( cd "$GEOFP8_ROOT"
    if ! git rev-parse --verify -q HEAD >/dev/null 2>&1; then date +%s%N; exit; fi
    local files
    files="$(git ls-files -co --exclude-standard | grep -Ev '^(docs|tests)/' | sort -u \
               | while read -r f; do [ -f "$f" ] && echo "$f"; done)"
    { paste <(echo "$files") <(echo "$files" | git hash-object --stdin-paths)
      echo "torch $torch_version"; } | sha256sum | cut -c1-16 )
}

image_setup
base="$(ensure_base)"
id="$(source_id)"
started=$SECONDS
built=()
# The build stages left untagged by the builds below are removed at the end; other untagged
# images in the store are not this script's to remove.
dangling_before="$(pod images -q --no-trunc -f dangling=true | sort)"
for target in "${targets[@]}"; do
  name="localhost/geofp8-$target:$tag"
  # "IMAGE-ID SOURCE-ID" of the last build of this name here. (Not an image label: podman 4.3's
  # layer cache ignores a build argument's value in a LABEL step, so the label would go stale.)
  state="$GEOFP8_CACHE/podman/geofp8-$target-$tag.source"
  if [ "$rebuild" = 0 ] && pod image exists "$name" && [ -f "$state" ] \
      && [ "$(cat "$state")" = "$(pod image inspect -f '{{.Id}}' "$name") $id" ]; then
    log "$name is up to date (source $id)"
    continue
  fi
  extra=()
  case "$target" in
    worker) extra=(--build-context "wheels=$(ensure_wheels)") ;;
    worker-cuda) extra=(--build-context "wheels=$(ensure_wheels nvcc)") ;;
  esac
  log "building $name from $base (source $id; the first build compiles for many minutes)"
  t0=$SECONDS
  # --isolation chroot: the OCI isolation sets RLIMIT_NPROC, which may be refused; --layers
  # reuses the build stage for the second image; the stages left dangling are removed below.
  pod build --isolation chroot --network host --layers \
    -f "$GEOFP8_ROOT/deploy/docker/Dockerfile" --target "$target" \
    --build-arg "BASE=$base" --build-arg "TORCH_VERSION=$torch_version" \
    "${extra[@]}" -t "$name" "$GEOFP8_ROOT"
  echo "$(pod image inspect -f '{{.Id}}' "$name") $id" >"$state"
  log "built $name in $((SECONDS - t0)) s"
  built+=("$name")
done
# The build stages and the images these builds replaced: untagged now, and not before. Removing
# a stage's last step leaves the one before it dangling, hence the rounds.
for _ in $(seq 50); do
  stages="$(comm -13 <(echo "$dangling_before") \
                     <(pod images -q --no-trunc -f dangling=true | sort))"
  [ -n "$stages" ] || break
  removed=0
  for stage in $stages; do
    pod rmi "$stage" >/dev/null 2>&1 && removed=1
  done
  [ "$removed" = 1 ] || break
done
for target in "${targets[@]}"; do
  name="localhost/geofp8-$target:$tag"
  printf '%s\t%s\n' "$name" "$(pod image inspect -f '{{.Size}}' "$name" \
    | awk '{printf "%.2f GB", $1 / 1e9}')"
done
[ ${#built[@]} -eq 0 ] || log "built ${built[*]} in $((SECONDS - started)) s"
