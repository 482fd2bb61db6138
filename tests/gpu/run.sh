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
# geofp8.torch's CUDA path (tests/python/test_hook_cuda.py, ctest python.hook.cuda): needs a
# python3 with a CUDA build of torch and pybind11, and the full build (the Python module links the
# trainer library), so it runs only where those are; a bare machine logs why it skipped.
if python3 -c 'import sys, torch, pybind11; sys.exit(0 if torch.cuda.is_available() else 1)' \
    > /dev/null 2>&1; then
  log "python CUDA hook"
  if cmake -S . -B build-gpu-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DGEOFP8_ENABLE_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DPython_EXECUTABLE="$(command -v python3)" \
      > "$OUT/configure-py.log" 2>&1; then
    timeout 200 cmake --build build-gpu-py --target geofp8_python -j "$(nproc)" \
      > "$OUT/build-py.log" 2>&1 \
      && (cd build-gpu-py && timeout 120 ctest -R 'python\.hook\.cuda' --output-on-failure) \
      > "$OUT/python-cuda.log" 2>&1
    py_rc=$?
    tail -5 "$OUT/python-cuda.log" 2>/dev/null | tee -a "$OUT/summary.txt"
    [[ $py_rc -eq 0 ]] || rc=$py_rc
  else
    log "python CUDA hook: skipped (the full build does not configure here: $OUT/configure-py.log)"
  fi
else
  log "python CUDA hook: skipped (no python3 with a CUDA torch and pybind11 on this machine)"
fi
# The GPU benchmarks (bench/gpu_bench_main.cc): codec against device memcpy, the lowrank
# transform against a cuBLAS sgemm of equal FLOPs, the sketch update against the transform, and a
# 4-rank exchange of device memory (the device plane, ranks as threads over Gloo) against host
# memory, after bit-for-bit device/host checks of both codecs and of the two exchanges (a
# mismatch fails the run).
log "gpu benchmarks"
timeout 120 build-gpu/bench/geofp8-gpu-bench --reps 20 > "$OUT/bench.log" 2>&1
bench_rc=$?
cat "$OUT/bench.log" >> "$OUT/summary.txt"
if [[ $bench_rc -ne 0 ]]; then
  log "gpu benchmarks: failed (exit $bench_rc)"
  rc=$bench_rc
fi
exit $rc
