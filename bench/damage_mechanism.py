#!/usr/bin/python3
"""The damage map's mechanism test (issue #27, item 5): where low-precision gradient exchange
can cost training, shown in minutes on a problem whose answer is known.

A linear student W (M x N) learns a low-rank teacher T = U diag(s) V^T whose singular values fall
geometrically from 1 to --smin (1e-3 by default): an ill-conditioned target whose small modes
carry little of the gradient. Each of 2 ranks (processes over gloo) holds its own fixed full
batch of Gaussian inputs, so every gradient is exact (B >> B_simple: there is no SGD noise at all
for quantization noise to hide in). The gradients go through the GeoFP8 DDP comm hook with each
arm's policy (bench/damage/ARM.yaml, or fp32 = torch's own all-reduce), and the student trains
with Adam (or SGD, --opt sgd) on a cosine schedule.

Reported per arm: the population loss 0.5 |W - T|_F^2 (the inputs are white), the excess over
fp32's, and per teacher mode i the relative recovery error |u_i^T W v_i - s_i| / s_i, grouped
into bands of modes by singular value. Every arm starts from the same W and the same batches
(seed), so the differences are the exchange's alone.

Usage: PYTHONPATH=build/client/python bench/damage_mechanism.py [--arms fp32 nvfp4-rtn ...]
       [--steps 2000] [--seeds 1 2 3] [--opt adam|sgd] [--csv OUT.csv]
"""
import argparse
import csv
import math
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS_DIR = os.path.join(HERE, "damage")


