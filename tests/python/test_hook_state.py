"""geofp8.torch state: a state_dict() round trip resumes bit for bit (geometry included),
set_policy(policy, effective_step) applies at that step on every rank, a NaN on one rank
skips the step on every rank, and the hook's cached bucket layouts follow a bucket whose
parameters change while its buffer stays. Two gloo ranks."""

import io
import warnings
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_testlib as L  # noqa: E402

WARM = 4  # steps before the checkpoint: the EMA geometry is active from step 1


def run_steps(rank, ddp, model, opt, first, count):
    import torch
    for s in range(first, first + count):
        x, y = L.batch(rank, s)
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    return [p.grad.detach().clone() for p in model.parameters()]


def fresh(policy):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    import geofp8.torch as gt
    model = L.tiny_model()
    # Several small buckets (torch documents both knobs), so the hook maps more than one bucket
    # to its layers and DDP's rebuild after step 0 moves layers between buckets (geometry
    # follows them through the engine's stash).
    torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 4096
    ddp = DDP(model, bucket_cap_mb=4096 / 2**20)
    state = gt.GeoFP8State(model=model, policy=policy, seed=5)
    ddp.register_comm_hook(state, gt.geofp8_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    return model, ddp, state, opt


class FakeBucket:
    """What geofp8_hook reads of torch's GradBucket, over a buffer and parameters we choose."""

    def __init__(self, buf, params):
        self.buf, self.params = buf, params

    def buffer(self):
        return self.buf

    def parameters(self):
        return list(self.params)

    def gradients(self):
        out, off = [], 0
        for p in self.params:
            out.append(self.buf[off:off + p.numel()].view(p.shape))
            off += p.numel()
        return out

    def index(self):
        return 0

    def is_last(self):
        return True


def layout_errors():
    """One buffer, reused for bucket layouts that hold the same two matrices in the two orders
    (DDP's rebuild can hand a new bucket the old buffer's address): each call must map the
    buffer to the layers it now holds. The matrices' gradients differ in magnitude by 1e6, so a
    stale layout (the first order's offsets on the second order's buffer) quantizes the small
    one with the large one's tensor scale and flushes it to 0 in FP8, while the right layout
    gives each its own scale and a relative error below E4M3's rounding bound 2^-4. Every rank
    holds the same gradients, so the average is the gradient itself."""
    import torch
    import geofp8.torch as gt
    model = L.tiny_model()
    # Tensor scaling (one scale per layer): a block-scaled layout would give each 128-element
    # block its own scale whatever the offsets, so a stale layout would go unseen.
    state = gt.GeoFP8State(model=model, seed=5, policy={
        "policy": {"default": {"format": "fp8_e4m3", "scaling": "tensor"}}})
    w0, w3 = model[0].weight, model[3].weight  # 64x32 and 16x64: different sizes
    g = torch.Generator().manual_seed(3)

    def values(n, scale):
        # Magnitudes in [0.5, 1) x scale, random signs: every value is a normal E4M3 number
        # after its layer's tensor scaling, so the rounding bound holds elementwise.
        mag = 0.5 + 0.5 * torch.rand(n, generator=g)
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        return scale * mag * sign

    buf = torch.empty(w0.numel() + w3.numel())
    errors = []
    for call, order in enumerate([(w3, w0), (w0, w3), (w3, w0)]):
        scales = {id(w0): 1e3, id(w3): 1e-3}
        parts = [values(p.numel(), scales[id(p)]) for p in order]
        expect = torch.cat(parts)
        buf.copy_(expect)
        out = gt.geofp8_hook(state, FakeBucket(buf, order)).wait()
        off = 0
        for p, part in zip(order, parts):
            got = out[off:off + p.numel()]
            rel = float(((got - part).abs() / part.abs()).max())
            if not rel < 2.0 ** -4:
                errors.append("layout call %d: layer of %d elements: max relative error %g"
                              % (call, p.numel(), rel))
            off += p.numel()
    if len(state._layouts) != 2:
        errors.append("layout cache holds %d layouts after 2 distinct ones"
                      % len(state._layouts))
    return errors


def same(a, b):
    """Deep equality of state_dict values: tensors and arrays by value and dtype, containers
    element by element (a tuple and a list of the same elements are the same: torch.save may
    turn one into the other), NaN equal to NaN."""
    import numpy as np
    import torch
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return type(a) is type(b) and a == b


def state_field_errors(rank):
    """Every field of the hook's state_dict, whatever fields it has: a round trip through
    torch.save brings each back equal. The state is made so that a field left unrestored would
    show: each differs from a fresh state's (steps taken, error-feedback residuals and geometry
    held, a policy change taken, version 2, and another one scheduled), or, where it cannot (the
    format, the parameter names), load_state_dict refuses a state without it."""
    import torch
    ef_policy = {"exchange": {"algorithm": "allgather"},
                 "policy": {"default": {"format": "nvfp4", "error_feedback": True},
                            "layers": [{"match": "*", "geometry": "lowrank", "rank": 4}]},
                 "geometry_refresh": {"estimator": "ema", "interval": 1}}
    model, ddp, state, opt = fresh("fp8")
    state.set_policy(ef_policy, effective_step=1)
    state.set_policy("fp8", effective_step=100)
    run_steps(rank, ddp, model, opt, 0, WARM)
    saved = state.state_dict()
    buf = io.BytesIO()
    torch.save(saved, buf)
    errors = []
    buf.seek(0)
    _, _, loaded, _ = fresh("fp8")
    loaded.load_state_dict(torch.load(buf))
    back = loaded.state_dict()
    if set(back) != set(saved):
        errors.append("state_dict fields %s after a round trip, %s before"
                      % (sorted(back), sorted(saved)))
    for key in saved:
        if key in back and not same(saved[key], back[key]):
            errors.append("state_dict field %r does not survive a round trip" % key)
    # Residuals saved by another rank or at another world size are dropped with a warning, never
    # applied; the geometry still loads.
    own = saved["per_rank"][str(rank)]
    for key, value in (("rank", 1 - rank), ("world_size", 4)):
        if key == "rank":  # this rank's file loaded by the other rank
            moved = dict(saved, per_rank={str(value): own})
        else:
            moved = dict(saved, world_size=value)
        _, _, other, _ = fresh("fp8")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            other.load_state_dict(moved)
        said = [str(w.message) for w in caught if "residuals" in str(w.message)]
        if not said or "dropped" not in said[0]:
            errors.append("a state saved with %s=%d loaded without a warning that drops its "
                          "residuals (%s)" % (key, value, said))
        if same(other.state_dict()["per_rank"][str(rank)]["residuals"], own["residuals"]):
            errors.append("residuals saved with %s=%d were applied" % (key, value))
        if not same(other.state_dict()["geometry"], saved["geometry"]):
            errors.append("geometry saved with %s=%d was not loaded" % (key, value))
    # A format 4 state (one rank's residuals and counters at the top level, beside the rank and
    # world size that saved them) still loads, its residuals on the rank that saved them.
    four = {k: v for k, v in saved.items() if k != "per_rank"}
    four.update(format=4, rank=rank, residuals=own["residuals"], stats=own["stats"])
    _, _, other, _ = fresh("fp8")
    other.load_state_dict(four)
    if not same(other.state_dict()["per_rank"][str(rank)], own):
        errors.append("a format 4 state's residuals or counters did not load on its own rank")
    _, _, blank, _ = fresh("fp8")
    fresh_state = blank.state_dict()
    for key in saved:
        if key in fresh_state and same(fresh_state[key], saved[key]):
            # Equal to a fresh state's (the format, the model's names): the round trip above
            # cannot tell it was restored, so it must be required: a state without it refused.
            partial = {k: v for k, v in saved.items() if k != key}
            _, _, other, _ = fresh("fp8")
            try:
                other.load_state_dict(partial)
            except (KeyError, ValueError):
                continue
            errors.append("state_dict field %r keeps its fresh value in the test state and is "
                          "not required by load_state_dict: its round trip proves nothing" % key)
    return sorted(saved), errors


def work(rank, world):
    import torch
    layout = layout_errors()
    fields, field_errors = state_field_errors(rank)
    model, ddp, state, opt = fresh("geofp8")
    run_steps(rank, ddp, model, opt, 0, WARM)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "hook": state.state_dict()}, buf)
    # Reference: the uninterrupted run's next two steps (the resumed DDP runs its first step on
    # one bucket, then rebuilds: both layouts take the restored geometry).
    reference = run_steps(rank, ddp, model, opt, WARM, 2)
    # The figure report() sends (describe's "saved N%"), after the same WARM + 2 steps.
    figures = {"reference": state.report(0.0)}
    step_bytes = state.last_step["bytes_sent"]
    # Resume into new objects.
    buf.seek(0)
    # weights_only on torch 2.x (its default from 2.6): the hook's state loads as torch's own
    # checkpoints do. (torch 1.13's weights-only loader takes no floats.)
    ckpt = torch.load(buf, **({"weights_only": True} if torch.__version__ >= "2" else {}))
    model2, ddp2, state2, opt2 = fresh("geofp8")
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    state2.load_state_dict(ckpt["hook"])
    resumed = run_steps(rank, ddp2, model2, opt2, WARM, 2)
    figures["resumed"] = state2.report(0.0)
    # Control: the same weights without the hook state (identity geometry, step 0 again).
    model3, ddp3, state3, opt3 = fresh("geofp8")
    model3.load_state_dict(ckpt["model"])
    opt3.load_state_dict(ckpt["opt"])
    control = run_steps(rank, ddp3, model3, opt3, WARM, 2)

    # set_policy at a future step: fp8 until step 2, fp32 from step 2 on.
    model4, ddp4, state4, opt4 = fresh("fp8")
    state4.set_policy("fp32", effective_step=2)
    formats = []
    for s in range(4):
        run_steps(rank, ddp4, model4, opt4, s, 1)
        formats.append((state4.layers[0]["format"], state4.last_step["bytes_sent"]))
    # Non-finite skip: rank 1's batch holds a NaN at step 1; the engine skips every bucket on
    # every rank, and the hook hands DDP NaN (so an optimizer step can be skipped).
    model5, ddp5, state5, opt5 = fresh("fp8")
    skips = []
    for s in range(3):
        x, y = L.batch(rank, s)
        if s == 1 and rank == 1:
            x[0, 0] = float("nan")
        opt5.zero_grad()
        ((ddp5(x) - y) ** 2).mean().backward()
        skips.append((state5.last_step["skipped"],
                      all(bool(p.grad.isnan().all()) for p in model5.parameters())))
    # Error feedback under the every-step geometry: the residuals travel in the state (format
    # 2), so a resume continues bit for bit; loaded without them it does not.
    ef_policy = {"exchange": {"algorithm": "allgather"},
                 "policy": {"default": {"format": "nvfp4", "error_feedback": True},
                            "layers": [{"match": "*", "geometry": "lowrank", "rank": 4}]},
                 "geometry_refresh": {"estimator": "ema", "interval": 1}}
    model6, ddp6, state6, opt6 = fresh(ef_policy)
    run_steps(rank, ddp6, model6, opt6, 0, WARM)
    buf6 = io.BytesIO()
    torch.save({"model": model6.state_dict(), "opt": opt6.state_dict(),
                "hook": state6.state_dict()}, buf6)
    ef_reference = run_steps(rank, ddp6, model6, opt6, WARM, 2)
    ef_runs = {}
    for name, keep in (("resumed", True), ("without", False)):
        buf6.seek(0)
        ck = torch.load(buf6)
        if not keep:
            # A format 1 state: no residuals and no counters (they start again from zero).
            del ck["hook"]["per_rank"]
            ck["hook"]["format"] = 1
        m, d, st, o = fresh(ef_policy)
        m.load_state_dict(ck["model"])
        o.load_state_dict(ck["opt"])
        st.load_state_dict(ck["hook"])
        ef_runs[name] = run_steps(rank, d, m, o, WARM, 2)
        figures["ef_" + name] = st.report(0.0)
    buf6.seek(0)
    ef_held = sum(1 for r in torch.load(buf6)["hook"]["per_rank"][str(rank)]["residuals"]
                  if len(r[1]))
    geometry_layers = sum(1 for g in ckpt["hook"]["geometry"] if len(g[0]))
    return {"reference": reference, "resumed": resumed, "control": control,
            "formats": formats, "version": state4.policy_version,
            "geometry_layers": geometry_layers, "step": ckpt["hook"]["step"],
            "skips": skips, "skipped_buckets": state5.stats["skipped_buckets"],
            "layout": layout,
            "refreshes": (state.stats["refreshes"], state.stats["refreshes_from_inverse"]),
            "buckets": state._engine.exchanger_count,
            "buckets_resumed": state2._engine.exchanger_count,
            "ef_same": all(torch.equal(a, b) for a, b in zip(ef_reference, ef_runs["resumed"])),
            "ef_without_same": all(torch.equal(a, b)
                                   for a, b in zip(ef_reference, ef_runs["without"])),
            "ef_held": ef_held, "figures": figures, "step_bytes": step_bytes,
            "fields": fields, "field_errors": field_errors}


