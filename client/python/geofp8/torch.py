"""geofp8.torch: a DistributedDataParallel communication hook that averages gradients with
GeoFP8's exchange engine (FP8/NVFP4 in geometry-aware coordinates) instead of an fp32
all-reduce.

    state = geofp8.torch.GeoFP8State(process_group=None, model=model, policy="geofp8")
    ddp_model.register_comm_hook(state, geofp8.torch.geofp8_hook)

The engine's Gloo communicator meets its peers through torch's own c10d store (under the
prefix "geofp8/hook/<n>/"), so no extra port or file is needed. Constructing a GeoFP8State is a
collective: every rank of the group constructs one, in the same order.

Under a GeoFP8 `command:` job (GEOFP8_HOOK_ADDRESS set by the worker) the state attaches to the
job: it takes the coordinator's policy versions (agreed per step, applied on every rank at one
step) and reports its catalog, steps (state.report(loss) once per step), per-layer errors and
checkpoints (state.report_checkpoint). See docs/pytorch.md.
"""

import atexit
import itertools
import math
import os
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from . import _CUDA_BUILD_HINT, _checkpoint, _geofp8, _job, build_info, policy_source

__all__ = ["GeoFP8FSDPState", "GeoFP8State", "compress_fsdp", "geofp8_hook"]

_states_created = 0  # per process: each state's store prefix (same order on every rank)


def _restart_prefix():
    """"" outside torchrun's restarts, else "r<TORCHELASTIC_RESTART_COUNT>/"."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return "" if count in ("", "0") else "r%s/" % count


def _local_hostname():
    """Address this rank's Gloo listens on: GEOFP8_HOSTNAME, else loopback when every rank runs
    on this host (torchrun's LOCAL_WORLD_SIZE == WORLD_SIZE, or no launcher), else the host's
    name."""
    explicit = os.environ.get("GEOFP8_HOSTNAME")
    if explicit:
        return explicit
    local = os.environ.get("LOCAL_WORLD_SIZE")
    world = os.environ.get("WORLD_SIZE")
    if local is None or world is None or local == world:
        return "127.0.0.1"
    import socket
    return socket.gethostbyname(socket.getfqdn())


def _script_name():
    """The running script's file name (sys.argv[0]'s basename), or "the model" under python -c or
    an interactive interpreter: what errors call the model unless GeoFP8State gets model_name."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 in ("", "-", "-c"):
        return "the model"
    return os.path.basename(argv0) or "the model"


# Gradient dtypes the hook takes. A CPU bucket of bfloat16 or float16 goes to the engine as it is:
# the engine reads it straight into fp32 as it encodes, sums in fp32 and writes the average back
# rounded to the bucket's dtype (no fp32 copy of the bucket), on the host and on the device (the
# device plane's, kernels/exchange/data_plane.h).
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_MAJOR = int(torch.__version__.split(".")[0])


