#!/usr/bin/python3
"""geofp8.torch.compress_fsdp (issue 42): GeoFP8 as FSDP2's gradient reduce-scatter, on CPU over
gloo.

- `policy: fp32` gives losses and parameters bit-identical to FSDP2's own reduce-scatter over
  STEPS steps at 2 ranks (the average of two fp32 values is exact in either order), and within
  the fp32 accumulation bound at 4 ranks;
- the padding of dim-0 chunks (layers whose rows do not divide by the world size), a conv weight
  (4-D, a matrix of out x in*k*k) and AVG, SUM and PREMUL_SUM (set_gradient_divide_factor);
- accumulation under set_requires_gradient_sync(False): one reduce-scatter per optimizer step;
- fp8 and geofp8 (lowrank geometry, error feedback) train, and each exchanged shard is within
  the format's bound of the exact average;
- state_dict round trip, and the refusals: a model without FSDP modules, installing twice, a
  reduce_dtype outside fp32/bf16/fp16.
Usage: test_fsdp.py --world N. On a torch without FSDP2's custom reduce-scatter (torch 1.13) it
checks only that compress_fsdp refuses, naming torch 2.9 and the DDP hook."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_testlib as L  # noqa: E402

STEPS = 50
ACCUM = 2  # micro-batches per step in the accumulation run


class Net:
    """A small Llama-style stack: blocks of two linears with odd row counts (so FSDP pads the
    dim-0 chunks), a norm, and a conv layer in front."""

    @staticmethod
    def make(seed=0):
        import torch
        torch.manual_seed(seed)

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.up = torch.nn.Linear(32, 45)
                self.down = torch.nn.Linear(45, 32)
                self.norm = torch.nn.LayerNorm(32)

            def forward(self, x):
                return self.norm(x + self.down(torch.tanh(self.up(x))))

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = torch.nn.Conv1d(1, 3, 5, padding=2)
                self.inp = torch.nn.Linear(96, 32)
                self.blocks = torch.nn.ModuleList([Block(), Block()])
                self.out = torch.nn.Linear(32, 16)

            def forward(self, x):
                h = self.conv(x.unsqueeze(1)).flatten(1)
                h = self.inp(h)
                for b in self.blocks:
                    h = b(h)
                return self.out(h)
        return Model()


def _shard(model, reduce_dtype=None):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype else None
    kw = {"mp_policy": mp} if mp else {}
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def _full_params(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _reference_reduce_scatter():
    """FSDP2 asks for PREMUL_SUM(1/factor) under set_gradient_divide_factor, which gloo does not
    have: the reference is gloo's SUM reduce-scatter times the factor, in fp32."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class Reference(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group,
                                       op=dist.ReduceOp.SUM)
            kind = getattr(op, "op", op)
            if kind == dist.ReduceOp.PREMUL_SUM:
                output_tensor.mul_(op.factor)
            elif kind == dist.ReduceOp.AVG:
                output_tensor.div_(group.size())
    return Reference()


