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
  reduce_dtype outside fp32/bf16/fp16;
- torch.distributed.checkpoint with the state beside the model and optimizer: at 2 ranks a run
  saved at step DCP_AT and resumed into fresh objects is bit-identical to the uninterrupted one
  (and is not without the residuals); at 4 ranks a checkpoint loaded at 2 drops its residuals
  with a warning and keeps the geometry, and one saved at 2 and loaded at 4 is refused by DCP or,
  with allow_partial_load, drops them with a warning.
Usage: test_fsdp.py --world N. On a torch without FSDP2's custom reduce-scatter (torch 1.13) it
checks only that compress_fsdp refuses, naming torch 2.9 and the DDP hook."""

import argparse
import os
import sys
import time

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


def _shard(model, reduce_dtype=None, mesh=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype else None
    kw = {"mp_policy": mp} if mp else {}
    if mesh is not None:
        kw["mesh"] = mesh
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
    state = gt.compress_fsdp(model, policy="fp8", trace_buckets=True)
    x, y = L.batch(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    # trace_buckets: one record per FSDP module's reduce-scatter, as examples/pytorch/train_fsdp.py
    # --timing reads them.
    trace = state.bucket_trace
    names = [r["module"] for r in trace]
    if not trace or len(set(names)) != len(names):
        failures.append("bucket_trace: not one record per module: %s" % names)
    for r in trace:
        if not (r["step"] == 0 and r["started"] <= r["finished"] and r["bytes_sent"] > 0
                and r["numel"] > 0 and r["numel"] % world == 0 and not r["skipped"]):
            failures.append("bucket_trace: record %s" % r)
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


# The distributed-checkpoint runs: error feedback (nvfp4, whose residuals are large) and lowrank
# geometry refreshed every other step, so that steps alternate between the engine's
# reduce-scatter and its all-reduce, and the residuals, the geometry and the refresh schedule
# all decide the next steps' bits. SGD with momentum, so the optimizer's state matters too.
EF_POLICY = {"policy": {"default": {"format": "nvfp4", "error_feedback": True},
                        "layers": [{"match": "*", "geometry": "lowrank", "rank": 4}]},
             "geometry_refresh": {"estimator": "ema", "interval": 2}}
DCP_STEPS, DCP_AT = 6, 3  # steps of the uninterrupted run; the step the checkpoint is taken at


def _dcp_fresh(group=None):
    """A fresh model, optimizer and GeoFP8 state over `group` (default: the whole world)."""
    import torch
    import geofp8.torch as gt
    mesh = None
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh
        mesh = DeviceMesh.from_group(group, "cpu")
    model = _shard(Net.make(), mesh=mesh)
    state = gt.compress_fsdp(model, policy=EF_POLICY, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, state


def _dcp_dict(model, opt, geofp8):
    """What an FSDP2 trainer saves (docs/pytorch.md, "FSDP2"): the model's and optimizer's
    sharded state dicts and the GeoFP8 state itself, which DCP treats as Stateful."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    m, o = get_state_dict(model, opt)
    return {"model": m, "optim": o, "geofp8": geofp8}


def _dcp_restore(model, opt, sd):
    from torch.distributed.checkpoint.state_dict import set_state_dict
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _dcp_steps(rank, model, opt, first, last, losses):
    import torch
    for step in range(first, last):
        opt.zero_grad()
        x, y = L.batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())


