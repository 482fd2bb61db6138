#!/usr/bin/python3
"""Paired-seed convergence statistics for scripts/convergence_study.sh (issue 11, item 5).

Usage: scripts/convergence_paired.py DIR [--baseline fp32] [--last 5] [--plot OUT.png]
       [--pairs geofp8:fp8,geonvfp4:nvfp4]

DIR holds conv_<policy>_seed<N>.csv (or .csv.gz) from geofp8-train --csv. Runs of one seed share
the initialization, the data order and the held-out batches, so each policy is compared with the
baseline *seed by seed*: d_s = metric(policy, s) - metric(baseline, s). The tables give the mean
of d over seeds, its standard error sd(d)/sqrt(n), a 95% confidence interval from Student's t
with n - 1 degrees of freedom, and how many seeds have d < 0.

Endpoints (fixed before the runs were read):
- primary: the mean validation loss over the last --last evaluations (steps 799-999 at the
  study's cadence), which averages out step-to-step wobble of a single evaluation;
- final validation loss (the last evaluation);
- mean training loss over the last 100 steps (50k training tokens at 512 tokens per step).
"""
import argparse
import csv
import glob
import gzip
import math
import os
import re
import statistics
import sys

# Two-sided 95% quantiles of Student's t, df = 1..30.
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df):
    return T975[df - 1] if df <= len(T975) else 1.96


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = [r for r in csv.DictReader(f) if None not in r.values() and r.get("step")]
    if not rows:
        sys.exit(f"convergence_paired.py: error: {path}: no rows")
    for key in ("step", "loss", "val_loss"):
        if key not in rows[0]:
            sys.exit(f"convergence_paired.py: error: {path}: missing column {key}")
    steps = [int(r["step"]) for r in rows]
    loss = [float(r["loss"]) for r in rows]
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
    if not val:
        sys.exit(f"convergence_paired.py: error: {path}: no validation loss")
    # --error-every rows: per 2-D layer, the exchange's rel_fro_error (err:) and the AdamW
    # update's relative error (upd:); their geometric means over the weight matrices.
    matrices = [k[4:] for k in rows[0] if k.startswith("err:") and "norm" not in k]
    errors = {"err": [], "upd": []}
    for r in rows:
        for kind in errors:
            vals = [float(r[f"{kind}:{m}"]) for m in matrices
                    if r.get(f"{kind}:{m}") not in (None, "")]
            vals = [v for v in vals if math.isfinite(v)]
            if vals and min(vals) == 0:
                errors[kind].append(0.0)  # an exact exchange (fp32)
            elif vals:
                errors[kind].append(math.exp(statistics.fmean(math.log(v) for v in vals)))
    return {"steps": steps, "loss": loss, "val": val, "errors": errors}


def endpoints(run, last):
    val = [v for _, v in run["val"]]
    return {
        "val_last": statistics.fmean(val[-last:]),
        "val_final": val[-1],
        "train_last100": statistics.fmean(run["loss"][-100:]),
    }


def paired(diffs):
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return mean, float("nan"), (float("nan"), float("nan")), sum(d < 0 for d in diffs), n
    se = statistics.stdev(diffs) / math.sqrt(n)
    h = t975(n - 1) * se
    return mean, se, (mean - h, mean + h), sum(d < 0 for d in diffs), n


