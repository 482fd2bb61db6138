#!/usr/bin/env python3
"""A small Llama-style decoder (RMSNorm, causal attention, SwiGLU; byte tokens) trained with
FSDP2, `fully_shard` per block, its gradient reduce-scatter done by GeoFP8 (compress_fsdp) or by
FSDP2's own for comparison. CPU and gloo; torch >= 2.9.

    PYTHONPATH=build/client/python torchrun --nproc_per_node 2 \\
        examples/pytorch/train_fsdp.py --policy geofp8
    torchrun --nproc_per_node 2 examples/pytorch/train_fsdp.py --policy native

Each log line gives the loss, the step time and, under GeoFP8, the wire bytes as a share of an
fp32 reduce-scatter's (FSDP2's own at --reduce-dtype float32). --checkpoint-every K saves the
model, optimizer and GeoFP8 state with torch.distributed.checkpoint. The same script runs as a
GeoFP8 `command:` job (live policies, per-layer errors, restarts from its checkpoints).
docs/pytorch.md, "FSDP2".
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        hidden = 256 * math.ceil(8 * d / 3 / 256)  # Llama's SwiGLU width, rounded
        self.attn_norm = RMSNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Parameter names like layers.0.wq.weight, for policy globs."""

    def __init__(self, layers, d, heads):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.out = nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


def batches(path, batch, seq, gen):
    """Random sequences of the file's bytes, drawn with `gen` (this rank's: a checkpoint keeps
    its state, so a resumed run draws what the uninterrupted one would)."""
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    if data.numel() < seq + 2:
        sys.exit("--data: %s has %d bytes; need at least %d" % (path, data.numel(), seq + 2))
    while True:
        ix = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        yield (torch.stack([data[i:i + seq] for i in ix]),
               torch.stack([data[i + 1:i + seq + 1] for i in ix]))