def teacher(args, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    u, _ = torch.linalg.qr(torch.randn(args.m, args.rank, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(args.n, args.rank, generator=g, dtype=torch.float64))
    s = torch.logspace(0, math.log10(args.smin), args.rank, dtype=torch.float64)
    return u, s, v


def rank_main(rank, args, arm, seed, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    u, s, v = teacher(args, seed)
    t = (u * s) @ v.T  # float64 teacher
    g = torch.Generator().manual_seed(2000 + 97 * seed + rank)
    x = torch.randn(args.batch, args.n, generator=g, dtype=torch.float64)
    # Label noise: each rank's own full-batch gradient stays non-zero at the optimum (only the
    # ranks' sum vanishes), so a quantization error relative to it never goes away by itself.
    y = (x @ t.T + args.noise * torch.randn(args.batch, args.m, generator=g,
                                            dtype=torch.float64)).float()
    x = x.float()
    torch.manual_seed(seed)
    model = torch.nn.Linear(args.n, args.m, bias=False)
    with torch.no_grad():
        model.weight.mul_(args.init_scale)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    if arm != "fp32":
        import geofp8.torch as gt
        with open(os.path.join(ARMS_DIR, arm + ".yaml")) as f:
            policy = f.read()
        state = gt.GeoFP8State(process_group=None, model=model, policy=policy, seed=seed,
                               coordinator=False)
        ddp.register_comm_hook(state, gt.geofp8_hook)
    if args.opt == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: 0.5 * (1 + math.cos(math.pi * min(k, args.steps) / args.steps)))
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = 0.5 * ((ddp(x) - y) ** 2).sum(dim=1).mean()
        loss.backward()
        opt.step()
        sched.step()
    # The least-squares optimum of both ranks' data, what an exact exchange converges to.
    xs = [torch.empty_like(x) for _ in range(2)]
    ys = [torch.empty_like(y) for _ in range(2)]
    dist.all_gather(xs, x)
    dist.all_gather(ys, y)
    if rank == 0:
        w = model.weight.detach().double()
        modes = torch.einsum("mi,mn,ni->i", u, w, v)
        rec = ((modes - s).abs() / s).tolist()
        pop = 0.5 * float(((w - t) ** 2).sum())
        xa, ya = torch.cat(xs).double(), torch.cat(ys).double()
        best = torch.linalg.lstsq(xa, ya).solution.T
        d = w - best
        gap = 0.5 * float(((d @ (xa.T @ xa / xa.shape[0])) * d).sum())
        torch.save({"rec": rec, "pop": pop, "gap": gap, "s": s.tolist()}, out_path)
    dist.destroy_process_group()


def run_arm(args, arm, seed, port):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.pt")
        mp.spawn(rank_main, args=(args, arm, seed, port, out), nprocs=2, join=True)
        return torch.load(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+",
                    default=["fp32", "nvfp4-rtn", "nvfp4-sr", "nvfp4-had", "nvfp4-had-sr",
                             "nvfp4-ef", "nvfp4-lowrank", "nvfp4-lowrank-had", "fp8b-rtn",
                             "fp8b-sr", "fp8b-ef", "fp8b-lowrank", "fp8t-rtn", "fp8t-sr",
                             "fp8t-ef"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--rank", type=int, default=32, help="teacher rank")
    ap.add_argument("--smin", type=float, default=1e-3, help="smallest teacher singular value")
    ap.add_argument("--batch", type=int, default=512, help="inputs per rank (full batch)")
    ap.add_argument("--noise", type=float, default=0.05, help="label noise sd")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--opt", choices=["adam", "sgd"], default="adam")
    ap.add_argument("--lr", type=float, default=None, help="peak lr (adam 1e-2, sgd 0.3)")
    ap.add_argument("--init-scale", type=float, default=0.1)
    ap.add_argument("--bands", type=int, default=4, help="groups of teacher modes reported")
    ap.add_argument("--csv", help="one row per (arm, seed)")
    ap.add_argument("--port", type=int, default=29641)
    args = ap.parse_args()
    if args.lr is None:
        args.lr = 1e-2 if args.opt == "adam" else 0.3
    for a in args.arms:
        if a != "fp32" and not os.path.exists(os.path.join(ARMS_DIR, a + ".yaml")):
            sys.exit(f"damage_mechanism.py: error: --arms: no bench/damage/{a}.yaml ({a})")
    if args.rank % args.bands:
        sys.exit(f"damage_mechanism.py: error: --bands: must divide --rank {args.rank} "
                 f"({args.bands})")
    results = {}
    port = args.port
    for seed in args.seeds:
        for arm in args.arms:
            port += 1
            results[(arm, seed)] = run_arm(args, arm, seed, port)
            r = results[(arm, seed)]
            print(f"  {arm:18s} seed {seed}: population loss {r['pop']:.4e}, gap to the "
                  f"least-squares optimum {r['gap']:.3e}", flush=True)
    s = results[(args.arms[0], args.seeds[0])]["s"]
    per = args.rank // args.bands
    bands = [(b * per, (b + 1) * per) for b in range(args.bands)]
    print(f"\nlinear student {args.m}x{args.n}, teacher rank {args.rank} (s 1 .. {args.smin:g}), "
          f"2 ranks x {args.batch} inputs (full batch), {args.opt} lr {args.lr:g} cosine, "
          f"{args.steps} steps, seeds {' '.join(map(str, args.seeds))}")
    head = ("| arm | gap to the optimum (median) | population loss (median) |"
            " excess over fp32, mean ± SE |")
    head += "".join(f" rec. error s {s[a]:.0e}..{s[b - 1]:.0e} |" for a, b in bands)
    print(head)
    print("|---" * (4 + len(bands)) + "|")
    rows = []
    for arm in args.arms:
        pops = [results[(arm, sd)]["pop"] for sd in args.seeds]
        gaps = [results[(arm, sd)]["gap"] for sd in args.seeds]
        line = f"| {arm} | {statistics.median(gaps):.3e} | {statistics.median(pops):.4e} |"
        if "fp32" in args.arms:
            d = [results[(arm, sd)]["pop"] - results[("fp32", sd)]["pop"] for sd in args.seeds]
            se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
            line += f" {statistics.mean(d):+.2e} ± {se:.1e} |"
        else:
            line += " - |"
        for a, b in bands:
            med = statistics.median(
                statistics.mean(results[(arm, sd)]["rec"][a:b]) for sd in args.seeds)
            line += f" {med:.3g} |"
        print(line)
        for sd in args.seeds:
            r = results[(arm, sd)]
            rows.append([arm, sd, r["gap"], r["pop"]] + r["rec"])
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["arm", "seed", "gap", "population_loss"] + [f"rec_s{x:.3g}" for x in s])
            w.writerows(rows)


if __name__ == "__main__":
    main()
