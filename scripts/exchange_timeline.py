#!/usr/bin/python3
"""Summarises and plots exchange timelines written by `geofp8-bench exchange --trace DIR` or
`geofp8-train --trace DIR`.

Usage: scripts/exchange_timeline.py [--step S | --from-step S] [--out timeline.png]
           FILE.json [FILE.json ...]

Give it the files of one run, one per rank (DIR/two_phase_fp8_e4m3.rank*.json from the bench,
DIR/rank*.json from the trainer, whose "trainer" lane shows forward/backward, the wait for the
exchange and the optimizer). For one step
(default: the last one every file has) it prints, per rank and lane, the span count, the busy
time and the median span, plus the step's wall time from the first span to the last; with
--out it draws the step as a Gantt chart, a row per rank and lane, a colour per span kind. Ranks
of one machine share the clock, so their rows line up; from different machines they are offset.

With --from-step S it summarises every step from S on instead: per rank and span kind the count
and the median and quartiles of the span's duration, and, for the kinds every file has, how far
apart the ranks start the same span (the i-th span of a kind in a step on one rank is paired with
the i-th on every other) and how long all of them are inside it at once (from the latest start
to the earliest end): for a collective, its time with every rank present.
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


def quartiles(values):
    """(first quartile, median, third quartile) of a non-empty list."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarise(files, first):
    per_file = [[e for e in load(f) if e["args"]["step"] >= first] for f in files]
    for f, spans in zip(files, per_file):
        if not spans:
            sys.exit(f"exchange_timeline.py: error: {f}: no span at step >= {first}")
    print(f"steps >= {first}, {len(files)} rank file(s); durations in ms")
    print(f"{'rank':>4} {'kind':<18} {'spans':>5} {'q1':>7} {'median':>7} {'q3':>7}")
    for spans in per_file:
        rank = spans[0]["pid"]
        for kind in sorted({e["name"] for e in spans}):
            q1, q2, q3 = quartiles([e["dur"] / 1000 for e in spans if e["name"] == kind])
            n = sum(1 for e in spans if e["name"] == kind)
            print(f"{rank:>4} {kind:<18} {n:>5} {q1:>7.3f} {q2:>7.3f} {q3:>7.3f}")
    if len(per_file) < 2:
        return
    # The i-th span of a kind in a step, on every rank.
    keyed = []
    for spans in per_file:
        seen, out = {}, {}
        for e in sorted(spans, key=lambda e: e["ts"]):
            k = (e["args"]["step"], e["name"])
            out[k + (seen.get(k, 0),)] = e
            seen[k] = seen.get(k, 0) + 1
        keyed.append(out)
    common = set.intersection(*(set(k) for k in keyed))
    print(f"{'kind':<18} {'spans':>5} {'start spread median':>20} {'all inside median':>18}")
    for kind in sorted({k[1] for k in common}):
        spread, inside = [], []
        for k in common:
            if k[1] != kind:
                continue
            es = [m[k] for m in keyed]
            starts = [e["ts"] for e in es]
            ends = [e["ts"] + e["dur"] for e in es]
            spread.append((max(starts) - min(starts)) / 1000)
            inside.append(max(0, min(ends) - max(starts)) / 1000)
        print(f"{kind:<18} {len(spread):>5} {statistics.median(spread):>20.3f} "
              f"{statistics.median(inside):>18.3f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--step", type=int, help="step to show (default: the last in every file)")
    p.add_argument("--from-step", type=int,
                   help="summarise every step >= this one instead of showing one step")
    p.add_argument("--out", help="write a Gantt chart of the step to this PNG")
    a = p.parse_args()
    if a.from_step is not None:
        if a.step is not None or a.out:
            p.error("--from-step: not with --step or --out")
        summarise(a.files, a.from_step)
        return

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