def fmt(x, digits=4):
    return "nan" if math.isnan(x) else f"{x:+.{digits}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--baseline", default="fp32")
    ap.add_argument("--last", type=int, default=5, help="evaluations averaged (primary endpoint)")
    ap.add_argument("--pairs", default="geofp8:fp8,geonvfp4:nvfp4",
                    help="geometry:euclidean pairs compared directly")
    ap.add_argument("--plot", help="PNG: loss curves and paired differences")
    args = ap.parse_args()
    if args.last < 1:
        sys.exit(f"convergence_paired.py: error: --last: must be >= 1 ({args.last})")
    runs = {}  # policy -> seed -> run
    for path in sorted(glob.glob(os.path.join(args.dir, "conv_*_seed*.csv*"))):
        m = re.fullmatch(r"conv_(.+)_seed(\d+)\.csv(\.gz)?", os.path.basename(path))
        if m:
            runs.setdefault(m.group(1), {})[int(m.group(2))] = load(path)
    if args.baseline not in runs:
        sys.exit(f"convergence_paired.py: error: {args.dir}: no runs of the baseline "
                 f"'{args.baseline}' (conv_{args.baseline}_seed<N>.csv)")
    order = [args.baseline] + sorted(p for p in runs if p != args.baseline)
    base = runs[args.baseline]
    ends = {p: {s: endpoints(r, args.last) for s, r in runs[p].items()} for p in runs}

    names = {"val_last": f"mean val loss, last {args.last} evals",
             "val_final": "final val loss", "train_last100": "train loss, last 100 steps"}
    print(f"Seeds per policy: " + ", ".join(f"{p} {sorted(runs[p])}" for p in order))
    print()
    print("| policy | seeds | " + " | ".join(f"{names[k]} (mean)" for k in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for p in order:
        cells = [f"{statistics.fmean(e[k] for e in ends[p].values()):.4f}" for k in names]
        print(f"| {p} | {len(ends[p])} | " + " | ".join(cells) + " |")
    print()

    if any(r["errors"]["err"] for p in order for r in runs[p].values()):
        print("Exchange and update error during training (--error-every rows: geometric mean over "
              "the weight matrices, median over the measured steps, mean over seeds)")
        print()
        print("| policy | exchange rel_fro_error | AdamW update relative error |")
        print("|---|---|---|")
        for p in order:
            cells = []
            for kind in ("err", "upd"):
                per_seed = [statistics.median(r["errors"][kind]) for r in runs[p].values()
                            if r["errors"][kind]]
                cells.append(f"{statistics.fmean(per_seed):.4g}" if per_seed else "-")
            print(f"| {p} | {cells[0]} | {cells[1]} |")
        print()

    def table(title, against):
        print(title)
        print()
        print("| policy | vs | endpoint | seeds | mean paired diff | SE | 95% CI | seeds below |")
        print("|---|---|---|---|---|---|---|---|")
        for p, q in against:
            shared = sorted(set(ends[p]) & set(ends[q]))
            if not shared:
                continue
            for k in names:
                mean, se, (lo, hi), below, n = paired([ends[p][s][k] - ends[q][s][k]
                                                       for s in shared])
                print(f"| {p} | {q} | {names[k]} | {n} | {fmt(mean)} | "
                      f"{'nan' if math.isnan(se) else f'{se:.4f}'} | [{fmt(lo)}, {fmt(hi)}] | "
                      f"{below}/{n} |")
        print()

    table(f"Paired difference to {args.baseline} (negative: lower loss than {args.baseline})",
          [(p, args.baseline) for p in order[1:]])
    pairs = []
    for spec in args.pairs.split(","):
        g, _, e = spec.partition(":")
        if g in runs and e in runs:
            pairs.append((g, e))
    if pairs:
        table("Geometry against Euclidean at the same bytes (negative: geometry trains better)",
              pairs)

    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
        palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        color = {p: palette[i % len(palette)] for i, p in enumerate(order)}  # same in every panel
        ax = axes[0]
        for p in order:
            seeds = sorted(runs[p])
            steps = [s for s, _ in runs[p][seeds[0]]["val"]]
            mean = [statistics.fmean(runs[p][s]["val"][i][1] for s in seeds)
                    for i in range(len(steps))]
            ax.plot(steps, mean, label=f"{p} ({len(seeds)} seeds)", color=color[p])
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (mean over seeds)")
        ax.set_ylim(top=min(3.2, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

        def band(ax, p, q, label, style="-"):
            shared = sorted(set(runs[p]) & set(runs[q]))
            if not shared:
                return
            steps = [s for s, _ in runs[q][shared[0]]["val"]]
            means, ses = [], []
            for i in range(len(steps)):
                d = [runs[p][s]["val"][i][1] - runs[q][s]["val"][i][1] for s in shared]
                means.append(statistics.fmean(d))
                ses.append(statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0)
            ax.plot(steps, means, label=label, color=color[p], linestyle=style)
            ax.fill_between(steps, [m - s for m, s in zip(means, ses)],
                            [m + s for m, s in zip(means, ses)], color=color[p],
                            alpha=0.2 if style == "-" else 0.08)

        ax = axes[1]
        for p in order[1:]:
            band(ax, p, args.baseline, p)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel(f"val loss - {args.baseline}, same seed (mean ± SE)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[2]
        drawn = {}  # a geometry policy in several pairs: solid, then dashed, then dotted
        for g, e in pairs:
            style = ("-", "--", ":")[min(drawn.get(g, 0), 2)]
            drawn[g] = drawn.get(g, 0) + 1
            band(ax, g, e, f"{g} - {e}", style)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("val loss, geometry - Euclidean, same seed (mean ± SE)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
