#!/usr/bin/env bash
# Builds everything and runs the whole test suite (ctest). Installs missing Debian packages
# when run as root, and torch 2.x from PyPI into a cached venv (lib/common.sh, ensure_torch_venv).
# Usage: scripts/test.sh [ctest args...], e.g. scripts/test.sh -L unit
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"

ensure_packages
ensure_torch_venv
configure_and_build
log "running tests"
cd "$GEOFP8_BUILD"
ctest --output-on-failure -j "$(nproc)" --timeout 900 "$@"