def saved(figure):
    return 1.0 - figure["bytes_sent"] / figure["bytes_baseline"]


def figure_failures(rank, r):
    """A resumed run reports the bytes saved of the run without the restart (issue #40): the
    same wire bytes within one step's and the same fp32 baseline, so the same saved fraction. An
    old state without the counters counts both from the resume."""
    f = r["figures"]
    out = []
    ref, res = f["reference"], f["resumed"]
    if res["bytes_baseline"] != ref["bytes_baseline"] or \
            abs(res["bytes_sent"] - ref["bytes_sent"]) > r["step_bytes"]:
        out.append("rank %d: resumed run reports %d of %d bytes (saved %.1f%%), the run without "
                   "the restart %d of %d (saved %.1f%%)"
                   % (rank, res["bytes_sent"], res["bytes_baseline"], 100 * saved(res),
                      ref["bytes_sent"], ref["bytes_baseline"], 100 * saved(ref)))
    # The baseline is WARM + 2 steps of an fp32 ring all-reduce of every gradient float.
    floats = sum(t.numel() for t in r["reference"])
    if ref["bytes_baseline"] != (WARM + 2) * 4 * floats:
        out.append("rank %d: baseline %d bytes after %d steps, expected %d"
                   % (rank, ref["bytes_baseline"], WARM + 2, (WARM + 2) * 4 * floats))
    full, old = f["ef_resumed"], f["ef_without"]
    if full["bytes_baseline"] != ref["bytes_baseline"]:
        out.append("rank %d: error-feedback run resumed: baseline %d, expected %d"
                   % (rank, full["bytes_baseline"], ref["bytes_baseline"]))
    if old["bytes_baseline"] != 2 * 4 * floats or \
            not 0 < old["bytes_sent"] < old["bytes_baseline"]:
        out.append("rank %d: a format 1 state, 2 steps after the resume: %d of %d bytes, "
                   "expected a baseline of the 2 steps, %d" % (rank, old["bytes_sent"],
                                                              old["bytes_baseline"],
                                                              2 * 4 * floats))
    return out


