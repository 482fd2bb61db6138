#!/usr/bin/python3
"""Plots geofp8-train CSVs (training and validation loss per policy) and prints a summary table.

Usage: scripts/plot_loss.py --out docs/img/convergence.png [--baseline fp32] LABEL=FILE.csv ...
The table (markdown) lists final and best validation loss, the gap to the baseline, bytes on
the wire per step (rank 0), and the median step time, all read from the CSVs.
"""
import argparse
import csv
import math
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path, newline="") as f:
        # A run still in progress may end in a partial line: keep complete rows only.
        rows = [r for r in csv.DictReader(f) if None not in r.values() and r["bytes_sent"]]
    if not rows:
        sys.exit(f"plot_loss.py: error: {path}: no rows")
    for key in ("step", "loss", "val_loss", "step_s", "bytes_sent"):
        if key not in rows[0]:
            sys.exit(f"plot_loss.py: error: {path}: missing column {key}")
    return rows


def ema(values, beta=0.9):
    out, m = [], None
    for v in values:
        m = v if m is None else beta * m + (1 - beta) * v
        out.append(m)
    return out


def summarize(label, rows):
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
    if not val:
        sys.exit(f"plot_loss.py: error: {label}: no validation loss in the CSV")
    errs = [float(r["max_layer_err"]) for r in rows if r.get("max_layer_err")]
    # Mean over layers of the per-layer relative error, on the steps where it was measured.
    layer_cols = [k for k in rows[0] if k.startswith("err:")]
    mean_errs = [statistics.fmean(float(r[k]) for k in layer_cols)
                 for r in rows if layer_cols and r[layer_cols[0]]]
    return {
        "final": val[-1][1],
        "best": min(v for _, v in val),
        "bytes": statistics.median(int(r["bytes_sent"]) for r in rows),
        "step_s": statistics.median(float(r["step_s"]) for r in rows),
        "max_layer_err": statistics.median(errs) if errs else math.nan,
        "mean_layer_err": statistics.median(mean_errs) if mean_errs else math.nan,
        "exchange_s": statistics.median(float(r["exchange_s"]) for r in rows),
        "wait_s": statistics.median(float(r["wait_s"]) for r in rows),
        "steps": int(rows[-1]["step"]) + 1,
        "val": val,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="PNG path")
    ap.add_argument("--baseline", default="fp32", help="label the gaps are measured against")
    ap.add_argument("--title", default="llama-small, 4 ranks: validation loss by exchange policy")
    ap.add_argument("runs", nargs="+", help="LABEL=FILE.csv")
    args = ap.parse_args()
    runs = []
    for spec in args.runs:
        if "=" not in spec:
            sys.exit(f"plot_loss.py: error: run: expected LABEL=FILE.csv ({spec})")
        label, path = spec.split("=", 1)
        runs.append((label, load(path)))
    stats = {label: summarize(label, rows) for label, rows in runs}
    if args.baseline not in stats:
        sys.exit(f"plot_loss.py: error: baseline: no run labelled {args.baseline}")
    base = stats[args.baseline]

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 5))
    base_val = dict(base["val"])
    for label, rows in runs:
        steps = [int(r["step"]) + 1 for r in rows]
        ax1.plot(steps, ema([float(r["loss"]) for r in rows]), label=label, lw=1)
        s = stats[label]
        ax2.plot([t + 1 for t, _ in s["val"]], [v for _, v in s["val"]], marker=".", label=label)
        gap = [(t + 1, (v - base_val[t]) / base_val[t] * 100) for t, v in s["val"] if t in base_val]
        ax3.plot([t for t, _ in gap], [g for _, g in gap], marker=".", label=label)
    ax1.set_title("training loss (EMA 0.9)")
    ax2.set_title("validation loss")
    ax3.set_title(f"validation loss gap to {args.baseline} at the same step (%)")
    ax3.axhline(1.0, color="grey", ls="--", lw=0.8)
    ax3.axhline(0.0, color="black", lw=0.6)
    for ax in (ax1, ax2, ax3):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("cross-entropy (nats/byte)")
    ax2.set_ylabel("cross-entropy (nats/byte)")
    ax3.set_ylabel("% above baseline")
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)

    print("| policy | final val loss | best val loss | gap to %s (final) | bytes/step rank 0 | "
          "wire vs %s | median step s | median exchange s | median wait s | "
          "mean layer rel err | max layer rel err |" % (args.baseline, args.baseline))
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, _ in runs:
        s = stats[label]
        gap = (s["final"] - base["final"]) / base["final"] * 100
        print(f"| {label} | {s['final']:.4f} | {s['best']:.4f} | {gap:+.2f}% | {s['bytes']:,.0f} | "
              f"{s['bytes'] / base['bytes']:.3f} | {s['step_s']:.3f} | {s['exchange_s']:.3f} | "
              f"{s['wait_s']:.3f} | {s['mean_layer_err']:.4g} | {s['max_layer_err']:.4g} |")


if __name__ == "__main__":
    main()
