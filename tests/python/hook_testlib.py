"""Shared by the geofp8.torch tests: skip without torch, spawn ranks over a FileStore, a tiny
model and its data."""

import os
import sys
import tempfile

SKIP = 77  # ctest SKIP_RETURN_CODE


def require_torch():
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
    except ImportError as e:
        print("SKIP: torch is not installed (%s); apt-get install python3-torch" % e)
        sys.exit(SKIP)
    try:
        import geofp8.torch  # noqa: F401
    except ImportError as e:
        print("FAIL: geofp8 is not importable (%s); set PYTHONPATH=<build>/client/python" % e)
        sys.exit(1)


def _entry(rank, world, store_path, out_dir, fn, args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store_path, rank=rank,
                            world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, "rank%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def spawn(world, fn, *args):
    """Runs fn(rank, world, *args) on `world` processes in one gloo group; returns the list of
    their results (rank order)."""
    import torch
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="geofp8-pytest-") as d:
        store = os.path.join(d, "store")
        mp.spawn(_entry, args=(world, store, d, fn, args), nprocs=world, join=True)
        # The ranks' own results (any picklable value): torch >= 2.6 loads only weights by default.
        return [torch.load(os.path.join(d, "rank%d.pt" % r), weights_only=False)
                for r in range(world)]


def exit_with_failures(world, fn):
    """For a test whose fn(rank, world) returns a list of failure messages: skips without torch,
    runs it on `world` ranks, prints rank 0's failures and exits 1 if there are any."""
    require_torch()
    failures = spawn(world, fn)[0]
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


def tiny_model(seed=0):
    """A two-layer MLP with a LayerNorm: two matrices for geometry, 1-D gains and biases."""
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 16))


def batch(rank, step, n=32):
    """Rank- and step-dependent regression data from a fixed teacher (the same on every run)."""
    import torch
    g = torch.Generator().manual_seed(1000 + 17 * step + rank)
    x = torch.randn(n, 32, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(32, 16, generator=teacher) / 4
    y = torch.tanh(x @ w)
    return x, y
