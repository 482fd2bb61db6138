"""GeoFP8State.state_dict and load_state_dict: everything a resume needs, saved by layer name
(docs/pytorch.md, "The state")."""

import warnings

import torch

FORMAT = 4
# The counters a state_dict carries (format 3), so that a resumed run reports the bytes saved of
# a run without the restart.
CARRIED_STATS = ("bytes_sent", "bytes_baseline", "seconds", "skipped_buckets", "refreshes",
                 "refreshes_from_inverse")


def save(state):
    if state._in_step:
        raise RuntimeError("state_dict: step %d is in progress" % state.step)
    return _tensors_for_bytes({
        "format": FORMAT,
        "step": state.step,
        "names": list(state.names),
        "policy": list(state._policy),
        "policy_version": state.policy_version,
        "scheduled": [list(t) for t in state._scheduled],
        "geometry": [tuple(g) for g in state._engine.export_geometry()],
        # error_feedback's residuals (format 2): without them a resume would drop what the last
        # step's quantization lost, and differ from a run without the restart
        "residuals": [tuple(r) for r in state._engine.export_residuals()],
        # stats (format 3): the wire bytes and their fp32 baseline over every step so far, so
        # that a resumed run reports the same bytes saved as one without the restart
        "stats": {k: state.stats[k] for k in CARRIED_STATS},
        # who saved the residuals (format 4): they are this rank's own quantization errors, so
        # another rank or world size drops them (load); geometry is portable
        "rank": state.rank,
        "world_size": state.world_size,
    })


def load(state, saved):
    saved = _bytes_for_tensors(saved)
    if saved.get("format") not in (1, 2, 3, FORMAT):
        raise ValueError("state.format: %r is not 1, 2, 3 or %d" % (saved.get("format"), FORMAT))
    if list(saved["names"]) != state.names:
        raise ValueError("state.names: the saved parameters (%d) differ from the model's (%d)"
                         % (len(saved["names"]), len(state.names)))
    policy = tuple(saved["policy"])
    state.policy_version = int(saved["policy_version"])
    if policy[0] == "coordinator":
        spec = state._job.job_spec if state._job is not None else ""
        state._layers = state._engine.set_coordinator_policy(policy[1], list(policy[2]), spec)
    else:
        state._layers = state._engine.set_policy(policy[0], policy[1], state.model_name,
                                                 state.policy_version)
    state._policy = policy
    state._engine.import_geometry([tuple(g) for g in saved["geometry"]])
    mine = (state.rank, state.world_size)
    saved_by = (int(saved["rank"]), int(saved["world_size"])) if saved["format"] >= 4 else mine
    if "residuals" not in saved:  # format 1 has none: error feedback starts again from zero
        pass
    elif saved_by != mine:
        warnings.warn("load_state_dict: the error-feedback residuals were saved by rank %d of %d "
                      "and this is rank %d of %d; they are dropped (error feedback starts again "
                      "from zero), the geometry is kept" % (saved_by + mine), stacklevel=3)
    else:
        state._engine.import_residuals([tuple(r) for r in saved["residuals"]])
    state._scheduled = [tuple(t) for t in saved["scheduled"]]
    state.step = int(saved["step"])
    # Formats 1 and 2 carry no counters: both start again from zero, so bytes_sent and
    # bytes_baseline still span the same steps (those since this resume).
    stats = saved.get("stats") or {}
    for k in CARRIED_STATS:
        state.stats[k] = type(state.stats[k])(stats.get(k, 0))
    state._in_step = False


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
