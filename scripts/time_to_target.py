#!/usr/bin/python3
"""Time to a target loss, per policy, from a bench/netem_train.sh results folder.

Usage: scripts/time_to_target.py DIR [--baseline fp32] [--fraction 0.8] [--window 10]
                                 [--png OUT.png] [--json OUT.json]

The daemon path has no validation loss (the worker runs no evaluation; JobProgress carries the
training loss of the last step, the mean over ranks), so the loss here is the TRAINING loss,
smoothed by a trailing mean over --window steps. The target is the baseline's smoothed loss at
--fraction of its steps. Per policy it prints the wall-clock seconds and steps until the smoothed
loss first reaches the target (clock from the job's SCHEDULED event: rendezvous and model set-up
are counted, the same for every policy), the ratios to the baseline, bf16 and fp8, and worker 0's
mean step and exchange time over the job (geofp8_worker_step_seconds and geofp8_exchange_seconds,
difference of /metrics scraped before and after it; compute = step - exchange; the workers do not
time geometry refreshes separately, so that column is not given). A PNG draws smoothed loss
against wall-clock, one curve per policy.
"""
import argparse
import json
import math
import os
import sys

ORDER = ["fp32", "bf16", "fp8", "geofp8", "nvfp4", "geonvfp4"]


def fail(msg):
    print(f"time_to_target.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def load_progress(path):
    """Last reported (coordinator time s, loss) per step > 0 ... the watch stream repeats steps."""
    per_step = {}
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) != 5 or fields[1] != "JOB_RUNNING":
                continue
            step, loss, ms = int(fields[2]), float(fields[3]), int(fields[4])
            if ms > 0 and math.isfinite(loss):
                per_step[step] = (ms / 1000.0, loss)
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
            for name in ("geofp8_worker_step_seconds", "geofp8_exchange_seconds"):
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
        pts = load_progress(prog)
        if len(pts) < 2:
            fail(f"{prog}: fewer than 2 steps of progress")
        desc = json.load(open(os.path.join(directory, p + ".describe.json")))
        sched = [e["unix_ms"] for e in desc["events"] if e["state"] == "JOB_SCHEDULED"]
        t0 = sched[0] / 1000.0 if sched else pts[0][1]
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
          "| step s | exchange s | compute s | final smoothed loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in ORDER:
        if p not in runs:
            continue
        r, tm = runs[p], runs[p]["timing"]
        print(f"| {p} | {r['state'].replace('JOB_', '')} | {r['target_step'] or 'not reached'} "
              f"| {f(r['target_s'], 1)} | {f(ratio(runs, p, 'fp32'))} | {f(ratio(runs, p, 'bf16'))} "
              f"| {f(ratio(runs, p, 'fp8'))} | {f(tm.get('step_s'))} | {f(tm.get('exchange_s'))} "
              f"| {f(tm.get('compute_s'))} | {r['smoothed'][-1]:.4f} |")


def plot(runs, target, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for p in ORDER:
        if p in runs:
            ax.plot(runs[p]["t"], runs[p]["smoothed"], label=p)
    ax.axhline(target, color="k", linestyle=":", label="target")
    ax.set_xlabel("wall-clock since the job was scheduled (s)")
    ax.set_ylabel("training loss (trailing mean)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--baseline", default="fp32")
    ap.add_argument("--fraction", type=float, default=0.8)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--png")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not os.path.isdir(a.dir):
        fail(f"DIR: no such folder ({a.dir})")
    runs, target, target_step = analyse(a.dir, a.baseline, a.fraction, a.window)
    report(runs, target, target_step, a.baseline, a.window)
    if a.png:
        plot(runs, target, a.png)
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"target": target, "target_step": target_step, "runs": runs}, out)


if __name__ == "__main__":
    main()
