#!/usr/bin/env bash
# Builds everything and runs the whole test suite (ctest). Installs missing Debian packages
# when run as root, and torch 2.x from PyPI into a cached venv (lib/common.sh, ensure_torch_venv).
# Usage: scripts/test.sh [ctest args...], e.g. scripts/test.sh -L unit
# Under load: GEOFP8_TEST_LOAD=N scripts/test.sh runs N busy loops (one spinning shell each)
# beside ctest, started after the build and stopped when ctest ends, as on a shared CI machine;
# a test that assumes a timing fails there (docs/developing.md, "Tests under load").
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"

load=${GEOFP8_TEST_LOAD:-0}
if ! [[ $load =~ ^[0-9]+$ ]] || [ "$load" -gt 64 ]; then
  echo "test.sh: error: GEOFP8_TEST_LOAD: must be a whole number of busy loops, 0 to 64 ($load)" >&2
  exit 2
fi

ensure_packages
ensure_torch_venv
configure_and_build
load_pids=()
stop_load() {
  for pid in "${load_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${load_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_load EXIT
for ((i = 0; i < load; i++)); do
  (while :; do :; done) &
  load_pids+=("$!")
done
log "running tests${load_pids[*]:+ beside $load busy loops}"
cd "$GEOFP8_BUILD"
ctest --output-on-failure -j "$(nproc)" --timeout 900 "$@"
