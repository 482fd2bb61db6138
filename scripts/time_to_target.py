#!/usr/bin/python3
"""Time to a target loss, per policy, from a bench/netem_train.sh results folder.

Usage: scripts/time_to_target.py DIR [DIR ...] [--baseline fp32] [--fraction 0.8] [--window 10]
                                 [--png OUT.png] [--json OUT.json]

The daemon path has no validation loss (the worker runs no evaluation; JobProgress carries the
training loss of the last step, the mean over ranks), so the loss here is the TRAINING loss,
smoothed by a trailing mean over --window steps. The target is the baseline's smoothed loss at
--fraction of its steps. Per policy it prints the wall-clock seconds and steps until the smoothed
loss first reaches the target (clock from the job's SCHEDULED event: rendezvous and model set-up
are counted, the same for every policy), the ratios to the baseline, bf16 and fp8, and worker 0's
mean step, exchange and geometry-refresh time over the job (geofp8_worker_step_seconds,
geofp8_exchange_seconds and geofp8_geometry_refresh_seconds, difference of /metrics scraped
before and after it; compute = step - exchange; the geometry estimation runs inside the exchange
time, so "of which geometry" is a part of the exchange column, not an addition to it). A PNG draws smoothed loss
against wall-clock, one curve per policy. With several DIRs (one per seed) it also prints the
median over them of each column, the ratios taken within each run.
"""
import argparse
import datetime
import json
import math
import os
import sys

ORDER = ["fp32", "bf16", "fp8", "geofp8", "nvfp4", "geonvfp4"]


def fail(msg):
    print(f"time_to_target.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def unix_seconds(rfc3339):
    """geofp8ctl's times (RFC 3339 UTC, 2026-12-03T12:49:36.123Z) as Unix seconds."""
    return datetime.datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def load_progress(path):
    """Last reported (coordinator time s, loss) per step (steps done, as geofp8ctl counts them)
    ... the watch stream repeats steps. A line: local time, state, step, loss, updated_time."""
    per_step = {}
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) != 5 or fields[1] != "running" or fields[4] == "null":
                continue
            step, loss, t = int(fields[2]), float(fields[3]), unix_seconds(fields[4])
            if math.isfinite(loss):
                per_step[step] = (t, loss)
    return [(s, t, l) for s, (t, l) in sorted(per_step.items())]


def smooth(values, window):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def metric_sums(path):
    sums = {}
    if not os.path.exists(path):
        return sums
    with open(path) as f:
        for line in f:
            for name in ("geofp8_worker_step_seconds", "geofp8_exchange_seconds",
                         "geofp8_geometry_refresh_seconds"):
                for suffix in ("_sum", "_count"):
                    if line.startswith(name + suffix + " "):
                        sums[name + suffix] = float(line.split()[1])
    return sums


def analyse(directory, baseline, fraction, window):
    if not 0 < fraction <= 1:
        fail(f"--fraction: must be in (0, 1] ({fraction})")
    if window < 1:
        fail(f"--window: must be >= 1 ({window})")
    runs = {}
    for p in ORDER:
        prog = os.path.join(directory, p + ".progress")
        if not os.path.exists(prog):
            continue
        desc_path = os.path.join(directory, p + ".describe.json")
        if not os.path.exists(desc_path):  # still running, or the run was cut short
            print(f"time_to_target.py: warning: {p}: no {desc_path}; left out", file=sys.stderr)
            continue
        pts = load_progress(prog)
        if len(pts) < 2:
            fail(f"{prog}: fewer than 2 steps of progress")
        desc = json.load(open(desc_path))
        sched = [unix_seconds(e["time"]) for e in desc["events"] if e["state"] == "scheduled"]
        t0 = sched[0] if sched else pts[0][1]
        before = metric_sums(os.path.join(directory, p + ".metrics.before"))
        after = metric_sums(os.path.join(directory, p + ".metrics.after"))
        timing = {}
        if after:  # a fresh worker may not print a histogram before its first observation
            before = {k: before.get(k, 0.0) for k in after}
            n = after["geofp8_worker_step_seconds_count"] - before["geofp8_worker_step_seconds_count"]
            ne = after["geofp8_exchange_seconds_count"] - before["geofp8_exchange_seconds_count"]
            if n > 0 and ne > 0:
                step_s = (after["geofp8_worker_step_seconds_sum"] -
                          before["geofp8_worker_step_seconds_sum"]) / n
                exch_s = (after["geofp8_exchange_seconds_sum"] -
                          before["geofp8_exchange_seconds_sum"]) / ne
                timing = {"step_s": step_s, "exchange_s": exch_s, "compute_s": step_s - exch_s}
                ng = after.get("geofp8_geometry_refresh_seconds_count", 0) - before.get(
                    "geofp8_geometry_refresh_seconds_count", 0)
                if ng > 0:  # geometry estimation runs inside the exchange time
                    timing["geometry_s"] = (after["geofp8_geometry_refresh_seconds_sum"] -
                                            before["geofp8_geometry_refresh_seconds_sum"]) / ng
        losses = smooth([l for _, _, l in pts], window)
        runs[p] = {"steps": [s for s, _, _ in pts], "t": [t - t0 for _, t, _ in pts],
                   "loss": [l for _, _, l in pts], "smoothed": losses, "timing": timing,
                   "state": desc["state"], "bytes_sent": desc["progress"]["bytes_sent"]}
    if baseline not in runs:
        fail(f"--baseline: no {baseline}.progress in {directory}")
    base = runs[baseline]
    at = min(len(base["steps"]) - 1, max(0, int(round(fraction * len(base["steps"]))) - 1))
    target = base["smoothed"][at]
    for r in runs.values():
        hit = next((i for i, v in enumerate(r["smoothed"]) if v <= target), None)
        r["target_step"] = r["steps"][hit] if hit is not None else None
        r["target_s"] = r["t"][hit] if hit is not None else None
    return runs, target, base["steps"][at]


