"""geofp8.torch with a parameter used on some ranks only (issue #40 item 6): DDP without
find_unused_parameters=True holds the bucket back on the rank that skipped it, and the rank
waiting in that bucket's exchange fails within seconds, not at the timeout (300 s by default),
with an error naming the bucket's layers, the rank and find_unused_parameters. Two gloo ranks,
the default timeout; one model in a single bucket (the skipping rank hands the hook nothing in
that step) and one in several buckets (it hands over the buckets before the held one).

A rank that is only late (rank 1 starting its backward 6 s after rank 0, after a no_sync()
micro-batch) raises nothing.

The skipping rank then waits in a torch collective (the all-reduce of its loss, say), the case
where nothing else would end the wait: the waiting rank joins that collective once its backward
has failed, so both finish."""

import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_testlib as L  # noqa: E402

SKIP_STEP = 1  # step 0 uses every parameter on both ranks (DDP rebuilds its buckets after it)
BOUND_S = 30  # well below the 300 s default timeout, generous for a loaded machine


def run(rank, world, buckets):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import geofp8.torch as gt

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 32)
            self.skipped = torch.nn.Linear(32, 32)
            self.head = torch.nn.Linear(32, 4)

        def forward(self, x, skip):
            h = torch.tanh(self.a(x))
            if not skip:
                h = torch.tanh(self.skipped(h))
            return self.head(h)

    torch.manual_seed(0)
    model = Net()
    if buckets == "several":
        # torch 1.13: head in bucket 0 (528 bytes fill the first bucket's 512), then skipped,
        # then a: the skipping rank hands bucket 0 over, then holds bucket 1 back.
        torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 512
        ddp = DDP(model, bucket_cap_mb=4096 / 2**20)
    else:
        ddp = DDP(model)
    state = gt.GeoFP8State(model=model, policy="fp8")
    ddp.register_comm_hook(state, gt.geofp8_hook)
    error, took = None, None
    for step in range(SKIP_STEP + 1):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = ddp(x, skip=(rank == 1 and step == SKIP_STEP)).pow(2).mean()
        started = time.monotonic()
        try:
            loss.backward()
        except RuntimeError as e:
            error, took = str(e), time.monotonic() - started
            break
    # Rank 1's backward returned with the bucket held back; here it waits for rank 0.
    dist.all_reduce(torch.zeros(1))
    return {"error": error, "took": took, "step": step}


def slow_peer(rank, world):
    """No false alarm: every parameter used, a no_sync() micro-batch before each synced one (its
    pass is posted: no bucket), and rank 1 starting its synced backward 3 * _WATCH_AFTER_S late,
    so rank 0 waits in the first bucket well past the point where the watch reads the posts."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    import geofp8.torch as gt
    torch.manual_seed(0)
    model = L.tiny_model()
    ddp = DDP(model)
    state = gt.GeoFP8State(model=model, policy="fp8")
    ddp.register_comm_hook(state, gt.geofp8_hook)
    error = None
    for step in range(2):
        x, y = L.batch(rank, step)
        with ddp.no_sync():
            ((ddp(x) - y) ** 2).mean().backward()
        loss = ((ddp(x) - y) ** 2).mean()
        if rank == 1:
            time.sleep(3 * gt._WATCH_AFTER_S)
        try:
            loss.backward()
        except RuntimeError as e:
            error = str(e)
            break
    return {"error": error, "waited": state._watch.passes}


def work(rank, world):
    # One group for the three cases (torch's import is most of the time): the late peer first,
    # the held buckets after it (rank 0's engines end aborted).
    return {"slow": slow_peer(rank, world), "one": run(rank, world, "one"),
            "several": run(rank, world, "several")}


def main():
    L.require_torch()
    failures = []
    results = L.spawn(2, work)
    for rank, r in enumerate(r["slow"] for r in results):
        print("slow peer: rank %d: %s" % (rank, r))
        if r["error"] is not None:
            failures.append("slow peer: rank %d's backward failed: %s" % (rank, r["error"]))
        if r["waited"] != 4:
            failures.append("slow peer: rank %d counted %d backward passes, not 4"
                            % (rank, r["waited"]))
    for buckets in ("one", "several"):
        r0, r1 = (r[buckets] for r in results)
        print("%s bucket(s): rank 0 %s after %s s: %s" % (buckets, "failed" if r0["error"]
                                                          else "did not fail", r0["took"],
                                                          (r0["error"] or "")[:400]))
        what = "%s bucket(s)" % buckets
        if r0["error"] is None:
            failures.append("%s: rank 0's backward did not fail" % what)
            continue
        if r0["step"] != SKIP_STEP:
            failures.append("%s: rank 0 failed at step %d, not %d" % (what, r0["step"],
                                                                      SKIP_STEP))
        if not r0["took"] < BOUND_S:
            failures.append("%s: rank 0 failed after %.1f s (bound %d s)" % (what, r0["took"],
                                                                          BOUND_S))
        # The held bucket's layers: all six in one bucket; in several, skipped's without a's
        # (torch 1.13 puts head in a bucket of its own before it, torch 2.x head with skipped).
        held = re.search(r"bucket (\d+) \(([^)]*)\)", r0["error"])
        layers = held.group(2).split(", ") if held else []
        if "skipped.weight" not in layers or (len(layers) == 6) != (buckets == "one"):
            failures.append("%s: rank 0's error names the held bucket's layers as %s"
                            % (what, layers))
        for needle in ("find_unused_parameters=True", "rank 1 ended backward pass 2",
                       "rank 0 waits for in step 1"):
            if needle not in r0["error"]:
                failures.append("%s: rank 0's error lacks %r: %s" % (what, needle,
                                                                      r0["error"]))
        if r1["error"] is not None:
            failures.append("%s: rank 1's backward failed: %s" % (what, r1["error"]))
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
