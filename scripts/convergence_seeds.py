#!/usr/bin/python3
"""Summarizes geofp8-train CSVs over seeds: per policy, the final validation loss and its gap to
the baseline policy of the same seed, as mean, sample standard deviation and range.

Usage: scripts/convergence_seeds.py [--baseline fp32] POLICY:SEED=FILE.csv ...
Prints a markdown table. A policy's gap is taken only over seeds that also have a baseline run.
"""
import argparse
import csv
import statistics
import sys


def final_and_best(path):
    with open(path, newline="") as f:
        val = [float(r["val_loss"]) for r in csv.DictReader(f)
               if None not in r.values() and r.get("val_loss")]
    if not val:
        sys.exit(f"convergence_seeds.py: error: {path}: no validation loss")
    return val[-1], min(val)


def spread(values, fmt):
    if len(values) == 1:
        return fmt.format(values[0]), "", ""
    return (fmt.format(statistics.fmean(values)),
            fmt.replace("+", "").format(statistics.stdev(values)),
            f"{fmt.format(min(values))} .. {fmt.format(max(values))}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="fp32", help="policy the gaps are measured against")
    ap.add_argument("runs", nargs="+", help="POLICY:SEED=FILE.csv")
    args = ap.parse_args()
    runs = {}  # policy -> {seed: (final, best)}
    order = []
    for spec in args.runs:
        if "=" not in spec or ":" not in spec.split("=", 1)[0]:
            sys.exit(f"convergence_seeds.py: error: run: expected POLICY:SEED=FILE.csv ({spec})")
        key, path = spec.split("=", 1)
        policy, seed = key.rsplit(":", 1)
        if policy not in runs:
            runs[policy] = {}
            order.append(policy)
        runs[policy][seed] = final_and_best(path)
    if args.baseline not in runs:
        sys.exit(f"convergence_seeds.py: error: baseline: no runs of policy {args.baseline}")
    base = runs[args.baseline]
    print(f"| policy | seeds | final val loss mean | sd | range | gap to {args.baseline} mean | "
          "sd | range |")
    print("|---|---|---|---|---|---|---|---|")
    for policy in order:
        seeds = sorted(runs[policy])
        finals = [runs[policy][s][0] for s in seeds]
        gaps = [(runs[policy][s][0] - base[s][0]) / base[s][0] * 100 for s in seeds if s in base]
        f_mean, f_sd, f_range = spread(finals, "{:.4f}")
        g_mean, g_sd, g_range = spread(gaps, "{:+.2f}%") if gaps else ("", "", "")
        print(f"| {policy} | {','.join(seeds)} | {f_mean} | {f_sd} | {f_range} | {g_mean} | "
              f"{g_sd} | {g_range} |")


if __name__ == "__main__":
    main()
