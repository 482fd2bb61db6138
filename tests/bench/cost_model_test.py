#!/usr/bin/python3
"""Unit test of bench/cost_model.py (issue 44, item 7): invariants that follow from the model's
math, not its printed numbers. Wire bytes against fp32 are what the formats give; more bandwidth
never makes a method slower; exposed <= total; bad arguments exit 2 naming the field."""
import importlib.util
import math
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "bench", "cost_model.py")
spec = importlib.util.spec_from_file_location("cost_model", SCRIPT)
cm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cm)

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def close(a, b, rel=1e-12):
    return abs(a - b) <= rel * max(abs(a), abs(b))


X = {k: v[0] for k, v in cm.INPUTS.items()}
ts = cm.tensors()
P = sum(r * c for r, c in ts)
# kernels/model/model.cc ParameterCount for llama-600m (and scripts/projection.py).
check(P == 595_395_072, f"llama-600m parameter count {P}")
# Byte ratios from the formats: fp8 block 128 = 1 byte + a 4-byte scale per 128 (per tensor,
# partial blocks rounded up); nvfp4 = half a byte + an E4M3 scale per 16 + one fp32 per tensor.
fp8 = sum(n + 4 * math.ceil(n / 128) for n in (r * c for r, c in ts))
nv = sum(math.ceil(n / 2) + math.ceil(n / 16) + 4 for n in (r * c for r, c in ts))
for name, setup in cm.SETUPS.items():
    rows, meta = cm.predict(setup, X)
    f32 = rows["fp32"]["sent"]
    check(close(rows["bf16"]["sent"] / f32, 0.5), f"{name}: bf16 / fp32 bytes")
    check(close(rows["native"]["sent"] / f32, 0.25), f"{name}: native fp8 / fp32 bytes")
    check(close(rows["fp8"]["sent"] / f32, fp8 / (4 * P)), f"{name}: fp8 / fp32 bytes")
    check(close(rows["nvfp4"]["sent"] / f32, nv / (4 * P)), f"{name}: nvfp4 / fp32 bytes")
    check(0.25 < fp8 / (4 * P) <= (1 + 4 / 128) / 4 + 1e-6, f"{name}: fp8 ratio near 0.2578")
    check(0.125 < nv / (4 * P) <= (0.5 + 1 / 16) / 4 + 1e-5, f"{name}: nvfp4 ratio near 0.1406")
    for key, r in rows.items():
        check(0 <= r["exposed"] <= r["total"] * (1 + 1e-12), f"{name} {key}: exposed <= total")
        check(close(r["total"], r["wire"] + r["codec"]), f"{name} {key}: total = wire + codec")
        check(r["ib"] <= r["sent"] * (1 + 1e-12), f"{name} {key}: IB bytes <= bytes sent")
    hidden, _ = cm.predict(setup, X, hide_codec=True)
    for key, r in hidden.items():
        check(0 <= r["exposed"] <= r["total"] * (1 + 1e-12), f"{name} {key}: hidden exposed")
    # The lowrank arm is the fp8 arm plus the transform.
    check(close(rows["fp8_lowrank"]["total"], rows["fp8"]["total"] + meta["transform"][0]),
          f"{name}: lowrank = fp8 + transform")
    # Monotone in every bandwidth: doubling one never makes any method slower.
    for field in ("ib_gbps", "nvlink_gbs", "hbm_tbs"):
        if setup[field] == 0:
            continue
        faster, _ = cm.predict(dict(setup, **{field: setup[field] * 2}), X)
        for key in rows:
            for col in ("wire", "codec", "total", "exposed"):
                check(faster[key][col] <= rows[key][col] * (1 + 1e-12),
                      f"{name} {key} {col}: not monotone in {field}")
# One GPU exchanges nothing.
one, _ = cm.predict(dict(cm.SETUPS["h100x1"], gpus_per_node=1), X)
check(all(r["total"] == 0 and r["exposed"] == 0 and r["sent"] == 0 for r in one.values()),
      "1 GPU: no wire time")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=60)


r = run()
check(r.returncode == 0, f"default run: exit {r.returncode} {r.stderr}")
check(r.stdout.count("| method |") == 3, "one table per default setup")
check("published: NVIDIA H100" in r.stdout and "Measured on CPU only" in r.stdout,
      "prints the sources and the CPU-measured rates")
check(run().stdout == r.stdout, "deterministic")
r = run("--help")
check(r.returncode == 0 and "--ib-gbps" in r.stdout, "--help")
for args, want in [(("--ib-gbps", "-1"), "--ib-gbps: must be > 0 (-1)"),
                   (("--mfu", "1.5"), "--mfu: must be in (0, 1] (1.5)"),
                   (("--mfu", "abc"), "--mfu: not a number (abc)"),
                   (("--nodes", "0"), "--nodes: must be an integer >= 1 (0)"),
                   (("--rank", "2.5"), "--rank: not an integer (2.5)"),
                   (("--hbm-tbs", "nan"), "--hbm-tbs: must be > 0 (nan)"),
                   (("--setup", "h100x8,bogus"), "--setup: each must be one of"),
                   (("--setup", "h100x8", "--nvlink-gbs", "0"), "--nvlink-gbs: must be > 0")]:
    r = run(*args)
    check(r.returncode == 2 and want in r.stderr, f"{args}: exit {r.returncode}, {r.stderr!r}")

if failures:
    print("FAIL:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("PASS cost_model")