def _train(rank, world, policy, steps, factor=None, accumulate=False, reduce_dtype=None):
    import torch
    import geofp8.torch as gt
    from torch.distributed.fsdp import FSDPModule
    model = _shard(Net.make(), reduce_dtype)
    if factor is not None:
        model.set_gradient_divide_factor(factor)
        if policy is None:
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_reduce_scatter(_reference_reduce_scatter())
    state = gt.compress_fsdp(model, policy=policy) if policy is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        micro = ACCUM if accumulate else 1
        total = 0.0
        for k in range(micro):
            if accumulate:
                model.set_requires_gradient_sync(k == micro - 1)
            x, y = L.batch(rank * micro + k, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    out = {"losses": losses, "params": _full_params(model)}
    if state is not None:
        out["step"] = state.step
        out["stats"] = dict(state.stats)
        sd = state.state_dict()
        out["names"] = list(sd["names"])
        # The round trip: a fresh state takes it back and gives the same state_dict.
        again = gt.compress_fsdp(_shard(Net.make()), policy=policy)
        again.load_state_dict(sd)
        out["roundtrip"] = _same_state(sd, again.state_dict())
    return out


def _same_state(a, b):
    import torch
    if a.keys() != b.keys():
        return "keys differ: %s vs %s" % (sorted(a), sorted(b))
    for k in a:
        x, y = a[k], b[k]
        if k == "stats":
            continue
        if repr(_plain(x)) != repr(_plain(y)):
            return "state_dict[%r] differs after load_state_dict" % k
    return None


def _plain(v):
    import torch
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _bounded_shards(rank, world):
    """Each exchanged shard against the exact average: fp8 e4m3 (3 mantissa bits, per-block
    scales) has a relative rounding error of at most 2^-4 per element after scaling, so each
    layer's relative Frobenius error is below 2^-4 for one quantization, plus the requantized
    sum's: 2 * 2^-4 = 0.125 bounds it."""
    import torch
    import torch.distributed as dist
    import geofp8.torch as gt
    failures = []
    model = _shard(Net.make())
    state = gt.compress_fsdp(model, policy="fp8")
    x, y = L.batch(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    ref = _shard(Net.make())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        got = p.grad.full_tensor().double()
        want = q.grad.full_tensor().double()
        err = float((got - want).norm() / max(float(want.norm()), 1e-30))
        if not err < 0.125:
            failures.append("fp8 shard of %s: relative error %.4f >= 0.125" % (name, err))
    if state.step != 1:
        failures.append("state.step is %d after one backward, not 1" % state.step)
    # Without a coordinator, nothing is measured by default; summary_every=1 measures each
    # layer's exchange error every step, and layers show the effective geometry.
    if state.report(0.0)["layer_errors"]:
        failures.append("layer errors measured by default without a coordinator")
    measured = _shard(Net.make())
    sm = gt.compress_fsdp(measured, policy="geofp8", summary_every=1)
    torch.nn.functional.mse_loss(measured(x), y).backward()
    record = sm.report(0.0)
    names = [n for n, _ in measured.named_parameters()]
    got = dict(record["layer_errors"])
    if sorted(got) != sorted(names):
        failures.append("summary_every=1: layer errors for %s, not every layer %s"
                        % (sorted(got), sorted(names)))
    # geofp8 is fp8 e4m3 in lowrank coordinates: the same bound as plain fp8 above.
    bad = {n: e for n, e in got.items() if not 0 <= e < 0.125}
    if bad:
        failures.append("summary_every=1: layer errors out of [0, 0.125): %s" % bad)
    text = sm.layer_summary(record)
    if "exchange error" not in text or names[0] not in text and len(names) <= 8:
        failures.append("layer_summary: %r" % text)
    effective = {l["name"]: l["effective_geometry"] for l in sm.layers}
    want = {n: ("none" if p.dim() < 2 else "lowrank") for n, p in measured.named_parameters()}
    if effective != want:
        failures.append("effective geometry %s, want %s" % (effective, want))
    dist.barrier()
    # Refusals (every rank the same, so no collective is left waiting).
    try:
        gt.compress_fsdp(model, policy="fp8")
        failures.append("a second compress_fsdp on one model was taken")
    except RuntimeError as e:
        if "already installed" not in str(e):
            failures.append("installing twice: %s" % e)
    try:
        gt.compress_fsdp(Net.make(), policy="fp8")
        failures.append("a model without FSDP modules was taken")
    except ValueError as e:
        if "fully_shard" not in str(e):
            failures.append("no FSDP module: message does not say fully_shard: %s" % e)
    comm = state  # noqa: F841
    from torch.distributed.fsdp import FSDPModule
    rs = next(m for m in model.modules() if isinstance(m, FSDPModule)) \
        ._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
    try:
        rs(torch.zeros(4, dtype=torch.float64), torch.zeros(4 * world, dtype=torch.float64),
           None, dist.ReduceOp.AVG)
        failures.append("a float64 reduce-scatter was taken")
    except TypeError as e:
        if "reduce_dtype" not in str(e) or "float64" not in str(e):
            failures.append("float64 refusal does not name reduce_dtype and the dtype: %s" % e)
    return failures


def _runs(rank, world):
    steps = STEPS if world == 2 else 10
    out = {"native": _train(rank, world, None, steps),
           "fp32": _train(rank, world, "fp32", steps)}
    if world == 2:
        for factor in (1.0, 4.0):
            out["native/%g" % factor] = _train(rank, world, None, 3, factor)
            out["fp32/%g" % factor] = _train(rank, world, "fp32", 3, factor)
        out["native/accum"] = _train(rank, world, None, 4, None, True)
        out["fp32/accum"] = _train(rank, world, "fp32", 4, None, True)
        for policy in ("fp8", "geofp8"):
            out[policy] = _train(rank, world, policy, 20)
        out["bounded"] = _bounded_shards(rank, world)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    L.require_torch()
    import torch
    try:
        from torch.distributed.fsdp import FSDPModule
        ok = hasattr(FSDPModule, "set_custom_reduce_scatter")
    except Exception:  # noqa: BLE001 - torch 1.13's fsdp fails to import on Python 3.11
        ok = False
    if not ok:
        import geofp8.torch as gt
        try:
            gt.compress_fsdp(torch.nn.Linear(2, 2))
            print("FAIL: compress_fsdp took a torch without FSDP2's custom reduce-scatter")
            sys.exit(1)
        except RuntimeError as e:
            if "2.9" not in str(e) or "DDP hook" not in str(e):
                print("FAIL: the old-torch refusal does not name 2.9 and the DDP hook: %s" % e)
                sys.exit(1)
        print("ok: torch %s has no FSDP2 custom reduce-scatter, and compress_fsdp says so"
              % torch.__version__)
        sys.exit(0)
    world = args.world
    failures = []
    steps = STEPS if world == 2 else 10
    # Every run in one process group (a spawn costs each rank a torch import).
    res = L.spawn(world, _runs)
    native = [r["native"] for r in res]
    fp32 = [r["fp32"] for r in res]
    for r in range(world):
        a, b = fp32[r], native[r]
        if world == 2:
            if a["losses"] != b["losses"]:
                failures.append("rank %d: fp32 losses differ from FSDP2's own: %s vs %s"
                                % (r, a["losses"][:4], b["losses"][:4]))
            for i, (x, y) in enumerate(zip(a["params"], b["params"])):
                if not torch.equal(x, y):
                    failures.append("rank %d: parameter %d differs from FSDP2's own after %d "
                                    "steps (max %.3g)" % (r, i, steps,
                                                          float((x - y).abs().max())))
        else:
            # The sum of N fp32 values in another order: N * 2^-24 relative per element per
            # step; over `steps` SGD steps of lr 0.05 the parameters move by far less than 1e-4.
            for i, (x, y) in enumerate(zip(a["params"], b["params"])):
                d = float((x - y).abs().max())
                if not d <= 1e-4:
                    failures.append("rank %d: parameter %d differs by %.3g > 1e-4 at %d ranks"
                                    % (r, i, d, world))
        if a["step"] != steps:
            failures.append("rank %d: state.step %d after %d steps" % (r, a["step"], steps))
        if a["roundtrip"]:
            failures.append("rank %d: %s" % (r, a["roundtrip"]))
    if world == 2:
        # SUM and PREMUL_SUM: a divide factor of 1 (SUM) and of 4 (PREMUL_SUM(1/4)).
        for factor in (1.0, 4.0):
            for r in range(world):
                g, n = res[r]["fp32/%g" % factor], res[r]["native/%g" % factor]
                if g["losses"] != n["losses"]:
                    failures.append("rank %d: divide factor %g: losses %s vs FSDP2's %s"
                                    % (r, factor, g["losses"], n["losses"]))
        # Accumulation: two micro-batches per step, one reduce-scatter.
        for r in range(world):
            g, n = res[r]["fp32/accum"], res[r]["native/accum"]
            if g["losses"] != n["losses"]:
                failures.append("rank %d: accumulation: losses %s vs FSDP2's %s"
                                % (r, g["losses"], n["losses"]))
            if g["step"] != 4:
                failures.append("rank %d: accumulation counted %d steps, not 4"
                                % (r, g["step"]))
        for policy in ("fp8", "geofp8"):
            for r in range(world):
                q = res[r][policy]
                ls = q["losses"]
                if not ls[-1] < 0.8 * ls[0]:
                    failures.append("rank %d: %s did not train: %.4f -> %.4f"
                                    % (r, policy, ls[0], ls[-1]))
                st = q["stats"]
                ratio = st["bytes_sent"] / max(st["bytes_baseline"], 1)
                # fp8: the engine's reduce-scatter, 1 byte per element plus scales and a 24-byte
                # header per chunk, which on this model's small layers (a 45-element bias sends
                # chunks of 23) is 0.289 at 2 ranks; issue 42's 0.27 is for >= 20M parameters.
                # geofp8 refreshes every layer's geometry every step (ema, interval 1). A layer
                # stays a reduce-scatter on its refresh steps when its sketch's thin products
                # move fewer bytes than an all-reduce's second pass (Exchanger::ShardedRefresh);
                # on this model's small layers they do not, so they are all-reduced.
                top = 0.30 if policy == "fp8" else 0.6
                print("%s rank %d: %.3f of an fp32 reduce-scatter's bytes" % (policy, r, ratio))
                if not 0.2 < ratio <= top:
                    failures.append("rank %d: %s sent %.3f of an fp32 reduce-scatter's bytes "
                                    "(> %.2f)" % (r, policy, ratio, top))
                if q["roundtrip"]:
                    failures.append("rank %d: %s: %s" % (r, policy, q["roundtrip"]))
        failures += res[0]["bounded"]
    for f in failures:
        print("FAIL:", f)
    if not failures:
        print("ok: FSDP2 reduce-scatter at %d ranks (torch %s)" % (world, torch.__version__))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