def _dcp_directory(rank):
    """A directory every rank sees (rank 0 makes it)."""
    import tempfile
    import torch.distributed as dist
    box = [tempfile.mkdtemp(prefix="geofp8-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _dcp_resume(rank, world):
    """Saved with DCP at step DCP_AT and resumed into a fresh model, optimizer and state, a run
    gives the uninterrupted run's losses and parameters bit for bit; resumed without this rank's
    residuals it does not (so the residuals are what the comparison sees)."""
    import hashlib
    import shutil
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    path = _dcp_directory(rank)
    try:
        model, opt, state = _dcp_fresh()
        straight = []
        _dcp_steps(rank, model, opt, 0, DCP_AT, straight)
        # DCP keeps one copy of the geometry, which every rank saves under one key: it must be
        # the same on every rank.
        geometry = repr(_plain(state.state_dict()["geometry"]))
        dcp.save(_dcp_dict(model, opt, state), checkpoint_id=path)
        _dcp_steps(rank, model, opt, DCP_AT, DCP_STEPS, straight)
        out = {"straight": straight, "straight_params": _full_params(model),
               "geometry": hashlib.sha256(geometry.encode()).hexdigest()}
        keys = sorted(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        out["residual_keys"] = [k for k in keys if k.startswith("geofp8.") and
                                k.endswith(".residuals")]
        for name, keep in (("resumed", True), ("without", False)):
            model, opt, state = _dcp_fresh()
            if keep:
                sd = _dcp_dict(model, opt, state)
                dcp.load(sd, checkpoint_id=path)
            else:
                # The GeoFP8 state as a plain dict, its residuals taken out before it is loaded.
                sd = _dcp_dict(model, opt, state.state_dict())
                dcp.load(sd, checkpoint_id=path)
                own = sd["geofp8"]["per_rank"][str(rank)]
                out["held"] = sum(1 for r in own["residuals"] if len(r[1]))
                own["residuals"] = [(r[0], r[1][:0], r[2][:0]) for r in own["residuals"]]
                state.load_state_dict(sd["geofp8"])
            _dcp_restore(model, opt, sd)
            losses = list(straight[:DCP_AT])
            if state.step != DCP_AT:
                out["step_" + name] = state.step
            _dcp_steps(rank, model, opt, DCP_AT, DCP_STEPS, losses)
            out[name] = losses
            out[name + "_params"] = _full_params(model)
        return out
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def _dcp_other_world(rank, world):
    """A checkpoint saved at `world` (4) ranks and loaded at 2 (ranks 0 and 1 in a group of
    their own) drops its residuals with a warning and keeps the geometry; one saved at 2 and
    loaded at 4 fails naming the first missing rank's key, and with allow_partial_load drops
    them with a warning on every rank."""
    import shutil
    import warnings
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    path = _dcp_directory(rank)
    wide, narrow = os.path.join(path, "wide"), os.path.join(path, "narrow")
    out = {}

    def said(caught):
        return [str(w.message) for w in caught if "residuals" in str(w.message)]
    try:
        model, opt, state = _dcp_fresh()
        _dcp_steps(rank, model, opt, 0, DCP_AT, [])
        geometry = state.state_dict()["geometry"]
        dcp.save(_dcp_dict(model, opt, state), checkpoint_id=wide)
        pair = dist.new_group([0, 1])
        if rank < 2:
            m2, o2, s2 = _dcp_fresh(pair)
            sd = _dcp_dict(m2, o2, s2)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dcp.load(sd, checkpoint_id=wide, process_group=pair)
            _dcp_restore(m2, o2, sd)
            after = s2.state_dict()
            out["down"] = {
                "said": said(caught), "step": s2.step,
                "geometry": repr(_plain(after["geometry"])) == repr(_plain(geometry)),
                "residuals": sum(1 for r in after["per_rank"][str(rank)]["residuals"]
                                 if len(r[1]))}
            _dcp_steps(rank, m2, o2, DCP_AT, DCP_AT + 1, out["down"].setdefault("loss", []))
            dcp.save(_dcp_dict(m2, o2, s2), checkpoint_id=narrow, process_group=pair)
        dist.barrier()
        try:
            dcp.load(_dcp_dict(model, opt, state), checkpoint_id=narrow)
            out["up_strict"] = None
        except dcp.api.CheckpointException as e:  # every rank's, naming each one's failure
            out["up_strict"] = str(e)
        sd = _dcp_dict(model, opt, state)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcp.load(sd, checkpoint_id=narrow,
                     planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
        _dcp_restore(model, opt, sd)
        out["up"] = {"said": said(caught), "step": state.step}
        return out
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def _dcp_world_failures(res, world):
    failures = []
    for r in range(world):
        d = res[r]["dcp_world"]
        if r < 2:
            down = d["down"]
            if len(down["said"]) != 1 or "dropped" not in down["said"][0] or \
                    ("saved by rank %d of %d" % (r, world)) not in down["said"][0]:
                failures.append("rank %d: a checkpoint of %d ranks loaded at 2 warned %s, not "
                                "that its residuals saved by rank %d of %d are dropped"
                                % (r, world, down["said"], r, world))
            if down["residuals"]:
                failures.append("rank %d: loaded at 2 ranks, %d layers took residuals saved "
                                "at %d" % (r, down["residuals"], world))
            if not down["geometry"]:
                failures.append("rank %d: loaded at 2 ranks, the geometry is not the one saved "
                                "at %d" % (r, world))
            if down["step"] != DCP_AT or not all(0 < x < 10 for x in down["loss"]):
                failures.append("rank %d: loaded at 2 ranks: step %d, then loss %s"
                                % (r, down["step"], down["loss"]))
        strict = d["up_strict"] or ""
        if "Missing key in checkpoint state_dict: geofp8.per_rank.2." not in strict:
            failures.append("rank %d: a checkpoint of 2 ranks loaded at %d: %r, not DCP's "
                            "missing key geofp8.per_rank.2.*" % (r, world, strict[:300]))
        up = d["up"]
        want = "saved by rank %d of 2" % r if r < 2 else "saved at world size 2"
        if len(up["said"]) != 1 or "dropped" not in up["said"][0] or want not in up["said"][0]:
            failures.append("rank %d: loaded at %d with allow_partial_load, warned %s, not %r "
                            "... dropped" % (r, world, up["said"], want))
        if up["step"] != DCP_AT + 1:
            failures.append("rank %d: loaded at %d: step %d, not %d" % (r, world, up["step"],
                                                                        DCP_AT + 1))
    return failures


def _dcp_failures(res, world):
    import torch
    failures = []
    if len({r["dcp"]["geometry"] for r in res}) != 1:
        failures.append("DCP checkpoint: the ranks' geometry differs, and DCP keeps one copy")
    keys = res[0]["dcp"]["residual_keys"]
    want = ["geofp8.per_rank.%d.residuals" % r for r in range(world)]
    if keys != want:
        failures.append("DCP checkpoint: residual keys %s, want one per rank %s" % (keys, want))
    for r in range(world):
        d = res[r]["dcp"]
        if not d.get("held"):
            failures.append("rank %d: the checkpoint holds no error-feedback residual" % r)
        for name in ("resumed", "without"):
            if "step_" + name in d:
                failures.append("rank %d: %s at step %d, not %d" % (r, name, d["step_" + name],
                                                                   DCP_AT))
        same = d["resumed"] == d["straight"] and all(
            torch.equal(a, b) for a, b in zip(d["resumed_params"], d["straight_params"]))
        if not same:
            failures.append("rank %d: resumed from DCP at step %d: losses %s, the uninterrupted "
                            "run's %s (or the parameters differ)"
                            % (r, DCP_AT, d["resumed"][DCP_AT:], d["straight"][DCP_AT:]))
        if all(torch.equal(a, b) for a, b in zip(d["without_params"], d["straight_params"])):
            failures.append("rank %d: resumed without the residuals, the parameters are the "
                            "uninterrupted run's: the comparison does not see them" % r)
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
    # The distributed-checkpoint checks, timed (their share of the test's time).
    began = time.monotonic()
    if world == 2:
        out["dcp"] = _dcp_resume(rank, world)
    else:
        out["dcp_world"] = _dcp_other_world(rank, world)
    out["dcp_s"] = time.monotonic() - began
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
        failures += _dcp_failures(res, world)
    else:
        failures += _dcp_world_failures(res, world)
    print("DCP checkpoint checks: %.1f s (rank 0)" % res[0]["dcp_s"])
    for f in failures:
        print("FAIL:", f)
    if not failures:
        print("ok: FSDP2 reduce-scatter at %d ranks (torch %s)" % (world, torch.__version__))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
