#!/usr/bin/env bash
# The damage map's real-data sweep (issue #27, item 5; docs/benchmarks.md, "The damage map"):
# llama-tiny on text, 2 ranks, the global batch grown by gradient accumulation at a fixed token
# budget, every arm of bench/damage/ against fp32 from paired seeds. Run (arm, seed, accum) and
# (fp32, seed, accum) share the initialization, the data order and the held-out batches; only the
# exchange differs. Resumable: a run whose CSV reaches its last step is skipped.
#
# Usage: scripts/damage_map.sh [-b BINARY] [-o OUTDIR] [-s "1 2 3"] [-a "4 16 64"]
#        [-p "fp32 nvfp4-rtn ..."] [-T TOKENS] [-- extra geofp8-train flags]
# An arm is a preset name (fp32) or the base name of bench/damage/ARM.yaml. Each run writes
# OUTDIR/dm_<arm>_a<accum>_seed<s>.csv and .log. Then: scripts/damage_map.py OUTDIR
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin="$here/build/worker/train/geofp8-train"
out="damage-map"
seeds="1 2 3 4 5"
accums="4 16 64"
arms="fp32 $(cd "$here/bench/damage" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')"
tokens=2097152  # 2^21 tokens per run, whatever the batch
while getopts "b:o:s:a:p:T:" opt; do
  case $opt in
    b) bin=$OPTARG ;;
    o) out=$OPTARG ;;
    s) seeds=$OPTARG ;;
    a) accums=$OPTARG ;;
    p) arms=$OPTARG ;;
    T) tokens=$OPTARG ;;
    *) echo "usage: $0 [-b BINARY] [-o OUTDIR] [-s SEEDS] [-a ACCUMS] [-p ARMS] [-T TOKENS] [-- FLAGS]" >&2
       exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ -x $bin ]] || { echo "damage_map.sh: error: -b: not an executable ($bin)" >&2; exit 2; }
for a in $accums; do
  [[ $a =~ ^[1-9][0-9]*$ ]] || { echo "damage_map.sh: error: -a: not a positive integer ($a)" >&2; exit 2; }
done
for p in $arms; do
  [[ $p == fp32 || -f $here/bench/damage/$p.yaml ]] ||
    { echo "damage_map.sh: error: -p: no preset or bench/damage/$p.yaml ($p)" >&2; exit 2; }
done
mkdir -p "$out"
# Fixed shape: 2 ranks x 8 sequences x 32 tokens = 512 tokens per micro-batch.
micro=512
total=0; for a in $accums; do for s in $seeds; do for p in $arms; do total=$((total + 1)); done; done; done
n=0
for a in $accums; do
  steps=$((tokens / (micro * a)))
  (( steps >= 16 )) || { echo "damage_map.sh: error: -a $a leaves $steps steps of the budget (< 16)" >&2; exit 2; }
  every=$((steps / 8))
  for s in $seeds; do
    for p in $arms; do
      n=$((n + 1))
      policy=$p; [[ $p == fp32 ]] || policy="$here/bench/damage/$p.yaml"
      base="$out/dm_${p}_a${a}_seed${s}"
      if [[ -f $base.csv ]] && tail -n 1 "$base.csv" | grep -q "^$((steps - 1)),"; then
        echo "[$n/$total] $p accum $a seed $s: done already"
        continue
      fi
      echo "[$n/$total] $p accum $a seed $s ($steps steps) -> $base.csv  ($(date +%H:%M:%S), load $(cut -d' ' -f1 /proc/loadavg))"
      "$bin" --preset llama-tiny --ranks 2 --batch 8 --accum "$a" --steps "$steps" --policy "$policy" \
        --data /usr/lib/python3.11 --seed "$s" --warmup 10 --eval-every "$every" --eval-batches 16 \
        --error-every "$every" --checksum-every 0 --quiet --csv "$base.csv.part" "$@" > "$base.log" 2>&1
      mv "$base.csv.part" "$base.csv"
      tail -n 2 "$base.log" | head -n 1
    done
  done
done
