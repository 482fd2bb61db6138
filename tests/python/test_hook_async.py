"""geofp8.torch's asynchronous hook (issue 28 item 3), two gloo ranks:

1. Overlap: with a layer whose backward takes SLOW_S seconds between two buckets, the hook
   trace shows that backward inside bucket 0's exchange; on the synchronous path it starts
   only after that exchange has finished (so the check can fail).
2. The same bits: several small buckets (many in flight at once), the geofp8 preset (geometry
   refreshed every step) and a per-layer YAML policy: weights and wire bytes after STEPS steps
   equal the synchronous path's exactly.
3. Errors reach DDP through the Future: ranks whose policies differ get the fingerprint
   mismatch from backward(), a rank whose peer never exchanges gets the timeout, and a NaN on
   one rank comes back as NaN buckets on both.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_testlib as L  # noqa: E402

SLOW_S = 0.25
STEPS = 5
YAML_POLICY = """
geometry_refresh: {estimator: ema, interval: 1}
policy:
  default: {format: fp8_e4m3}
  layers:
    - {match: "[02].weight", geometry: lowrank, rank: 8}
    - {match: "7.*", format: nvfp4}
"""


def overlap(rank, world, synchronous):
    """Bucket 0 holds the last layer's weight, bucket 1 the first's; between them a layer whose
    backward sleeps SLOW_S and records when. Returns [(sleep begin, end)] and the trace."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    import geofp8.torch as gt
    spans = []

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            t0 = time.monotonic()
            time.sleep(SLOW_S)
            spans.append((t0, time.monotonic()))
            return g

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            # 2048 x 2048 floats (16 MiB) each: bucket 0's exchange (encode, 4 MiB each way,
            # decode) takes tens of milliseconds, far more than the microseconds from the hook's
            # return to the next backward node.
            self.a = torch.nn.Linear(2048, 2048, bias=False)
            self.b = torch.nn.Linear(2048, 2048, bias=False)

        def forward(self, x):
            return self.b(Slow.apply(self.a(x)))

    model = Net()
    # Each 16 MiB weight over the 1 MiB cap: one bucket each, b's first (backward order).
    ddp = DDP(model, bucket_cap_mb=1)
    state = gt.GeoFP8State(model=model, policy="fp8", synchronous=synchronous,
                           trace_buckets=True)
    ddp.register_comm_hook(state, gt.geofp8_hook)
    for s in range(3):
        x = torch.randn(8, 2048, generator=torch.Generator().manual_seed(rank * 100 + s))
        ddp(x).square().mean().backward()
    return {"spans": spans, "trace": state.bucket_trace}


def multi_bucket_model():
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.LayerNorm(64), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    # Buckets of at most 4 KiB, the first one included (torch documents both knobs): each
    # 8-16 KiB weight in a bucket of its own, so buckets queue on the exchange thread while
    # backward runs.
    torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 4096
    return model, DDP(model, bucket_cap_mb=4096 / 2**20)


def train(rank, world, policy, synchronous):
    import torch
    import geofp8.torch as gt
    model, ddp = multi_bucket_model()
    state = gt.GeoFP8State(model=model, policy=policy, seed=3, synchronous=synchronous,
                           trace_buckets=True)
    ddp.register_comm_hook(state, gt.geofp8_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for s in range(STEPS):
        x, y = L.batch(rank, s)
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "bytes": state.stats["bytes_sent"], "refreshes": state.stats["refreshes"],
            "trace": state.bucket_trace}


