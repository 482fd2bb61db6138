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
import warnings
import weakref

import torch
import torch.distributed as dist

from . import _CUDA_BUILD_HINT, _geofp8, build_info, policy_source

__all__ = ["GeoFP8FSDPState", "GeoFP8State", "compress_fsdp", "geofp8_hook"]

_states_created = 0  # per process: each state's store prefix (same order on every rank)
_STATE_FORMAT = 4
# The counters a state_dict carries (format 3): the saved-bytes figure spans the restarts.
_CARRIED_STATS = ("bytes_sent", "bytes_baseline", "seconds", "skipped_buckets", "refreshes",
                  "refreshes_from_inverse")


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


# Gradient dtypes the hook takes. bfloat16 and float16 buckets are exchanged through an fp32 copy
# of the bucket (the engine encodes from fp32, sums in fp32) and written back in their dtype.
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


class GeoFP8State:
    """The hook's state: the engine (communicator, per-layer policy, geometry) and the step.

    process_group: the DDP group (None: the default group). model: the module DDP wraps (or the
    DDP module); its named_parameters() name the layers that policy globs match. policy: a
    preset name, a YAML path, YAML text or a dict in geofp8-train's --policy schema
    (docs/pytorch.md). seed: stochastic rounding and geometry cold starts derive from it.
    timeout_s: every collective's timeout (default: the job spec's exchange.timeout_s under a
    GeoFP8 `command:` job, GEOFP8_EXCHANGE_TIMEOUT_S; else 300). store: a c10d Store to meet
    through (default: the group's default store). model_name: what errors call the model
    ("matches no layer of <model_name>"), here and, under a `command:` job, in the coordinator's
    messages (the catalog carries it); default: the script's file name (sys.argv[0]).
    synchronous: False (the default)
    queues each bucket on the engine's exchange thread and returns a Future the engine
    completes, so DDP goes on with backward while the bucket is on the wire; True exchanges the
    bucket inside the hook call and returns a completed Future (the same bits, no overlap).
    None: GEOFP8_HOOK_SYNCHRONOUS (0 or 1; unset: False). On CUDA tensors too.
    trace_buckets: keep one record per bucket in `bucket_trace` (time.monotonic() seconds:
    called, started, finished, returned, completed; docs/pytorch.md).
    """

    _watch_buckets = True  # _BucketWatch on the model's forward passes (DDP's buckets)

    def __init__(self, process_group=None, model=None, policy="geofp8", *, seed=0,
                 timeout_s=None, store=None, hostname=None, model_name=None,
                 coordinator=None, summary_every=10, attach_timeout_s=60.0, blas_threads=None,
                 synchronous=None, trace_buckets=False):
        global _states_created
        if model is None:
            raise ValueError("model: required (the module DDP wraps), to name the parameters")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            if getattr(model, "_use_python_reducer", False):
                raise RuntimeError(_COMPILED_DDP_REFUSED)
            model = model.module
        if not dist.is_initialized():
            raise RuntimeError("process_group: torch.distributed is not initialized "
                               "(call init_process_group first)")
        self.process_group = process_group
        group = process_group if process_group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        self.names = []
        shapes = []
        self._index = {}
        device = first = None
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if device is None:
                device, first = p.device, name
            _check_parameter(name, p, first, device)
            self._index[id(p)] = len(self.names)
            self.names.append(name)
            shapes.append(_layer_shape(tuple(p.shape)))
        if not self.names:
            raise ValueError("model: has no parameter that requires a gradient")
        if synchronous is None:
            synchronous = _environment_synchronous()
        if synchronous not in (True, False):
            raise ValueError("synchronous: True, False or None (GEOFP8_HOOK_SYNCHRONOUS), not %r"
                             % (synchronous,))
        self.synchronous = synchronous
        self.bucket_trace = [] if trace_buckets else None
        if model_name is None:
            model_name = _script_name()
        self.model_name = str(model_name)
        # The policy is parsed in C++ once the layers are known (set_policy below); a bad one
        # fails the same way on every rank.
        kind, spec = policy_source(policy)
        # Under a GeoFP8 `command:` job: the channel to the coordinator, checked against this
        # process group before the engine's rendezvous (a wrong world size would hang it).
        self._hook = None
        self._job_spec = ""
        self.summary_every = int(summary_every)
        self.attach_timeout_s = float(attach_timeout_s)
        if blas_threads is not None:
            # Process-wide: the geometry's products over each gradient run on OpenBLAS, which
            # otherwise uses one thread per core in every rank (docs/pytorch.md, "The state").
            if not isinstance(blas_threads, int) or blas_threads < 1:
                raise ValueError("blas_threads: must be an integer >= 1 (%r)" % (blas_threads,))
            _geofp8.set_blas_threads(blas_threads)
        if coordinator not in (None, True, False):
            raise ValueError("coordinator: None (attach when GEOFP8_HOOK_ADDRESS is set), True "
                             "(require it) or False (never attach), not %r" % (coordinator,))
        if coordinator is not False:
            self._attach(coordinator is True, rank, size, shapes)
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        prefix = "geofp8/hook/%d/" % _states_created
        _states_created += 1
        # CUDA parameters: the NCCL communicator and the CUDA codec kernels, on that device.
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if timeout_s is None:
            timeout_s = _environment_timeout()
        store = dist.PrefixStore(prefix, base)
        self._engine = _geofp8.Engine(store, rank, size,
                                      hostname or _local_hostname(), float(timeout_s), int(seed),
                                      backend, device.index if device.index is not None else -1)
        self._engine.set_layers(self.names, shapes)
        self._policy = (kind, spec)
        self.policy_version = 1
        self.layers = self._engine.set_policy(kind, spec, self.model_name, self.policy_version)
        self.step = 0
        self._in_step = False
        self._scheduled = []  # [(effective_step, kind, spec)], applied in order
        # bytes_sent and bytes_baseline count the same buckets (those this state exchanged, and
        # those of the run a state_dict came from): the saved fraction is their ratio.
        self.stats = {"bytes_sent": 0, "bytes_baseline": 0, "seconds": 0.0,
                      "skipped_buckets": 0, "refreshes": 0, "refreshes_from_inverse": 0}
        self.last_step = {"bytes_sent": 0, "seconds": 0.0, "skipped": False}
        # What an fp32 ring all-reduce sends per rank and gradient float.
        self._baseline_per_float = 2.0 * (size - 1) / size * 4.0 if size > 1 else 0.0
        self._reported_at = time.perf_counter()
        self._layer_errors = []  # this step's (layer, rel_fro_error), measured steps only
        self._measure = False
        # DDP bucket layouts already mapped to layers: (buffer address, numel, parameter ids)
        # -> (layers, offsets, sizes) (_bucket_layout).
        self._layouts = {}
        # A bucket that some rank's backward never hands over (a parameter without a gradient
        # there): found through the store within seconds rather than at the timeout.
        self._watch = _BucketWatch(self, store, rank, size)
        if self._watch_buckets and hasattr(model, "register_forward_hook"):
            self._watch.attach(model)

    # ---- the coordinator (a GeoFP8 `command:` job) ------------------------------------------

    def _attach(self, required, rank, size, shapes):
        hook = _geofp8.HookClient.from_environment()
        if hook is None:
            if required:
                raise RuntimeError("coordinator: GEOFP8_HOOK_ADDRESS is not set; the script is "
                                   "not running under a GeoFP8 command job")
            return
        address = os.environ.get("GEOFP8_HOOK_ADDRESS")
        try:
            welcome = hook.wait_for_welcome(self.attach_timeout_s)
            if welcome is None:
                raise RuntimeError("coordinator: no answer on the worker's hook socket %s within "
                                   "%g s (attach_timeout_s)" % (address, self.attach_timeout_s))
            if welcome["world_size"] != size:
                raise ValueError(
                    "world size: torch's process group has %d ranks (WORLD_SIZE=%s) but GeoFP8 "
                    "job %s has %d (its spec.world_size); launch the script with one process per "
                    "rank of the job" % (size, os.environ.get("WORLD_SIZE", "unset"),
                                         welcome["job_id"], welcome["world_size"]))
            if welcome["rank"] != rank:
                raise ValueError("rank: torch's rank is %d but the GeoFP8 worker runs rank %d of "
                                 "job %s" % (rank, welcome["rank"], welcome["job_id"]))
            if not hook.wait_for_policy(self.attach_timeout_s):
                raise RuntimeError("coordinator: no policy version of job %s arrived within %g s"
                                   % (welcome["job_id"], self.attach_timeout_s))
            path = os.environ.get("GEOFP8_JOB_SPEC")
            if path:
                with open(path) as f:
                    self._job_spec = f.read()
            # Every rank resolves the versions against the catalog; the worker forwards rank
            # 0's to the coordinator (which computes the refresh schedules from it).
            hook.send_catalog([(n, r, c) if r > 1 else (n, r * c, 1)
                               for n, (r, c) in zip(self.names, shapes)], self.model_name)
        except BaseException:
            hook.close()
            raise
        self._hook = hook
        self.job_id = welcome["job_id"]
        print("geofp8: rank %d attached to job %s (attempt %d, resume step %d)"
              % (rank, welcome["job_id"], welcome["attempt"], welcome["resume_step"]),
              flush=True)

    @property
    def attached(self):
        """True when the state reports to a GeoFP8 coordinator (under a `command:` job)."""
        return self._hook is not None

    @property
    def resume_step(self):
        """The step a restarted attempt resumes at (GEOFP8_RESUME_STEP; 0: a fresh start)."""
        return self._hook.resume_step if self._hook else int(os.environ.get(
            "GEOFP8_RESUME_STEP", "0") or 0)

    @property
    def checkpoint_dir(self):
        """Where the job keeps checkpoints (GEOFP8_CHECKPOINT_DIR), or None."""
        return (self._hook.checkpoint_dir if self._hook else
                os.environ.get("GEOFP8_CHECKPOINT_DIR")) or None

    def _apply_change(self, change):
        if (self._policy[0] == "coordinator" and self.policy_version == change["version"]
                and self._policy[1] == change["policy"]):
            return  # resumed from a checkpoint written under this very version
        refresh = list(change["refresh"])
        if not refresh and any(l["geometry"] != "none" for l in change["layers"]):
            # The coordinator computes the schedules once rank 0's catalog reaches it.
            got = self._hook.wait_for_refresh(self.attach_timeout_s)
            if got is None:
                raise RuntimeError("policy v%d: no geometry refresh schedule arrived from the "
                                   "coordinator within %g s" % (change["version"],
                                                               self.attach_timeout_s))
            refresh = list(got)
        self.layers = self._engine.set_coordinator_policy(change["policy"], refresh,
                                                          self._job_spec)
        self.policy_version = change["version"]
        self._policy = ("coordinator", change["policy"], refresh)
        print("geofp8: rank %d: policy v%d (%s) in force from step %d"
              % (self.rank, change["version"], change["reason"], self.step), flush=True)

    def report(self, loss, step=None, tokens=None, val_loss=None):
        """Call once per step, after the optimizer step: reports the step's loss (a float or a
        0-d tensor), this rank's wire bytes, the step time (since the previous call) and the
        exchange's share to the coordinator, and on rank 0 the per-layer errors measured this
        step. `step` defaults to the step the hook just ran; `tokens` (this rank's tokens in the
        step) gives tokens/s; `val_loss`, on the steps that validated, is the validation loss
        after this step (describe's `Validation:`, `get -o wide`'s VAL-LOSS,
        geofp8_worker_val_loss). Outside a GeoFP8 job it only returns what it would send."""
        now = time.perf_counter()
        seconds = now - self._reported_at
        self._reported_at = now
        if step is None:
            step = self.step - 1
        loss = float(loss.item() if hasattr(loss, "item") else loss)
        if val_loss is not None:
            val_loss = float(val_loss.item() if hasattr(val_loss, "item") else val_loss)
            if not math.isfinite(val_loss):
                raise ValueError("val_loss: must be finite (%r)" % val_loss)
        record = {
            "step": step, "loss": loss, "step_seconds": seconds,
            "exchange_seconds": self.last_step["seconds"],
            "tokens_per_second": (tokens / seconds) if tokens and seconds > 0 else 0.0,
            "bytes_sent": self.stats["bytes_sent"],
            "bytes_baseline": self.stats["bytes_baseline"],
            "layer_errors": list(self._layer_errors),
            "val_loss": val_loss,
        }
        if self._hook is not None:
            self._hook.report_step(step, loss, record["tokens_per_second"],
                                   record["bytes_sent"], record["bytes_baseline"], seconds,
                                   record["exchange_seconds"], val_loss)
            if self.rank == 0 and self._layer_errors:
                self._hook.report_layers([(n, step, e, 0.0) for n, e in self._layer_errors])
        self._layer_errors = []
        return record

    def report_checkpoint(self, step, path):
        """Tells the coordinator that the job can resume at `step` (the next step to run) from
        checkpoints like `path`. Call it on every rank once every rank has written its file (rank
        0's report moves the job's recovery point, GEOFP8_RESUME_STEP of a restart)."""
        if self._hook is not None:
            self._hook.report_checkpoint(int(step), str(path))

    def close(self):
        """Closes the channel to the coordinator (what was reported is delivered first)."""
        if self._hook is not None:
            self._hook.close()
            self._hook = None

    @property
    def rank(self):
        return self._engine.rank

    @property
    def world_size(self):
        return self._engine.size

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
            self.layers = self._engine.set_policy(kind, spec, self.model_name,
                                                  self.policy_version)
            self._policy = (kind, spec)
        if self._hook is not None:
            # The coordinator's versions, as the worker's trainer takes them: one small
            # collective agrees on the newest version every rank holds, and the hook client puts
            # a version in force at the first step at or after its effective step where all do
            # (hook_client.h, PolicyAgreedAt), on every rank at the same step.
            stream = (torch.cuda.current_stream(self.device).cuda_stream
                      if self.device.type == "cuda" else 0)
            agreed = self._engine.agree_min(self._hook.newest_held(), stream)
            change = self._hook.policy_agreed_at(self.step, agreed)
            if change is not None:
                self._apply_change(change)
        self._in_step = True
        self._measure = (self._hook is not None and self.summary_every > 0
                         and self.step % self.summary_every == 0)
        self._layer_errors = []
        self.last_step = {"bytes_sent": 0, "seconds": 0.0, "skipped": False}

    def state_dict(self):
        """Everything a resume needs: step, policy (and scheduled changes), every layer's
        geometry. Only between steps."""
        if self._in_step:
            raise RuntimeError("state_dict: step %d is in progress" % self.step)
        return _tensors_for_bytes({
            "format": _STATE_FORMAT,
            "step": self.step,
            "names": list(self.names),
            "policy": list(self._policy),
            "policy_version": self.policy_version,
            "scheduled": [list(t) for t in self._scheduled],
            "geometry": [tuple(g) for g in self._engine.export_geometry()],
            # error_feedback's residuals (format 2): without them a resume would drop what the
            # last step's quantization lost, and differ from a run without the restart
            "residuals": [tuple(r) for r in self._engine.export_residuals()],
            # stats (format 3): the wire bytes and their fp32 baseline over every step so far,
            # so that a resumed run reports the same bytes saved as one without the restart
            "stats": {k: self.stats[k] for k in _CARRIED_STATS},
            # who saved the residuals (format 4): they are this rank's own quantization errors,
            # so another rank or world size drops them (load_state_dict); geometry is portable
            "rank": self.rank,
            "world_size": self.world_size,
        })

    def load_state_dict(self, state):
        """Restores state_dict()'s output; the model must have the same parameters."""
        state = _bytes_for_tensors(state)
        if state.get("format") not in (1, 2, 3, _STATE_FORMAT):
            raise ValueError("state.format: %r is not 1, 2, 3 or %d" % (state.get("format"),
                                                                        _STATE_FORMAT))
        if list(state["names"]) != self.names:
            raise ValueError("state.names: the saved parameters (%d) differ from the model's (%d)"
                             % (len(state["names"]), len(self.names)))
        policy = tuple(state["policy"])
        self.policy_version = int(state["policy_version"])
        if policy[0] == "coordinator":
            self.layers = self._engine.set_coordinator_policy(policy[1], list(policy[2]),
                                                              self._job_spec)
        else:
            self.layers = self._engine.set_policy(policy[0], policy[1], self.model_name,
                                                  self.policy_version)
        self._policy = policy
        self._engine.import_geometry([tuple(g) for g in state["geometry"]])
        saved_by = ((int(state["rank"]), int(state["world_size"])) if state["format"] >= 4
                    else (self.rank, self.world_size))
        if "residuals" not in state:  # format 1 has none: error feedback starts again from zero
            pass
        elif saved_by != (self.rank, self.world_size):
            warnings.warn("load_state_dict: the error-feedback residuals were saved by rank %d "
                          "of %d and this is rank %d of %d; they are dropped (error feedback "
                          "starts again from zero), the geometry is kept"
                          % (saved_by + (self.rank, self.world_size)), stacklevel=2)
        else:
            self._engine.import_residuals([tuple(r) for r in state["residuals"]])
        self._scheduled = [tuple(t) for t in state["scheduled"]]
        self.step = int(state["step"])
        # Formats 1 and 2 carry no counters: both start again from zero, so bytes_sent and
        # bytes_baseline still span the same steps (those since this resume).
        saved = state.get("stats") or {}
        for k in _CARRIED_STATS:
            self.stats[k] = type(self.stats[k])(saved.get(k, 0))
        self._in_step = False


