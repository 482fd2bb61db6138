#!/usr/bin/env bash
# Paired-seed convergence study (issue 11, item 5): every policy trains from the same seeds, so
# run (policy, seed) and (fp32, seed) share the initialization, the data order and the held-out
# batches, and differ only in the exchange. Resumable: a run whose CSV already reaches the last
# step is skipped.
#
# Usage: scripts/convergence_study.sh [-b BINARY] [-o OUTDIR] [-s "1 2 3 4 5"] [-p "fp32 fp8 ..."]
#        [-n STEPS] [-- extra geofp8-train flags]
# A policy is a preset name or a policy file (FILE.yaml); a file's runs are named by its base name:
# -p examples/policies/ema-every4-beta66.yaml writes conv_ema-every4-beta66_seed<s>.csv.
# Then:  scripts/convergence_paired.py OUTDIR
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin="$here/build/worker/train/geofp8-train"
out="conv-study"
seeds="1 2 3 4 5"
policies="fp32 fp8 geofp8 nvfp4 geonvfp4"
steps=1000
while getopts "b:o:s:p:n:" opt; do
  case $opt in
    b) bin=$OPTARG ;;
    o) out=$OPTARG ;;
    s) seeds=$OPTARG ;;
    p) policies=$OPTARG ;;
    n) steps=$OPTARG ;;
    *) echo "usage: $0 [-b BINARY] [-o OUTDIR] [-s SEEDS] [-p POLICIES] [-n STEPS] [-- FLAGS]" >&2
       exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ -x $bin ]] || { echo "convergence_study.sh: error: -b: not an executable ($bin)" >&2; exit 2; }
mkdir -p "$out"
last=$((steps - 1))
total=0; for s in $seeds; do for p in $policies; do total=$((total + 1)); done; done
n=0
for s in $seeds; do
  for p in $policies; do
    n=$((n + 1))
    name=$p
    if [[ $p == *.yaml || $p == *.yml ]]; then
      [[ -f $p ]] || { echo "convergence_study.sh: error: -p: no such policy file ($p)" >&2; exit 2; }
      name=$(basename "${p%.*}")
    fi
    csv="$out/conv_${name}_seed${s}.csv"
    if [[ -f $csv ]] && tail -n 1 "$csv" | grep -q "^$last,"; then
      echo "[$n/$total] $name seed $s: done already ($csv)"
      continue
    fi
    echo "[$n/$total] $name seed $s -> $csv  ($(date +%H:%M:%S))"
    "$bin" --preset llama-small --ranks 2 --batch 4 --steps "$steps" --policy "$p" \
      --data /usr/lib/python3.11 --seed "$s" --eval-every 50 --eval-batches 16 \
      --error-every 100 --checksum-every 0 --quiet --csv "$csv.part" "$@" > "$out/conv_${name}_seed${s}.log" 2>&1
    mv "$csv.part" "$csv"
    tail -n 1 "$out/conv_${name}_seed${s}.log"
  done
done
