#!/usr/bin/env bash
# What share of a training step's CPU time the geometry takes (issue 11's overhead target), from
# one run under perf: geofp8-train --policy geofp8, 4 ranks as threads, llama-small, batch 8.
# CPU shares rather than wall-clock differences between two runs, because the development
# machines are shared and oversubscribed (4 ranks on 2 cores), which makes wall time noisy while
# each sample still lands in the function that used the CPU. A sample counts once, by its whole
# call stack.
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
# Each sample's whole call stack, so that a sample is counted once however many of the frames
# below it matches, and threads that are not under Trainer::Step are classified by their own
# frames: the exchange pipeline's helper thread (encode, decode and the fused transform run there)
# and its side-channel lane, as well as the exchanger thread and Gloo's I/O threads.
perf script -i "$tmp/perf.data" -F ip,sym 2> /dev/null > "$tmp/stacks.txt"
/usr/bin/python3 - "$tmp/stacks.txt" <<'PY'
import re, sys
STEP = [r"geofp8::train::Trainer::Step\b", r"geofp8::Exchanger::WorkerLoop\b",
        r"gloo::transport::tcp::Loop::run\b", r"\bHelperLoop\b", r"\bRunLane\b"]
# Only the helper thread and the side lane start at HelperLoop / RunLane without one of the
# other frames above them; lane 0 runs RunLane on the exchanger thread itself.
PARTS = [
    ("sketch update (UpdateFactorSketch)", r"geofp8::UpdateFactorSketch\b"),
    ("drift (SubspaceDrift)", r"geofp8::SubspaceDrift\b"),
    ("basis from sketch (GeometryFromSketch)", r"geofp8::GeometryFromSketch\b"),
    ("estimation in all (Exchanger::RunRefreshes)", r"geofp8::Exchanger::RunRefreshes\b"),
    ("transform + inverse (geometry Transform)",
     r"geofp8::\(anonymous namespace\)::Transform\b|^Transform \(inlined\)"),
    ("fingerprint digest (GeometryDigest)", r"geofp8::GeometryDigest\b"),
]
GEOMETRY = ["estimation in all (Exchanger::RunRefreshes)", "transform + inverse (geometry Transform)",
            "fingerprint digest (GeometryDigest)"]
step_re = re.compile("|".join(STEP))
part_re = {name: re.compile(rx) for name, rx in PARTS}
total = step = geo = 0
count = {name: 0 for name, _ in PARTS}
old_step = 0  # Trainer::Step + exchanger thread + Gloo threads only (this script before session 9)
old_re = re.compile("|".join(STEP[:3]))

def finish(frames):
    global total, step, geo, old_step
    if not frames:
        return
    total += 1
    if any(step_re.search(f) for f in frames):
        step += 1
    if any(old_re.search(f) for f in frames):
        old_step += 1
    hit = set(name for name, rx in part_re.items() if any(rx.search(f) for f in frames))
    for name in hit:
        count[name] += 1
    if hit & set(GEOMETRY):
        geo += 1

frames = []
for line in open(sys.argv[1], errors="replace"):
    line = line.strip()
    if not line:
        finish(frames)
        frames = []
        continue
    parts = line.split(None, 1)
    frames.append(parts[1] if len(parts) > 1 else parts[0])
finish(frames)
if step == 0:
    sys.exit("geometry_overhead.sh: error: no samples under Trainer::Step (perf without DWARF call graphs?)")
print(f"per-step CPU (Trainer::Step, the exchanger thread, the exchange pipeline's helper and lane "
      f"threads, Gloo's I/O threads): {100.0 * step / total:.2f}% of {total} samples")
print("| part | % of samples | share of the step's CPU |")
print("|---|---|---|")
for name, _ in PARTS:
    print(f"| {name} | {100.0 * count[name] / total:.2f} | {count[name] / step:.3f} |")
print(f"| **geometry (estimation + transform + digest)** | {100.0 * geo / total:.2f} | "
      f"**{geo / step:.3f}** |")
print(f"(against Trainer::Step + exchanger + Gloo threads only, as this script measured before "
      f"it counted the pipeline's threads: {geo / old_step:.3f})")
PY
