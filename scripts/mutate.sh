#!/usr/bin/env bash
# Mutation check (issues #17, #31): plants each bug of scripts/mutations.txt one at a time in the
# numeric core (kernels/) or the services (server/, worker/, platform/policy, client/python),
# rebuilds only the tests that must catch it, runs them per OpenBLAS core, prints a table.
#
# Usage: scripts/mutate.sh [-B BUILD_DIR] [-c CORES] [NAME_REGEX]
#   BUILD_DIR  a configured build folder (default: build)
#   CORES      comma-separated OPENBLAS_CORETYPE values (default: Prescott,Haswell,Zen); the
#              services' tests do not depend on the core, so one (-c Haswell) is enough for them
#   NAME_REGEX only the mutations whose name matches
# Exit status: 0 when every mutation is caught under every core, 1 otherwise (a mutation whose
# tests were all skipped, e.g. Python tests without torch, counts as not caught).
# Each file is restored after its mutation, on error and on Ctrl-C too; the build folder is left
# built from the restored sources. Not run in CI: it rebuilds the code once per mutation.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=build
cores=Prescott,Haswell,Zen
while getopts "B:c:h" opt; do
  case $opt in
    B) build=$OPTARG ;;
    c) cores=$OPTARG ;;
    *) sed -n '2,15p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
