#!/usr/bin/python3
"""Per-step view of `geofp8-bench trajectory --csv` files: for each policy, the geometric mean over
layers of the deployed geometry's error divided by the Euclidean twin's on the same step, and the
fresh-basis bound. Prints a markdown summary and draws one panel per CSV.

usage: scripts/trajectory_plot.py --out ratios.png [--metric rel_fro_error|worst_band_error]
                                  [--policies NAME,NAME] LABEL=FILE.csv [LABEL=FILE.csv ...]
"""
import argparse
import collections
import csv
import math
import sys


def load(path, metric):
    """{policy: {variant: {step: {layer: value}}}}"""
    data = collections.defaultdict(lambda: collections.defaultdict(lambda: collections.defaultdict(dict)))
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        need = {"policy", "variant", "layer", "step", metric}
        if not rows.fieldnames or not need <= set(rows.fieldnames):
            sys.exit(f"trajectory_plot.py: error: {path}: not a `geofp8-bench trajectory --csv` file "
                     f"(needs columns {sorted(need)})")
        for r in rows:
            v = float(r[metric]) if r[metric] else math.nan
            data[r["policy"]][r["variant"]][int(r["step"])][r["layer"]] = v
    return data


def geomean(xs):
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def per_step(data, policy, variant):
    """step -> geometric mean over layers of variant / euclid on that step."""
    out = {}
    euclid = data[policy]["euclid"]
    for step, layers in sorted(data[policy][variant].items()):
        out[step] = geomean([v / euclid[step][l] for l, v in layers.items()
                             if euclid[step].get(l, 0) > 0])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--metric", default="rel_fro_error", choices=["rel_fro_error", "worst_band_error"])
    ap.add_argument("--policies", default="",
                    help="comma-separated policy names (file names without folder) to show; default all")
    ap.add_argument("files", nargs="+", metavar="LABEL=FILE.csv")
    a = ap.parse_args()
    panels = []
    for spec in a.files:
        if "=" not in spec:
            sys.exit(f"trajectory_plot.py: error: argument: expected LABEL=FILE.csv ({spec})")
        label, path = spec.split("=", 1)
        panels.append((label, load(path, a.metric)))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    print(f"| window | policy | deployed / euclid ({a.metric}, geomean over layers and steps) | fresh bound |")
    print("|---|---|---|---|")
    for ax, (label, data) in zip(axes[0], panels):
        wanted = [p for p in a.policies.split(",") if p]
        for policy in data:
            if wanted and policy.rsplit("/", 1)[-1] not in wanted:
                continue
            dep = per_step(data, policy, "deployed")
            fresh = per_step(data, policy, "fresh")
            name = policy.rsplit("/", 1)[-1]
            line, = ax.plot(list(dep), list(dep.values()), marker=".", label=name)
            print(f"| {label} | {name} | {geomean(list(dep.values())):.3f} | "
                  f"{geomean(list(fresh.values())):.3f} |")
        fresh = per_step(data, next(iter(data)), "fresh")
        ax.plot(list(fresh), list(fresh.values()), "k--", label="fresh basis (bound)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(f"{label}: {a.metric} vs Euclidean FP8, same bytes")
        ax.set_xlabel("step")
        ax.set_ylabel("geomean over layers of deployed / euclid")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
