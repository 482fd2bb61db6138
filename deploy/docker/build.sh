#!/bin/sh
# Run by deploy/docker/Dockerfile's build stages in /src (a copy of the repository): configures
# and builds what the images hold in /build, then lays each image's files out under /out/<image>
# as they land in it (one COPY each). GEOFP8_ENABLE_CUDA (ON or OFF, default OFF) picks the CUDA
# build or the CPU one; the arguments are more CMake arguments (where the CUDA stage's nvcc,
# cuBLAS and NCCL are). ccache keeps its objects in /ccache (the stages' cache mount).
set -eu
cuda="${GEOFP8_ENABLE_CUDA:-OFF}"
launchers="-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
[ "$cuda" = OFF ] || launchers="$launchers -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"
export CCACHE_DIR=/ccache CCACHE_MAXSIZE=2G
# shellcheck disable=SC2086
cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGEOFP8_ENABLE_CUDA="$cuda" \
  -DGEOFP8_BUILD_TESTS=OFF -DGEOFP8_BUILD_BENCH=OFF -DPython_EXECUTABLE=/usr/bin/python3 \
  $launchers "$@"
cmake --build /build -j"$(nproc)" --target geofp8-coordinator geofp8-worker geofp8ctl \
  geofp8-train geofp8-tool geofp8_python
ccache --show-stats | grep -E '^ *(Hits|Misses|Cache size)' || true
# The geofp8 package is the wheel pyproject.toml builds (setup.py reuses /build, strips the
# extension and, with GEOFP8_ENABLE_CUDA=ON, fails unless /build is the CUDA build), unpacked
# where Debian's python3 looks for locally installed packages (a wheel is a zip of that layout).
GEOFP8_ENABLE_CUDA="$cuda" GEOFP8_CMAKE_BUILD_DIR=/build \
  python3 -m build --no-isolation --wheel --outdir /dist .
c=/out/coordinator/usr/local/bin w=/out/worker
mkdir -p "$c" "$w/usr/local/bin" "$w/usr/local/lib/python3.11/dist-packages" "$w/usr/share/geofp8"
install -s /build/server/coordinator/geofp8-coordinator /build/client/ctl/geofp8ctl "$c/"
install -s /build/server/coordinator/geofp8-coordinator /build/worker/daemon/geofp8-worker \
  /build/client/ctl/geofp8ctl /build/worker/train/geofp8-train /build/client/tool/geofp8-tool \
  "$w/usr/local/bin/"
python3 -m zipfile -e /dist/geofp8-*.whl "$w/usr/local/lib/python3.11/dist-packages/"
cp -r examples "$w/usr/share/geofp8/examples"
