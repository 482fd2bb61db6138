"""geofp8.torch against DDP's own all-reduce, over real gloo process groups (--world 2 or 4).

1. policy fp32: the hook's weights equal DDP's default all-reduce within round-off.
2. policy geofp8 (FP8 E4M3 + low-rank geometry, EMA estimator) and a per-layer YAML policy with
   globs: the loss falls like the fp32 run's.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_testlib as L  # noqa: E402

STEPS = 6
LR = 0.05
# A policy file (the job spec's exchange, policy and geometry_refresh sections, as
# geofp8-train --policy takes them): fp8 everywhere, geometry on the hidden matrix only, nvfp4
# for the output layer.
YAML_POLICY = """
geometry_refresh: {estimator: ema, interval: 1}
policy:
  default: {format: fp8_e4m3}
  layers:
    - {match: "0.weight", geometry: lowrank, rank: 8}
    - {match: "3.*", format: nvfp4}
"""


def train(rank, world, policy, steps=STEPS):
    """Trains tiny_model for `steps` SGD steps; policy None: DDP's default all-reduce."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    import geofp8.torch as gt
    model = L.tiny_model()
    ddp = DDP(model)
    state = None
    if policy is not None:
        state = gt.GeoFP8State(model=model, policy=policy)
        ddp.register_comm_hook(state, gt.geofp8_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses, gmax = [], 0.0
    for s in range(steps):
        x, y = L.batch(rank, s)
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        gmax = max(gmax, max(p.grad.abs().max().item() for p in model.parameters()))
        opt.step()
        losses.append(loss.item())
    # The loss all ranks agree on: the mean over ranks of each rank's final-weights loss on a
    # fixed evaluation batch.
    with torch.no_grad():
        x, y = L.batch(100 + rank, 999, n=256)
        final = torch.tensor([((model(x) - y) ** 2).mean().item()])
    torch.distributed.all_reduce(final)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = dict(state.stats) if state else {}
    return {"weights": weights, "losses": losses, "final": final.item() / world, "gmax": gmax,
            "stats": stats}


def work(rank, world):
    import torch
    out = {"ddp": train(rank, world, None), "fp32": train(rank, world, "fp32"),
           "geofp8": train(rank, world, "geofp8"), "yaml": train(rank, world, YAML_POLICY)}
    # The loss before any step, on the evaluation batch (mean over ranks).
    model = L.tiny_model()
    with torch.no_grad():
        x, y = L.batch(100 + rank, 999, n=256)
        initial = torch.tensor([((model(x) - y) ** 2).mean().item()])
    torch.distributed.all_reduce(initial)
    out["initial"] = initial.item() / world
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    L.require_torch()
    results = L.spawn(args.world, work)
    failures = []
    r0 = results[0]
    # 1. fp32 parity. DDP divides each rank's bucket by n and sums over gloo; the engine sums
    # then divides: the same terms in another order and rounding. Each averaged element differs
    # by at most ~(n + 1) u max|g| (u = 2^-24, n ranks), so each SGD step moves a weight by at
    # most LR (n + 1) u max|g| differently. A weight difference feeds back into later gradients
    # through the Hessian; with LR * ||H|| <= 1 on this model each later step at most doubles
    # it, so after STEPS steps |dw| <= 2^STEPS * STEPS * LR * (n + 1) * u * max|g|. FP8 would
    # differ by ~2^-4 relative, orders of magnitude above this bound.
    u = 2.0 ** -24
    gmax = max(r0["ddp"]["gmax"], r0["fp32"]["gmax"])
    tol = 2 ** STEPS * STEPS * LR * (args.world + 1) * u * gmax
    worst = 0.0
    for name, w in r0["ddp"]["weights"].items():
        d = (w - r0["fp32"]["weights"][name]).abs().max().item()
        worst = max(worst, d)
    print("fp32 hook vs DDP all-reduce: max |dw| = %.3g (tolerance %.3g)" % (worst, tol))
    if not worst <= tol:
        failures.append("fp32 weights differ from DDP's by %.3g > %.3g" % (worst, tol))
    # Every rank holds the same weights under the hook (the average is identical everywhere).
    for r in results[1:]:
        for name, w in r["geofp8"]["weights"].items():
            if not torch_equal(w, r0["geofp8"]["weights"][name]):
                failures.append("rank weights differ under geofp8 (%s)" % name)
                break
    # 2. The loss falls alike. FP8 E4M3 rounds each element to 3 mantissa bits (relative error
    # <= 2^-4) in the geometry's coordinates, so every step's direction is within a few percent
    # of the exact average and the descent over the run should be close to fp32's: we require
    # at least 80% of fp32's loss reduction, and a final loss strictly below the initial one.
    init = r0["initial"]
    f32 = r0["fp32"]["final"]
    for key in ("geofp8", "yaml"):
        fin = r0[key]["final"]
        print("%s: eval loss %.5f -> %.5f (fp32 hook %.5f, DDP %.5f); wire bytes/rank %d"
              % (key, init, fin, f32, r0["ddp"]["final"], r0[key]["stats"]["bytes_sent"]))
        if not fin < init:
            failures.append("%s: final loss %.5f not below initial %.5f" % (key, fin, init))
        if not (init - fin) >= 0.8 * (init - f32):
            failures.append("%s: loss fell by %.5f, less than 80%% of fp32's %.5f"
                            % (key, init - fin, init - f32))
    # Compression moved fewer bytes than fp32 (4 bytes per element): fp8 ~1 byte.
    if not r0["geofp8"]["stats"]["bytes_sent"] < 0.5 * r0["fp32"]["stats"]["bytes_sent"]:
        failures.append("geofp8 sent %d bytes, fp32 %d" % (r0["geofp8"]["stats"]["bytes_sent"],
                                                          r0["fp32"]["stats"]["bytes_sent"]))
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


def torch_equal(a, b):
    import torch
    return torch.equal(a, b)


if __name__ == "__main__":
    main()
