"""geofp8.torch on CUDA tensors (label gpu): the engine's device plane (the CUDA codec, geometry
and rotation kernels) over an NCCL communicator bootstrapped from the c10d store, after the work
on torch's current stream.

Skips (exit 77) unless torch has CUDA and a device, and this geofp8 was built with its CUDA path
(-DGEOFP8_ENABLE_CUDA=ON with NCCL). Runs 2 processes when 2 devices are visible (NCCL takes one
rank per device), else 1. Every DDP bucket is checked against the exact fp32 average (an NCCL
all-reduce of a copy of the bucket, divided by N):

- policy fp32: within fp32 round-off of the exact average;
- policy fp8 (E4M3, 128-element blocks, geometry none): relF within the E4M3 bound derived below;
- policy geofp8 (lowrank geometry refreshed on the host from a copy of the averaged gradient,
  applied with cuBLAS): no error bound here (the whitening's amplification depends on the
  gradients), but every rank must still end with the same bits;
- every rank ends with the same bits;
- a NaN in one rank's gradient skips the bucket on every rank (filled with NaN);
- agree_min (a command job's per-step policy agreement) gives the minimum over the ranks;
- a bfloat16 model under policy fp32: within bf16's rounding of the exact (fp64) average, and
  handed back in bfloat16.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_testlib as L  # noqa: E402


def require_cuda():
    L.require_torch()
    import torch
    import geofp8
    from geofp8 import _geofp8
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        print("SKIP: torch has no CUDA or no CUDA device (torch %s)" % torch.__version__)
        sys.exit(L.SKIP)
    if not _geofp8.has_cuda:
        print("SKIP: this geofp8 was built without its CUDA path (-DGEOFP8_ENABLE_CUDA=ON)")
        sys.exit(L.SKIP)
    del geofp8


# E4M3 has 3 mantissa bits: round to nearest is off by at most 2^-4 of |x| for a normal value.
# Per 128-block scaled to amax/448, a value in the subnormal range is off by at most half the
# smallest subnormal, 2^-10 * amax / 448, and 128 of those are < 1e-6 * amax: together each
# rank's encoded gradient g_r / N is within (2^-4 + 1e-6) of ||g_r / N|| in Frobenius norm. The
# average's error is at most the sum of those; the fp32 sums in the decode add about N * 2^-24.
FP8_REL = 2.0 ** -4 + 1e-6 + 1e-5


def work(rank, world, policy, dtype="float32"):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import geofp8.torch as gt

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    model = L.tiny_model().to(device, getattr(torch, dtype))
    ddp = DDP(model, device_ids=[rank])
    state = gt.GeoFP8State(model=model, policy=policy)
    assert state._engine.backend == "nccl", state._engine.backend
    failures = []
    seen = {"buckets": 0, "nan_step": False}

    def hook(st, bucket):
        buf = bucket.buffer()
        mine = buf.clone()
        exact = buf.double()
        dist.all_reduce(exact)
        exact /= world
        out = gt.geofp8_hook(st, bucket).wait()
        if seen["nan_step"]:
            if not torch.isnan(out).all():
                failures.append("step with a NaN: bucket %d not all NaN on rank %d"
                                % (bucket.index(), rank))
            fut = torch.futures.Future()
            fut.set_result(out)
            return fut
        seen["buckets"] += 1
        err = float((out.double() - exact.double()).norm())
        norms = torch.tensor([float(mine.double().norm()) / world], device=device,
                             dtype=torch.float64)
        dist.all_reduce(norms)  # sum over ranks of ||g_r / N||
        if policy == "geofp8":
            bound = float("inf")  # bits only (the docstring)
        elif policy == "fp32":
            # Each g_r / N is rounded once and the sum adds N - 1 roundings: every element is
            # within N * 2^-24 of sum_r |g_r / N|, so the norm within N * 2^-24 * sum_r ||g_r/N||
            # (x2 for the order NCCL sums in).
            bound = 2 * world * 2.0 ** -24 * float(norms)
        else:
            bound = FP8_REL * float(norms)
        if dtype == "bfloat16":
            # Summed in fp32 and rounded once to bf16 (8 significant bits): within 2^-8 of each
            # element of the average, on top of the fp32 sum's bound.
            bound += 2.0 ** -8 * float(exact.norm())
        if out.dtype != buf.dtype:
            failures.append("bucket %d came back %s, handed over %s" % (bucket.index(), out.dtype,
                                                                       buf.dtype))
        if err > bound:
            failures.append("%s: bucket %d off by %g > %g" % (policy, bucket.index(), err, bound))
        # Bitwise identical on every rank.
        ref = out.clone()
        dist.broadcast(ref, 0)
        if not torch.equal(ref, out):
            failures.append("bucket %d differs between rank 0 and rank %d" % (bucket.index(),
                                                                             rank))
        fut = torch.futures.Future()
        fut.set_result(out)
        return fut

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(4):
        x, y = L.batch(rank, step)
        x, y = x.to(device, getattr(torch, dtype)), y.to(device, getattr(torch, dtype))
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        seen["nan_step"] = step == 3
        if step == 3 and rank == world - 1:
            loss = loss * float("nan")
        loss.backward()
        if step < 3:
            opt.step()
    torch.cuda.synchronize()
    # The per-step policy agreement of command jobs (agree_min) on the NCCL engine.
    stream = torch.cuda.current_stream(device).cuda_stream
    agreed = state._engine.agree_min(10 + rank, stream)
    if agreed != 10:
        failures.append("agree_min on rank %d gave %d, expected 10" % (rank, agreed))
    if seen["buckets"] == 0:
        failures.append("no bucket was checked")
    if not state.last_step["skipped"]:
        failures.append("the NaN step was not reported skipped on rank %d" % rank)
    return failures


def _entry(rank, world, store_path, out_dir, policy, dtype):
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method="file://" + store_path, rank=rank,
                            world_size=world)
    try:
        torch.save(work(rank, world, policy, dtype), os.path.join(out_dir, "rank%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def main():
    require_cuda()
    import torch
    import torch.multiprocessing as mp
    world = 2 if torch.cuda.device_count() >= 2 else 1
    print("CUDA path: %d rank(s) on %d device(s)" % (world, torch.cuda.device_count()))
    failures = []
    # A bfloat16 model's buckets go to the device plane as they are (no fp32 copy).
    for policy, dtype in (("fp32", "float32"), ("fp8", "float32"), ("geofp8", "float32"),
                          ("fp32", "bfloat16")):
        with tempfile.TemporaryDirectory(prefix="geofp8-cudatest-") as d:
            mp.spawn(_entry, args=(world, os.path.join(d, "store"), d, policy, dtype),
                     nprocs=world, join=True)
            for r in range(world):
                failures += ["%s %s: %s" % (policy, dtype, f)
                             for f in torch.load(os.path.join(d, "rank%d.pt" % r))]
    for f in failures:
        print("FAIL:", f)
    print("OK" if not failures else "%d failures" % len(failures))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
