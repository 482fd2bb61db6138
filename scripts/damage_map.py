#!/usr/bin/python3
"""The damage map's statistics (issue #27, item 5) for scripts/damage_map.sh.

Usage: scripts/damage_map.py DIR [--baseline fp32] [--last 3] [--plot OUT.png]

DIR holds dm_<arm>_a<accum>_seed<N>.csv from geofp8-train --csv. Runs of one (seed, accum) share
the initialization, the data order and the held-out batches, so each arm is compared with the
baseline seed by seed: d_s = endpoint(arm, s) - endpoint(fp32, s), reported as the mean of d,
its standard error sd(d)/sqrt(n), a 95% t interval, and z = mean/SE.

Endpoints (fixed before the runs, docs/benchmarks.md "The damage map"):
- primary: the validation loss averaged over the last --last evaluations (an evaluation every
  1/8 of the run: the last 3 are at 6/8, 7/8 and the end);
- the final validation loss;
- the training loss averaged over the last 1/8 of the steps (the same tokens at every batch).
Per (arm, accum) it also gives the global batch B in tokens, the gradient noise scale B_simple
(the trainer's `gns` column, median over the second half of the run, mean over seeds), B/B_simple,
the bytes each rank sends per step, and the exchange's rel_fro error (geometric mean over the
weight matrices, median over the measured steps).
"""
import argparse
import glob
import math
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convergence_paired import fmt, load, paired  # noqa: E402

import csv  # noqa: E402

MICRO_TOKENS = 512  # 2 ranks x 8 sequences x 32 tokens per micro-batch (damage_map.sh)


def extra(path):
    """gns, bytes_sent per step, from the same CSV (convergence_paired.load ignores them)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("step")]
    half = rows[len(rows) // 2:]
    gns = [float(r["gns"]) for r in half if r.get("gns") not in (None, "")]
    gns = [g for g in gns if math.isfinite(g) and g > 0]
    sent = [float(r["bytes_sent"]) for r in rows if r.get("bytes_sent")]
    return (statistics.median(gns) if gns else float("nan"),
            statistics.median(sent) if sent else float("nan"))


def endpoints(run, last):
    val = [v for _, v in run["val"]]
    tail = max(1, len(run["loss"]) // 8)
    return {"val_last": statistics.fmean(val[-last:]), "val_final": val[-1],
            "train_tail": statistics.fmean(run["loss"][-tail:])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--baseline", default="fp32")
    ap.add_argument("--last", type=int, default=3, help="evaluations averaged (primary endpoint)")
    ap.add_argument("--plot", help="PNG: each arm's paired gap to the baseline against B/B_simple")
    args = ap.parse_args()
    if args.last < 1:
        sys.exit(f"damage_map.py: error: --last: must be >= 1 ({args.last})")
    runs = {}  # (arm, accum) -> seed -> (run, gns, bytes)
    for path in sorted(glob.glob(os.path.join(args.dir, "dm_*_a*_seed*.csv"))):
        m = re.fullmatch(r"dm_(.+)_a(\d+)_seed(\d+)\.csv", os.path.basename(path))
        if m:
            runs.setdefault((m.group(1), int(m.group(2))), {})[int(m.group(3))] = (
                load(path), *extra(path))
    if not runs:
        sys.exit(f"damage_map.py: error: {args.dir}: no dm_<arm>_a<accum>_seed<N>.csv")
    accums = sorted({a for _, a in runs})
    names = {"val_last": f"val loss, last {args.last} evals", "val_final": "final val loss",
             "train_tail": "train loss, last 1/8"}
    points = {}  # arm -> [(B/B_simple, mean, se)]
    for a in accums:
        base = runs.get((args.baseline, a))
        if not base:
            print(f"accum {a}: no {args.baseline} runs, skipped\n")
            continue
        arms = [args.baseline] + sorted(p for p, b in runs if b == a and p != args.baseline)
        B = MICRO_TOKENS * a
        gns = statistics.fmean(g for _, g, _ in base.values())
        print(f"### accum {a}: global batch B = {B} tokens, {args.baseline}'s B_simple "
              f"{gns:.0f} tokens (B/B_simple {B / gns:.1f})\n")
        print(f"| arm | seeds | bytes/step/rank | rel_fro | B_simple | {names['val_last']} | "
              f"paired diff to {args.baseline} ± SE | 95% CI | z | seeds below | "
              f"{names['val_final']} diff | {names['train_tail']} diff |")
        print("|---" * 12 + "|")
        for p in arms:
            seeds = runs[(p, a)]
            ends = {s: endpoints(r, args.last) for s, (r, _, _) in seeds.items()}
            bends = {s: endpoints(r, args.last) for s, (r, _, _) in base.items()}
            shared = sorted(set(ends) & set(bends))
            errs = [statistics.median(r["errors"]["err"]) for r, _, _ in seeds.values()
                    if r["errors"]["err"]]
            err = f"{statistics.fmean(errs):.4g}" if errs else "-"
            g = statistics.fmean(x for _, x, _ in seeds.values())
            byt = statistics.fmean(x for _, _, x in seeds.values())
            prim = statistics.fmean(e["val_last"] for e in ends.values())
            cells = [p, str(len(seeds)), f"{byt / 1e3:.1f} kB", err, f"{g:.0f}", f"{prim:.4f}"]
            if p == args.baseline:
                cells += ["-"] * 6
            else:
                diffs = {k: [ends[s][k] - bends[s][k] for s in shared] for k in names}
                mean, se, (lo, hi), below, n = paired(diffs["val_last"])
                z = mean / se if se and not math.isnan(se) and se > 0 else float("nan")
                cells += [f"{fmt(mean)} ± {se:.4f}", f"[{fmt(lo)}, {fmt(hi)}]",
                          "nan" if math.isnan(z) else f"{z:+.1f}", f"{below}/{n}"]
                for k in ("val_final", "train_tail"):
                    m2, se2, _, _, _ = paired(diffs[k])
                    cells.append(f"{fmt(m2)} ± {se2:.4f}")
                points.setdefault(p, []).append((B / gns, mean, se))
            print("| " + " | ".join(cells) + " |")
        print()
    if args.plot and points:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for i, (p, pts) in enumerate(sorted(points.items())):
            pts.sort()
            x = [q[0] * (1 + 0.015 * (i - len(points) / 2)) for q in pts]  # dodge
            ax.errorbar(x, [q[1] for q in pts], yerr=[q[2] for q in pts], marker="o",
                        capsize=3, label=p, color=plt.cm.tab20(i % 20),
                        linestyle="-" if p.startswith("nvfp4") else "--")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(f"B / B_simple ({args.baseline}'s noise scale, second half of the run)")
        ax.set_ylabel(f"val loss - {args.baseline}, same seed (mean ± SE)")
        ax.set_title("Damage map: llama-tiny, 2 ranks, 2^21 tokens per run")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
