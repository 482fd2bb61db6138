#!/usr/bin/python3
"""A small GPT (byte tokens) trained with plain torch DDP, its gradients averaged by GeoFP8's
comm hook or by one of torch's own hooks for comparison.

    PYTHONPATH=build/client/python torchrun --redirects 1:1 --tee 1:1 --nproc_per_node 2 \\
        examples/pytorch/train_gpt.py --policy geofp8
    torchrun --redirects 1:1 --tee 1:1 --nproc_per_node 2 examples/pytorch/train_gpt.py --hook fp16
    PYTHONPATH=build/client/python /usr/bin/python3 examples/pytorch/train_gpt.py --nproc 2

(--redirects/--tee: Debian's torchrun 1.13 fails on Python 3.11 with its defaults; --nproc
starts the ranks itself, with torchrun's environment, when torchrun is not used.)

CPU and gloo (Debian's python3-torch). docs/pytorch.md explains the hook and the policy.
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
from torch.nn.parallel import DistributedDataParallel as DDP

HOOKS = ("geofp8", "ddp", "fp16", "bf16", "powersgd")


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level decoder: parameter names like blocks.0.qkv.weight, for policy globs."""

    def __init__(self, layers=2, d=128, heads=4, seq=64):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def load_bytes(path):
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    if data.numel() < 1024:
        sys.exit("--data: %s has %d bytes; need at least 1024" % (path, data.numel()))
    return data


def get_batch(data, batch, seq, gen):
    ix = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    x = torch.stack([data[i:i + seq] for i in ix])
    y = torch.stack([data[i + 1:i + seq + 1] for i in ix])
    return x, y


def waited(hook):
    """`hook` with its future waited for inside the call. Registered directly, torch 1.13's
    PowerSGD hook aborted the process on CPU gloo at its first compressed step in our runs
    (gloo::EnforceNotMet in a chained all-reduce); waiting inside the call keeps the same
    arithmetic and lets one bucket's collectives finish before the next bucket's start."""
    def run(state, bucket):
        out = hook(state, bucket).wait()
        fut = torch.futures.Future()
        fut.set_result(out[0] if isinstance(out, list) else out)
        return fut
    return run