def _tensors_for_bytes(value):
    """state_dict's byte strings (serialized geometry, residuals, coordinator policies) as uint8
    tensors, recursively: torch.load's default weights_only=True (torch >= 2.6) refuses bytes,
    and a checkpoint must load as torch's own do."""
    if isinstance(value, (bytes, bytearray)):
        if not value:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(value), dtype=torch.uint8)
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors_for_bytes(v) for v in value)
    if isinstance(value, dict):
        return {k: _tensors_for_bytes(v) for k, v in value.items()}
    return value


def _bytes_for_tensors(value):
    """The inverse of _tensors_for_bytes; bytes (a checkpoint saved before it) pass as they are."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1:
        return value.cpu().numpy().tobytes()
    if isinstance(value, (list, tuple)):
        return type(value)(_bytes_for_tensors(v) for v in value)
    if isinstance(value, dict):
        return {k: _bytes_for_tensors(v) for k, v in value.items()}
    return value


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
    exact = buf / state.world_size
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
    out = buf
    if buf.dtype != torch.float32:
        buf = buf.float()  # exchanged in fp32, written back into DDP's bucket at the end
    if not state._in_step:
        state._begin_step()
    layers, offsets, sizes = _bucket_layout(state, bucket, out)
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
                _account(state, result, buf, layers, offsets, sizes, exact, out.element_size())
                if out is not buf:
                    out.copy_(buf)
                if trace is not None:
                    record.update(started=result["started"], finished=result["finished"],
                                  completed=time.monotonic(), skipped=result["skipped"])
                    trace.append(record)
            except BaseException as e:  # noqa: BLE001 - it belongs to the Future
                fut.set_exception(e)
                return
            fut.set_result(out)

        record = {"step": step, "bucket": index, "called": called}
        if buf.device.type == "cuda":
            # Device pointer and torch's current stream as integers: the engine's stream waits
            # for the backward kernels queued by now, and `done` keeps the bucket alive.
            stream = torch.cuda.current_stream(buf.device).cuda_stream
            state._engine.submit_cuda(step, layers, buf.data_ptr(), buf.numel(), offsets, stream,
                                      done)
        else:
            state._engine.submit(step, layers, buf.numpy(), offsets, done)
        _end_bucket(state, bucket)
        # DDP reads the Future from C++, where set_exception's value would be a failed cast to
        # Tensor: the chained Future turns it into a real error, which backward() raises.
        chained = fut.then(_unwrap)
        record["returned"] = time.monotonic()
        return chained
    started = time.monotonic()
    try:
        if buf.device.type == "cuda":
            # Device pointers and torch's current stream as integers: the work is ordered after
            # the backward kernels that wrote the bucket, and done when this returns.
            stream = torch.cuda.current_stream(buf.device).cuda_stream
            result = state._engine.exchange_cuda(step, layers, buf.data_ptr(), buf.numel(),
                                                 offsets, stream)
        else:
            result = state._engine.exchange(step, layers, buf.numpy(), offsets)
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
    _account(state, result, buf, layers, offsets, sizes, exact, out.element_size())
    if out is not buf:
        out.copy_(buf)
    _end_bucket(state, bucket)
    fut.set_result(out)
    if trace is not None:
        now = time.monotonic()
        trace.append({"step": step, "bucket": index, "called": called, "started": started,
                      "finished": finished, "returned": now, "completed": now,
                      "skipped": result["skipped"]})
    return fut


# FSDP2's reduce-scatter over the same state (after GeoFP8State, which it extends).
from ._fsdp import GeoFP8FSDPState, compress_fsdp  # noqa: E402
