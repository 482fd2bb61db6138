"""A GeoFP8State's link to the GeoFP8 `command:` job it runs under (GEOFP8_HOOK_ADDRESS, set by
the worker that started the script): the attach and its checks, the coordinator's policy
versions, agreed per step, and the reports (docs/pytorch.md, "Under the coordinator")."""

import atexit
import math
import os
import sys
import time

from . import _geofp8

# Attach mode (GEOFP8_JOB set: the user's launcher started this process, docs/launchers.md): the
# links stay open until the interpreter exits, and then report the rank's end. An uncaught
# exception (sys.excepthook) makes it a failure; the launcher still sees the exit code.
_attached_links = []
_uncaught = []


def _note_uncaught(previous):
    def hook(kind, value, tb):
        _uncaught.append("%s: %s" % (kind.__name__, value))
        previous(kind, value, tb)
    return hook


def _finish_attached():
    for link in _attached_links:
        link.finish()


def _keep_until_exit(link):
    if not _attached_links:
        sys.excepthook = _note_uncaught(sys.excepthook)
        atexit.register(_finish_attached)
    _attached_links.append(link)


def torchrun_restart_note(env):
    """The line rank 0 prints at attach when torchrun can restart its ranks onto the store their
    last attempt wrote, else None (docs/launchers.md, "torchrun's restarts").

    torchrun hands its workers one rendezvous store for all its restarts
    (TORCHELASTIC_USE_AGENT_STORE=True), and init_process_group keys nothing by attempt, so a
    restarted rank can read the Gloo address its dead peer published and fail in
    connectFullMesh (Connection refused) before GeoFP8 runs. The c10d rendezvous
    (--standalone or --rdzv-backend c10d) gives each attempt a store of its own with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; the static one has no such switch."""
    try:
        restarts_left = (int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
                         - int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restarts_left <= 0:
        return None
    return ("geofp8: torchrun --max-restarts %s keeps one rendezvous store across its restarts, "
            "so a restarted rank can read its dead peer's Gloo address and fail in "
            "init_process_group (connectFullMesh ... Connection refused); run torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --standalone or --rdzv-backend c10d "
            "(docs/launchers.md)" % env.get("TORCHELASTIC_MAX_RESTARTS"))


class JobLink:
    """The hook socket to this rank's worker, once attached."""

    def __init__(self, hook, job_id, job_spec, timeout_s):
        self.hook = hook
        self.job_id = job_id
        self.job_spec = job_spec  # the job's spec (GEOFP8_JOB_SPEC), for coordinator policies
        self.timeout_s = timeout_s
        self.finished = False

    def close(self):
        """GeoFP8State.close: a command job's channel closes now; an attached rank's stays open
        until the interpreter exits, when finish() reports how the rank ended."""
        if not getattr(self.hook, "attach_mode", False):
            self.hook.close()

    def finish(self):
        """Attach mode, at exit: the rank's end (a failure after an uncaught exception)."""
        if self.finished or self.hook.closed:
            return
        self.finished = True
        self.hook.finish(not _uncaught, _uncaught[0] if _uncaught else "")
        self.hook.close()

    @classmethod
    def attach(cls, required, rank, size, names, shapes, model_name, timeout_s):
        """The link, or None outside a job (an error if `required`). Checked against torch's
        process group before the engine's rendezvous, which a wrong world size would hang."""
        hook = _geofp8.HookClient.from_environment()
        if hook is None:
            if required:
                raise RuntimeError("coordinator: GEOFP8_HOOK_ADDRESS is not set; the script is "
                                   "not running under a GeoFP8 command job")
            return None
        address = os.environ.get("GEOFP8_HOOK_ADDRESS")
        try:
            welcome = hook.wait_for_welcome(timeout_s)
            attach_mode = getattr(hook, "attach_mode", False)  # False for older or fake hooks
            if welcome is None and attach_mode:
                if hook.refused:
                    raise RuntimeError("attach: rank %d of job %s was refused: %s"
                                       % (rank, os.environ.get("GEOFP8_JOB"), hook.refused))
                raise RuntimeError(
                    "attach: rank %d of job %s was not placed within %g s (attach_timeout_s): "
                    "either no attach-only worker serves %s, or the job's other ranks have not "
                    "all attached (geofp8ctl describe %s shows which)"
                    % (rank, os.environ.get("GEOFP8_JOB"), timeout_s, address,
                       os.environ.get("GEOFP8_JOB")))
            if welcome is None:
                raise RuntimeError("coordinator: no answer on the worker's hook socket %s within "
                                   "%g s (attach_timeout_s)" % (address, timeout_s))
            if welcome["world_size"] != size:
                raise ValueError(
                    "world size: torch's process group has %d ranks (WORLD_SIZE=%s) but GeoFP8 "
                    "job %s has %d (its spec.world_size); launch the script with one process per "
                    "rank of the job" % (size, os.environ.get("WORLD_SIZE", "unset"),
                                         welcome["job_id"], welcome["world_size"]))
            if welcome["rank"] != rank:
                raise ValueError("rank: torch's rank is %d but the GeoFP8 worker runs rank %d of "
                                 "job %s" % (rank, welcome["rank"], welcome["job_id"]))
            if not hook.wait_for_policy(timeout_s):
                raise RuntimeError("coordinator: no policy version of job %s arrived within %g s"
                                   % (welcome["job_id"], timeout_s))
            spec = ""
            path = os.environ.get("GEOFP8_JOB_SPEC")
            if path:
                with open(path) as f:
                    spec = f.read()
            # Every rank resolves the versions against the catalog; the worker forwards rank
            # 0's to the coordinator (which computes the refresh schedules from it).
            hook.send_catalog([(n, r, c) if r > 1 else (n, r * c, 1)
                               for n, (r, c) in zip(names, shapes)], model_name)
        except BaseException:
            hook.close()
            raise
        print("geofp8: rank %d attached to job %s (attempt %d, resume step %d)"
              % (rank, welcome["job_id"], welcome["attempt"], welcome["resume_step"]),
              flush=True)
        link = cls(hook, welcome["job_id"], spec, timeout_s)
        if attach_mode:
            _keep_until_exit(link)
            note = torchrun_restart_note(os.environ) if rank == 0 else None
            if note:
                print(note, file=sys.stderr, flush=True)
        return link

    def take_agreed(self, state, stream):
        """At the start of a step: the coordinator's versions, as the worker's trainer takes
        them. One small collective agrees on the newest version every rank holds, and the hook
        client puts a version in force at the first step at or after its effective step where
        all do (hook_client.h, PolicyAgreedAt), on every rank at the same step."""
        agreed = state._engine.agree_min(self.hook.newest_held(), stream)
        change = self.hook.policy_agreed_at(state.step, agreed)
        if change is None:
            return
        if (state._policy[0] == "coordinator" and state.policy_version == change["version"]
                and state._policy[1] == change["policy"]):
            return  # resumed from a checkpoint written under this very version
        refresh = list(change["refresh"])
        if not refresh and any(l["geometry"] != "none" for l in change["layers"]):
            # The coordinator computes the schedules once rank 0's catalog reaches it.
            got = self.hook.wait_for_refresh(self.timeout_s)
            if got is None:
                raise RuntimeError("policy v%d: no geometry refresh schedule arrived from the "
                                   "coordinator within %g s" % (change["version"],
                                                               self.timeout_s))
            refresh = list(got)
        state._layers = state._engine.set_coordinator_policy(change["policy"], refresh,
                                                             self.job_spec)
        state.policy_version = change["version"]
        state._policy = ("coordinator", change["policy"], refresh)
        print("geofp8: rank %d: policy v%d (%s) in force from step %d"
              % (state.rank, change["version"], change["reason"], state.step), flush=True)


def report(state, loss, step, tokens, val_loss):
    """GeoFP8State.report's record, sent to the coordinator when the state is attached."""
    now = time.perf_counter()
    seconds = now - state._reported_at
    state._reported_at = now
    if step is None:
        step = state.step - 1
    loss = float(loss.item() if hasattr(loss, "item") else loss)
    if val_loss is not None:
        val_loss = float(val_loss.item() if hasattr(val_loss, "item") else val_loss)
        if not math.isfinite(val_loss):
            raise ValueError("val_loss: must be finite (%r)" % val_loss)
    record = {
        "step": step, "loss": loss, "step_seconds": seconds,
        "exchange_seconds": state.last_step["seconds"],
        "tokens_per_second": (tokens / seconds) if tokens and seconds > 0 else 0.0,
        "bytes_sent": state.stats["bytes_sent"],
        "bytes_baseline": state.stats["bytes_baseline"],
        "layer_errors": list(state._layer_errors),
        "val_loss": val_loss,
    }
    job = state._job
    if job is not None:
        job.hook.report_step(step, loss, record["tokens_per_second"], record["bytes_sent"],
                             record["bytes_baseline"], seconds, record["exchange_seconds"],
                             val_loss)
        if state.rank == 0 and state._layer_errors:
            job.hook.report_layers([(n, step, e, 0.0) for n, e in state._layer_errors])
    state._layer_errors = []
    return record


def layer_summary(state, record):
    """GeoFP8State.layer_summary."""
    errors = sorted(record.get("layer_errors") or [], key=lambda t: -t[1])
    if not errors:
        return ""
    info = {l["name"]: l for l in state.layers}
    worst = ", ".join("%s %.4f (%s, %s)" % (n, e, info[n]["format"],
                                            info[n]["effective_geometry"])
                      for n, e in errors[:8])
    return ("geofp8: step %d: exchange error (relative Frobenius, %d layers; worst first): %s"
            % (record["step"], len(errors), worst))
