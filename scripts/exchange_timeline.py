#!/usr/bin/python3
"""Summarises and plots exchange timelines written by `geofp8-bench exchange --trace DIR` or
`geofp8-train --trace DIR`.

Usage: scripts/exchange_timeline.py [--step S] [--out timeline.png] FILE.json [FILE.json ...]

Give it the files of one run, one per rank (DIR/two_phase_fp8_e4m3.rank*.json from the bench,
DIR/rank*.json from the trainer, whose "trainer" lane shows forward/backward, the wait for the
exchange and the optimizer). For one step
(default: the last one every file has) it prints, per rank and lane, the span count, the busy
time and the median span, plus the step's wall time from the first span to the last; with
--out it draws the step as a Gantt chart, a row per rank and lane, a colour per span kind. Ranks
of one machine share the clock, so their rows line up; from different machines they are offset.
"""
import argparse
import json
import statistics
import sys

LANES = {0: "main", 1: "side", 2: "codec", 3: "trainer"}


def load(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"exchange_timeline.py: error: {path}: {e}")
    spans = [e for e in doc.get("traceEvents", []) if e.get("ph") == "X"]
    if not spans:
        sys.exit(f"exchange_timeline.py: error: {path}: no spans (was it written by --trace?)")
    return spans


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--step", type=int, help="step to show (default: the last in every file)")
    p.add_argument("--out", help="write a Gantt chart of the step to this PNG")
    a = p.parse_args()

    per_file = [load(f) for f in a.files]
    steps = set.intersection(*({e["args"]["step"] for e in spans} for spans in per_file))
    if not steps:
        sys.exit("exchange_timeline.py: error: the files share no step")
    step = max(steps) if a.step is None else a.step
    if step not in steps:
        sys.exit(f"exchange_timeline.py: error: --step: {step} is not in every file "
                 f"(common steps {min(steps)}..{max(steps)})")

    rows = []  # (rank, lane, [spans])
    for spans in per_file:
        mine = [e for e in spans if e["args"]["step"] == step]
        for lane in sorted({e["tid"] for e in mine}):
            rows.append((mine[0]["pid"], lane, [e for e in mine if e["tid"] == lane]))
    t0 = min(e["ts"] for _, _, spans in rows for e in spans)
    t1 = max(e["ts"] + e["dur"] for _, _, spans in rows for e in spans)

    print(f"step {step}: {(t1 - t0) / 1000:.1f} ms from the first span to the last, "
          f"{len(per_file)} rank file(s)")
    print(f"{'rank':>4} {'lane':<6} {'spans':>5} {'busy_ms':>8} {'busy_%':>6}  median ms per kind")
    for rank, lane, spans in rows:
        busy = sum(e["dur"] for e in spans)
        kinds = sorted({e["name"] for e in spans})
        medians = ", ".join(
            f"{k} {statistics.median(e['dur'] for e in spans if e['name'] == k) / 1000:.2f}"
            for k in kinds)
        print(f"{rank:>4} {LANES.get(lane, lane):<6} {len(spans):>5} {busy / 1000:>8.1f} "
              f"{100 * busy / max(t1 - t0, 1):>6.1f}  {medians}")

    if a.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        kinds = sorted({e["name"] for _, _, spans in rows for e in spans})
        colours = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(kinds)}
        fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
        for y, (rank, lane, spans) in enumerate(rows):
            ax.broken_barh([((e["ts"] - t0) / 1000, e["dur"] / 1000) for e in spans], (y - 0.4, 0.8),
                           facecolors=[colours[e["name"]] for e in spans], edgecolor="white",
                           linewidth=0.3)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"rank {r} {LANES.get(l, l)}" for r, l, _ in rows])
        ax.invert_yaxis()
        ax.set_xlabel("ms since the step's first span")
        ax.set_title(f"exchange timeline, step {step}")
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in kinds], labels=kinds,
                  loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(kinds), frameon=False)
        fig.tight_layout()
        fig.savefig(a.out, dpi=110)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