def _stream(t):
    """The engine's `stream` argument for tensor t: torch's current CUDA stream as an integer, whose
    work queued by now (the backward kernels that wrote t) the exchange follows; 0 on CPU."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.device.type == "cuda" else 0


def _check_parameter(name, p, first, device):
    """first, device: the model's first trainable parameter's name and device."""
    if p.device != device:
        raise RuntimeError(
            "device: the model is on more than one device: parameter '%s' is on %s, its first "
            "parameter '%s' on %s; the GeoFP8 hook takes a model on one device (move it with "
            "model.to(device))%s" % (name, p.device, first, device,
                                     "; CUDA tensors also need a CUDA build of geofp8, which "
                                     "this is not (build %s): %s" % (build_info["build"],
                                                                    _CUDA_BUILD_HINT)
                                     if "cuda" in (p.device.type, device.type)
                                     and not _geofp8.has_cuda else ""))
    if p.device.type == "cuda" and not _geofp8.has_cuda:
        raise RuntimeError(
            "device: parameter '%s' is on %s; CUDA tensors need a CUDA build of geofp8 and torch "
            "(this geofp8 is the %s build, without CUDA/NCCL, so it runs the Gloo engine on CPU "
            "tensors): %s" % (name, p.device, build_info["build"], _CUDA_BUILD_HINT))
    if p.device.type not in ("cpu", "cuda"):
        raise RuntimeError("device: parameter '%s' is on %s; the GeoFP8 hook takes CPU or CUDA "
                           "tensors" % (name, p.device))
    if p.dtype not in _GRAD_DTYPES:
        raise TypeError("gradient dtype: parameter '%s' is %s; the GeoFP8 hook takes float32, "
                        "bfloat16 and float16 gradients" % (name, p.dtype))
    if p.dtype == torch.bfloat16 and p.device.type == "cpu" and _TORCH_MAJOR < 2:
        # Said here, as DDP's own constructor fails first with only "Invalid scalar type".
        raise TypeError("gradient dtype: parameter '%s' is torch.bfloat16, and torch %s's gloo "
                        "has no bfloat16 collectives, so DistributedDataParallel cannot "
                        "broadcast this model (its constructor fails with 'Invalid scalar "
                        "type'); use torch 2.x, or float32 parameters" % (name, torch.__version__))


def _layer_shape(shape):
    """A parameter as the engine's layer: a matrix of dim 0 by the rest, as K-FAC and Shampoo
    see a conv weight (out, in * kh * kw); a 1-D parameter of n elements (or a scalar) is the
    engine's (1, n) vector, which takes no geometry."""
    if len(shape) < 2 or shape[0] == 0:
        return 1, math.prod(shape)
    return int(shape[0]), math.prod(shape) // int(shape[0])


def _environment_synchronous():
    # GEOFP8_HOOK_SYNCHRONOUS=1 puts every state made without synchronous= on the synchronous
    # path (to compare it with the asynchronous one without editing the script).
    text = os.environ.get("GEOFP8_HOOK_SYNCHRONOUS")
    if text is None or text == "":
        return False
    if text not in ("0", "1"):
        raise ValueError("GEOFP8_HOOK_SYNCHRONOUS: must be 0 or 1 (%r)" % text)
    return text == "1"


def _environment_timeout():
    # A command job's worker passes the spec's exchange.timeout_s; elsewhere the default.
    text = os.environ.get("GEOFP8_EXCHANGE_TIMEOUT_S")
    if text is None:
        return 300.0
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError("GEOFP8_EXCHANGE_TIMEOUT_S: must be a positive number of seconds (%r)"
                         % text)
    return value


def _model_layers(model):
    """The model (unwrapped from DDP) and its trainable parameters as the engine's layers:
    (model, names, shapes, index by id(parameter), device)."""
    if model is None:
        raise ValueError("model: required (the module DDP wraps), to name the parameters")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        if getattr(model, "_use_python_reducer", False):
            raise RuntimeError(_COMPILED_DDP_REFUSED)
        model = model.module
    names, shapes, index = [], [], {}
    device = first = None
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if device is None:
            device, first = p.device, name
        _check_parameter(name, p, first, device)
        index[id(p)] = len(names)
        names.append(name)
        shapes.append(_layer_shape(tuple(p.shape)))
    if not names:
        raise ValueError("model: has no parameter that requires a gradient")
    return model, names, shapes, index, device


def _checked_options(synchronous, summary_every, blas_threads, coordinator):
    """GeoFP8State's keyword checks; returns synchronous with None resolved."""
    if synchronous is None:
        synchronous = _environment_synchronous()
    if synchronous not in (True, False):
        raise ValueError("synchronous: True, False or None (GEOFP8_HOOK_SYNCHRONOUS), not %r"
                         % (synchronous,))
    if summary_every is not None and (not isinstance(summary_every, int) or summary_every < 0):
        raise ValueError("summary_every: must be None or an integer >= 0 (%r)" % (summary_every,))
    if blas_threads is not None:
        # Process-wide: the geometry's products over each gradient run on OpenBLAS, which
        # otherwise uses one thread per core in every rank (docs/pytorch.md, "The state").
        if not isinstance(blas_threads, int) or blas_threads < 1:
            raise ValueError("blas_threads: must be an integer >= 1 (%r)" % (blas_threads,))
        _geofp8.set_blas_threads(blas_threads)
    if coordinator not in (None, True, False):
        raise ValueError("coordinator: None (attach when GEOFP8_HOOK_ADDRESS is set), True "
                         "(require it) or False (never attach), not %r" % (coordinator,))
    return synchronous