def main():
    L.require_torch()
    import torch
    results = L.spawn(2, work)
    failures = []
    for rank, r in enumerate(results):
        if r["step"] != WARM:
            failures.append("rank %d: saved step %d, expected %d" % (rank, r["step"], WARM))
        if r["geometry_layers"] < 2:
            failures.append("rank %d: %d layers with saved geometry, expected the 2 matrices"
                            % (rank, r["geometry_layers"]))
        same = all(torch.equal(a, b) for a, b in zip(r["reference"], r["resumed"]))
        if not same:
            failures.append("rank %d: resumed step differs from the uninterrupted one" % rank)
        # Without the hook state the step differs: the check above is not vacuous.
        if all(torch.equal(a, b) for a, b in zip(r["reference"], r["control"])):
            failures.append("rank %d: a fresh hook state gave the same step as the resumed one"
                            % rank)
        if r["buckets"] < 2 or r["buckets_resumed"] != r["buckets"]:
            failures.append("rank %d: %d and %d DDP buckets, the test wants several" %
                            (rank, r["buckets"], r["buckets_resumed"]))
        # The EMA refreshes after the first take their projections from the exchange's inverse
        # transform (the geometry in force is the sketch's basis), not from another read.
        refreshes, from_inverse = r["refreshes"]
        if not (refreshes > 0 and 0 < from_inverse < refreshes):
            failures.append("rank %d: %d refreshes, %d from the inverse's products; expected all "
                            "but the first of each layer" % (rank, refreshes, from_inverse))
        if r["ef_held"] < 2:
            failures.append("rank %d: %d layers with saved error-feedback residuals" %
                            (rank, r["ef_held"]))
        if not r["ef_same"]:
            failures.append("rank %d: error feedback: the resumed step differs" % rank)
        if r["ef_without_same"]:
            failures.append("rank %d: error feedback: a resume without the residuals gave the "
                            "same step (the check is vacuous)" % rank)
        fmts = [f for f, _ in r["formats"]]
        if fmts != ["fp8_e4m3", "fp8_e4m3", "fp32", "fp32"]:
            failures.append("rank %d: formats by step %s" % (rank, fmts))
        b = [n for _, n in r["formats"]]
        if not (b[2] > 3 * b[1]):
            failures.append("rank %d: bytes by step %s: fp32 at step 2 should be ~4x fp8" %
                            (rank, b))
        if r["skips"] != [(False, False), (True, True), (False, False)]:
            failures.append("rank %d: (skipped, all-NaN grads) by step %s, expected skip at step"
                            " 1 only" % (rank, r["skips"]))
        failures += ["rank %d: %s" % (rank, e) for e in r["layout"]]
        failures += figure_failures(rank, r)
        failures += ["rank %d: %s" % (rank, e) for e in r["field_errors"]]
        if r["version"] != 2:
            failures.append("rank %d: policy version %d, expected 2" % (rank, r["version"]))
    print("state_dict fields checked by round trip: %s" % ", ".join(results[0]["fields"]))
    print("resume exact over %d buckets, set_policy at step 2: formats %s"
          % (results[0]["buckets"], results[0]["formats"]))
    for k, f in sorted(results[0]["figures"].items()):
        print("rank 0 %-12s %8d of %8d bytes: saved %.1f%%" % (k, f["bytes_sent"],
                                                             f["bytes_baseline"],
                                                             100 * saved(f)))
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
