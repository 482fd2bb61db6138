#!/usr/bin/env bash
# Runs ON the GPU machine (device tool), from the repository root, after tests/gpu/prepare.sh
# ran here: builds the numeric core with CUDA, runs the `gpu` ctest label,
# and writes logs to $OUT. Budget: under 8 minutes on an H200 machine (16 cores).
#   device run: command "bash tests/gpu/run.sh", carry [".gpu-deps"], timeout_s 560
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/.gpu-deps/lib:${LD_LIBRARY_PATH:-}"
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

{ nvidia-smi || true; nvcc --version || true; } > "$OUT/device.txt" 2>&1
log "configure"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DGEOFP8_GPU_ONLY=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
log "build"
timeout 240 cmake --build build-gpu -j "$(nproc)" > "$OUT/build.log" 2>&1 \
  || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
log "gpu tests"
(cd build-gpu && timeout 150 ctest -L gpu --output-on-failure) > "$OUT/gpu-tests.log" 2>&1
rc=$?
tail -15 "$OUT/gpu-tests.log" | tee -a "$OUT/summary.txt"
# There are no GPU benchmarks yet (geofp8-bench times the CPU paths only); when they exist, run
# them here and append to "$OUT/bench.log".
exit $rc