def _state_store(store):
    """A new state's own store: `store` (default: torch's c10d store) under the prefix
    "geofp8/hook/<n>/", n counting the states made in this process (the same on every rank).
    torchrun's restarts keep its store: each restart's keys apart (a restarted rank would
    otherwise find the addresses the last one published)."""
    global _states_created
    base = store if store is not None else dist.distributed_c10d._get_default_store()
    prefixed = dist.PrefixStore("geofp8/hook/%s%d/" % (_restart_prefix(), _states_created), base)
    _states_created += 1
    return prefixed


class GeoFP8State:
    """The hook's state: the engine (communicator, per-layer policy, geometry) and the step.
    model: the module DDP wraps (or the DDP module), whose named_parameters() name the layers;
    policy: a preset, YAML path or text, or dict; timeout_s: each collective's (default: the
    job's exchange.timeout_s, GEOFP8_EXCHANGE_TIMEOUT_S, else 300); coordinator: None attaches
    under a job, True requires one, False never; summary_every: measure each layer's error every
    N steps (None: 10 under a job, else never); synchronous: exchange inside the hook call (None:
    GEOFP8_HOOK_SYNCHRONOUS). Every keyword is in docs/pytorch.md, "The state"."""

    _watch_buckets = True  # _BucketWatch on the model's forward passes (DDP's buckets)

    def __init__(self, process_group=None, model=None, policy="geofp8", *, seed=0,
                 timeout_s=None, store=None, hostname=None, model_name=None,
                 coordinator=None, summary_every=None, attach_timeout_s=60.0, blas_threads=None,
                 synchronous=None, trace_buckets=False):
        model, self.names, shapes, self._index, self.device = _model_layers(model)
        if not dist.is_initialized():
            raise RuntimeError("process_group: torch.distributed is not initialized "
                               "(call init_process_group first)")
        self.synchronous = _checked_options(synchronous, summary_every, blas_threads,
                                            coordinator)
        self.process_group = process_group
        group = process_group if process_group is not None else dist.group.WORLD
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.summary_every = summary_every
        self.bucket_trace = [] if trace_buckets else None
        self.model_name = str(model_name if model_name is not None else _script_name())
        # The policy is parsed in C++ once the layers are known; a bad one fails the same way
        # on every rank.
        kind, spec = policy_source(policy)
        self._job = None if coordinator is False else _job.JobLink.attach(
            coordinator is True, rank, size, self.names, shapes, self.model_name,
            float(attach_timeout_s))
        store = _state_store(store)
        # CUDA parameters: the NCCL communicator and the CUDA codec kernels, on that device.
        self._engine = _geofp8.Engine(
            store, rank, size, hostname or _local_hostname(),
            float(timeout_s if timeout_s is not None else _environment_timeout()), int(seed),
            "nccl" if self.device.type == "cuda" else "gloo",
            self.device.index if self.device.index is not None else -1)
        self._engine.set_layers(self.names, shapes)
        self._policy, self.policy_version = (kind, spec), 1
        self._vector = [r == 1 or c == 1 for r, c in shapes]
        self._layers = self._engine.set_policy(kind, spec, self.model_name, self.policy_version)
        self.step, self._in_step = 0, False
        self._scheduled = []  # [(effective_step, kind, spec)], applied in order
        # bytes_sent and bytes_baseline count the same buckets (those this state exchanged, and
        # those of the run a state_dict came from): the saved fraction is their ratio.
        self.stats = dict(dict.fromkeys(_checkpoint.CARRIED_STATS, 0), seconds=0.0)
        self.last_step = {"bytes_sent": 0, "seconds": 0.0, "skipped": False}
        # What an fp32 ring all-reduce sends per rank and gradient float.
        self._baseline_per_float = 2.0 * (size - 1) / size * 4.0 if size > 1 else 0.0
        self._reported_at = time.perf_counter()
        self._layer_errors, self._measure = [], False  # this step's (layer, rel_fro_error)
        self._layouts = {}  # DDP bucket layouts mapped to layers (_bucket_layout)
        # A bucket that some rank's backward never hands over: found within seconds.
        self._watch = _BucketWatch(self, store, rank, size)
        if self._watch_buckets and hasattr(model, "register_forward_hook"):
            self._watch.attach(model)

    attached = property(lambda self: self._job is not None,
                        doc="True when the state reports to a GeoFP8 coordinator (a job).")
    rank = property(lambda self: self._engine.rank)
    world_size = property(lambda self: self._engine.size)
    job_id = property(lambda self: self._job.job_id if self._job else None)

    resume_step = property(lambda self: self._job.hook.resume_step if self._job else int(
        os.environ.get("GEOFP8_RESUME_STEP", "0") or 0), doc="The step an attempt resumes at.")
    checkpoint_dir = property(lambda self: (self._job.hook.checkpoint_dir if self._job else
                                            os.environ.get("GEOFP8_CHECKPOINT_DIR")) or None,
                              doc="Where the job keeps checkpoints, or None.")

    @property
    def layers(self):
        """The policy in force, one dict per layer (name, algorithm, format, scaling, block,
        rounding, geometry, rank, alpha, refresh_interval) and its `effective_geometry`: "none"
        for a vector (1-D, or one row or column), which takes none whatever the policy asks."""
        return [dict(l, effective_geometry="none" if v else l["geometry"])
                for l, v in zip(self._layers, self._vector)]

    def report(self, loss, step=None, tokens=None, val_loss=None):
        """Once per step, after the optimizer step: the step's loss, this rank's wire bytes, the
        step time and the exchange's share, and on measured steps the per-layer errors; sent to
        the coordinator under a job (docs/pytorch.md, "Reports"). Returns the record."""
        return _job.report(self, loss, step, tokens, val_loss)

    def layer_summary(self, record):
        """report()'s layer_errors as one line, worst first ("" on steps that measured none)."""
        return _job.layer_summary(self, record)

    def report_checkpoint(self, step, path):
        """The job can resume at `step` from files like `path` (every rank, once all wrote)."""
        if self._job is not None:
            self._job.hook.report_checkpoint(int(step), str(path))

    def close(self):
        """Closes the channel to the coordinator (what was reported is delivered first)."""
        if self._job is not None:
            self._job.close()
            self._job = None

    def set_policy(self, policy, effective_step=None):
        """Applies `policy` at the start of step `effective_step` (default: the next step that
        starts) on this rank; every rank must make the same call for the same step. The policy
        is checked now. Geometry carries over for layers whose geometry settings still fit."""
        kind, spec = policy_source(policy)
        self._engine.check_policy(kind, spec, self.model_name)
        if effective_step is None:
            effective_step = self.step + 1 if self._in_step else self.step
        if effective_step < self.step or (effective_step == self.step and self._in_step):
            raise ValueError("effective_step: %d has already started (current step %d)"
                             % (effective_step, self.step))
        self._scheduled.append((int(effective_step), kind, spec))
        self._scheduled.sort(key=lambda t: t[0])

    def _begin_step(self):
        # Buckets of an earlier step still in flight (its backward raised) finish first, so
        # their callbacks do not count into this step.
        self._engine.drain()
        while self._scheduled and self._scheduled[0][0] <= self.step:
            _, kind, spec = self._scheduled.pop(0)
            self.policy_version += 1
            self._layers = self._engine.set_policy(kind, spec, self.model_name,
                                                   self.policy_version)
            self._policy = (kind, spec)
        if self._job is not None:
            self._job.take_agreed(self, torch.cuda.current_stream(self.device).cuda_stream
                                  if self.device.type == "cuda" else 0)
        self._in_step = True
        every = self.summary_every if self.summary_every is not None else (
            10 if self._job is not None else 0)
        self._measure = every > 0 and self.step % every == 0
        self._layer_errors = []
        self.last_step = {"bytes_sent": 0, "seconds": 0.0, "skipped": False}

    def state_dict(self):
        """Everything a resume needs: step, policy (and scheduled changes), every layer's
        geometry, the world size, and this rank's residuals and counters under its rank's key.
        Only between steps. With load_state_dict it makes the state a torch.distributed.checkpoint
        Stateful: put the state itself in dcp.save's and dcp.load's dict (docs/pytorch.md,
        "Checkpoints with torch.distributed.checkpoint")."""
        return _checkpoint.save(self)

    def load_state_dict(self, state):
        """Restores state_dict()'s output; the model must have the same parameters."""
        _checkpoint.load(self, state)


