#!/usr/bin/env bash
# The Hadamard and lowrank+Hadamard arms on llama-small trajectories (issue #27; docs/benchmarks.md,
# "Hadamard and lowrank+Hadamard on the trajectories"). Per batch: dump the fp32 trajectory (steps
# 20-59 and 260-299) unless DUMPS/bB/.done exists, then replay both windows with every arm.
# Resumable: a replay whose OUT/bB_W.md ends with its last policy's summary is not run again.
#   scripts/trajectory_hadamard.sh [-b build] [-d /work/dumps] [-o OUT] [--rm-dumps] 8 2 32
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=$here/build dumps=/work/dumps out=/work/traj_out rm_dumps=0 batches=()
while (($#)); do
  case $1 in
    -b) build=$2; shift 2 ;;
    -d) dumps=$2; shift 2 ;;
    -o) out=$2; shift 2 ;;
    --rm-dumps) rm_dumps=1; shift ;;
    -*) echo "trajectory_hadamard.sh: error: unknown flag ($1)" >&2; exit 2 ;;
    *) batches+=("$1"); shift ;;
  esac
done
((${#batches[@]})) || batches=(8 2 32)
D=$here/bench/damage
arms=(geofp8 "$D/fp8b-had.yaml" "$D/fp8b-lowrank.yaml" "$D/fp8b-lowrank-had.yaml"
      geonvfp4 "$D/nvfp4-had.yaml" "$D/nvfp4-lowrank.yaml" "$D/nvfp4-lowrank-had.yaml")
policies=()
for a in "${arms[@]}"; do policies+=(--policy "$a"); done
mkdir -p "$out"
stamp() { echo "$(date -u +%FT%TZ) $(uptime)"; }
for b in "${batches[@]}"; do
  dir=$dumps/b$b
  if [[ ! -f $dir/.done ]]; then
    rm -rf "$dir"
    echo "dump b$b start $(stamp)" | tee -a "$out/runs.log"
    nice -n 10 "$build/worker/train/geofp8-train" --preset llama-small --ranks 4 --batch "$b" \
      --steps 300 --policy fp32 --data /usr/lib/python3.11 --dump-grads "$dir" \
      --dump-steps 20-59,260-299 --quiet >"$out/dump_b$b.txt" 2>&1
    touch "$dir/.done"
    echo "dump b$b end $(stamp) $(du -sh "$dir" | cut -f1)" | tee -a "$out/runs.log"
  fi
  for w in 20-59 260-299; do
    md=$out/b${b}_$w.md
    if [[ -f $md ]] && grep -qF "**${arms[-1]}**" "$md"; then continue; fi
    echo "replay b$b $w start $(stamp)" | tee -a "$out/runs.log"
    nice -n 10 "$build/bench/geofp8-bench" trajectory "$dir" --steps "$w" --warmup 20 \
      "${policies[@]}" --csv "$out/b${b}_$w.csv" >"$md.part" 2>"$out/b${b}_$w.err"
    mv "$md.part" "$md"
    echo "replay b$b $w end $(stamp)" | tee -a "$out/runs.log"
  done
  ((rm_dumps)) && rm -rf "$dir"
done
