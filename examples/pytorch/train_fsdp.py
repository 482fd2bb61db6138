#!/usr/bin/env python3
"""A small Llama-style decoder (RMSNorm, causal attention, SwiGLU; byte tokens) trained with
FSDP2, `fully_shard` per block, its gradient reduce-scatter done by GeoFP8 (compress_fsdp) or by
FSDP2's own for comparison. CPU and gloo; torch >= 2.9.

    PYTHONPATH=build/client/python torchrun --nproc_per_node 2 \\
        examples/pytorch/train_fsdp.py --policy geofp8
    torchrun --nproc_per_node 2 examples/pytorch/train_fsdp.py --policy native

Each log line gives the loss, the step time and, under GeoFP8, the wire bytes as a share of an
fp32 reduce-scatter's (FSDP2's own at --reduce-dtype float32). docs/pytorch.md, "FSDP2".
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


def batches(path, batch, seq, rank, seed):
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    if data.numel() < seq + 2:
        sys.exit("--data: %s has %d bytes; need at least %d" % (path, data.numel(), seq + 2))
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    while True:
        ix = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        yield (torch.stack([data[i:i + seq] for i in ix]),
               torch.stack([data[i + 1:i + seq + 1] for i in ix]))


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
    ap.add_argument("--summary-every", type=int, default=0,
                    help="measure each layer's exchange error every N steps and print the "
                         "worst layers (one extra fp32 all-reduce on those steps; 0: never)")
    args = ap.parse_args()
    if args.summary_every < 0:
        ap.error("--summary-every: must be >= 0 (%d)" % args.summary_every)
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
                                           summary_every=args.summary_every)
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print("llama: %d layers, d_model %d, %.2fM parameters, %d ranks, reduce %s, policy %s"
              % (args.layers, args.d_model, params / 1e6, world, args.reduce_dtype, args.policy),
              flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(args.data, args.batch, args.seq, rank, args.seed)
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = next(data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if state is not None:
            summary = state.layer_summary(state.report(loss))
            if rank == 0 and summary:
                print(summary, flush=True)
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
    if state is not None:
        state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
