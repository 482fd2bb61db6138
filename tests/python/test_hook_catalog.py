"""geofp8.torch under a command job: the catalog the state sends names its model (issue #29),
GeoFP8State's model_name or by default the script's file name, so that the coordinator's
messages ("matches no layer of <model>") name it as GeoFP8State's own errors do. The worker's
hook channel is replaced by a fake that records what the state sends. One gloo rank."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_testlib as L  # noqa: E402


class FakeHook:
    """What GeoFP8State._attach calls on geofp8.HookClient, for a one-rank job."""

    def __init__(self):
        self.catalogs = []
        self.resume_step, self.checkpoint_dir = 0, ""

    def wait_for_welcome(self, timeout_s):
        return {"job_id": "job-1", "attempt": 0, "rank": 0, "world_size": 1, "resume_step": 0}

    def wait_for_policy(self, timeout_s):
        return True

    def send_catalog(self, layers, model_name=""):
        self.catalogs.append((layers, model_name))

    def close(self):
        pass


def work(rank, world):
    import geofp8.torch as gt
    failures = []
    hooks = []

    def fake():
        hooks.append(FakeHook())
        return hooks[-1]

    gt._geofp8.HookClient.from_environment = staticmethod(fake)
    for kwargs, want in (({}, os.path.basename(sys.argv[0])), ({"model_name": "my-gpt"}, "my-gpt")):
        state = gt.GeoFP8State(model=L.tiny_model(), policy="fp8", coordinator=True, **kwargs)
        state.close()
        layers, name = hooks[-1].catalogs[-1]
        print("catalog of %d layers named %r (GeoFP8State%r)" % (len(layers), name, kwargs))
        if name != want or not layers:
            failures.append("model name %r, wanted %r (%r)" % (name, want, kwargs))
    return failures


if __name__ == "__main__":
    L.exit_with_failures(1, work)