def checkpoint_dict(model, opt, state, gen, rank):
    """What a checkpoint holds, for torch.distributed.checkpoint (docs/pytorch.md, "Checkpoints
    with torch.distributed.checkpoint"): the sharded model and optimizer, this rank's data
    generator under its rank's key, and the GeoFP8 state itself, which DCP saves and restores
    through its state_dict() and load_state_dict() (its residuals are per rank, keyed so)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    m, o = get_state_dict(model, opt)
    sd = {"model": m, "optim": o, "data": {str(rank): gen.get_state()}}
    if state is not None:
        sd["geofp8"] = state
    return sd


def timing(state, first, end, world, rank):
    """The 'timing:' line of --timing, over steps [first, end): the GeoFP8 reduce-scatters' time
    per step, split at the moment the last rank called (what a rank waited for a slower one,
    which FSDP2's own reduce-scatter waits too, and what the exchange took after it), and an fp32
    reduce-scatter of the same tensors in this run, each call after a barrier. The split compares
    time.monotonic() across processes, so the ranks must share a host."""
    import statistics
    calls = [r for r in state.bucket_trace if first <= r["step"] < end]
    if not calls:
        raise SystemExit("--timing: no reduce-scatter after the warm-up steps (steps %d to %d); "
                         "run at least 3 steps" % (first, end - 1))
    every = [None] * world
    dist.all_gather_object(every, [(r["started"], r["finished"]) for r in calls])
    steps = max(1, end - first)
    waited = after = 0.0
    for k, (started, finished) in enumerate(every[rank]):
        last = max(e[k][0] for e in every)
        waited += last - started
        after += finished - last
    # The baseline: the last step's reduce-scatters again, fp32, FSDP's sizes, 5 times.
    sizes = [r["numel"] for r in calls if r["step"] == end - 1]
    # What the baseline puts on the wire, where the interface is known (bench/fsdp_netem.sh).
    tx_path = "/sys/class/net/%s/statistics/tx_bytes" % os.environ.get("GLOO_SOCKET_IFNAME", "-")
    tx = (lambda: int(open(tx_path).read())) if os.path.exists(tx_path) else (lambda: 0)
    tx0 = tx()
    reps = []
    for _ in range(5):
        total = 0.0
        for n in sizes:
            x, out = torch.randn(n), torch.empty(n // world)
            dist.barrier()
            t0 = time.perf_counter()
            dist.reduce_scatter_tensor(out, x)
            total += time.perf_counter() - t0
        reps.append(total)
    fp32 = statistics.median(reps)
    # Sent per step by the baseline, against an fp32 reduce-scatter's 4 (N-1)/N bytes per element.
    sent = (tx() - tx0) / 5 / max(1, 4 * (world - 1) / world * sum(sizes))
    row = torch.tensor([waited / steps, after / steps, fp32, sent], dtype=torch.float64)
    dist.all_reduce(row)
    waited, after, fp32, sent = (row / world).tolist()
    # A reduce-scatter's bytes at the link's rate as the baseline met it (gloo's fp32
    # reduce-scatter sends about twice those bytes: `sent`); GeoFP8's share of those bytes.
    rs = fp32 / sent if sent > 0 else fp32
    ratio = state.stats["bytes_sent"] / max(1, state.stats["bytes_baseline"])
    beyond = after - ratio * rs
    if rank == 0:
        print("timing: GeoFP8 exchange %.3f s/step: %.3f waiting for the last rank to call, %.3f "
              "after it; fp32 reduce-scatter of the same tensors %.3f s/step (median of 5, this "
              "run), %.2fx a reduce-scatter's bytes on the wire, so a reduce-scatter's bytes take "
              "%.3f s; GeoFP8 sends %.3f of those bytes; beyond them: %.3f s/step, %.3f of a "
              "reduce-scatter" % (waited + after, waited, after, fp32, sent, rs, ratio, beyond,
                                  beyond / rs), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="geofp8",
                    help="a GeoFP8 preset, YAML path or text (docs/pytorch.md), or 'native' for "
                         "FSDP2's own reduce-scatter")
    ap.add_argument("--reduce-dtype", choices=("float32", "bfloat16", "float16"),
                    default="float32", help="MixedPrecisionPolicy(reduce_dtype=...)")
    ap.add_argument("--data", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--init-method", default="env://",
                    help="torch.distributed's rendezvous (env:// under torchrun; a file:// URL "
                         "with RANK and WORLD_SIZE set, as bench/fsdp_netem.sh runs it)")
    ap.add_argument("--summary-every", type=int, default=None,
                    help="measure each layer's exchange error every N steps and print the "
                         "worst layers (one extra fp32 all-reduce on those steps; 0: never; "
                         "default: every 10 steps under a GeoFP8 job, which reports them, else "
                         "never)")
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="save model, optimizer, data position and GeoFP8 state with "
                         "torch.distributed.checkpoint every K steps into --checkpoint-dir "
                         "(default: GEOFP8_CHECKPOINT_DIR under a GeoFP8 job; every rank must "
                         "see the same directory); a restarted job resumes from the last one")
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--timing", action="store_true",
                    help="time each GeoFP8 reduce-scatter (all ranks on one host: their clocks "
                         "agree), and an fp32 reduce-scatter of the same tensors after training; "
                         "prints a 'timing:' line (bench/fsdp_netem.sh)")
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds to sleep per step (tests: time to act mid-run)")
    args = ap.parse_args()
    for name in ("summary_every", "checkpoint_every"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            ap.error("--%s: must be >= 0 (%d)" % (name.replace("_", "-"), getattr(args, name)))
    for name in ("steps", "batch", "seq", "layers", "d_model", "heads", "log_every", "threads"):
        if getattr(args, name) < 1:
            ap.error("--%s: must be >= 1 (%d)" % (name.replace("_", "-"), getattr(args, name)))
    if args.d_model % args.heads:
        ap.error("--d-model: must be a multiple of --heads (%d, %d)" % (args.d_model, args.heads))

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.set_num_threads(args.threads)
    if args.init_method == "env://":
        dist.init_process_group("gloo")
    else:
        for var in ("RANK", "WORLD_SIZE"):
            if not os.environ.get(var, "").isdigit():
                ap.error("--init-method %s: set %s (%r)" % (args.init_method, var,
                                                            os.environ.get(var)))
        dist.init_process_group("gloo", init_method=args.init_method,
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = Llama(args.layers, args.d_model, args.heads)
    mp = MixedPrecisionPolicy(reduce_dtype=getattr(torch, args.reduce_dtype))
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    state = None
    if args.policy != "native":
        import geofp8.torch
        state = geofp8.torch.compress_fsdp(model, policy=args.policy, seed=args.seed,
                                           summary_every=args.summary_every,
                                           trace_buckets=args.timing)
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print("llama: %d layers, d_model %d, %.2fM parameters, %d ranks, reduce %s, policy %s"
              % (args.layers, args.d_model, params / 1e6, world, args.reduce_dtype, args.policy),
              flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    data = batches(args.data, args.batch, args.seq, gen)
    ckpt_dir = args.checkpoint_dir or (state.checkpoint_dir if state is not None else None)
    first = state.resume_step if state is not None else 0
    if first > 0:
        # A restarted GeoFP8 job: every rank loads the recovery point; DCP calls
        # state.load_state_dict, and reshards the model and optimizer.
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        sd = checkpoint_dict(model, opt, state, gen, rank)
        dcp.load(sd, checkpoint_id=os.path.join(ckpt_dir, "step%d" % first))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        gen.set_state(sd["data"][str(rank)])
        print("rank %d: resumed from step %d" % (rank, first), flush=True)
    times = []
    for step in range(first, args.steps):
        t0 = time.perf_counter()
        x, y = next(data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if state is not None:
            # To the coordinator under a GeoFP8 job (step, loss, bytes, layer errors).
            summary = state.layer_summary(state.report(loss, tokens=args.batch * args.seq))
            if rank == 0 and summary:
                print(summary, flush=True)
        if args.checkpoint_every and ckpt_dir and (step + 1) % args.checkpoint_every == 0:
            import torch.distributed.checkpoint as dcp
            path = os.path.join(ckpt_dir, "step%d" % (step + 1))
            # A collective: when it returns, every rank's part and the metadata are written.
            dcp.save(checkpoint_dict(model, opt, state, gen, rank), checkpoint_id=path)
            if state is not None:
                state.report_checkpoint(step + 1, path)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            wire = ""
            if state is not None and state.stats["bytes_baseline"]:
                wire = ", wire %.3f of an fp32 reduce-scatter's bytes" % (
                    state.stats["bytes_sent"] / state.stats["bytes_baseline"])
            print("step %d loss %.4f, %.3f s/step (median so far)%s"
                  % (step, loss.item(), sorted(times)[len(times) // 2], wire), flush=True)
    dist.barrier()
    if rank == 0:
        # The bench's line: the median step after the first two (warm-up), and the exchange's
        # own seconds per step (GeoFP8's engine time; FSDP2's own is not measured here).
        tail = sorted(times[2:] or times)
        ex = (state.stats["seconds"] / args.steps) if state is not None else float("nan")
        print("result: policy %s, %d ranks, %.2fM parameters: median step %.3f s, exchange "
              "%.3f s/step, wire %s" % (args.policy, world, params / 1e6, tail[len(tail) // 2],
                                        ex, "%.3f of fp32" % (state.stats["bytes_sent"] /
                                                             state.stats["bytes_baseline"])
                                        if state is not None and state.stats["bytes_baseline"]
                                        else "fp32 (FSDP2's own)"), flush=True)
    if args.timing and state is not None:
        timing(state, first + 2, args.steps, world, rank)
    if state is not None:
        state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