def ratio(runs, a, b):
    if a in runs and b in runs and runs[a]["target_s"] and runs[b]["target_s"]:
        return runs[a]["target_s"] / runs[b]["target_s"]
    return None


def report(runs, target, target_step, baseline, window):
    f = lambda x, d=2: "n/a" if x is None else f"{x:.{d}f}"
    print(f"target: {baseline} smoothed training loss {target:.4f} (trailing mean of {window} "
          f"steps) at its step {target_step}")
    print()
    print("| policy | state | steps to target | s to target | x fp32 | x bf16 | x fp8 "
          "| step s | exchange s | of which geometry s | compute s | final smoothed loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in ORDER:
        if p not in runs:
            continue
        r, tm = runs[p], runs[p]["timing"]
        print(f"| {p} | {r['state'].upper()} | {r['target_step'] or 'not reached'} "
              f"| {f(r['target_s'], 1)} | {f(ratio(runs, p, 'fp32'))} | {f(ratio(runs, p, 'bf16'))} "
              f"| {f(ratio(runs, p, 'fp8'))} | {f(tm.get('step_s'))} | {f(tm.get('exchange_s'))} "
              f"| {f(tm.get('geometry_s'), 3)} | {f(tm.get('compute_s'))} "
              f"| {r['smoothed'][-1]:.4f} |")


def medians(all_runs):
    """Per policy, the median over runs (seeds) of time and steps to target and of the ratios,
    each ratio taken within one run (paired: same seed, same data windows). A run that never
    reached the target counts as infinitely slow, so the median stays a median of all runs."""
    import statistics
    inf = float("inf")

    def f(x, d=2):
        if x is None:
            return "n/a"
        return "not reached" if x == inf else f"{x:.{d}f}"

    def med(xs):
        return statistics.median(xs) if xs else None

    def paired(r, p, q):
        if q not in r or r[q]["target_s"] is None:
            return None  # no baseline time in this run: the ratio is undefined
        return inf if r[p]["target_s"] is None else r[p]["target_s"] / r[q]["target_s"]

    print(f"Median over {len(all_runs)} runs (ratios paired within each run; a run that did not "
          "reach the target counts as infinitely slow):")
    print()
    print("| policy | reached | steps to target | s to target | x fp32 | x bf16 | x fp8 | step s "
          "| exchange s | of which geometry s | compute s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in ORDER:
        rs = [r for r in all_runs if p in r]
        if not rs:
            continue
        reached = sum(r[p]["target_s"] is not None for r in rs)
        steps = [inf if r[p]["target_step"] is None else r[p]["target_step"] for r in rs]
        secs = [inf if r[p]["target_s"] is None else r[p]["target_s"] for r in rs]
        vals = lambda q: [x for x in (paired(r, p, q) for r in rs) if x is not None]
        tm = lambda key: med([r[p]["timing"][key] for r in rs if key in r[p]["timing"]])
        print(f"| {p} | {reached}/{len(rs)} | {f(med(steps), 0)} | {f(med(secs), 1)} "
              f"| {f(med(vals('fp32')))} | {f(med(vals('bf16')))} | {f(med(vals('fp8')))} "
              f"| {f(tm('step_s'))} | {f(tm('exchange_s'))} | {f(tm('geometry_s'), 3)} "
              f"| {f(tm('compute_s'))} |")


def plot(all_runs, targets, labels, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = ["-", "--", ":", "-."]
    colors = {p: f"C{i}" for i, p in enumerate(ORDER)}
    for i, (runs, target, label) in enumerate(zip(all_runs, targets, labels)):
        for p in ORDER:
            if p in runs:
                ax.plot(runs[p]["t"], runs[p]["smoothed"], color=colors[p],
                        linestyle=styles[i % len(styles)],
                        label=p if len(all_runs) == 1 else f"{p} ({label})")
        ax.axhline(target, color="k", linestyle=styles[i % len(styles)], linewidth=0.8,
                   label="fp32 target" if len(all_runs) == 1 else f"target ({label})")
    ax.set_xlabel("wall-clock since the job was scheduled (s)")
    ax.set_ylabel("training loss (trailing mean)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="+", help="one bench/netem_train.sh --out folder per seed")
    ap.add_argument("--baseline", default="fp32")
    ap.add_argument("--fraction", type=float, default=0.8)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--png")
    ap.add_argument("--json")
    a = ap.parse_args()
    all_runs, targets, labels = [], [], []
    for d in a.dir:
        if not os.path.isdir(d):
            fail(f"DIR: no such folder ({d})")
        runs, target, target_step = analyse(d, a.baseline, a.fraction, a.window)
        print(f"## {d}")
        print()
        report(runs, target, target_step, a.baseline, a.window)
        print()
        all_runs.append(runs)
        targets.append(target)
        labels.append(os.path.basename(os.path.normpath(d)))
    if len(all_runs) > 1:
        medians(all_runs)
    if a.png:
        plot(all_runs, targets, labels, a.png)
    if a.json:
        with open(a.json, "w") as out:
            json.dump([{"dir": d, "target": t, "runs": r}
                       for d, t, r in zip(a.dir, targets, all_runs)], out)


if __name__ == "__main__":
    main()
