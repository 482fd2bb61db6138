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

import math
import os
import sys
import time

import torch
import torch.distributed as dist

from . import _geofp8, policy_source

__all__ = ["GeoFP8State", "geofp8_hook"]

_states_created = 0  # per process: each state's store prefix (same order on every rank)
_STATE_FORMAT = 2


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


def _check_parameter(name, p, first, device):
    """first, device: the model's first trainable parameter's name and device."""
    if p.device != device:
        raise RuntimeError(
            "device: the model is on more than one device: parameter '%s' is on %s, its first "
            "parameter '%s' on %s; the GeoFP8 hook takes a model on one device (move it with "
            "model.to(device))%s" % (name, p.device, first, device,
                                     "; CUDA tensors also need a CUDA build of geofp8, which "
                                     "this is not" if "cuda" in (p.device.type, device.type)
                                     and not _geofp8.has_cuda else ""))
    if p.device.type == "cuda" and not _geofp8.has_cuda:
        raise RuntimeError(
            "device: parameter '%s' is on %s; CUDA tensors need a CUDA build of geofp8 and torch "
            "(this geofp8 was built without CUDA/NCCL, so it runs the Gloo engine on CPU tensors)"
            % (name, p.device))
    if p.device.type not in ("cpu", "cuda"):
        raise RuntimeError("device: parameter '%s' is on %s; the GeoFP8 hook takes CPU or CUDA "
                           "tensors" % (name, p.device))
    if p.dtype != torch.float32:
        raise TypeError("gradient dtype: parameter '%s' is %s; the GeoFP8 hook takes float32 "
                        "gradients" % (name, p.dtype))


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

    def __init__(self, process_group=None, model=None, policy="geofp8", *, seed=0,
                 timeout_s=None, store=None, hostname=None, model_name=None,
                 coordinator=None, summary_every=10, attach_timeout_s=60.0, blas_threads=None,
                 synchronous=None, trace_buckets=False):
        global _states_created
        if model is None:
            raise ValueError("model: required (the module DDP wraps), to name the parameters")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
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
            shapes.append((p.shape[0], p.shape[1]) if p.dim() == 2 else (1, p.numel()))
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
        self._engine = _geofp8.Engine(dist.PrefixStore(prefix, base), rank, size,
                                      hostname or _local_hostname(), float(timeout_s), int(seed),
                                      backend, device.index if device.index is not None else -1)
        self._engine.set_layers(self.names, shapes)
        self._policy = (kind, spec)
        self.policy_version = 1
        self.layers = self._engine.set_policy(kind, spec, self.model_name, self.policy_version)
        self.step = 0
        self._in_step = False
        self._scheduled = []  # [(effective_step, kind, spec)], applied in order
        self.stats = {"bytes_sent": 0, "seconds": 0.0, "skipped_buckets": 0, "refreshes": 0,
                      "refreshes_from_inverse": 0}
        self.last_step = {"bytes_sent": 0, "seconds": 0.0, "skipped": False}
        # What an fp32 ring all-reduce of the same parameters sends per rank and step.
        numel = sum(r * c for r, c in shapes)
        self._baseline_per_step = 2.0 * (size - 1) / size * 4.0 * numel if size > 1 else 0.0
        self._reported_at = time.perf_counter()
        self._layer_errors = []  # this step's (layer, rel_fro_error), measured steps only
        self._measure = False
        # DDP bucket layouts already mapped to layers: (buffer address, numel, parameter ids)
        # -> (layers, offsets, sizes) (_bucket_layout).
        self._layouts = {}

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
        done = step + 1
        record = {
            "step": step, "loss": loss, "step_seconds": seconds,
            "exchange_seconds": self.last_step["seconds"],
            "tokens_per_second": (tokens / seconds) if tokens and seconds > 0 else 0.0,
            "bytes_sent": self.stats["bytes_sent"],
            "bytes_baseline": int(self._baseline_per_step * done),
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
        return {
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
        }

    def load_state_dict(self, state):
        """Restores state_dict()'s output; the model must have the same parameters."""
        if state.get("format") not in (1, _STATE_FORMAT):
            raise ValueError("state.format: %r is not 1 or %d" % (state.get("format"),
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
        if "residuals" in state:  # format 1 has none: error feedback starts again from zero
            self._engine.import_residuals([tuple(r) for r in state["residuals"]])
        self._scheduled = [tuple(t) for t in state["scheduled"]]
        self.step = int(state["step"])
        self._in_step = False


_LAYOUT_CACHE_MAX = 64  # bucket layouts a state remembers (DDP keeps a handful at a time)


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
    offsets = [(g.data_ptr() - base) // 4 for g in grads]
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


def _account(state, result, buf, layers, offsets, sizes, exact):
    """A finished bucket: measured errors, the NaN fill of a skipped bucket, the statistics."""
    if exact is not None and not result["skipped"]:
        _measure_layers(state, layers, exact, buf, offsets, sizes)
    if result["skipped"]:
        buf.fill_(float("nan"))
        state.stats["skipped_buckets"] += 1
        state.last_step["skipped"] = True
    state.stats["bytes_sent"] += result["bytes_sent"]
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
    buf = bucket.buffer()
    if buf.device != state.device:
        if buf.device.type == "cuda" and not _geofp8.has_cuda:
            raise RuntimeError("device: bucket %d is on %s; CUDA tensors need a CUDA build of "
                               "geofp8 and torch (this geofp8 was built without CUDA/NCCL)"
                               % (bucket.index(), buf.device))
        raise RuntimeError("device: bucket %d is on %s; this GeoFP8State was made for a model on "
                           "%s" % (bucket.index(), buf.device, state.device))
    if buf.dtype != torch.float32:
        raise TypeError("gradient dtype: bucket %d is %s; the GeoFP8 hook takes float32 "
                        "gradients" % (bucket.index(), buf.dtype))
    if not state._in_step:
        state._begin_step()
    layers, offsets, sizes = _bucket_layout(state, bucket, buf)
    exact = _exact_average(state, buf) if state._measure else None
    step, index = state.step, bucket.index()
    fut = torch.futures.Future()
    trace = state.bucket_trace
    # The step's last bucket is exchanged in this call, after the queued ones: no backward is
    # left to overlap it with, and the calling thread saves the handoffs to the engine's
    # threads and back (the same Exchanger call, so the same bits).
    if not state.synchronous and not bucket.is_last():
        def done(result, error):
            # The engine's completer thread, with the GIL.
            if error is not None:
                fut.set_exception(error)
                return
            try:
                _account(state, result, buf, layers, offsets, sizes, exact)
                if trace is not None:
                    record.update(started=result["started"], finished=result["finished"],
                                  completed=time.monotonic(), skipped=result["skipped"])
                    trace.append(record)
            except BaseException as e:  # noqa: BLE001 - it belongs to the Future
                fut.set_exception(e)
                return
            fut.set_result(buf)

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
    if buf.device.type == "cuda":
        # Device pointers and torch's current stream as integers: the work is ordered after
        # the backward kernels that wrote the bucket, and done when this returns.
        stream = torch.cuda.current_stream(buf.device).cuda_stream
        result = state._engine.exchange_cuda(step, layers, buf.data_ptr(), buf.numel(),
                                             offsets, stream)
    else:
        result = state._engine.exchange(step, layers, buf.numpy(), offsets)
    finished = time.monotonic()
    _account(state, result, buf, layers, offsets, sizes, exact)
    _end_bucket(state, bucket)
    fut.set_result(buf)
    if trace is not None:
        now = time.monotonic()
        # The engine's start: after the queued buckets it waited for, not when this call began.
        started = result.get("started", started)
        trace.append({"step": step, "bucket": index, "called": called, "started": started,
                      "finished": finished, "returned": now, "completed": now,
                      "skipped": result["skipped"]})
    return fut
