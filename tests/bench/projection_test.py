#!/usr/bin/python3
"""Unit test of scripts/projection.py (issue 15): known inputs give hand-computed outputs, and bad
input exits 2 naming the field. Runs in well under a second."""
import importlib.util
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "scripts", "projection.py")
spec = importlib.util.spec_from_file_location("projection", SCRIPT)
proj = importlib.util.module_from_spec(spec)
spec.loader.exec_module(proj)

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def close(a, b):  # the formulas are a handful of float ops: 1e-12 relative is ample
    return abs(a - b) <= 1e-12 * max(abs(a), abs(b))


# Parameter counts: llama-small's is stated in kernels/model/model.cc (3,344,640); llama-600m's
# by hand, 2*256*1536 + 1536 + 21*(2*1536 + 4*1536^2 + 3*1536*4096).
check(proj.shapes("llama-small")[0] == 3_344_640, "llama-small parameter count")
check(proj.shapes("llama-600m")[0] == 595_395_072, "llama-600m parameter count")

# One step by hand: P = 3,344,640, 2 GPUs, 1000 global tokens -> 500 per GPU.
P, M = proj.shapes("llama-small")
x = {k: v[0] for k, v in proj.INPUTS.items()}
x.update(peak_bf16_flops=1e12, mfu=0.5, global_tokens=1000, link_bw=1e9, exch_eff=0.5,
         overlap=0.0, hbm_bw=1e11, codec_ratio=0.5, codec_passes=5, fp32_flops=1e10,
         transform_ratio=0.5, geo_flop_factor=2, rank=8, steps_ratio_geo=0.5, base_steps=100)
compute = 6 * P * 500 / 5e11
t = proj.step_time("fp32", 2, P, M, x)
check(close(t["compute"], compute), "fp32 compute")
check(close(t["exchange"], 2 * (1 / 2) * P * 4 / 5e8), "fp32 exchange: 2(N-1)/N P 4 B / (link eff)")
check(t["codec"] == 0 and t["geometry"] == 0, "fp32 has no codec or geometry")
g = proj.step_time("geofp8", 2, P, M, x)
codec = 5 * 4 * P / 5e10
geometry = 2 * 16 * 8 * M / 5e9
exchange8 = P * (1 + 4 / 128) / 5e8
check(close(g["codec"], codec), "geofp8 codec")
check(close(g["geometry"], geometry), "geofp8 geometry")
check(close(g["step"], compute + exchange8 + codec + geometry), "geofp8 step (no overlap)")
f8 = proj.step_time("fp8", 2, P, M, x)["step"]
check(close(proj.gain(2, P, M, x), 1 - 0.5 * g["step"] / f8), "gain: half the steps")
# Full overlap hides up to 2/3 of compute: the step cannot drop below compute.
x_ov = dict(x, overlap=1.0)
h = proj.step_time("fp32", 2, P, M, x_ov)
check(close(h["step"], compute + max(0.0, t["exchange"] - 2 / 3 * compute)), "overlap")
# One GPU: nothing to exchange.
check(proj.step_time("fp32", 1, P, M, x)["exchange"] == 0, "1 GPU exchanges nothing")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=60)


r = run("--gpus", "8,64")
check(r.returncode == 0, f"default run: exit {r.returncode} {r.stderr}")
check("the paper reports -7.6%" in r.stdout, "prints the paper's 7.6%")
check("| steps_ratio_geo |" in r.stdout and "published: NVIDIA H100" in r.stdout,
      "prints inputs with sources")
for args, want in [(("--set", "mfu=2"), "--set mfu: out of range (2)"),
                   (("--set", "bogus=1"), "--set: unknown input bogus"),
                   (("--set", "mfu"), "--set: expected NAME=VALUE (mfu)"),
                   (("--set", "link_bw=fast"), "--set link_bw: not a number (fast)"),
                   (("--gpus", "0,8"), "--gpus: each must be in [1, 1000000] (0,8)"),
                   (("--gpus", "x"), "--gpus: expected a comma list of integers (x)")]:
    r = run(*args)
    check(r.returncode == 2 and want in r.stderr, f"{args}: exit {r.returncode}, {r.stderr!r}")

if failures:
    print("FAIL:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("PASS projection")