_LAYOUT_CACHE_MAX = 64  # bucket layouts a state remembers (DDP keeps a handful at a time)

# The unused-parameter watch (_BucketWatch): a bucket waited for this long is looked into, every
# _WATCH_POLL_S; a peer seen to have ended this backward pass without it on two looks in a row
# ends the wait.
_WATCH_AFTER_S = 2.0
_WATCH_POLL_S = 1.0
_WATCH_NAMES = 6  # layers an error names, of the bucket
_POST_PASS = 1 << 16  # unused/<rank> holds pass * _POST_PASS + the buckets handed over in it


def _post(passes, handed):
    return passes * _POST_PASS + min(handed, _POST_PASS - 1)


def _output_tensors(value, depth=0):
    """The tensors that require a gradient in a module's output (a tensor, or tuples, lists and
    dicts of them, as DDP looks for them)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if depth > 4:
        return []
    if isinstance(value, (list, tuple)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return []
    return [t for v in items for t in _output_tensors(v, depth + 1)]


class _BucketWatch:
    """Ends, within seconds, the wait for a DDP bucket that another rank will never exchange.

    Without find_unused_parameters=True, DDP hands a bucket to the hook only once every one of
    its parameters has a gradient. A parameter that one rank's forward did not use keeps that
    rank's bucket back for good: its backward pass ends without it, while the other ranks wait in
    the bucket's exchange (the engine's fingerprint, which compares the ranks' buckets, is never
    reached) until the timeout, typically while that rank waits in a collective of its own.

    So each rank counts its backward passes through the model (a gradient hook on the model's
    outputs, so a backward nested inside one, as reentrant activation checkpointing runs, is not
    counted again) and, when a pass ends (an autograd engine callback) without the hook having
    been handed the step's last bucket, posts the pass's number and how many buckets it handed
    over under the key unused/<rank> of the state's store: nothing is posted for a pass that
    completes its step, and a no_sync() pass costs one store add. A rank with a bucket waiting
    _WATCH_AFTER_S reads its peers' keys every _WATCH_POLL_S; a peer that posted the pass the
    bucket belongs to, having handed over fewer buckets in it than come before this one, will
    not send it, and if so on two reads in a row, the wait ends with an error naming
    the bucket's layers, that peer and find_unused_parameters (Engine.abort, which the peers see
    as closed connections). The second read leaves room for a DDP that hands buckets over in its
    own end-of-backward callback (static_graph's first step). A model whose outputs carry no
    tensor this finds (a custom object) posts nothing, and keeps the plain timeout."""

    def __init__(self, state, store, rank, size):
        self.state = weakref.ref(state)
        self.store = store
        self.rank, self.size = rank, size
        self.passes = 0  # backward passes through the model
        self.open = False  # inside one
        self.handed = 0  # buckets handed to the hook in the pass now open
        self.posted = 0  # the value of unused/<rank>: _post(pass, buckets handed in it)
        self.lock = threading.Lock()
        # token -> (pass, the bucket's place in it, step, bucket index, layers, handed at)
        self.pending = {}
        self.tokens = itertools.count()
        self.suspect = None  # (token, ranks) seen on the last read
        self.error = None  # the message that ended a wait
        self.thread = None

    def attach(self, model):
        ref = weakref.ref(self)

        def on_forward(module, inputs, output):
            watch = ref()
            if watch is None or not torch.is_grad_enabled():
                return
            for t in _output_tensors(output):
                t.register_hook(watch.on_output_grad)

        handle = model.register_forward_hook(on_forward)
        weakref.finalize(self, handle.remove)

    def on_output_grad(self, grad):
        # The first output gradient of a backward pass: the pass starts.
        if not self.open:
            self.open = True
            self.passes += 1
            self.handed = 0
            torch.autograd.Variable._execution_engine.queue_callback(self.on_backward_end)

    def on_backward_end(self):
        self.open = False
        state = self.state()
        if state is None or (self.handed > 0 and not state._in_step):
            return
        # No bucket (no_sync(), or the first bucket held back) or not the step's last one.
        value = _post(self.passes, self.handed)
        self.store.add("unused/%d" % self.rank, value - self.posted)
        self.posted = value

    def handing(self, step, bucket_index, layers):
        """A bucket goes to the engine; returns the token for done()."""
        token = next(self.tokens)
        with self.lock:
            self.pending[token] = (self.passes if self.open else None, self.handed, step,
                                   bucket_index, layers, time.monotonic())
        self.handed += 1
        if self.thread is None and self.size > 1:
            self.thread = threading.Thread(target=_watch_loop, args=(weakref.ref(self),),
                                           name="geofp8-bucket-watch", daemon=True)
            _watch_threads.add(self.thread)
            self.thread.start()
        return token

    def done(self, token):
        with self.lock:
            self.pending.pop(token, None)

    def check(self):
        """One look (the watch thread): ends a bucket's wait if a peer will not send it."""
        now = time.monotonic()
        with self.lock:
            waiting = sorted((v[5], token, v) for token, v in self.pending.items()
                             if v[0] is not None and now - v[5] >= _WATCH_AFTER_S)
        if not waiting:
            self.suspect = None
            return
        peers = {r: divmod(self.store.add("unused/%d" % r, 0), _POST_PASS)
                 for r in range(self.size) if r != self.rank}
        # The oldest bucket that some peer ended its pass without (it handed over fewer buckets
        # in that pass than this bucket's place): a bucket a peer did hand over is only slow.
        for _, token, (passes, place, step, index, layers, _) in waiting:
            short = tuple(r for r, (p, handed) in peers.items() if p == passes and handed <= place)
            if short:
                break
        else:
            self.suspect = None
            return
        if self.suspect != (token, short):
            self.suspect = (token, short)
            return
        state = self.state()
        with self.lock:
            if state is None or token not in self.pending:
                return
            names = [state.names[i] for i in layers]
            shown = ", ".join(names[:_WATCH_NAMES]) + (
                ", ... (%d layers)" % len(names) if len(names) > _WATCH_NAMES else "")
            self.error = (
                "unused parameters: rank%s %s ended backward pass %d without handing DDP's "
                "bucket %d (%s) to the hook, which rank %d waits for in step %d: a parameter of "
                "that bucket got no gradient there (the forward did not use it on that rank), or "
                "that rank ran the pass under no_sync(). DDP holds a bucket back until every "
                "parameter in it has a gradient unless it is built with "
                "find_unused_parameters=True: pass that to DistributedDataParallel, or use every "
                "parameter on every rank" % ("s" if len(short) > 1 else "",
                                             ", ".join(map(str, short)), passes, index, shown,
                                             self.rank, step))
        state._engine.abort(self.error)


# The watch threads, stopped and joined at exit: a daemon thread still inside a C++ call (a store
# read, or an engine it held the last reference to being destroyed) when the interpreter
# finalizes would be ended by the GIL inside a destructor, which aborts the process.
_watch_stop = threading.Event()
_watch_threads = set()


def _stop_watches():
    _watch_stop.set()
    for t in list(_watch_threads):
        t.join(timeout=10.0)


atexit.register(_stop_watches)


def _watch_loop(ref):
    try:
        while not _watch_stop.wait(_WATCH_POLL_S):
            if not _watch_once(ref):
                return
    finally:
        _watch_threads.discard(threading.current_thread())


def _watch_once(ref):
    """One look of the watch thread; False when the watch is gone or broken."""
    watch = ref()
    if watch is None:
        return False
    try:
        watch.check()
    except Exception as e:  # noqa: BLE001 - a broken store ends the watch, not the run
        print("geofp8: rank %d: the bucket watch stopped: %s" % (watch.rank, e),
              file=sys.stderr, flush=True)
        return False
    return True


def _bucket_layout(state, bucket, buf):
    """The bucket's layers (indices into state.names), their offsets in the bucket buffer and
    their sizes, in bucket order. Mapped once per layout and then looked up: the key is the
    buffer (address and size) and the identities of its parameters in order, which together fix
    where DDP puts each gradient in the buffer, so a bucket that DDP rebuilds gets a new entry
    even where the allocator hands it the old address (the parameters or their order differ, or
    the layout is the same one)."""
    params = bucket.parameters()
    key = (buf.data_ptr(), buf.numel(), tuple(map(id, params)))
    hit = state._layouts.get(key)
    if hit is not None:
        return hit
    layers = []
    for p in params:
        i = state._index.get(id(p))
        if i is None:
            raise ValueError("model: bucket %d holds a parameter (shape %s) that is not in the "
                             "model given to GeoFP8State" % (bucket.index(), tuple(p.shape)))
        layers.append(i)
    base = buf.data_ptr()
    grads = bucket.gradients()
    offsets = [(g.data_ptr() - base) // buf.element_size() for g in grads]
    sizes = [g.numel() for g in grads]
    if len(state._layouts) >= _LAYOUT_CACHE_MAX:
        state._layouts.clear()
    state._layouts[key] = (layers, offsets, sizes)
    return layers, offsets, sizes


def _exact_average(state, buf):
    """The bucket's exact fp32 average over the group (one gloo all-reduce of a copy, as the
    worker's trainer measures), taken on the hook's thread so that every rank issues it in the
    order DDP hands the buckets over."""
    exact = buf.float() / state.world_size
    dist.all_reduce(exact, group=state.process_group)
    return exact


def _measure_layers(state, layers, exact, averaged, offsets, sizes):
    """Each layer's relative Frobenius error of the exchanged average against the exact one."""
    for i, o, n in zip(layers, offsets, sizes):
        e = exact[o:o + n].double()
        d = averaged[o:o + n].double() - e
        g2 = float(e.dot(e))
        err = float(d.dot(d))
        state._layer_errors.append(
            (state.names[i], math.sqrt(err / g2) if g2 > 0 else math.sqrt(err)))


def _account(state, result, buf, layers, offsets, sizes, exact, elem_bytes=4):
    """A finished bucket: measured errors, the NaN fill of a skipped bucket, the statistics.
    elem_bytes: the gradients' own dtype's size; bytes_baseline counts the plain collective in
    that dtype (an fp32, bf16 or fp16 all-reduce)."""
    if exact is not None and not result["skipped"]:
        _measure_layers(state, layers, exact, buf, offsets, sizes)
    if result["skipped"]:
        buf.fill_(float("nan"))
        state.stats["skipped_buckets"] += 1
        state.last_step["skipped"] = True
    state.stats["bytes_sent"] += result["bytes_sent"]
    state.stats["bytes_baseline"] += int(round(state._baseline_per_float * sum(sizes) *
                                               elem_bytes / 4.0))
    state.stats["seconds"] += result["seconds"]
    state.stats["refreshes"] += result["refreshes"]
    state.stats["refreshes_from_inverse"] += result["refreshes_from_inverse"]
    state.last_step["bytes_sent"] += result["bytes_sent"]
    state.last_step["seconds"] += result["seconds"]


def _unwrap(fut):
    return fut.value()


def _end_bucket(state, bucket):
    if bucket.is_last():
        state.step += 1
        state._in_step = False


# Compiled DDP (torch 2.x: torch._dynamo.config.optimize_ddp = "python_reducer" with compiled
# autograd) calls a comm hook once per parameter with (grad, param) and ignores what it returns
# (torch/nn/parallel/distributed.py, _register_accum_grad_hook): no buckets to exchange, and a
# hook traced into the compiled backward graph. Refused, naming the setting and what works.
_COMPILED_DDP_REFUSED = (
    "torch._dynamo.config.optimize_ddp = 'python_reducer' (compiled DDP) calls comm hooks per "
    "parameter, which the GeoFP8 hook does not take: it exchanges DDP's buckets. Use "
    "optimize_ddp = True (the default, DDPOptimizer: torch.compile(model) under DDP works with "
    "the hook) or leave compiled autograd off")


def geofp8_hook(state, bucket):
    """DDP comm hook: averages the bucket over the group with GeoFP8's engine and returns a
    Future holding the averaged bucket. Unless the state is synchronous, each
    bucket but the step's last is queued on the engine's exchange thread, which exchanges the
    buckets in the order DDP hands them over, and the engine completes the Future, so DDP's
    backward goes on meanwhile (the last bucket is exchanged in the call, after them); errors (timeouts, fingerprint mismatches) complete it with the engine's
    geofp8.Error, which DDP raises from backward(). A bucket in which some rank had a NaN or inf
    gradient comes back as NaN (the engine skips it on every rank), so a GradScaler or a
    finiteness check skips the optimizer step."""
    called = time.monotonic()
    if isinstance(bucket, tuple):
        raise RuntimeError(_COMPILED_DDP_REFUSED)
    buf = bucket.buffer()
    if buf.device != state.device:
        if buf.device.type == "cuda" and not _geofp8.has_cuda:
            raise RuntimeError("device: bucket %d is on %s; CUDA tensors need a CUDA build of "
                               "geofp8 and torch (this geofp8 is the %s build, without "
                               "CUDA/NCCL): %s" % (bucket.index(), buf.device,
                                                   build_info["build"], _CUDA_BUILD_HINT))
        raise RuntimeError("device: bucket %d is on %s; this GeoFP8State was made for a model on "
                           "%s" % (bucket.index(), buf.device, state.device))
    if buf.dtype not in _GRAD_DTYPES:
        raise TypeError("gradient dtype: bucket %d is %s; the GeoFP8 hook takes float32, "
                        "bfloat16 and float16 gradients" % (bucket.index(), buf.dtype))
    if not state._in_step:
        state._begin_step()
    layers, offsets, sizes = _bucket_layout(state, bucket, buf)
    exact = _exact_average(state, buf) if state._measure else None
    step, index = state.step, bucket.index()
    watch = state._watch
    token = watch.handing(step, index, layers)
    fut = torch.futures.Future()
    trace = state.bucket_trace
    # The step's last bucket is exchanged in this call, after the queued ones: no backward is
    # left to overlap it with, and the calling thread saves the handoffs to the engine's
    # threads and back (the same Exchanger call, so the same bits).
    if not state.synchronous and not bucket.is_last():
        def done(result, error):
            # The engine's completer thread, with the GIL.
            watch.done(token)
            if error is not None:
                fut.set_exception(RuntimeError(watch.error) if watch.error else error)
                return
            try:
                _account(state, result, buf, layers, offsets, sizes, exact, buf.element_size())
                if trace is not None:
                    record.update(started=result["started"], finished=result["finished"],
                                  completed=time.monotonic(), skipped=result["skipped"])
                    trace.append(record)
            except BaseException as e:  # noqa: BLE001 - it belongs to the Future
                fut.set_exception(e)
                return
            fut.set_result(buf)

        record = {"step": step, "bucket": index, "called": called}
        # `done` keeps the bucket alive until the engine is done with it.
        state._engine.submit(step, layers, buf, offsets, done, _stream(buf))
        _end_bucket(state, bucket)
        # DDP reads the Future from C++, where set_exception's value would be a failed cast to
        # Tensor: the chained Future turns it into a real error, which backward() raises.
        chained = fut.then(_unwrap)
        record["returned"] = time.monotonic()
        return chained
    started = time.monotonic()
    try:
        result = state._engine.exchange(step, layers, buf, offsets, _stream(buf))
    except Exception as e:
        if watch.error:
            raise RuntimeError(watch.error) from e
        raise
    finally:
        watch.done(token)
    finished = time.monotonic()
    # When the engine began it, after the buckets queued before it (a CPU build from before
    # "started" was reported: when the call began).
    started = result.get("started", started)
    _account(state, result, buf, layers, offsets, sizes, exact, buf.element_size())
    _end_bucket(state, bucket)
    fut.set_result(buf)
    if trace is not None:
        now = time.monotonic()
        trace.append({"step": step, "bucket": index, "called": called, "started": started,
                      "finished": finished, "returned": now, "completed": now,
                      "skipped": result["skipped"]})
    return fut


# FSDP2's reduce-scatter over the same state (after GeoFP8State, which it extends).
from ._fsdp import GeoFP8FSDPState, compress_fsdp  # noqa: E402
