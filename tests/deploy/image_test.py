#!/usr/bin/python3
# The images scripts/image.sh builds, run as the Helm chart runs them: a coordinator container
# and two worker containers (host network) with the chart's arguments, user, read-only root and
# dropped capabilities, and a 2-rank command: job of torch DDP with the geofp8 hook through them;
# then an external job (docs/launchers.md): two attach-only worker containers with the
# PyTorchJob recipe's sidecar arguments, and torchrun in a container of the worker image whose
# ranks attach to them, take a live policy set and succeed.
# CudaImageTest: the GPU worker image (scripts/image.sh --only worker-cuda), on a machine without a
# GPU: geofp8's CUDA build in it, in both import orders with torch, on torch's own CUDA and NCCL
# libraries, and the CPU path (the same command: job) through containers of it.
# Label "image"; it builds the images when they are missing or stale (tens of minutes the first
# time), so it runs only with GEOFP8_IMAGE_TEST=1 (CudaImageTest: GEOFP8_IMAGE_TEST_CUDA=1) and is
# skipped (77) otherwise.
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import yaml

ROOT = os.environ.get("GEOFP8_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import helm_render  # noqa: E402  (tests/deploy/helm_render.py)


def common_sh(expr):
    """A value of scripts/lib/common.sh, the one place it is set (cache dir, torch version)."""
    return subprocess.run(["bash", "-c", 'source "$1/scripts/lib/common.sh"; echo "%s"' % expr,
                           "-", ROOT], capture_output=True, text=True, check=True).stdout.strip()


TAG = subprocess.run(["sed", "-n", r"s/^project(geofp8 VERSION \([0-9.]*\).*/\1/p",
                      os.path.join(ROOT, "CMakeLists.txt")],
                     capture_output=True, text=True, check=True).stdout.strip()
WORKER_IMAGE = "localhost/geofp8-worker:" + TAG
CUDA_WORKER_IMAGE = "localhost/geofp8-worker-cuda:" + TAG
COORDINATOR_IMAGE = "localhost/geofp8-coordinator:" + TAG
# The job's program, mounted read-only into the workers as the chart's ConfigMap example does: it
# says who and what it runs with, then trains the image's example GPT for a few steps over gloo
# with the geofp8 comm hook attached to the worker.
JOB_SCRIPT = r"""
import json, os, runpy, sys
import torch, geofp8, geofp8.torch
print("IDENTITY " + json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
    "torch": torch.__version__.split("+")[0], "geofp8": geofp8.__version__,
    "build": geofp8.build_info["build"], "rank": int(os.environ["RANK"])}), flush=True)
sys.argv = ["/usr/share/geofp8/examples/pytorch/train_gpt.py", "--steps", "12",
            "--log-every", "4", "--eval-every", "6"]
runpy.run_path(sys.argv[0], run_name="__main__")
print("TRAINED", flush=True)
"""
JOB_SPEC = """
name: image-test
world_size: 2
backend: gloo
command: [/usr/bin/python3, /opt/job/train.py]
training: {steps: 12}
policy:
  default: {format: fp8_e4m3, scaling: block, block: 128, geometry: lowrank, rank: 8}
"""
# The external job torchrun's ranks attach to; train_gpt.py takes 0.1 s per step at least, so a
# policy set after step 3 lands well before the last.
ATTACH_SPEC = """
name: image-attach
world_size: 2
launcher: external
training: {steps: 60}
policy:
  default: {format: fp8_e4m3, scaling: block, block: 64}
  margin: 3
"""


class Podman:
    """podman with the configuration scripts/image.sh writes (runc, no default ulimits) and its
    storage driver (GEOFP8_PODMAN_STORAGE)."""

    def __init__(self):
        self.env = dict(os.environ, CONTAINERS_CONF=os.path.join(
            common_sh("$GEOFP8_CACHE"), "podman", "containers.conf"))
        driver = os.environ.get("GEOFP8_PODMAN_STORAGE")
        self.podman = ["podman"] + (["--storage-driver", driver] if driver else [])
        self.names = []

    def __call__(self, *args, check=True, timeout=120):
        r = subprocess.run(self.podman + list(args), env=self.env, capture_output=True,
                           text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError("podman %s: exit %d\n%s%s" % (" ".join(args), r.returncode,
                                                                r.stdout, r.stderr))
        return r

    def start(self, name, run_args, image, args):
        self.names.append(name)
        self("run", "-d", "--name", name, *run_args, image, *args)

    def cleanup(self):
        for name in self.names:
            self("rm", "-f", "-t", "5", name, check=False)
        self.names = []


def token_mount(dirs):
    """The token's mount, as the chart mounts its Secret."""
    return (dirs["token"], "/etc/geofp8/token", True)


def chart_container(docs, component):
    """The pod spec and the one container of the chart's StatefulSet for component."""
    sts = next(d for d in docs if d["kind"] == "StatefulSet"
               and d["metadata"]["name"].endswith(component))
    spec = sts["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    return spec, c


def run_args(test, spec, c, mounts):
    """podman run flags for the chart's security settings (checked to be the ones this test
    knows how to translate) and the given host directories."""
    pod, sec = spec["securityContext"], c["securityContext"]
    test.assertEqual((pod["runAsNonRoot"], pod["runAsUser"], pod["runAsGroup"]),
                     (True, 10001, 10001))
    test.assertEqual(pod["seccompProfile"], {"type": "RuntimeDefault"})
    test.assertEqual(sec, {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                           "capabilities": {"drop": ["ALL"]}})
    args = ["--runtime", "runc", "--ulimit", "host", "--network", "host",
            "--user", "%d:%d" % (pod["runAsUser"], pod["runAsGroup"]),
            "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp",
            "--cap-drop", "all", "--security-opt", "no-new-privileges"]
    for host, path, ro in mounts:
        args += ["-v", "%s:%s:%s" % (host, path, "ro" if ro else "rw")]
    return args


def chart_args(c, replace, extra=()):
    out = []
    for a in c.get("args", []):
        flag, eq, value = a.partition("=")
        out.append("%s=%s" % (flag, replace.get(flag, value)) if eq else a)
    return out + list(extra)


def wait_file(path, what, container, podman, timeout=60):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > deadline:
            logs = podman("logs", container, check=False)
            raise AssertionError("%s did not write %s in %d s\n%s%s"
                                 % (what, path, timeout, logs.stdout, logs.stderr))
        time.sleep(0.1)
    time.sleep(0.1)
    with open(path) as f:
        return json.load(f)


class ImageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        started = time.time()
        subprocess.run([os.path.join(ROOT, "scripts/image.sh")], check=True)
        print("images ready in %.0f s" % (time.time() - started), flush=True)
        cls.podman = Podman()

    def image_run(self, image, script):
        r = self.podman("run", "--rm", "--runtime", "runc", "--ulimit", "host", "--read-only",
                        "--cap-drop", "all", "--entrypoint", "/bin/sh", image, "-c", script)
        return r.stdout

    def test_images_identity_and_contents(self):
        # Both: uid and gid 10001 (the chart's runAsUser and runAsGroup), an existing HOME.
        for image in (WORKER_IMAGE, COORDINATOR_IMAGE):
            out = self.image_run(image, 'id -u; id -g; echo "$HOME"; test -d "$HOME" && echo ok')
            self.assertEqual(out.split(), ["10001", "10001", "/home/geofp8", "ok"], image)
        # The coordinator: its daemon and geofp8ctl, no Python, no torch.
        out = self.image_run(COORDINATOR_IMAGE, "ls /usr/local/bin; command -v python3 || echo "
                             "no-python; geofp8-coordinator --help >/dev/null && echo help-ok")
        self.assertEqual(out.split(), ["geofp8-coordinator", "geofp8ctl", "no-python", "help-ok"])
        # The worker: the programs, and the torch the tests pin with the geofp8 package.
        # (torch's own scripts, torchrun and the like, are in /usr/local/bin too.)
        out = self.image_run(WORKER_IMAGE, "cd /usr/local/bin && ls geofp8*; python3 -c 'import "
                             "torch, geofp8.torch; print(torch.__version__.split(\"+\")[0])'")
        self.assertEqual(out.split(), ["geofp8-coordinator", "geofp8-tool", "geofp8-train",
                                       "geofp8-worker", "geofp8ctl",
                                       common_sh("$GEOFP8_TORCH_VERSION")])

    def start_coordinator(self, tag, tmp, names, image=COORDINATOR_IMAGE):
        """The chart's coordinator container, with a token, and host directories for the volumes
        (`names`, besides its own): returns the directories, the chart's worker pod spec and
        container, the coordinator's address and geofp8ctl in its container. A worker image
        (which holds geofp8-coordinator and geofp8ctl too) runs it with that entrypoint."""
        docs = [d for _, d in helm_render.Renderer(
            os.path.join(ROOT, "helm/geofp8"), [{"tokenSecret": "geofp8-token"}]).manifests()]
        cspec, cc = chart_container(docs, "coordinator")
        wspec, wc = chart_container(docs, "worker")
        # Host directories for the chart's volumes, owned by the pods' fsGroup as a
        # PersistentVolume with fsGroup 10001 would be; the token as its Secret mounts it.
        dirs = {n: os.path.join(tmp, n) for n in ("token", "coord") + names}
        for n, d in dirs.items():
            os.makedirs(d)
            if n != "token":
                shutil.chown(d, 10001, 10001)
        with open(os.path.join(dirs["token"], "token"), "w") as f:
            f.write("imagetest-" + os.urandom(16).hex() + "\n")
        os.chmod(dirs["token"], 0o755)
        os.chmod(os.path.join(dirs["token"], "token"), 0o644)
        self.assertIn("--token-file=/etc/geofp8/token/token", cc["args"])

        coord = tag + "-coordinator"
        entrypoint = [] if image == COORDINATOR_IMAGE else ["--entrypoint", "geofp8-coordinator"]
        self.podman.start(
            coord, run_args(self, cspec, cc, [(dirs["coord"], "/var/lib/geofp8", False),
                                              token_mount(dirs)]) + entrypoint,
            image,
            chart_args(cc, {"--listen": "127.0.0.1:0", "--metrics-listen": "127.0.0.1:0"},
                       ["--ready-file=/var/lib/geofp8/ready.json"]))
        address = wait_file(os.path.join(dirs["coord"], "ready.json"), "coordinator",
                            coord, self.podman)["grpc"]

        def ctl(*args):
            # geofp8ctl of the coordinator's image, in its container.
            return self.podman("exec", coord, "geofp8ctl", "-s", address, "--token-file",
                               "/etc/geofp8/token/token", *args).stdout
        return dirs, (wspec, wc), address, ctl

    def submit(self, ctl, dirs, spec):
        # geofp8ctl reads the spec in the coordinator's container: a copy in its data
        # directory, the one directory it has besides the token.
        with open(os.path.join(dirs["coord"], "job.yaml"), "w") as f:
            f.write(spec)
        return json.loads(ctl("-o", "json", "submit", "-f",
                              "/var/lib/geofp8/job.yaml"))["job"]["id"]

    def wait_final(self, ctl, job_id, timeout=600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            j = json.loads(ctl("-o", "json", "get", "job", job_id))
            if j.get("state") in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(1)
        return j

    def test_command_job_across_containers(self):
        self.command_job(WORKER_IMAGE, COORDINATOR_IMAGE, "cpu")

    def command_job(self, worker_image, coordinator_image, build):
        """The 2-rank command: job of torch DDP on CPU tensors with the geofp8 hook, through a
        coordinator container of coordinator_image and two of worker_image, whose geofp8 is
        `build` (build_info["build"])."""
        tag = "geofp8-imagetest-%d" % os.getpid()
        tmp = tempfile.mkdtemp(prefix=tag + "-")
        try:
            dirs, (wspec, wc), address, ctl = self.start_coordinator(tag, tmp, ("w0", "w1"),
                                                                     coordinator_image)
            self.assertIn("--allow-commands", wc["args"])
            # The job's script, read-only as the chart's ConfigMap example mounts it.
            dirs["job"] = os.path.join(tmp, "job")
            os.makedirs(dirs["job"])
            with open(os.path.join(dirs["job"], "train.py"), "w") as f:
                f.write(JOB_SCRIPT)
            for i in range(2):
                name = "%s-w%d" % (tag, i)
                self.podman.start(
                    name, run_args(self, wspec, wc, [
                        (dirs["w%d" % i], "/var/lib/geofp8", False), token_mount(dirs),
                        (dirs["job"], "/opt/job", True)]),
                    worker_image,
                    chart_args(wc, {"--coordinator": address, "--name": "w%d" % i,
                                    "--advertise-host": "127.0.0.1", "--metrics-host": "127.0.0.1",
                                    "--metrics-port": "0"},
                               ["--ready-file=/var/lib/geofp8/ready.json"]))
                wait_file(os.path.join(dirs["w%d" % i], "ready.json"), "worker %d" % i, name,
                          self.podman)

            job_id = self.submit(ctl, dirs, JOB_SPEC)
            j = self.wait_final(ctl, job_id)
            outs = [ctl("logs", job_id, "--rank", str(r)) for r in range(2)]
            self.assertEqual(j.get("state"), "succeeded",
                             (j, outs, [ctl("logs", job_id, "--rank", str(r), "--stderr")
                                        for r in range(2)]))
            for rank, out in enumerate(outs):
                ident = json.loads(next(line for line in out.splitlines()
                                        if line.startswith("IDENTITY "))[len("IDENTITY "):])
                self.assertLessEqual(set(ident.pop("groups")), {10001}, out)
                self.assertEqual(ident, {"uid": 10001, "gid": 10001,
                                         "torch": common_sh("$GEOFP8_TORCH_VERSION"),
                                         "geofp8": TAG, "build": build, "rank": rank}, out)
                self.assertIn("TRAINED", out)
            print(outs[0], flush=True)
        finally:
            self.podman.cleanup()
            shutil.rmtree(tmp, ignore_errors=True)

    def test_attached_torchrun_job_across_containers(self):
        # The sidecar of the PyTorchJob recipe (its flags are checked against --help by
        # deploy_test.py), one per local rank, on a shared hook directory as on its emptyDir.
        with open(os.path.join(ROOT, "examples/launchers/pytorchjob.yaml")) as f:
            recipe = yaml.safe_load(f)
        pod = recipe["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        sidecar = next(c for c in pod["containers"] if c["name"] == "geofp8-worker")
        self.assertIn("--token-file=/etc/geofp8/token/token", sidecar["args"])
        tag = "geofp8-imagetest-attach-%d" % os.getpid()
        tmp = tempfile.mkdtemp(prefix=tag + "-")
        try:
            dirs, (wspec, wc), address, ctl = self.start_coordinator(tag, tmp, ("hook", "a0", "a1"))
            for i in range(2):
                name = "%s-a%d" % (tag, i)
                self.podman.start(
                    name, run_args(self, wspec, wc, [
                        (dirs["a%d" % i], "/var/lib/geofp8", False), token_mount(dirs),
                        (dirs["hook"], "/run/geofp8", False)]),
                    WORKER_IMAGE,
                    chart_args(sidecar, {"--coordinator": address, "--name": "a%d" % i,
                                         "--attach": "/run/geofp8/hook.%d.sock" % i,
                                         "--data-dir": "/var/lib/geofp8",
                                         "--metrics-host": "127.0.0.1", "--metrics-port": "0"},
                               ["--ready-file=/var/lib/geofp8/ready.json"]))
                wait_file(os.path.join(dirs["a%d" % i], "ready.json"), "attach-only worker %d"
                          % i, name, self.podman)
            job_id = self.submit(ctl, dirs, ATTACH_SPEC)

            # torchrun as examples/launchers/torchrun.sh runs it, in a container of the worker
            # image with the chart's user, read-only root and dropped capabilities.
            trainer = tag + "-torchrun"
            env = {"GEOFP8_JOB": "image-attach", "OMP_NUM_THREADS": "1",
                   "GEOFP8_HOOK_ADDRESS": "unix:/run/geofp8/hook.{local_rank}.sock",
                   "GEOFP8_TOKEN_FILE": "/etc/geofp8/token/token",
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
            self.podman.start(
                trainer, run_args(self, wspec, wc, [token_mount(dirs),
                                                    (dirs["hook"], "/run/geofp8", False)])
                + [a for k, v in env.items() for a in ("--env", "%s=%s" % (k, v))]
                + ["--entrypoint", "torchrun"],
                WORKER_IMAGE,
                ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                 "/usr/share/geofp8/examples/pytorch/train_gpt.py", "--steps", "60",
                 "--step-sleep", "0.1", "--layers", "1", "--d-model", "32", "--seq", "16",
                 "--batch", "4", "--log-every", "10", "--eval-every", "0"])

            def logs():
                r = self.podman("logs", trainer, check=False)
                return r.stdout + r.stderr

            # (torchrun's output is read only for a failure's message: a podman call per poll
            # would load the machine the test runs on.)
            deadline = time.time() + 300
            while True:
                j = json.loads(ctl("-o", "json", "get", "job", job_id))
                if int(j.get("progress", {}).get("step", -1)) >= 3:
                    break
                if (j.get("state") in ("succeeded", "failed", "cancelled")
                        or time.time() > deadline):
                    self.fail("job %s: %s before step 3\n%s\n%s"
                              % (job_id, j.get("state"), j, logs()))
                time.sleep(0.5)
            self.assertEqual(j["state"], "running", j)
            self.assertEqual({r["worker_id"] for r in j["ranks"]}, {"a0", "a1"}, j)
            ctl("policy", "set", job_id, "--layer", "*", "--format", "nvfp4", "--reason",
                "image test: nvfp4")
            try:
                code = self.podman("wait", trainer, timeout=300).stdout.strip()
            except subprocess.TimeoutExpired:
                self.fail("torchrun did not exit within 300 s of the policy set\n" + logs())
            out = logs()
            self.assertEqual(code, "0", out)
            j = self.wait_final(ctl, job_id)
            self.assertEqual(j.get("state"), "succeeded", (j, out))
            self.assertEqual(int(j["policy_version"]), 2, j)
            self.assertEqual(int(j["progress"]["step"]), 60, j)
            taken = dict(re.findall(r"geofp8: rank (\d): policy v2 \(image test: nvfp4\) in "
                                    r"force from step (\d+)", out))
            self.assertEqual(set(taken), {"0", "1"}, out)
            self.assertEqual(taken["0"], taken["1"], out)
            # ... the step the coordinator records for v2.
            v2 = json.loads(ctl("-o", "json", "policy", "get", job_id, "--version", "2"))
            self.assertEqual(int(v2["taken_step"]), int(taken["0"]), (v2, out))
            print(out[-3000:], flush=True)
        finally:
            self.podman.cleanup()
            shutil.rmtree(tmp, ignore_errors=True)


# ldd's "NAME => PATH" lines.
LDD_LINE = re.compile(r"^\s*(\S+) => (.*?)(?: \(0x[0-9a-f]+\))?$", re.M)
# Where torch's wheels put the CUDA libraries in the image (pip as root, Debian's python3).
TORCH_NVIDIA = "/usr/local/lib/python3.11/dist-packages/nvidia/"


class CudaImageTest(ImageTest):
    """geofp8-worker-cuda, built here without a GPU (scripts/image.sh --only worker-cuda): the
    CUDA build in it, on torch's CUDA and NCCL, and the CPU path through it."""

    @classmethod
    def setUpClass(cls):
        if os.environ.get("GEOFP8_IMAGE_TEST_CUDA") != "1":
            raise unittest.SkipTest("the GPU worker image: run with GEOFP8_IMAGE_TEST_CUDA=1")
        started = time.time()
        subprocess.run([os.path.join(ROOT, "scripts/image.sh"), "--only", "worker-cuda"],
                       check=True)
        print("image ready in %.0f s" % (time.time() - started), flush=True)
        cls.podman = Podman()

    def test_images_identity_and_contents(self):
        out = self.image_run(CUDA_WORKER_IMAGE, 'id -u; id -g; echo "$HOME"; cd /usr/local/bin '
                             '&& ls geofp8*')
        self.assertEqual(out.split(), ["10001", "10001", "/home/geofp8", "geofp8-coordinator",
                                       "geofp8-tool", "geofp8-train", "geofp8-worker",
                                       "geofp8ctl"])

    def test_cuda_build_in_both_import_orders(self):
        # has_cuda and the build's name, with torch imported first and with geofp8 first; and
        # the extension itself loaded (its libnccl with it) before torch is: the order that
        # broke torch where geofp8 was linked against an older NCCL (undefined symbol
        # ncclCommResume).
        script = ("import json, sys, importlib\n"
                  "label = first, second = sys.argv[1:]\n"
                  "if first == 'extension':\n"
                  "    import ctypes, glob\n"
                  "    ctypes.CDLL(glob.glob('/usr/local/lib/python3.11/dist-packages/geofp8/"
                  "_geofp8*.so')[0], mode=ctypes.RTLD_GLOBAL)\n"
                  "    first = 'geofp8'\n"
                  "a, b = importlib.import_module(first), importlib.import_module(second)\n"
                  "torch, geofp8 = (a, b) if first == 'torch' else (b, a)\n"
                  "print('ORDER', *label, geofp8.has_cuda, json.dumps(geofp8.build_info), "
                  "torch.version.cuda, '.'.join(map(str, torch.cuda.nccl.version())))\n")
        out = self.image_run(CUDA_WORKER_IMAGE, "cat >/tmp/o.py <<'EOF'\n%sEOF\n"
                             "python3 /tmp/o.py torch geofp8 && python3 /tmp/o.py geofp8 torch "
                             "&& python3 /tmp/o.py extension torch" % script)
        lines = [line for line in out.splitlines() if line.startswith("ORDER ")]
        self.assertEqual(len(lines), 3, out)
        for line in lines:
            print(line, flush=True)
            _, first, second, has_cuda, rest = line.split(" ", 4)
            info, torch_cuda, nccl = rest.rsplit(" ", 2)
            info = json.loads(info)
            self.assertEqual(has_cuda, "True", line)
            self.assertEqual(info["build"], "cuda" + torch_cuda, line)
            self.assertEqual(info["cuda"], torch_cuda, line)
            self.assertEqual(info["version"], TAG, line)
            self.assertTrue(info["cuda_architectures"], line)

    def test_linked_against_torchs_cuda_libraries(self):
        # The extension's CUDA libraries resolve to the ones torch's wheels installed (the same
        # files torch loads); nothing the extension or the programs link is missing (the
        # programs link no CUDA library: --as-needed drops them), and there is no CUDA toolkit.
        out = self.image_run(CUDA_WORKER_IMAGE, "ldd /usr/local/lib/python3.11/dist-packages/"
                             "geofp8/_geofp8*.so; echo ==; for f in /usr/local/bin/geofp8*; do "
                             "echo \"$f:\"; ldd \"$f\"; done; "
                             "echo ==; ldd /usr/local/lib/python3.11/dist-packages/torch/lib/"
                             "libtorch_cuda.so; echo ==; ls -d /usr/local/cuda* 2>&1 || true")
        ext, programs, torch_cuda, toolkit = out.split("==\n")
        self.assertIn("/usr/local/bin/geofp8-worker:", programs)
        self.assertNotIn("not found", ext + programs, out)
        self.assertIn("No such file", toolkit)
        libs = dict(LDD_LINE.findall(ext))
        torch_libs = dict(LDD_LINE.findall(torch_cuda))
        for name in ("libnccl.so.2", "libcudart.so.13", "libcublas.so.13"):
            self.assertIn(name, libs, ext)
            self.assertTrue(libs[name].startswith(TORCH_NVIDIA), (name, libs[name]))
            print("%s => %s" % (name, libs[name]), flush=True)
        self.assertIn("libnccl.so.2", torch_libs, torch_cuda)
        for name in set(("libnccl.so.2", "libcudart.so.13")) & set(torch_libs):
            # (torch's run path goes through torch/lib/../../nvidia/...)
            self.assertEqual(os.path.normpath(libs[name]), os.path.normpath(torch_libs[name]),
                             (name, ext, torch_cuda))
        for name, path in LDD_LINE.findall(programs):
            if "nccl" in name or "cuda" in name:
                self.assertTrue(path.startswith(TORCH_NVIDIA), (name, path))

    def test_command_job_across_containers(self):
        # The CPU path: the command: job on CPU tensors, through the GPU image's coordinator and
        # workers.
        self.command_job(CUDA_WORKER_IMAGE, CUDA_WORKER_IMAGE,
                         "cuda" + self.image_run(CUDA_WORKER_IMAGE, "python3 -c 'import torch; "
                                                 "print(torch.version.cuda)'").strip())

    def test_attached_torchrun_job_across_containers(self):
        self.skipTest("ImageTest runs it on the CPU image")


if __name__ == "__main__":
    # CudaImageTest alone (deploy.CudaImageTest) has its own switch; without a class name both
    # classes run under GEOFP8_IMAGE_TEST=1, CudaImageTest skipped unless its switch is set too.
    switch = ("GEOFP8_IMAGE_TEST_CUDA" if sys.argv[1:] and "CudaImageTest" in sys.argv[1:]
              and "ImageTest" not in sys.argv[1:] else "GEOFP8_IMAGE_TEST")
    if os.environ.get(switch) != "1":
        print("skipped: builds and runs the container images (scripts/image.sh, tens of minutes "
              "the first time); run with %s=1" % switch)
        sys.exit(77)
    if os.geteuid() != 0:
        print("skipped: needs root (podman's system store, chown of the volumes to 10001)")
        sys.exit(77)
    unittest.main()