def backward_error(rank, world, step1_policy=None, timeout_s=30.0, idle_rank=None):
    """Two steps of the multi-bucket model (DDP's step 0 has one bucket, later steps several),
    the second under `step1_policy` when given. Returns what step 1's backward() raised and
    what its bucket 0's Future (queued on the engine's thread, not the step's last) raises."""
    import geofp8.torch as gt
    model, ddp = multi_bucket_model()
    state = gt.GeoFP8State(model=model, policy="fp8", timeout_s=timeout_s)
    if step1_policy is not None:
        state.set_policy(step1_policy, effective_step=1)
    futures = {}

    def hook(st, bucket):
        fut = gt.geofp8_hook(st, bucket)
        futures[bucket.index()] = (fut, bucket.is_last())
        return fut

    ddp.register_comm_hook(state, hook)
    x, y = L.batch(rank, 0)
    ((ddp(x) - y) ** 2).mean().backward()
    x, y = L.batch(rank, 1)
    # Step 1's forward rebuilds DDP's buckets (a collective over torch's group): every rank.
    loss = ((ddp(x) - y) ** 2).mean()
    if rank == idle_rank:
        # Never exchanges: the peer's collectives run out of time (bucket 0's, then the last
        # bucket's). Wait for both to fail first, so this rank's engine is not torn down under
        # them.
        time.sleep(2 * timeout_s + 3.0)
        return None
    out = {}
    t0 = time.monotonic()
    try:
        loss.backward()
    except Exception as e:  # noqa: BLE001 - what reaches the caller is the test
        out["backward"] = "%s: %s" % (type(e).__name__, e)
    out["seconds"] = time.monotonic() - t0
    fut, last = futures.get(0, (None, True))
    out["bucket0_queued"] = not last
    try:
        if fut is not None:
            fut.wait()
    except Exception as e:  # noqa: BLE001
        out["bucket0"] = "%s: %s" % (type(e).__name__, e)
    return out


def nan_step(rank, world):
    import geofp8.torch as gt
    model, ddp = multi_bucket_model()
    state = gt.GeoFP8State(model=model, policy="fp8")
    ddp.register_comm_hook(state, gt.geofp8_hook)
    for s in range(2):  # step 1: several buckets
        x, y = L.batch(rank, s)
        if rank == 1 and s == 1:
            x[0, 0] = float("nan")
        ((ddp(x) - y) ** 2).mean().backward()
    return {"all_nan": all(bool(p.grad.isnan().all()) for p in model.parameters()),
            "skipped": state.last_step["skipped"],
            "skipped_buckets": state.stats["skipped_buckets"]}


def work(rank, world):
    import torch.distributed as dist
    out = {"overlap_async": overlap(rank, world, False),
           "overlap_sync": overlap(rank, world, True)}
    for name, policy in (("geofp8", "geofp8"), ("yaml", YAML_POLICY)):
        out["async_" + name] = train(rank, world, policy, False)
        out["sync_" + name] = train(rank, world, policy, True)
    out["nan"] = nan_step(rank, world)
    dist.barrier()
    # From step 1 rank 1 runs another policy (version 2): bucket 0's fingerprint differs.
    other = {"policy": {"default": {"format": "fp8_e4m3"},
                        "layers": [{"match": "7.*", "format": "nvfp4"}]}}
    out["fingerprint"] = backward_error(rank, world, None if rank == 0 else other)
    dist.barrier()
    out["timeout"] = backward_error(rank, world, timeout_s=2.0, idle_rank=1)
    return out


def intersect(a0, a1, b0, b1):
    return max(a0, b0) < min(a1, b1)


