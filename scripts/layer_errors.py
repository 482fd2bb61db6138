#!/usr/bin/python3
"""Per-layer-kind exchange error from geofp8-train CSVs written with --error-every.

Usage: scripts/layer_errors.py LABEL=FILE.csv ...
For each kind of parameter (tok_emb, attn.wq, ..., mlp.w2, lm_head, norms) prints the median over
the measured steps and over the layers of that kind of rel_fro_error (the exchanged average
against an exact fp32 average), one column per run, as a markdown table.
"""
import csv
import re
import statistics
import sys


def kind(column):
    name = column[len("err:"):]
    return re.sub(r"^layers\.\d+\.", "", name)


def main():
    runs = []
    for spec in sys.argv[1:]:
        if "=" not in spec:
            sys.exit(f"layer_errors.py: error: run: expected LABEL=FILE.csv ({spec})")
        label, path = spec.split("=", 1)
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if None not in r.values()]
        cols = [c for c in (rows[0] if rows else {}) if c.startswith("err:")]
        if not cols:
            sys.exit(f"layer_errors.py: error: {path}: no err: columns (run with --error-every)")
        by_kind = {}
        for c in cols:
            by_kind.setdefault(kind(c), []).extend(float(r[c]) for r in rows if r[c])
        runs.append((label, by_kind))
    if not runs:
        sys.exit("layer_errors.py: error: no runs given")
    kinds = list(runs[0][1])
    print("| parameter kind | " + " | ".join(label for label, _ in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for k in kinds:
        cells = [f"{statistics.median(by[k]):.4g}" if by.get(k) else "" for _, by in runs]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
