#!/usr/bin/python3
"""bfloat16 and float16 gradients (issue 42), under the DDP hook (a bf16 or fp16 model) and under
compress_fsdp (MixedPrecisionPolicy(reduce_dtype=...)), against an fp64 reference: every rank's
own gradients in the reduce dtype, gathered and averaged in fp64.

Bounds, from the formats:
- policy fp32: the engine sums the low-precision inputs in fp32 (exact to 2^-24 relative per
  add) and rounds the average once into the gradient's dtype, so every element is within
  u * |ref| + tiny of the reference, with u the dtype's unit roundoff (bf16 2^-8, fp16 2^-11),
  tiny fp16's half subnormal spacing (2^-25; 0 for bf16), plus 2^-20 * |ref| for the fp32 sum;
- policy fp8: each layer's relative Frobenius error within 0.125 (two e4m3 quantizations of
  2^-4 each, as test_fsdp.py) plus u.
Usage: test_lowp.py (2 ranks). Needs torch 2.x (torch 1.13's DDP cannot broadcast bf16 over
gloo; its FSDP2 does not exist): skipped (77) on torch 1.x."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_testlib as L  # noqa: E402

UNIT = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
TINY = {"bfloat16": 0.0, "float16": 2.0 ** -25}


def _reference(local_grads):
    """The fp64 average over the ranks of each rank's gradients (already in the reduce dtype)."""
    import torch
    import torch.distributed as dist
    out = []
    for g in local_grads:
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, g.contiguous())
        out.append(sum(p.double() for p in parts) / len(parts))
    return out


def _check(what, policy, dtype_name, names, got, ref):
    import torch
    failures = []
    u, tiny = UNIT[dtype_name], TINY[dtype_name]
    for name, g, r in zip(names, got, ref):
        g = g.double()
        if policy == "fp32":
            excess = (g - r).abs() - (u * r.abs() + tiny + 2.0 ** -20 * r.abs().max())
            if float(excess.max()) > 0:
                i = int(excess.argmax())
                failures.append("%s %s %s: %s element %d is %.9g, reference %.9g (bound %.3g)"
                                % (what, dtype_name, policy, name, i, float(g.flatten()[i]),
                                   float(r.flatten()[i]),
                                   u * float(r.flatten()[i].abs()) + tiny))
        else:
            rel = float((g - r).norm() / max(float(r.norm()), 1e-30))
            if not rel <= 0.125 + u:
                failures.append("%s %s %s: %s relative error %.4f > %.4f"
                                % (what, dtype_name, policy, name, rel, 0.125 + u))
    return failures


def _ddp(rank, world, dtype_name, policy):
    import torch
    import geofp8.torch as gt
    from torch.nn.parallel import DistributedDataParallel as DDP
    dtype = getattr(torch, dtype_name)
    model = L.tiny_model().to(dtype)
    local = L.tiny_model().to(dtype)
    ddp = DDP(model)
    state = gt.GeoFP8State(model=ddp, policy=policy)
    ddp.register_comm_hook(state, gt.geofp8_hook)
    failures = []
    for step in range(3):
        x, y = L.batch(rank, step)
        for m in (ddp, local):
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x.to(dtype)).float(), y).backward()
        got = [p.grad for p in model.parameters()]
        if any(g.dtype != dtype for g in got):
            failures.append("DDP %s: gradients came back as %s" % (dtype_name, got[0].dtype))
        ref = _reference([p.grad for p in local.parameters()])
        failures += _check("DDP step %d" % step, policy, dtype_name,
                           [n for n, _ in model.named_parameters()], got, ref)
        with torch.no_grad():  # keep the replica in step with the trained model
            for p, q in zip(model.parameters(), local.parameters()):
                q.copy_(p)
    if state.stats["bytes_sent"] <= 0:
        failures.append("DDP %s: the hook sent nothing" % dtype_name)
    return failures


def _fsdp(rank, world, dtype_name, policy):
    import torch
    import geofp8.torch as gt
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    dtype = getattr(torch, dtype_name)
    model = L.tiny_model()
    local = L.tiny_model()
    mp = MixedPrecisionPolicy(reduce_dtype=dtype)
    fully_shard(model[0], mp_policy=mp)
    fully_shard(model[3], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    gt.compress_fsdp(model, policy=policy)
    x, y = L.batch(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.functional.mse_loss(local(x), y).backward()
    ref = _reference([p.grad.to(dtype) for p in local.parameters()])
    # FSDP casts the reduced shard back to the parameter's fp32: the value stays the reduce
    # dtype's.
    got = [p.grad.full_tensor() for p in model.parameters()]
    return _check("FSDP", policy, dtype_name, [n for n, _ in model.named_parameters()], got, ref)


def _all(rank, world):
    failures = []
    for dtype_name in ("bfloat16", "float16"):
        for policy in ("fp32", "fp8"):
            failures += _ddp(rank, world, dtype_name, policy)
            failures += _fsdp(rank, world, dtype_name, policy)
    return failures


def main():
    L.require_torch()
    import torch
    if int(torch.__version__.split(".")[0]) < 2:
        print("SKIP: torch %s; bf16 DDP over gloo and FSDP2 need torch 2.x" % torch.__version__)
        sys.exit(L.SKIP)
    failures = L.spawn(2, _all)[0]
    for f in failures:
        print("FAIL:", f)
    if not failures:
        print("ok: bf16 and fp16 gradients under DDP and FSDP2 within the formats' bounds")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
