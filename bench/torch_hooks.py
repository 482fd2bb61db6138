#!/usr/bin/python3
"""DDP comm hooks side by side on examples/pytorch's GPT, 2 ranks over gloo, in one run: DDP's
default all-reduce, fp16_compress_hook, PowerSGD (rank 4 and 32) and
geofp8.torch (fp8, fp8 + geometry, nvfp4 + geometry).

Every method trains from the same initial weights on the same batches. Each of its hook calls
is wrapped: after a barrier, the bucket's exact fp32 average is taken by a timed gloo all-reduce of
a copy (the same-run fp32 baseline), then the method's hook runs (timed) and its result is compared
with the exact average. Reported per method, over steps >= --skip (PowerSGD's and the geometry's
warm-up excluded):
  bytes/step   payload each rank puts on the wire per step: measured by the engine for geofp8;
               for torch's hooks the tensors they all-reduce x 2(N-1)/N (ring all-reduce)
  relF         sqrt(sum |avg - exact|^2 / sum |exact|^2) over every bucket and step
  step ms      median wall time of one training step (the measuring all-reduce included)
  hook/fp32    the hook's time over the same-run fp32 all-reduce of the same buckets
  overhead     (hook time - fp32 all-reduce time x bytes/fp32 bytes) / fp32 all-reduce time:
               what the hook costs beyond moving its bytes at the fp32 all-reduce's rate
  glue/fp32    geofp8 only: the hook's time outside the engine (Python, bucket mapping, GIL)
               over the same-run fp32 all-reduce time
  loss         mean training loss over the last 5 steps (mean over ranks)

With --exposed the hook is not waited for inside the wrapper: DDP gets the method's own Future,
so an asynchronous hook (geofp8's default on CPU tensors, torch's all-reduce hooks) overlaps
the rest of backward. The bucket is copied in the hook call, and the copies' fp32 all-reduce
(the same-run baseline, after a barrier) runs after backward. Then "hook" time is the exposed
time: the hook calls' own time (the copy left out) plus the wait at the end of backward (from
the last hook call's return to backward()'s). "geofp8 ... sync" methods are the same presets
with GeoFP8State(synchronous=True).

    PYTHONPATH=build/client/python /usr/bin/python3 bench/torch_hooks.py --steps 40

Over a tc-shaped link instead of loopback, one rank per network namespace (root only):

    PYTHONPATH=build/client/python bench/torch_hooks_netem.sh --rate 1gbit -- --steps 40

which runs this script once per rank with --rank R --store-dir DIR (the ranks meet through a
FileStore there; rank 0 prints the table).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "pytorch"))

# bf16_compress_hook is selectable but not in the default list: on CPU, torch 1.13's gloo has no
# bf16 all-reduce ("Invalid scalar type", and the process aborts).
DEFAULT_METHODS = ["ddp", "fp16", "powersgd4", "powersgd32", "geofp8 fp8", "geofp8 fp8+geometry",
                   "geofp8 nvfp4+geometry"]
METHODS = ["ddp", "fp16", "bf16", "powersgd4", "powersgd32", "geofp8 fp8", "geofp8 fp8+geometry",
           "geofp8 nvfp4+geometry", "geofp8 fp8+geometry/2", "geofp8 fp8+geometry/4",
           "geofp8 fp8+geometry/10",
           "geofp8 fp8 two_phase", "geofp8 fp8 sync", "geofp8 fp8+geometry sync",
           "geofp8 fp8+geometry/2 sync"]


def every(interval, beta=None):
    """The geofp8 preset with its EMA sketch fed every `interval`-th step (the schedule staggers
    the layers over the interval), at `beta` per update (None: the preset's)."""
    refresh = {"estimator": "ema", "interval": interval}
    if beta is not None:
        refresh["beta"] = beta
    return {"geometry_refresh": refresh,
            "policy": {"default": {"format": "fp8_e4m3"},
                       "layers": [{"match": "*", "geometry": "lowrank", "rank": 8}]}}


GEOFP8_POLICY = {"geofp8 fp8": "fp8", "geofp8 fp8+geometry": "geofp8",
                 "geofp8 nvfp4+geometry": "geonvfp4",
                 # Every 2nd or 4th step with beta 0.9^2 or 0.9^4, the same memory in steps
                 # (examples/policies/ema-every2-beta81.yaml, ema-every4-beta66), or every 10th
                 # step at the preset's beta.
                 "geofp8 fp8+geometry/2": every(2, 0.81),
                 "geofp8 fp8+geometry/4": every(4, 0.6561),
                 "geofp8 fp8+geometry/10": every(10),
                 # The fp8 preset with two_phase forced (the presets' algorithm is auto, which is
                 # allgather at 2 ranks): the same bytes at 2 ranks, one collective round more.
                 "geofp8 fp8 two_phase": {"exchange": {"algorithm": "two_phase"},
                                          "policy": {"default": {"format": "fp8_e4m3"}}}}


def ring(nbytes, world):
    return nbytes * 2 * (world - 1) / world


def powersgd_bytes(params, r):
    """What PowerSGD all-reduces per step: P and Q (fp32) for a compressible matrix, the whole
    tensor otherwise (its rule: compress when (rows + cols) * r * 2 < rows * cols)."""
    total = 0
    for p in params:
        if p.dim() <= 1:
            total += 4 * p.numel()
            continue
        rows, cols = p.shape[0], p.numel() // p.shape[0]
        rr = min(r, rows, cols)
        if (rows + cols) * rr * 2 < rows * cols:
            total += 4 * rr * (rows + cols)
        else:
            total += 4 * p.numel()
    return total


def run_method(name, rank, world, args, data):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    import train_gpt as T

    torch.manual_seed(args.seed)
    model = T.GPT(args.layers, args.d_model, 4, args.seq)
    ddp = DDP(model)
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    gstate = None
    if name == "ddp":
        inner, istate = default_hooks.allreduce_hook, dist.group.WORLD
        static_bytes = ring(4 * n, world)
    elif name in ("fp16", "bf16"):
        inner = getattr(default_hooks, name + "_compress_hook")
        istate = dist.group.WORLD
        static_bytes = ring(2 * n, world)
    elif name.startswith("powersgd"):
        r = int(name[len("powersgd"):])
        istate = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                             start_powerSGD_iter=2)
        inner = powerSGD_hook.powerSGD_hook
        static_bytes = ring(powersgd_bytes(params, r), world)
    else:
        import geofp8.torch as gt
        sync = name.endswith(" sync")
        gstate = gt.GeoFP8State(model=model, policy=GEOFP8_POLICY[name[:-5] if sync else name],
                                seed=args.seed, synchronous=sync)
        inner, istate = gt.geofp8_hook, gstate
        if args.trace:
            gstate._engine.start_trace()
        static_bytes = None
    rec = {"err2": 0.0, "ref2": 0.0, "t_hook": 0.0, "t_ref": 0.0, "measure": False,
           "copies": [], "futures": [], "returned": 0.0}

    def exposed_hook(state, bucket):
        buf = bucket.buffer()
        if rec["measure"]:
            rec["copies"].append(buf.clone())
        t0 = time.perf_counter()
        fut = inner(istate, bucket)
        rec["returned"] = time.perf_counter()
        if rec["measure"]:
            rec["t_hook"] += rec["returned"] - t0
            rec["futures"].append(fut)
        return fut

    def hook(state, bucket):
        buf = bucket.buffer()
        exact = buf.clone()
        # Both ranks enter the timed all-reduce together: otherwise it absorbs the skew of
        # their backward passes and the hook after it looks cheap.
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(exact)
        t_ref = time.perf_counter() - t0
        exact /= world
        t0 = time.perf_counter()
        out = inner(istate, bucket).wait()
        t_hook = time.perf_counter() - t0
        if isinstance(out, list):
            out = out[0]
        if rec["measure"]:
            rec["err2"] += float(((out - exact) ** 2).sum())
            rec["ref2"] += float((exact ** 2).sum())
            rec["t_hook"] += t_hook
            rec["t_ref"] += t_ref
        fut = torch.futures.Future()
        fut.set_result(out)
        return fut

    ddp.register_comm_hook(None, exposed_hook if args.exposed else hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    losses, times, wire = [], [], []
    engine_s = 0.0  # geofp8: the engine's own time (Exchanger::Exchange) in the measured steps
    for step in range(args.steps):
        x, y = T.get_batch(data, args.batch, args.seq, gen)
        rec["measure"] = step >= args.skip
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x).view(-1, 256), y.view(-1))
        loss.backward()
        if args.exposed and rec["measure"]:
            # The wait at the end of backward for the Futures still running.
            rec["t_hook"] += time.perf_counter() - rec["returned"]
            dist.barrier()
            for exact, fut in zip(rec["copies"], rec["futures"]):
                t1 = time.perf_counter()
                dist.all_reduce(exact)
                rec["t_ref"] += time.perf_counter() - t1
                exact /= world
                out = fut.value()
                if isinstance(out, list):
                    out = out[0]
                rec["err2"] += float(((out - exact) ** 2).sum())
                rec["ref2"] += float((exact ** 2).sum())
            rec["copies"], rec["futures"] = [], []
        opt.step()
        if step >= args.skip:
            times.append(time.perf_counter() - t0)
            wire.append(gstate.last_step["bytes_sent"] if gstate else static_bytes)
            engine_s += gstate.last_step["seconds"] if gstate else 0.0
        losses.append(loss.item())
    if gstate is not None and args.trace:
        os.makedirs(args.trace, exist_ok=True)
        tag = name.replace(" ", "_").replace("+", "_").replace("/", "_")
        gstate._engine.write_trace(os.path.join(args.trace, "%s.rank%d.json" % (tag, rank)))
    last = torch.tensor([statistics.mean(losses[-5:])])
    dist.all_reduce(last)
    return {"bytes": statistics.mean(wire), "relF": (rec["err2"] / rec["ref2"]) ** 0.5,
            "step_ms": 1e3 * statistics.median(times), "t_hook": rec["t_hook"],
            "t_ref": rec["t_ref"], "engine_s": engine_s if gstate else None, "loss": last.item() / world, "fp32_bytes": ring(4 * n, world),
            "params": n}


