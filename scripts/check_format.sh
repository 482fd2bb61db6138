#!/usr/bin/env bash
# Checks that every C++ and CUDA source follows .clang-format (clang-format 14, Debian 12's).
# Usage: scripts/check_format.sh [--fix]. Exit 1 names the files that differ; --fix rewrites them.
# Exit 77 (ctest: skipped) when no clang-format 14 is installed: other versions format
# differently, so their verdict would not be the one CI gives.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cf=""
for c in clang-format-14 clang-format; do
  if command -v "$c" > /dev/null && "$c" --version | grep -q "version 14\."; then cf=$c; break; fi
done
[[ -n $cf ]] || { echo "check_format.sh: skipped: clang-format 14 not found (apt-get install clang-format)"; exit 77; }
cd "$root"
mapfile -t files < <(find kernels server worker client bench tests proto \
  -path kernels/exchange/gloo_compat -prune -o \
  -type f \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print | sort)
if [[ ${1:-} == --fix ]]; then
  "$cf" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$cf" --dry-run --Werror "$f" > /dev/null 2>&1 || bad+=("$f")
done
if [[ ${#bad[@]} -gt 0 ]]; then
  echo "check_format.sh: ${#bad[@]} of ${#files[@]} files differ from .clang-format (fix: scripts/check_format.sh --fix):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check_format.sh: ${#files[@]} files follow .clang-format"
