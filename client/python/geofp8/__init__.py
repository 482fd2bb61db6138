"""GeoFP8 for Python: the project's gradient exchange engine (kernels/exchange) and, in
geofp8.torch, a DDP communication hook on top of it. See docs/pytorch.md.

Installed: /usr/bin/python3 -m pip install --no-build-isolation . (pyproject.toml, setup.py).
From a build tree: PYTHONPATH=build/client/python /usr/bin/python3 -c 'import geofp8.torch'
"""

import importlib
import json
import os

from . import _version

if _version.build != "cpu":
    # torch first, where it is installed: PyPI's torch CUDA wheel ships its own NCCL, newer than
    # the toolkit's this build links, and the process keeps whichever libnccl.so.2 loads first.
    # Loaded after ours, torch fails to import (undefined symbol: ncclCommResume); ours runs on
    # torch's newer one.
    # (importlib: the name `torch` in this package is geofp8.torch, the hook module.)
    try:
        importlib.import_module("torch")
    except ImportError:
        pass
from ._geofp8 import Engine, Error, HookClient, accepted_presets, has_cuda, layer_matches
from ._version import __version__

__all__ = ["Engine", "Error", "HookClient", "__version__", "accepted_presets", "build_info",
           "has_cuda", "layer_matches", "policy_source"]

# Which build this is (docs/pytorch.md, "CUDA"): has_cuda is True in a CUDA build (CUDA tensors
# go through NCCL and the device plane), False in a CPU one (the Gloo engine on CPU tensors).
# build_info["build"] is "cuda<major.minor>" (the CUDA toolkit it was compiled with) or "cpu".
build_info = {
    "version": __version__,
    "build": _version.build,
    "cuda": _version.cuda_version,
    "cuda_architectures": _version.cuda_architectures,
}

# How to get the CUDA build, for the errors that a CPU build gives on CUDA tensors.
_CUDA_BUILD_HINT = ("reinstall geofp8 where the CUDA toolkit's nvcc and NCCL are found, "
                   "forcing the CUDA build with GEOFP8_ENABLE_CUDA=ON pip install "
                   "--no-build-isolation . (docs/pytorch.md, \"CUDA\"), or run in the GPU "
                   "worker image, geofp8-worker-cuda (docs/deploy.md)")


def policy_source(policy):
    """(kind, spec) for Engine.set_policy from what a user passes as a policy:

    - a preset name (fp32, bf16, fp8, geofp8, nvfp4, geonvfp4, fp8-ef, nvfp4-ef), as geofp8-train --policy;
    - a path ending in .yaml or .yml: the policy file geofp8-train --policy reads;
    - YAML text (anything with a newline or a colon) in that file's schema;
    - a dict in that schema (sent as JSON, which is YAML).

    Parsing and validation happen in C++ (platform/policy/exchange_policy), not here.
    """
    if isinstance(policy, dict):
        return "text", json.dumps(policy)
    if not isinstance(policy, str):
        raise TypeError(
            "policy: must be a preset name, a YAML path, YAML text or a dict (got %s)"
            % type(policy).__name__)
    if policy.endswith((".yaml", ".yml")) and "\n" not in policy:
        if not os.path.isfile(policy):
            raise ValueError("policy: cannot read file %s" % policy)
        return "file", policy
    if "\n" in policy or ":" in policy:
        return "text", policy
    return "preset", policy
