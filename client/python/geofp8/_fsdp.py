"""geofp8.torch.compress_fsdp: GeoFP8's exchange as FSDP2's gradient reduce-scatter.

    model = ...                                   # fully_shard(block) per block, then the root
    state = geofp8.torch.compress_fsdp(model, policy="geofp8")

FSDP2 (torch >= 2.9) reduces each FSDP module's gradients with one reduce-scatter of a flat
input laid out by `torch._chunk_cat`: viewed as (world_size, -1), row r holds the r-th dim-0 chunk
of every parameter of the module, each zero-padded to a multiple of world_size rows. The
`ReduceScatter` installed here (FSDPModule.set_custom_reduce_scatter, on every FSDP module)
gathers each layer's chunks back into the layer's full gradient, averages the layers over the
ranks with the same engine, policy schema, geometry and error feedback as the DDP hook (each
layer's state keyed by its parameter name), and writes this rank's rows into FSDP's output.

What this costs (docs/pytorch.md, "FSDP2"): the layers travel as the engine's
reduce-scatter (ExchangeEngine::ReduceScatter: chunk r of every layer, quantized after its
geometry and error feedback, to rank r, which sums its rows in fp32), about (N-1)/N bytes per
gradient element at fp8, a quarter of an fp32 reduce-scatter's 4(N-1)/N. A lowrank layer adds a
k x n fp32 all-reduce for its inverse, and on the steps its geometry refreshes it is all-reduced
instead (the refresh reads the whole average). CUDA tensors take the same reduce-scatter on the
engine's device plane. Each rank keeps its error-feedback residual at the layer's full size
(fp32, N times its shard).
"""

import math
import time

import torch
import torch.distributed as dist

from . import torch as _gt

__all__ = ["GeoFP8FSDPState", "compress_fsdp"]

_comm_class = None  # _GeoFP8ReduceScatter as torch's ReduceScatter (made on first use)
_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OLD_TORCH = (
    "torch %s has no FSDP2 custom reduce-scatter (FSDPModule.set_custom_reduce_scatter arrived "
    "in torch 2.9); upgrade torch, or use the DDP hook (geofp8.torch.GeoFP8State with "
    "DistributedDataParallel.register_comm_hook), which works from torch 1.13")


def _fsdp_api():
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except Exception as e:  # noqa: BLE001 - torch 1.13's fsdp fails to import on Python 3.11
        raise RuntimeError((_OLD_TORCH % torch.__version__) + " (importing FSDP2: %s: %s)"
                           % (type(e).__name__, e)) from None
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(_OLD_TORCH % torch.__version__)
    return FSDPModule, ReduceScatter


class GeoFP8FSDPState(_gt.GeoFP8State):
    """The state behind compress_fsdp: a GeoFP8State whose layers are the model's unsharded
    parameters (rows = dim 0), stepped by FSDP's reduce-scatters. Its wire bytes are compared
    with an fp32 reduce-scatter's, (N-1)/N x 4 bytes per gradient element."""

    _watch_buckets = False  # DDP's unused-bucket watch; FSDP2 reduces what has gradients

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        size = self.world_size
        self._fsdp_full = torch.zeros(0)
        self._fsdp_rows = torch.zeros(0)  # this rank's rows of a module's layers
        self._baseline_per_float = (size - 1) / size * 4.0 if size > 1 else 0.0

    def _end_step(self):
        # The autograd engine's callback at the end of the backward pass that reduced.
        if self._in_step:
            self.step += 1
            self._in_step = False


