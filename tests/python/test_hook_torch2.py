#!/usr/bin/python3
"""geofp8.torch under torch 2.x (issue 42): torch.compile(model) under DDP (DDPOptimizer splits
the graph at bucket boundaries) with the GeoFP8 hook gives DDP's own bits at `policy: fp32` and
trains under fp8; compiled DDP's per-parameter hook form (optimize_ddp = "python_reducer") is
refused naming the setting. Skipped (77) on torch 1.x."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_testlib as L  # noqa: E402

STEPS = 4


def _train(rank, world, policy, compiled=True):
    import torch
    import torch.distributed as dist
    import geofp8.torch as gt
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = True  # DDPOptimizer
    torch.manual_seed(0)
    # Layers of about 1 MiB each, DDP's first bucket's size and the smallest cap DDPOptimizer
    # takes: a bucket per layer, so there are graph breaks to place.
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
        torch.nn.LayerNorm(512), torch.nn.Linear(512, 512), torch.nn.Tanh(),
        torch.nn.Linear(512, 16))
    ddp = DDP(model, bucket_cap_mb=1)
    if policy is not None:
        ddp.register_comm_hook(gt.GeoFP8State(model=ddp, policy=policy, synchronous=False),
                               gt.geofp8_hook)
    # aot_eager: dynamo and AOTAutograd with DDPOptimizer's split, without a C++ toolchain step.
    run = torch.compile(ddp, backend="aot_eager") if compiled else ddp
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = L.batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(run(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dist.barrier()
    # In the last process group, compiled DDP's per-parameter form (one spawn fewer).
    refusals = _python_reducer(rank, world) if policy == "fp8" else []
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "refusals": refusals}


def _python_reducer(rank, world):
    import torch
    import geofp8.torch as gt
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch._dynamo
    failures = []
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        ddp = DDP(L.tiny_model())
    finally:
        torch._dynamo.config.optimize_ddp = True
    try:
        gt.GeoFP8State(model=ddp, policy="fp32")
        failures.append("GeoFP8State took a DDP module in python_reducer mode")
    except RuntimeError as e:
        if "optimize_ddp = 'python_reducer'" not in str(e):
            failures.append("python_reducer refusal does not name the setting: %s" % e)
    # The per-parameter call itself, as compiled DDP makes it.
    state = gt.GeoFP8State(model=L.tiny_model(), policy="fp32")
    p = next(iter(L.tiny_model().parameters()))
    try:
        gt.geofp8_hook(state, (torch.zeros_like(p), p))
        failures.append("the hook took a (grad, param) call")
    except RuntimeError as e:
        if "python_reducer" not in str(e):
            failures.append("per-parameter refusal does not name the setting: %s" % e)
    return failures


def main():
    L.require_torch()
    import torch
    major = int(torch.__version__.split(".")[0])
    if major < 2:
        print("SKIP: torch %s; torch.compile and compiled DDP need torch 2.x" % torch.__version__)
        sys.exit(L.SKIP)
    failures = []
    world = 2
    ddp = L.spawn(world, _train, None)
    fp32 = L.spawn(world, _train, "fp32")
    for r in range(world):
        if fp32[r]["losses"] != ddp[r]["losses"]:
            failures.append("rank %d: compiled fp32 losses %s differ from DDP's %s"
                            % (r, fp32[r]["losses"], ddp[r]["losses"]))
        for i, (a, b) in enumerate(zip(fp32[r]["params"], ddp[r]["params"])):
            if not torch.equal(a, b):
                failures.append("rank %d: parameter %d differs from DDP's under torch.compile"
                                % (r, i))
    fp8 = L.spawn(world, _train, "fp8")
    for r in range(world):
        if not fp8[r]["losses"][-1] < fp8[r]["losses"][0]:
            failures.append("rank %d: compiled fp8 did not train: %s" % (r, fp8[r]["losses"]))
        failures += fp8[r]["refusals"]
    for f in failures:
        print("FAIL:", f)
    if not failures:
        print("ok: torch %s, torch.compile under DDP with the hook; python_reducer refused"
              % torch.__version__)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