def entry(rank, world, store, args, out):
    import torch
    import torch.distributed as dist
    import train_gpt as T
    torch.set_num_threads(1)
    if args.blas_threads:
        # Every method, torch's included: OpenBLAS is shared, and its setting is process-wide.
        from geofp8 import _geofp8
        _geofp8.set_blas_threads(args.blas_threads)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    data = T.load_bytes(args.data)
    results = {}
    for m in args.methods:
        results[m] = run_method(m, rank, world, args, data)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def print_table(res, args):
    first = next(iter(res.values()))
    print("GPT %d layers d=%d (%d parameters), %d ranks, %d steps (figures over steps %d-%d)%s"
          % (args.layers, args.d_model, first["params"], args.ranks, args.steps, args.skip,
             args.steps - 1, "; hook time: exposed (--exposed)" if args.exposed else ""))
    fp16 = res.get("fp16", {}).get("bytes")
    print("| method | bytes/step/rank | x fp16 | relF | step ms | hook/fp32 all-reduce | "
          "hook ms/step | fp32 all-reduce ms/step | overhead/fp32 all-reduce | glue/fp32 | "
          "loss (last 5) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    measured = args.steps - args.skip
    for m, r in res.items():
        over = (r["t_hook"] - r["t_ref"] * r["bytes"] / r["fp32_bytes"]) / r["t_ref"]
        glue = "-" if r["engine_s"] is None or args.exposed else "%.2f" % ((r["t_hook"] - r["engine_s"]) /
                                                           r["t_ref"])
        print("| %s | %d | %s | %.4f | %.1f | %.2f | %.1f | %.1f | %.2f | %s | %.4f |"
              % (m, r["bytes"], "%.3f" % (r["bytes"] / fp16) if fp16 else "-", r["relF"],
                 r["step_ms"], r["t_hook"] / r["t_ref"], 1e3 * r["t_hook"] / measured,
                 1e3 * r["t_ref"] / measured, over, glue, r["loss"]))


def main():
    ap = argparse.ArgumentParser(description="DDP comm hooks side by side (docs/benchmarks.md)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the figures")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help="comma-separated, of: " + ", ".join(METHODS))
    ap.add_argument("--blas-threads", type=int, default=0,
                    help="OpenBLAS threads per rank for every method (0: OpenBLAS's default, one "
                         "per core)")
    ap.add_argument("--trace", default=None,
                    help="write DIR/METHOD.rankR.json, the GeoFP8 engine's timeline per method "
                         "(scripts/exchange_timeline.py DIR/METHOD.rank*.json)")
    ap.add_argument("--exposed", action="store_true",
                    help="hand DDP each hook's own Future and time what it leaves exposed "
                         "(asynchronous hooks overlap backward; see the docstring)")
    ap.add_argument("--rank", type=int, default=None,
                    help="run only this rank (with --store-dir; bench/torch_hooks_netem.sh)")
    ap.add_argument("--store-dir", default=None,
                    help="with --rank: the folder the ranks' FileStore lives in")
    args = ap.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",")]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        ap.error("--methods: unknown %s (accepted: %s)" % (bad, ", ".join(METHODS)))
    if args.blas_threads < 0:
        ap.error("--blas-threads: must be >= 0 (%d)" % args.blas_threads)
    if args.steps <= args.skip + 5:
        ap.error("--steps: must exceed --skip + 5 (%d)" % args.steps)
    import torch
    if args.rank is not None:
        if args.store_dir is None or not os.path.isdir(args.store_dir):
            ap.error("--store-dir: must name an existing folder with --rank (%s)"
                     % args.store_dir)
        if not 0 <= args.rank < args.ranks:
            ap.error("--rank: must be in [0, %d) (%d)" % (args.ranks, args.rank))
        out = os.path.join(args.store_dir, "results.pt")
        entry(args.rank, args.ranks, os.path.join(args.store_dir, "store"), args, out)
        if args.rank == 0:
            print_table(torch.load(out), args)
        return
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="geofp8-hooks-") as d:
        out = os.path.join(d, "results.pt")
        mp.spawn(entry, args=(args.ranks, os.path.join(d, "store"), args, out),
                 nprocs=args.ranks, join=True)
        res = torch.load(out)
    print_table(res, args)

if __name__ == "__main__":
    main()