class _Layout:
    """Where each layer's chunks sit in one reduce-scatter: per layer (in FSDP's order) its
    index, element count, chunk size q (ceil(rows / N) rows) and offset o in a row of the
    (N, -1) input; the full buffer holds layer p's padded gradient (N x q) at N * o."""

    def __init__(self, state, fsdp_params, world):
        self.layers, self.sizes, self.chunks, self.row_offsets = [], [], [], []
        self.key = tuple(map(id, fsdp_params))
        o = 0
        for fp in fsdp_params:
            i = state._index.get(id(fp.sharded_param))
            if i is None:
                raise ValueError("model: FSDP parameter %s is not among the parameters of the "
                                 "model given to compress_fsdp" % _param_name(fp))
            shape = tuple(fp._orig_size)
            rows = int(shape[0]) if shape else 1
            cols = math.prod(shape[1:]) if shape else 1
            q = -(-rows // world) * cols
            self.layers.append(i)
            self.sizes.append(rows * cols)
            self.chunks.append(q)
            self.row_offsets.append(o)
            o += q
        self.row = o
        self.full_offsets = [world * x for x in self.row_offsets]


def _param_name(fp):
    info = getattr(fp, "_module_info", None)
    return repr(getattr(info, "param_name", "?"))


class _GeoFP8ReduceScatter:
    """FSDP2's ReduceScatter for one FSDP module (made by compress_fsdp)."""

    def __init__(self, state, module_name, group):
        self.state = state
        self.module_name = module_name
        self.group = group
        self.pending = None  # the parameters with gradients in the coming call
        self.layouts = {}

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def _layout(self, world):
        params = self.pending if self.pending is not None else self.group.fsdp_params
        self.pending = None
        key = tuple(map(id, params))
        hit = self.layouts.get(key)
        if hit is None:
            hit = self.layouts[key] = _Layout(self.state, params, world)
        return hit

    def _note(self, started, result, input_tensor):
        """trace_buckets=True: one record per reduce-scatter in state.bucket_trace."""
        if self.state.bucket_trace is not None:
            self.state.bucket_trace.append({
                "step": self.state.step, "module": self.module_name,
                "numel": input_tensor.numel(), "element_size": input_tensor.element_size(),
                "started": started, "finished": time.monotonic(),
                "bytes_sent": result["bytes_sent"], "skipped": result["skipped"]})

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        state = self.state
        world, rank = state.world_size, state.rank
        if group is not None and (group.size() != world or dist.get_rank(group) != rank):
            raise RuntimeError("process_group: module %s reduces over %d ranks (rank %d), the "
                               "GeoFP8 state over %d (rank %d)" % (self.module_name,
                                                                   group.size(),
                                                                   dist.get_rank(group), world,
                                                                   rank))
        if input_tensor.dtype not in _REDUCE_DTYPES:
            raise TypeError("reduce_dtype: module %s reduces %s gradients; GeoFP8 takes float32, "
                            "bfloat16 or float16" % (self.module_name, input_tensor.dtype))
        if input_tensor.device != state.device:
            raise RuntimeError("device: module %s reduces on %s; the GeoFP8 state was made for "
                               "%s" % (self.module_name, input_tensor.device, state.device))
        kind = getattr(op, "op", op)
        if kind == dist.ReduceOp.AVG:
            scale = 1.0
        elif kind == dist.ReduceOp.SUM:
            scale = float(world)
        elif kind == dist.ReduceOp.PREMUL_SUM:
            scale = float(world) * float(op.factor)
        else:
            raise ValueError("op: module %s asks for a %s reduce-scatter; GeoFP8 takes AVG, SUM "
                             "and PREMUL_SUM" % (self.module_name, kind))
        lay = self._layout(world)
        if input_tensor.numel() != world * lay.row or output_tensor.numel() != lay.row:
            raise RuntimeError(
                "module %s: a reduce-scatter of %d elements into %d, where its parameters with "
                "gradients (%d) lay out %d x %d" % (self.module_name, input_tensor.numel(),
                                                    output_tensor.numel(), len(lay.layers), world,
                                                    lay.row))
        end_here = False
        if not state._in_step:
            state._begin_step()
            try:
                torch.autograd.Variable._execution_engine.queue_callback(state._end_step)
            except RuntimeError:  # called outside a backward pass: a step of its own
                end_here = True
        # One buffer for every module of the state (they reduce one at a time), the size of the
        # largest module's unsharded gradients, in the gradients' dtype (the engine reads
        # bfloat16 and float16 as they are, on the host and on the device).
        dtype = input_tensor.dtype
        if state._fsdp_full.numel() < world * lay.row or state._fsdp_full.dtype != dtype:
            state._fsdp_full = torch.zeros(world * lay.row, dtype=dtype, device=state.device)
        full = state._fsdp_full[:world * lay.row]
        rows = input_tensor.view(world, lay.row)
        # Layer p's chunks, row after row, are its padded gradient.
        for o, fo, q in zip(lay.row_offsets, lay.full_offsets, lay.chunks):
            full[fo:fo + world * q].view(world, q).copy_(rows[:, o:o + q])
        exact = _gt._exact_average(state, full) if state._measure else None
        out = output_tensor.view(lay.row)
        # The engine's reduce-scatter: each layer's chunk r goes to rank r, which sums its rows in
        # fp32 and writes them rounded to the output's dtype: the gradients', or fp32 where a SUM
        # or PREMUL_SUM scales them afterwards (one rounding, at the end); FSDP's padding rows stay
        # zero. On CUDA the engine's stream follows the one FSDP calls this on (the copies above).
        rows_dtype = dtype if scale == 1.0 else torch.float32
        if state._fsdp_rows.numel() < lay.row or state._fsdp_rows.dtype != rows_dtype:
            state._fsdp_rows = torch.zeros(lay.row, dtype=rows_dtype, device=state.device)
        mine = state._fsdp_rows[:lay.row]
        mine.zero_()
        started = time.monotonic()
        result = state._engine.reduce_scatter(state.step, lay.layers, full, lay.full_offsets, mine,
                                              lay.row_offsets, _gt._stream(full))
        self._note(started, result, input_tensor)
        own = [max(0, min(q, n - rank * q)) for n, q in zip(lay.sizes, lay.chunks)]
        if exact is not None and not result["skipped"]:
            rows_exact = torch.zeros(lay.row, dtype=torch.float32, device=state.device)
            for o, fo, q in zip(lay.row_offsets, lay.full_offsets, lay.chunks):
                rows_exact[o:o + q] = exact[fo + rank * q:fo + (rank + 1) * q]
            _gt._measure_layers(state, lay.layers, rows_exact, mine, lay.row_offsets, own)
        _gt._account(state, result, mine, lay.layers, lay.row_offsets, lay.sizes, None,
                     input_tensor.element_size())
        out.copy_(mine * scale if scale != 1.0 else mine)
        if end_here:
            state._end_step()
        return None


def compress_fsdp(model, policy="geofp8", *, process_group=None, **kwargs):
    """Installs GeoFP8's reduce-scatter on every FSDP module of `model` (fully_shard'ed, torch >=
    2.9) and returns its GeoFP8FSDPState (state_dict, set_policy, report, stats as the DDP
    hook's; the state goes into torch.distributed.checkpoint's dict beside the model and
    optimizer). kwargs: GeoFP8State's (seed, timeout_s, coordinator, summary_every, ...).
    process_group: the group FSDP shards over (default: the default group). A collective: every
    rank calls it, in the same order."""
    FSDPModule, ReduceScatter = _fsdp_api()
    if not isinstance(model, torch.nn.Module):
        raise TypeError("model: a torch.nn.Module that fully_shard wrapped, not %s"
                        % type(model).__name__)
    if getattr(model, "_geofp8_fsdp_state", None) is not None:
        raise RuntimeError("model: compress_fsdp is already installed on this model (it returned "
                           "its state then; install once)")
    modules = [(name or "<root>", m) for name, m in model.named_modules()
               if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("model: %s has no FSDP module; call torch.distributed.fsdp.fully_shard "
                         "on its blocks and on the model first (for DDP use GeoFP8State and "
                         "geofp8_hook)" % type(model).__name__)
    global _comm_class
    if _comm_class is None:
        _comm_class = type("GeoFP8ReduceScatter", (_GeoFP8ReduceScatter, ReduceScatter), {})
    groups = []
    for name, m in modules:
        param_groups = m._get_fsdp_state()._fsdp_param_groups
        if len(param_groups) > 1:
            raise ValueError("model: FSDP module %s has %d parameter groups (shard_placement_fn "
                             "meshes); GeoFP8 takes modules with one" % (name, len(param_groups)))
        for g in param_groups:
            mesh = type(getattr(g, "mesh_info", None)).__name__
            if mesh != "FSDPMeshInfo":
                raise ValueError("model: FSDP module %s has a %s mesh (HSDP or replication); "
                                 "GeoFP8 takes 1-D FSDP meshes" % (name, mesh))
            for fp in g.fsdp_params:
                dim = getattr(getattr(fp, "fsdp_placement", None), "dim", 0)
                if dim != 0:
                    raise ValueError("model: parameter %s of FSDP module %s is sharded on dim %d "
                                     "(shard_placement_fn); GeoFP8 takes dim-0 shards"
                                     % (_param_name(fp), name, dim))
            groups.append((name, m, g))
    state = GeoFP8FSDPState(process_group=process_group, model=model, policy=policy, **kwargs)
    for name, m, g in groups:
        comm = _comm_class(state, name, g)
        m.set_custom_reduce_scatter(comm)
        # FSDP passes only the parameters that have gradients; its input-layout function names
        # them for the call that follows (all of the module's where this torch has none).
        prepare = getattr(g, "_prepare_reduce_scatter_inputs", None)
        if prepare is not None:
            def noting(fsdp_params, grads, world, _prepare=prepare, _comm=comm):
                _comm.pending = list(fsdp_params)
                return _prepare(fsdp_params, grads, world)
            g._prepare_reduce_scatter_inputs = noting
    model._geofp8_fsdp_state = state
    return state