filter=${1:-.}
cd "$root"
[[ $build = /* ]] || build=$root/$build
[[ -f $build/build.ninja ]] || { echo "mutate.sh: error: -B: no configured build in $build" >&2; exit 2; }
IFS=, read -r -a core_list <<<"$cores"

backup_dir=$(mktemp -d /tmp/geofp8_mutate.XXXXXX)
planted=""  # the file currently mutated, relative to the root
restore() {
  if [[ -n $planted ]]; then
    cp -p "$backup_dir/original" "$root/$planted"
    touch "$root/$planted"  # newer than the mutated build outputs
    planted=""
  fi
}
trap 'restore; rm -rf "$backup_dir"' EXIT
trap 'echo "mutate.sh: interrupted; restored sources" >&2; exit 130' INT TERM

# Test executables behind a ctest regex and label regex, as ninja targets (paths relative to the
# build folder). A Python test (label python) needs the geofp8 package, and it and a wire test
# (label wire) need the daemons and geofp8ctl when their environment names them.
targets_for() {  # regex labels
  ctest --test-dir "$build" -N -R "$1" -L "$2" --show-only=json-v1 | python3 -c '
import json, os, sys
build = sys.argv[1]
seen = set()
for t in json.load(sys.stdin).get("tests", []):
    cmd = t.get("command") or []
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    if cmd and cmd[0].startswith(build + "/"):
        seen.add(os.path.relpath(cmd[0], build))
    elif set(props.get("LABELS") or []) & {"python", "wire"}:
        # A script: the geofp8 package for Python tests, and the daemons it starts.
        if "python" in props.get("LABELS"):
            seen.add("geofp8_python")
        env = " ".join(props.get("ENVIRONMENT") or [])
        for var, target in (("GEOFP8_COORDINATOR=", "geofp8-coordinator"),
                            ("GEOFP8_WORKER=", "geofp8-worker"), ("GEOFP8CTL=", "geofp8ctl")):
            if var in env:
                seen.add(target)
if not seen:
    sys.exit("mutate.sh: error: no built test matches the regex")
print(" ".join(sorted(seen)))' "$build"
}

run_tests() {  # regex labels core -> 0 when all pass
  OPENBLAS_CORETYPE=$3 ctest --test-dir "$build" -L "$2" -R "$1" --timeout 600 -j2 >"$backup_dir/ctest.log" 2>&1
}
skipped_tests() {  # of the last run
  grep -c -E '\*\*\*Skipped|Not Run' "$backup_dir/ctest.log" || true
}
ran_tests() {
  grep -c -E '^ *[0-9]+/[0-9]+ Test +#' "$backup_dir/ctest.log" || true
}

mapfile -t lines < <(grep -v '^#' scripts/mutations.txt | grep -v '^[[:space:]]*$')
rows=()
declare -A regexes_by_labels=()  # the ctest -L regex -> the test regexes under it
for line in "${lines[@]}"; do
  IFS=$'\t' read -r name file script regex labels <<<"$line"
  [[ $name =~ $filter ]] || continue
  labels=${labels:-unit}
  regexes_by_labels[$labels]+="$regex "
done
[[ ${#regexes_by_labels[@]} -gt 0 ]] || { echo "mutate.sh: error: NAME_REGEX: no mutation matches ($filter)" >&2; exit 2; }
# One regex per label set: CMake's regular expressions allow only 9 groups, so the "^A" and
# "^(A|B)" forms of mutations.txt are merged into a single "^(A|B|...)".
merge_regexes() {
  python3 -c '
import sys
alts = set()
for r in sys.stdin.read().split():
    r = r[1:] if r.startswith("^") else r
    alts.update(r[1:-1].split("|") if r.startswith("(") and r.endswith(")") else [r])
print("^(" + "|".join(sorted(alts)) + ")")'
}

# Unmutated, every test involved must pass, or "caught" would mean nothing.
echo "building and running the unmutated tests ($(date -u +%H:%M:%S))" >&2
all_targets=""
for labels in "${!regexes_by_labels[@]}"; do
  merged=$(merge_regexes <<<"${regexes_by_labels[$labels]}")
  all_targets+=" $(targets_for "$merged" "$labels")"
done
ninja -C "$build" $all_targets >"$backup_dir/build.log" 2>&1 ||
  { cat "$backup_dir/build.log" >&2; exit 2; }
for labels in "${!regexes_by_labels[@]}"; do
  merged=$(merge_regexes <<<"${regexes_by_labels[$labels]}")
  for core in "${core_list[@]}"; do
    if ! run_tests "$merged" "$labels" "$core"; then
      tail -30 "$backup_dir/ctest.log" >&2
      echo "mutate.sh: error: the unmutated tests (-L '$labels') fail under OPENBLAS_CORETYPE=$core" >&2
      exit 2
    fi
  done
done

status=0
header="| mutation | file | tests (ctest -R) |"
sep="|---|---|---|"
for core in "${core_list[@]}"; do header+=" $core |"; sep+="---|"; done
for line in "${lines[@]}"; do
  IFS=$'\t' read -r name file script regex labels <<<"$line"
  [[ $name =~ $filter ]] || continue
  labels=${labels:-unit}
  echo "$name ($(date -u +%H:%M:%S))" >&2
  cp -p "$file" "$backup_dir/original"
  planted=$file
  sed -E -i "$script" "$file"
  row="| $name | $file | \`${regex//|/\\|}\` |"  # a bare | would split the Markdown cell
  if cmp -s "$file" "$backup_dir/original"; then
    for core in "${core_list[@]}"; do row+=" STALE (sed matched nothing) |"; done
    status=1
  elif ! targets=$(targets_for "$regex" "$labels") ||
    ! ninja -C "$build" $targets >"$backup_dir/build.log" 2>&1; then
    for core in "${core_list[@]}"; do row+=" BUILD FAILED |"; done
    status=1
  else
    for core in "${core_list[@]}"; do
      if run_tests "$regex" "$labels" "$core"; then
        skipped=$(skipped_tests)
        if [[ $skipped -gt 0 && $skipped -ge $(ran_tests) ]]; then
          row+=" NOT RUN ($skipped skipped) |"
        else
          row+=" **survived** |"
        fi
        status=1
      else
        failed=$(grep -c -E '^[[:space:]]*[0-9]+ - ' "$backup_dir/ctest.log" || true)
        row+=" caught ($failed failed) |"
      fi
    done
  fi
  restore
  rows+=("$row")
done

echo "rebuilding from the restored sources ($(date -u +%H:%M:%S))" >&2
ninja -C "$build" $all_targets >"$backup_dir/build.log" 2>&1 || cat "$backup_dir/build.log" >&2

echo "scripts/mutate.sh -c $cores $filter" | sed 's/ \.$//'
echo
echo "$header"
echo "$sep"
printf '%s\n' "${rows[@]}"
exit $status
