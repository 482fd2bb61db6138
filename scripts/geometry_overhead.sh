#!/usr/bin/env bash
# What share of a training step's CPU time the geometry takes (issue 11's overhead target), from
# one run under perf: geofp8-train --policy geofp8, 4 ranks as threads, llama-small, batch 8.
# CPU shares rather than wall-clock differences between two runs, because the development
# machines are shared and oversubscribed (4 ranks on 2 cores), which makes wall time noisy while
# each sample still lands in the function that used the CPU.
#
# Usage: scripts/geometry_overhead.sh [-b BUILD] [-s STEPS] [-p POLICY]
# Needs perf (Debian package linux-perf) and perf_event_paranoid <= 2 or root.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="$here/build"; steps=30; policy=geofp8
while getopts "b:s:p:" opt; do
  case $opt in
    b) build=$OPTARG ;;
    s) steps=$OPTARG ;;
    p) policy=$OPTARG ;;
    *) echo "usage: $0 [-b BUILD] [-s STEPS] [-p POLICY]" >&2; exit 2 ;;
  esac
done
command -v perf > /dev/null || { echo "geometry_overhead.sh: error: perf not found (apt-get install linux-perf)" >&2; exit 2; }
[[ "$steps" =~ ^[0-9]+$ && "$steps" -ge 5 ]] || { echo "geometry_overhead.sh: error: -s: need an integer >= 5 ($steps)" >&2; exit 2; }
bin="$build/worker/train/geofp8-train"
[[ -x $bin ]] || { echo "geometry_overhead.sh: error: -b: no geofp8-train in $build" >&2; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
perf record -q -F 400 --call-graph dwarf,16384 -o "$tmp/perf.data" "$bin" --preset llama-small \
  --ranks 4 --batch 8 --steps "$steps" --policy "$policy" --data /usr/lib/python3.11 --quiet \
  --eval-every 100000 --checksum-every 0 > "$tmp/train.log" 2> "$tmp/perf.err"
perf report -i "$tmp/perf.data" --children --sort symbol 2> /dev/null > "$tmp/report.txt"
/usr/bin/python3 - "$tmp/report.txt" <<'PY'
import re, sys
share = {}
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"\s+([0-9.]+)%\s+[0-9.]+%\s+\[\.\]\s+(.*?)(\s+-\s+-)?\s*$", line)
    if m:
        share.setdefault(m.group(2), float(m.group(1)))
def get(pattern):
    return max([v for k, v in share.items() if re.fullmatch(pattern, k)] or [0.0])
step = get(r"geofp8::train::Trainer::Step") + get(r"geofp8::Exchanger::WorkerLoop") + \
       get(r"gloo::transport::tcp::Loop::run")
parts = {
    "sketch update (UpdateFactorSketch)": get(r"geofp8::UpdateFactorSketch"),
    "drift (SubspaceDrift)": get(r"geofp8::SubspaceDrift"),
    "basis from sketch (GeometryFromSketch)": get(r"geofp8::GeometryFromSketch"),
    "estimation in all (Exchanger::RunRefreshes)": get(r"geofp8::Exchanger::RunRefreshes"),
    "transform + inverse (geometry Transform)": get(r"geofp8::\(anonymous namespace\)::Transform|Transform \(inlined\)"),
    "fingerprint digest (GeometryDigest)": get(r"geofp8::GeometryDigest"),
}
print(f"per-step CPU (Trainer::Step + exchanger thread + gloo I/O threads): {step:.2f}% of samples")
print("| part | % of samples | share of the step's CPU |")
print("|---|---|---|")
for k, v in parts.items():
    print(f"| {k} | {v:.2f} | {v / step:.3f} |")
geo = parts["estimation in all (Exchanger::RunRefreshes)"] + parts["transform + inverse (geometry Transform)"] + parts["fingerprint digest (GeometryDigest)"]
print(f"| **geometry (estimation + transform + digest)** | {geo:.2f} | **{geo / step:.3f}** |")
PY
