#!/usr/bin/python3
"""What a geofp8.torch hook call costs outside the engine: the Python of geofp8_hook (bucket
checks, its layers and offsets, the result and the Future) and the binding around
Exchanger::Exchange. One process (a 1-rank gloo group, so no collective waits), examples/pytorch's
GPT under DDP with its default buckets, trained --steps steps; per hook call it takes the call's
wall time minus the engine's own time for it (the growth of state.stats["seconds"]) and prints
the median and minimum over the calls after the first 10 (docs/benchmarks.md, "Where a hook
call's time goes").

    PYTHONPATH=build/client/python /usr/bin/python3 bench/torch_hook_glue.py --steps 150
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "pytorch"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--policy", default="fp8")
    args = ap.parse_args()
    if args.steps < 12:
        ap.error("--steps: must be >= 12 (%d)" % args.steps)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    import train_gpt as T
    import geofp8.torch as gt
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="geofp8-glue-") as d:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "store"),
                                rank=0, world_size=1)
        torch.manual_seed(0)
        model = T.GPT(2, 128, 4, 64)
        ddp = DDP(model)
        state = gt.GeoFP8State(model=model, policy=args.policy)
        outside = []

        def hook(st, bucket):
            engine_before = st.stats["seconds"]
            t0 = time.perf_counter()
            fut = gt.geofp8_hook(st, bucket)
            outside.append(time.perf_counter() - t0 - (st.stats["seconds"] - engine_before))
            return fut

        ddp.register_comm_hook(state, hook)
        data = T.load_bytes("/usr/share/common-licenses/GPL-3")
        gen = torch.Generator().manual_seed(0)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        for _ in range(args.steps):
            x, y = T.get_batch(data, 8, 64, gen)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x).view(-1, 256), y.view(-1))
            loss.backward()
            opt.step()
        dist.destroy_process_group()
    calls = outside[10:]
    print("policy %s: hook time outside the engine per call: median %.1f us, min %.1f us "
          "(%d calls)" % (args.policy, 1e6 * statistics.median(calls), 1e6 * min(calls),
                          len(calls)))


if __name__ == "__main__":
    main()
