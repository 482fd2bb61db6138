#!/usr/bin/python3
"""The GeoFP8 engine's CPU time per call on one rank (world size 1: no collective wait), on one
bucket holding every parameter of examples/pytorch's GPT (470,528 floats, 29 layers, reverse order
as DDP packs them), for each policy given. The gradient is a fixed random tensor plus fresh noise
each call, so the geometry's sketch sees a persistent direction and a changing one.

    PYTHONPATH=build/client/python /usr/bin/python3 bench/torch_engine_cpu.py --iters 300 fp8 geofp8

Prints, per policy, the median and minimum wall time per call and the calling thread's CPU time
per call (time.thread_time) over the calls after the warm-up: on a shared machine the CPU time
moves less than the wall time, and the difference between two policies is what the second one's
extra work costs (docs/benchmarks.md, "DDP comm hooks").
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "pytorch"))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policies", nargs="*", default=["fp8", "geofp8"],
                    help="presets, policy YAML files or YAML text (default: fp8 geofp8)")
    ap.add_argument("--iters", type=int, default=300, help="calls per policy (default 300)")
    ap.add_argument("--warmup", type=int, default=20, help="calls left out (default 20)")
    args = ap.parse_args()
    if args.iters <= args.warmup:
        ap.error("--iters (%d) must exceed --warmup (%d)" % (args.iters, args.warmup))
    import torch
    import torch.distributed as dist
    import train_gpt as T
    import geofp8.torch as gt
    from torch_engine_overhead import one_bucket
    torch.set_num_threads(1)
    store = tempfile.NamedTemporaryFile(prefix="geofp8_engine_cpu.", delete=False).name
    os.unlink(store)
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = T.GPT(2, 128, 4, 64)
    layers, offsets, off = one_bucket(model)
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(off, generator=gen)
    for policy in args.policies:
        state = gt.GeoFP8State(model=model, policy=policy, blas_threads=1)
        wall, cpu = [], 0.0
        result = None
        for it in range(args.iters):
            x = base + 0.3 * torch.randn(off, generator=gen)
            t0, c0 = time.perf_counter(), time.thread_time()
            result = state._engine.exchange(it, layers, x, offsets)
            if it >= args.warmup:
                wall.append(time.perf_counter() - t0)
                cpu += time.thread_time() - c0
        print("%-24s wall median %.3f ms (min %.3f), CPU %.3f ms per call; %d geometry refreshes "
              "on the last call" % (policy if len(policy) < 24 else policy[:21] + "...",
                                    1e3 * statistics.median(wall), 1e3 * min(wall),
                                    1e3 * cpu / len(wall), result["refreshes"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