def register_hook(ddp, model, args):
    """Registers the chosen hook; returns the GeoFP8 state (or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if args.hook == "ddp":
        return None
    if args.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif args.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, waited(powerSGD_hook.powerSGD_hook))
    else:
        import geofp8.torch as gt
        state = gt.GeoFP8State(model=model, policy=args.policy, seed=args.seed)
        ddp.register_comm_hook(state, gt.geofp8_hook)
        return state
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hook", choices=HOOKS, default="geofp8")
    ap.add_argument("--policy", default="geofp8",
                    help="geofp8 hook: preset (fp32, bf16, fp8, geofp8, nvfp4, geonvfp4, fp8-ef, nvfp4-ef) or "
                         "policy YAML file")
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--data", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=50,
                    help="validation loss on the held-out last 10%% of --data every this many "
                         "steps and after the last (0: after the last only)")
    ap.add_argument("--eval-batches", type=int, default=4,
                    help="held-out batches per rank per validation")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="save model, optimizer and hook state every K steps into "
                         "GEOFP8_CHECKPOINT_DIR (under a GeoFP8 job) or --checkpoint-dir; a "
                         "restarted job resumes from the last one")
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds to sleep per step (tests: time to act mid-run)")
    ap.add_argument("--nproc", type=int, default=0,
                    help="without torchrun: start this many ranks on this host")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps: must be >= 1 (%d)" % args.steps)
    if args.eval_every < 0:
        ap.error("--eval-every: must be >= 0 (%d)" % args.eval_every)
    if args.eval_batches < 1:
        ap.error("--eval-batches: must be >= 1 (%d)" % args.eval_batches)
    if args.d_model % 4:
        ap.error("--d-model: must be a multiple of 4 heads (%d)" % args.d_model)

    if args.nproc and "RANK" not in os.environ:
        if args.nproc < 1:
            ap.error("--nproc: must be >= 1 (%d)" % args.nproc)
        import socket
        import torch.multiprocessing as mp
        with socket.socket() as s:  # a free port for torch's TCPStore
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(run_rank, args=(args, port), nprocs=args.nproc, join=True)
        return
    train(args)


def run_rank(rank, args, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                      LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    train(args)


def validate(model, data, args, rank, world):
    """Mean cross-entropy over every rank's --eval-batches held-out batches (the same batches at
    every validation: a generator seeded by the rank), averaged over the ranks."""
    gen = torch.Generator().manual_seed(10007 * (args.seed + 1) + rank)
    total = 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for _ in range(args.eval_batches):
            x, y = get_batch(data, args.batch, args.seq, gen)
            total += float(F.cross_entropy(model(x).view(-1, 256), y.view(-1)))
    model.train(was_training)
    mean = torch.tensor([total / args.eval_batches], dtype=torch.float64)
    dist.all_reduce(mean)
    return float(mean) / world


def checkpoint_path(directory, rank, step):
    return os.path.join(directory, "rank%d.step%d.pt" % (rank, step))


def train(args):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_bytes(args.data)
    # The last 10% is held out for validation, the rest is trained on.
    split = data.numel() * 9 // 10
    data, held_out = data[:split], data[split:]
    if held_out.numel() < args.seq + 2:
        sys.exit("--data: %s holds too few bytes to hold out %d-byte validation sequences"
                 % (args.data, args.seq))
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT(args.layers, args.d_model, 4, args.seq)
    ddp = DDP(model)
    state = register_hook(ddp, model, args)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        what = "geofp8 (policy %s)" % args.policy if args.hook == "geofp8" else args.hook
        print("GPT: %d layers, d=%d, %d parameters; %d ranks; hook %s"
              % (args.layers, args.d_model, n, world, what), flush=True)
    ckpt_dir = args.checkpoint_dir or (state.checkpoint_dir if state is not None else None)
    if ckpt_dir and args.checkpoint_every > 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    first = 0
    resume = state.resume_step if state is not None else 0
    if resume > 0:
        # A restarted GeoFP8 job: every rank loads its own file of the recovery point.
        saved = torch.load(checkpoint_path(ckpt_dir, rank, resume))
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["geofp8"])
        gen.set_state(saved["generator"])
        first = resume
        print("rank %d: resumed from step %d" % (rank, resume), flush=True)
    start = time.perf_counter()
    for step in range(first, args.steps):
        x, y = get_batch(data, args.batch, args.seq, gen)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x).view(-1, 256), y.view(-1))
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        val = None
        if (args.eval_every and (step + 1) % args.eval_every == 0) or step == args.steps - 1:
            val = validate(model, held_out, args, rank, world)
            if rank == 0:
                print("step %4d  val_loss %.4f" % (step, val), flush=True)
        if state is not None:
            # To the coordinator under a GeoFP8 job (step, loss, bytes, step time, layer errors,
            # validation loss).
            state.report(loss, tokens=args.batch * args.seq, val_loss=val)
        if args.checkpoint_every and ckpt_dir and (step + 1) % args.checkpoint_every == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "geofp8": state.state_dict() if state is not None else None,
                        "generator": gen.get_state()},
                       checkpoint_path(ckpt_dir, rank, step + 1))
            dist.barrier()  # every rank's file is written before the recovery point moves
            if state is not None:
                state.report_checkpoint(step + 1, checkpoint_path(ckpt_dir, rank, step + 1))
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            extra = ""
            if state is not None:
                extra = "  wire %d B/rank" % state.last_step["bytes_sent"]
            print("step %4d  loss %.4f  %.1f ms%s" % (step, loss.item(), dt * 1e3, extra),
                  flush=True)
    if rank == 0:
        print("done: %d steps in %.1f s" % (args.steps, time.perf_counter() - start), flush=True)
    # Drop the DDP module and the hook state (torch's PowerSGD state holds work on the group)
    # before the group goes.
    dist.barrier()
    if state is not None:
        state.close()
    del ddp, state, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
