#!/usr/bin/python3
"""Euclidean FP8 against GeoFP8 for scripts/demo.sh: record a job through geofp8ctl, then compare.

Usage:
  scripts/demo_compare.py record CTL JOB OUT.jsonl [--interval S]
      Follows `CTL watch JOB -o jsonpath=...` (every progress update: step, state, training loss,
      validation loss and its step, wire and fp32 bytes) and polls `CTL get job JOB -o json` every S seconds (default 0.5) for
      the latest per-layer exchange error, until the job ends; one JSON line per record.
  scripts/demo_compare.py report --euclid A.jsonl --geo B.jsonl [--png OUT.png] [--json OUT.json]
      [--skip-fraction F]
      Prints, as markdown tables: per layer, the median relative Frobenius error of the exchanged
      gradient (against the exact fp32 average) over the summaries recorded after the first F of
      the steps (default 0.1: geometry warms up), Euclidean against GeoFP8; wire bytes against fp32;
      the validation loss on held-out data (training.eval_every) after the last step and the best
      one. Draws validation loss against step and the per-layer error in OUT.png.
"""
import argparse
import json
import math
import statistics
import subprocess
import sys
import threading
import time

# Records hold what geofp8ctl prints: states in lower case, steps as steps done (the table's).
TERMINAL = ("succeeded", "failed", "cancelled")


