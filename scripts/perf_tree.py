#!/usr/bin/python3
"""Inclusive time under one function, split by callee, from `perf script` call stacks.

    perf record -F 5000 --call-graph dwarf,32768 -o perf.data CMD
    perf script -i perf.data -F ip,sym --no-inline > stacks.txt
    scripts/perf_tree.py stacks.txt 'geofp8::Exchanger::Exchange' --depth 3

Prints the share of samples whose stack passes through the root (its first occurrence from the
bottom), then, for every callee path below it up to --depth frames, the share of those samples
that pass through it (at least --min percent). Anonymous namespaces and argument lists are
dropped from names, so the same function in two processes merges.
"""

import argparse
import collections
import re
import sys


def stacks(path):
    cur = []
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                if cur:
                    yield cur[::-1]  # root first
                cur = []
                continue
            parts = line.split(None, 1)
            cur.append(parts[1] if len(parts) > 1 else parts[0])
    if cur:
        yield cur[::-1]


def clean(frame):
    return re.sub(r"\(.*", "", frame.replace("(anonymous namespace)::", ""))[:80]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stacks", help="`perf script -F ip,sym` output")
    ap.add_argument("root", help="function name prefix, e.g. geofp8::Exchanger::Exchange")
    ap.add_argument("--depth", type=int, default=2, help="callee frames shown (default 2)")
    ap.add_argument("--min", type=float, default=1.0, help="smallest share shown, percent")
    args = ap.parse_args()
    total = under = 0
    counts = collections.Counter()
    for s in stacks(args.stacks):
        total += 1
        hit = next((i for i, f in enumerate(s) if f.startswith(args.root)), None)
        if hit is None:
            continue
        under += 1
        path = tuple(clean(f) for f in s[hit + 1:hit + 1 + args.depth])
        for d in range(1, len(path) + 1):
            counts[path[:d]] += 1
    if not under:
        sys.exit("perf_tree.py: no sample passes through %s" % args.root)
    print("%d samples, %d (%.1f%%) under %s" % (total, under, 100.0 * under / total, args.root))
    def order(p):  # depth-first, larger subtrees first
        return [(-counts[p[:d]], p[d - 1]) for d in range(1, len(p) + 1)]

    for p, c in sorted(counts.items(), key=lambda kv: order(kv[0])):
        if 100.0 * c / under >= args.min:
            print("%6.1f%%  %s%s" % (100.0 * c / under, "    " * (len(p) - 1), p[-1]))


if __name__ == "__main__":
    main()
