"""geofp8.torch bad input: each error names the field (and the value). One gloo rank."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_testlib as L  # noqa: E402


def expect(failures, what, fn, *needles):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        msg = "%s: %s" % (type(e).__name__, e)
        missing = [n for n in needles if n not in msg]
        if missing:
            failures.append("%s: message lacks %s: %s" % (what, missing, msg))
        else:
            print("ok  %-28s %s" % (what, msg.splitlines()[0][:150]))
        return
    failures.append("%s: no error" % what)


def work(rank, world):
    import torch
    import geofp8.torch as gt
    failures = []
    model = L.tiny_model()
    mk = lambda policy, m=model: gt.GeoFP8State(model=m, policy=policy)  # noqa: E731
    expect(failures, "glob matching nothing",
           lambda: mk({"policy": {"layers": [{"match": "blocks.*.attn", "geometry": "lowrank"}]}}),
           "policy.layers[0].match", "blocks.*.attn", "0.weight")
    expect(failures, "bad format", lambda: mk({"policy": {"default": {"format": "fp9"}}}),
           "policy.default.format", "fp9")
    expect(failures, "bad rank", lambda: mk("policy:\n  layers:\n    - {match: '0.*', rank: 0}\n"),
           "policy.layers[0].rank", "must be in [1, 4096]")
    expect(failures, "unknown key", lambda: mk({"defaults": {}}), "spec.defaults",
           "unknown field")
    expect(failures, "unknown preset", lambda: mk("fp7"), "policy", "fp7", "geofp8")
    expect(failures, "missing file", lambda: mk("/nonexistent/p.yaml"), "policy",
           "/nonexistent/p.yaml")
    expect(failures, "policy type", lambda: mk(3), "policy", "int")
    m64 = L.tiny_model().double()
    expect(failures, "float64 gradients", lambda: gt.GeoFP8State(model=m64, policy="fp8"),
           "gradient dtype", "0.weight", "float64")
    mmeta = torch.nn.Linear(4, 4, device="meta")
    expect(failures, "meta device", lambda: gt.GeoFP8State(model=mmeta, policy="fp8"),
           "device", "weight", "meta")
    expect(failures, "no model", lambda: gt.GeoFP8State(policy="fp8"), "model")
    expect(failures, "blas_threads 0",
           lambda: gt.GeoFP8State(model=model, policy="fp8", blas_threads=0), "blas_threads", "0")
    expect(failures, "blas_threads str",
           lambda: gt.GeoFP8State(model=model, policy="fp8", blas_threads="2"), "blas_threads",
           "'2'")
    expect(failures, "set_blas_threads 0", lambda: gt._geofp8.set_blas_threads(0),
           "blas_threads", "(0)")
    state = gt.GeoFP8State(model=model, policy="fp8")
    expect(failures, "set_policy bad field",
           lambda: state.set_policy({"policy": {"default": {"scaling": "diagonal"}}}, 3),
           "policy.default.scaling", "diagonal")
    expect(failures, "set_policy past step", lambda: state.set_policy("fp32", -1),
           "effective_step")
    sd = state.state_dict()
    sd2 = dict(sd, names=sd["names"][:-1])
    expect(failures, "state of another model", lambda: state.load_state_dict(sd2), "state.names")
    sd3 = dict(sd, geometry=[(b"junk", b"", 0, b"")] + sd["geometry"][1:])
    expect(failures, "corrupt geometry", lambda: state.load_state_dict(sd3), "0.weight")
    if torch.cuda.is_available() and not gt._geofp8.has_cuda:
        mc = L.tiny_model().cuda()
        expect(failures, "cuda tensors", lambda: gt.GeoFP8State(model=mc, policy="fp8"),
               "CUDA tensors need a CUDA build")
    return failures


def main():
    L.require_torch()
    failures = L.spawn(1, work)[0]
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