def record(args):
    """Two sources into one file: `CTL watch JOB -o jsonpath=...` streams every progress update
    (a dense loss curve), and `CTL get job JOB -o json` polls the per-layer summaries, which the
    watch stream does not carry."""
    template = ('{.job.state} {.job.progress.step} '
                '{.job.progress.total_steps} {.job.progress.loss} {.job.progress.bytes_sent} '
                '{.job.progress.bytes_baseline} {.job.policy_version} {.job.progress.val_loss} '
                '{.job.progress.val_step}{"\\n"}')  # jsonpath adds no newline of its own
    lock = threading.Lock()
    out = open(args.out, "w")
    ident = {"id": "", "name": args.job}  # filled in by the first poll

    def write(rec):
        with lock:
            out.write(json.dumps(rec) + "\n")
            out.flush()

    watch = subprocess.Popen([args.ctl, "watch", args.job, "-o", "jsonpath=" + template],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def follow():
        for line in watch.stdout:
            f = line.split()
            if len(f) != 9:
                continue
            write({"t": time.time(), "id": ident["id"], "name": ident["name"], "state": f[0],
                   "step": int(f[1]), "total_steps": int(f[2]), "loss": float(f[3]),
                   "bytes_sent": int(f[4]), "bytes_baseline": int(f[5]),
                   "policy_version": int(f[6]),
                   "val_loss": None if f[7] == "null" else float(f[7]), "val_step": int(f[8]),
                   "layers": []})

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    last_step = None
    while True:
        proc = subprocess.run([args.ctl, "get", "job", args.job, "-o", "json"],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            watch.kill()
            sys.exit(f"demo_compare.py: error: {args.ctl} get job {args.job}: "
                     f"{proc.stderr.strip()}")
        job = json.loads(proc.stdout)
        ident.update(id=job["id"], name=job["name"])
        p = job["progress"]
        if job["state"] in TERMINAL or p["step"] != last_step:
            write({"t": time.time(), "id": job["id"], "name": job["name"], "state": job["state"],
                   "step": p["step"], "total_steps": p["total_steps"], "loss": p["loss"],
                   "bytes_sent": p["bytes_sent"], "bytes_baseline": p["bytes_baseline"],
                   "policy_version": job["policy_version"],
                   "val_loss": p.get("val_loss"), "val_step": p.get("val_step", 0),
                   "layers": [{"layer": l["layer"], "step": l["step"],
                               "rel_fro_error": l["rel_fro_error"]} for l in job["layers"]]})
            last_step = p["step"]
        if job["state"] in TERMINAL:
            break
        time.sleep(args.interval)
    try:
        watch.wait(30)
    except subprocess.TimeoutExpired:
        watch.kill()
    reader.join(5)
    out.close()
    return 0


def load(path):
    recs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"demo_compare.py: error: {path}:{n}: not JSON ({e})")
    if not recs:
        sys.exit(f"demo_compare.py: error: {path}: no records")
    for key in ("step", "loss", "bytes_sent", "bytes_baseline", "layers", "total_steps", "state"):
        if key not in recs[-1]:
            sys.exit(f"demo_compare.py: error: {path}: records lack the field {key}")
    return recs


def val_losses(recs):
    """(steps done, validation loss) per validation, in order: val_step is the number of steps
    trained when the loss was measured."""
    seen = {}
    for r in recs:
        v = r.get("val_loss")
        if v is not None and math.isfinite(v):
            seen[r["val_step"]] = v
    return sorted(seen.items())


def layer_errors(recs, skip_fraction):
    """layer -> median rel_fro_error over distinct (layer, step) summaries past the warm-up."""
    total = max(r["total_steps"] for r in recs)
    first = int(total * skip_fraction)
    per = {}
    for r in recs:
        for l in r["layers"]:
            if l["step"] >= first and math.isfinite(l["rel_fro_error"]):
                per.setdefault(l["layer"], {})[l["step"]] = l["rel_fro_error"]
    return {k: statistics.median(v.values()) for k, v in per.items() if v}


def mib(b):
    return f"{b / 2**20:.1f} MiB"


def report(args):
    runs = {"Euclidean FP8": load(args.euclid), "GeoFP8": load(args.geo)}
    errs = {k: layer_errors(v, args.skip_fraction) for k, v in runs.items()}
    e, g = errs["Euclidean FP8"], errs["GeoFP8"]
    layers = [l for l in e if l in g]
    if not layers:
        sys.exit("demo_compare.py: error: the two runs share no layer summaries")
    lines = ["| layer | Euclidean FP8 rel. error | GeoFP8 rel. error | Euclidean / GeoFP8 |",
             "|---|---|---|---|"]
    for l in layers:
        ratio = e[l] / g[l] if g[l] > 0 else float("inf")
        lines.append(f"| {l} | {e[l]:.4g} | {g[l]:.4g} | {ratio:.2f}x |")
    med_e = statistics.median(e[l] for l in layers)
    med_g = statistics.median(g[l] for l in layers)
    lines.append(f"| median over layers | {med_e:.4g} | {med_g:.4g} | {med_e / med_g:.2f}x |")
    print("Per-layer exchange error (median relative Frobenius error of the averaged gradient "
          f"against exact fp32, steps >= {args.skip_fraction:.0%} of the run):")
    print("\n".join(lines))
    print()
    print("| run | job | state | steps | wire bytes | fp32 bytes | wire / fp32 | validations "
          "| final val. loss | best val. loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = {"layers": {l: {"euclidean": e[l], "geofp8": g[l]} for l in layers}, "runs": {}}
    for label, recs in runs.items():
        # The final state: records of the watch stream and of the polls interleave.
        last = max(recs, key=lambda r: (r["state"] in TERMINAL, r["step"], r["bytes_sent"]))
        vs = val_losses(recs)
        if not vs:
            sys.exit(f"demo_compare.py: error: {label}: no validation loss recorded (the job "
                     "reports one every training.eval_every steps and after the last)")
        final_step, final = vs[-1]
        best = min(x for _, x in vs)
        frac = last["bytes_sent"] / last["bytes_baseline"] if last["bytes_baseline"] else math.nan
        print(f"| {label} | {last.get('name', '')} ({last.get('id', '')}) | "
              f"{last['state'].upper()} | {last['step']}/{last['total_steps']} | "
              f"{mib(last['bytes_sent'])} | {mib(last['bytes_baseline'])} | {frac:.1%} | "
              f"{len(vs)} | {final:.4f} (step {final_step}) | {best:.4f} |")
        summary["runs"][label] = {"bytes_sent": last["bytes_sent"],
                                  "bytes_baseline": last["bytes_baseline"],
                                  "val_loss": [[s, x] for s, x in vs], "final_val_loss": final,
                                  "best_val_loss": best, "state": last["state"]}
    print("(validation loss: mean cross-entropy on held-out batches the runs never train on, "
          "measured every training.eval_every steps and after the last step; one run each, so "
          "a difference within run-to-run noise says nothing)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
        for label, recs in runs.items():
            vs = val_losses(recs)
            ax1.plot([s for s, _ in vs], [x for _, x in vs], label=label, lw=1.2, marker="o",
                     ms=3)
        ax1.set_xlabel("steps trained")
        ax1.set_ylabel("validation loss (held-out data)")
        ax1.set_title("Validation loss")
        ax1.legend()
        ax1.grid(alpha=0.3)
        x = range(len(layers))
        w = 0.4
        ax2.bar([i - w / 2 for i in x], [e[l] for l in layers], w, label="Euclidean FP8")
        ax2.bar([i + w / 2 for i in x], [g[l] for l in layers], w, label="GeoFP8")
        ax2.set_xticks(list(x))
        ax2.set_xticklabels(layers, rotation=70, ha="right", fontsize=7)
        ax2.set_ylabel("median rel. Frobenius error")
        ax2.set_yscale("log")
        ax2.set_title("Per-layer exchange error (same bytes)")
        ax2.legend()
        ax2.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"plot: {args.png}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("ctl")
    r.add_argument("job")
    r.add_argument("out")
    r.add_argument("--interval", type=float, default=0.5)
    p = sub.add_parser("report")
    p.add_argument("--euclid", required=True)
    p.add_argument("--geo", required=True)
    p.add_argument("--png")
    p.add_argument("--json")
    p.add_argument("--skip-fraction", type=float, default=0.1)
    args = ap.parse_args()
    if args.cmd == "record":
        return record(args)
    if not 0 <= args.skip_fraction < 1:
        sys.exit(f"demo_compare.py: error: --skip-fraction: must be in [0, 1) ({args.skip_fraction})")
    return report(args)


if __name__ == "__main__":
    sys.exit(main())
