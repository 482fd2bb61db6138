"""GeoFP8State.state_dict and load_state_dict: everything a resume needs, saved by layer name
(docs/pytorch.md, "The state")."""

import warnings

import torch

FORMAT = 5
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
        # Tuples, as every value below that holds bytes: torch.distributed.checkpoint keeps a
        # tuple (or a list without tensors) as one item, where it would take a list holding a
        # tensor apart and load each tensor in place, refusing one whose size differs from the
        # fresh state's (a coordinator policy's, a geometry's).
        "policy": tuple(state._policy),
        "policy_version": state.policy_version,
        "scheduled": [tuple(t) for t in state._scheduled],
        # The same on every rank (each refreshes from the same average), so portable.
        "geometry": [tuple(g) for g in state._engine.export_geometry()],
        "world_size": state.world_size,
        # What is this rank's own (format 5), under its rank's key: the error-feedback residuals
        # (format 2: without them a resume would drop what the last step's quantization lost,
        # and differ from a run without the restart) and the counters (format 3: the wire bytes
        # and their fp32 baseline over every step so far, so that a resumed run reports the
        # bytes saved of one without the restart). A distributed checkpoint keeps one copy of
        # an item that every rank saves under the same key, so one rank's residuals there
        # would be loaded by all; under per-rank keys each rank gets its own back.
        "per_rank": {str(state.rank): {
            "residuals": [tuple(r) for r in state._engine.export_residuals()],
            "stats": {k: state.stats[k] for k in CARRIED_STATS},
        }},
    })


def load(state, saved):
    saved = _bytes_for_tensors(saved)
    if saved.get("format") not in (1, 2, 3, 4, FORMAT):
        raise ValueError("state.format: %r is not 1, 2, 3, 4 or %d" % (saved.get("format"),
                                                                       FORMAT))
    if list(saved["names"]) != state.names:
        raise ValueError("state.names: the saved parameters (%d) differ from the model's (%d)"
                         % (len(saved["names"]), len(state.names)))
    own, saved_by = _own_part(state, saved)
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
    if "residuals" not in own:  # format 1 has none: error feedback starts again from zero
        pass
    elif saved_by is not None:
        warnings.warn("load_state_dict: the error-feedback residuals were saved %s and this is "
                      "rank %d of %d; they are dropped (error feedback starts again from zero), "
                      "the geometry is kept" % (saved_by, state.rank, state.world_size),
                      stacklevel=3)
    else:
        state._engine.import_residuals([tuple(r) for r in own["residuals"]])
    state._scheduled = [tuple(t) for t in saved["scheduled"]]
    state.step = int(saved["step"])
    # Formats 1 and 2 carry no counters: both start again from zero, so bytes_sent and
    # bytes_baseline still span the same steps (those since this resume).
    stats = own.get("stats") or {}
    for k in CARRIED_STATS:
        state.stats[k] = type(state.stats[k])(stats.get(k, 0))
    state._in_step = False


def _own_part(state, saved):
    """(this rank's part of `saved`: residuals and stats, None or how another rank or world
    size saved them). Formats 2-4 hold one rank's part at the top level, format 4 with its rank
    and world size; format 5 per rank ("per_rank"), its world size beside."""
    rank, world = state.rank, state.world_size
    if saved["format"] < 5:
        if saved["format"] < 4 or (int(saved["rank"]), int(saved["world_size"])) == (rank, world):
            return saved, None
        return saved, "by rank %d of %d" % (int(saved["rank"]), int(saved["world_size"]))
    saved_world = int(saved["world_size"])
    parts = saved["per_rank"]
    own = parts.get(str(rank))
    if own is not None:
        if saved_world == world:
            return own, None
        # A distributed checkpoint loaded at another world size: this rank's key holds what
        # that rank saved there, or (loaded with allow_partial_load, beyond the saved ranks) the
        # fresh state's own.
        return own, ("by rank %d of %d" % (rank, saved_world) if rank < saved_world else
                     "at world size %d" % saved_world)
    # One rank's file loaded by another (torch.save per rank).
    if len(parts) == 1:
        (other, own), = parts.items()
        return own, "by rank %s of %d" % (other, saved_world)
    return {"residuals": []}, "by ranks %s of %d" % (", ".join(sorted(parts, key=int)),
                                                     saved_world)


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