def main():
    L.require_torch()
    import torch
    results = L.spawn(2, work)
    failures = []
    for rank, r in enumerate(results):
        # 1. Overlap, every step after the first (step 0 includes DDP's bucket rebuild).
        for mode, expect in (("overlap_async", True), ("overlap_sync", False)):
            spans, trace = r[mode]["spans"], r[mode]["trace"]
            for step in (1, 2):
                b0 = [t for t in trace if t["step"] == step and t["bucket"] == 0]
                b1 = [t for t in trace if t["step"] == step and t["bucket"] == 1]
                if len(b0) != 1 or len(b1) != 1:
                    failures.append("rank %d %s step %d: trace has %d and %d records for "
                                    "buckets 0 and 1" % (rank, mode, step, len(b0), len(b1)))
                    continue
                s0, s1 = spans[step]
                ex0, ex1 = b0[0]["started"], b0[0]["finished"]
                inside = intersect(ex0, ex1, s0, s1)
                print("rank %d %s step %d: bucket 0 exchanged %.1f-%.1f ms, bucket 1's backward "
                      "%.1f-%.1f ms (from bucket 0's hook call): %s"
                      % (rank, mode, step, 1e3 * (ex0 - b0[0]["called"]),
                         1e3 * (ex1 - b0[0]["called"]), 1e3 * (s0 - b0[0]["called"]),
                         1e3 * (s1 - b0[0]["called"]), "overlap" if inside else "no overlap"))
                if inside != expect:
                    failures.append("rank %d %s step %d: overlap %s, expected %s"
                                    % (rank, mode, step, inside, expect))
                # The hook returned before the exchange finished (async) / after (sync).
                if (b0[0]["returned"] < ex1) != expect:
                    failures.append("rank %d %s step %d: hook returned at %.4f, exchange ended "
                                    "%.4f" % (rank, mode, step, b0[0]["returned"], ex1))
                # Bucket 1 was exchanged after bucket 0: submission order.
                if not b1[0]["started"] >= ex1:
                    failures.append("rank %d %s step %d: bucket 1 started before bucket 0 "
                                    "ended" % (rank, mode, step))
        # 2. The same bits.
        for name in ("geofp8", "yaml"):
            a, s = r["async_" + name], r["sync_" + name]
            diff = [n for n, w in a["weights"].items() if not torch.equal(w, s["weights"][n])]
            trace = a["trace"]
            per_step = min(sum(1 for t in trace if t["step"] == k) for k in range(1, STEPS))
            # A bucket handed over while the one before it was still being exchanged.
            queued = sum(1 for p, t in zip(trace, trace[1:])
                         if t["step"] == p["step"] and t["called"] < p["finished"])
            print("rank %d %s: async vs sync: %d of %d weights differ; bytes %d / %d; "
                  "refreshes %d / %d; >= %d buckets a step after step 0, %d handed over during the previous "
                  "one's exchange" % (rank, name, len(diff), len(a["weights"]), a["bytes"],
                                      s["bytes"], a["refreshes"], s["refreshes"], per_step,
                                      queued))
            if diff or a["bytes"] != s["bytes"] or a["refreshes"] != s["refreshes"]:
                failures.append("rank %d %s: async differs from sync (%s)" % (rank, name, diff))
            if per_step < 4:
                failures.append("rank %d %s: %d bucket(s) a step; the test needs several"
                                % (rank, name, per_step))
        # 3. Errors.
        n = r["nan"]
        print("rank %d NaN on rank 1: %s" % (rank, n))
        if not (n["all_nan"] and n["skipped"] and n["skipped_buckets"] >= 2):
            failures.append("rank %d: the NaN step did not come back as NaN buckets (%s)"
                            % (rank, n))
        f = r["fingerprint"]
        print("rank %d different policies: %s" % (rank, f))
        for key in ("backward", "bucket0"):
            msg = f.get(key, "")
            if "fingerprint mismatch in bucket 0 at step 1" not in msg or "policy version" \
                    not in msg:
                failures.append("rank %d: different policies: %s lacks bucket 0's fingerprint "
                                "mismatch naming the policy version (%s)" % (rank, key, f))
        if not f["bucket0_queued"]:
            failures.append("rank %d: bucket 0 was the step's last; its Future was not tested"
                            % rank)
    t = results[0]["timeout"]
    print("rank 0, peer idle: %s" % (t,))
    # Bucket 0's collective waits out the 2 s timeout, and backward() raises that root cause
    # (the last bucket is not exchanged after it); 2 s, and never a hang: 8 s leaves room for a
    # loaded machine.
    for key in ("backward", "bucket0"):
        if "Timed out" not in t.get(key, ""):
            failures.append("rank 0: an idle peer: %s lacks the timeout (%s)" % (key, t))
    if not t["seconds"] < 8.0:
        failures.append("rank 0: an idle peer: backward took %.1f s" % t["seconds"])
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
