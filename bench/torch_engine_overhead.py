#!/usr/bin/python3
"""The GeoFP8 engine alone against gloo's fp32 all-reduce on one bucket holding every parameter
of examples/pytorch's GPT (470,528 floats, 29 layers, reverse order as DDP packs them), 2 ranks
on loopback, interleaved call by call after a barrier each. No DDP and no training step, so the
figures are the engine's cost and its collectives only (docs/benchmarks.md, "DDP comm hooks").

    PYTHONPATH=build/client/python /usr/bin/python3 bench/torch_engine_overhead.py --iters 60

Prints the median and minimum wall time per call of each; on a busy machine the minimum is the
steadier figure (the medians include waiting for a core).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "pytorch"))


def one_bucket(model):
    """Every parameter of `model` in one bucket, in reverse order as DDP packs them: the layer
    indices, each one's offset in the flat bucket, and the bucket's length."""
    params = list(model.parameters())
    layers = list(range(len(params)))[::-1]
    offsets, off = [], 0
    for i in layers:
        offsets.append(off)
        off += params[i].numel()
    return layers, offsets, off


def entry(rank, world, store, args):
    import torch
    import torch.distributed as dist
    import train_gpt as T
    import geofp8.torch as gt
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = T.GPT(2, 128, 4, 64)
    state = gt.GeoFP8State(model=model, policy=args.policy)
    layers, offsets, off = one_bucket(model)
    grad = torch.randn(off, generator=torch.Generator().manual_seed(rank))
    t_ref, t_eng = [], []
    result = None
    for it in range(args.iters):
        x = grad.clone()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        t_ref.append(time.perf_counter() - t0)
        x = grad.clone()
        dist.barrier()
        t0 = time.perf_counter()
        result = state._engine.exchange(it, layers, x, offsets)
        t_eng.append(time.perf_counter() - t0)
    if rank == 0:
        print("policy %s, %d layers, %d floats: fp32 all-reduce median %.2f ms (min %.2f); "
              "engine median %.2f ms (min %.2f), %d bytes sent per call"
              % (args.policy, len(layers), off, 1e3 * statistics.median(t_ref), 1e3 * min(t_ref),
                 1e3 * statistics.median(t_eng), 1e3 * min(t_eng), result["bytes_sent"]))
        print("last call: %d geometry refreshes, %d of them from the inverse's products"
              % (result["refreshes"], result["refreshes_from_inverse"]))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--policy", default="fp8")
    args = ap.parse_args()
    if args.iters < 1:
        ap.error("--iters: must be >= 1 (%d)" % args.iters)
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="geofp8-engine-") as d:
        mp.spawn(entry, args=(2, os.path.join(d, "store"), args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
