"""The pip-installable package (issue 29): pyproject.toml + setup.py make a wheel with Debian's
setuptools/wheel/build, the wheel installs into a fresh venv (--system-site-packages, for
Debian's torch), and a 2-rank DDP step with the geofp8 hook runs under torchrun from a directory
outside the source tree, importing the installed copy; under policy fp32 the gradients equal
the exact fp32 mean with DDP's defaults, a frozen parameter + find_unused_parameters=True,
gradient_as_bucket_view=True and no_sync() accumulation. The installed extension carries no
debug sections (the ctest tree it comes from is RelWithDebInfo), and the build prints progress.
The wheel is the auto-detected build (issue 44): the CUDA one where nvcc and NCCL are found (the
tree's CUDA objects are nvcc's, no device needed), and the installed copy reports it
(geofp8.has_cuda, geofp8.build_info); setup.py's detection agrees with the tree's CMake, its
GEOFP8_ENABLE_CUDA values are checked, and forcing the other build against the tree is refused.

Environment: GEOFP8_SOURCE (repository root), GEOFP8_CMAKE_BUILD_DIR (the ctest build tree,
reused so the test does not rebuild the engine), GEOFP8CTL (geofp8ctl, whose version the
package's must equal). Exit 77 (skipped) without torch, venv or build.
"""

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Runs on each rank under torchrun, cwd outside the tree. Policy fp32 first: with 2 ranks the
# fp32 mean (a + b) / 2 is correctly rounded in any order (one addition, an exact halving), so
# the hook's gradients equal the local gradients' all-reduced mean exactly. Then one geofp8
# step: every gradient finite and equal on both ranks (they all decode the same bytes).
RANK_SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import geofp8, geofp8.torch as gt

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
ref = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
ref.load_state_dict(model.state_dict())
g = torch.Generator().manual_seed(100 + rank)
x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)

((ref(x) - y) ** 2).mean().backward()
want = [p.grad.clone() for p in ref.parameters()]
for w in want:
    dist.all_reduce(w)
    w /= world

out = {"file": geofp8.__file__, "version": geofp8.__version__, "has_cuda": geofp8.has_cuda,
       "build_info": geofp8.build_info}
for policy in ("fp32", "geofp8"):
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    m.load_state_dict(ref.state_dict())
    ddp = DDP(m)
    ddp.register_comm_hook(gt.GeoFP8State(model=m, policy=policy), gt.geofp8_hook)
    ((ddp(x) - y) ** 2).mean().backward()
    got = [p.grad.clone() for p in m.parameters()]
    if policy == "fp32":
        out["fp32_exact"] = all(torch.equal(a, b) for a, b in zip(got, want))
    else:
        out["geofp8_finite"] = all(bool(torch.isfinite(a).all()) for a in got)
        flat = torch.cat([a.flatten() for a in got])
        other = flat.clone()
        dist.broadcast(other, 0)
        out["geofp8_same_on_ranks"] = torch.equal(flat, other)
# DDP options under policy fp32, each against the same computation without DDP (exact, as
# above): a frozen parameter and a module the forward never uses (find_unused_parameters=True),
# gradient_as_bucket_view=True, and two micro-batches accumulated under no_sync().
# (Without find_unused_parameters a parameter the forward skips keeps its bucket from ever
# becoming ready, so only that case has one.)
class Net(torch.nn.Module):
    def __init__(self, unused):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 8))
        if unused:
            self.unused = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.body(x)


def variant(frozen=False, accumulate=False, **ddp_kwargs):
    unused = ddp_kwargs.get("find_unused_parameters", False)
    base = Net(unused)
    base.body.load_state_dict(ref.state_dict())
    if frozen:
        base.body[0].bias.requires_grad_(False)
    plain = Net(unused)
    plain.load_state_dict(base.state_dict())
    if frozen:
        plain.body[0].bias.requires_grad_(False)
    ddp = DDP(base, **ddp_kwargs)
    ddp.register_comm_hook(gt.GeoFP8State(model=base, policy="fp32"), gt.geofp8_hook)
    x2, y2 = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
    if accumulate:
        with ddp.no_sync():
            ((ddp(x) - y) ** 2).mean().backward()
        ((ddp(x2) - y2) ** 2).mean().backward()
        ((plain(x) - y) ** 2).mean().backward()
        ((plain(x2) - y2) ** 2).mean().backward()
    else:
        ((ddp(x) - y) ** 2).mean().backward()
        ((plain(x) - y) ** 2).mean().backward()
    ok = True
    for (name, a), b in zip(base.named_parameters(), plain.parameters()):
        if b.grad is None:  # frozen or unused: nothing to compare but a zero at most
            ok = ok and (a.grad is None or not bool(a.grad.any()))
            continue
        w = b.grad.clone()
        dist.all_reduce(w)
        w /= world
        ok = ok and torch.equal(a.grad, w)
    return ok


out["ddp_options"] = {
    "find_unused_parameters+frozen": variant(frozen=True, find_unused_parameters=True),
    "gradient_as_bucket_view": variant(gradient_as_bucket_view=True),
    "no_sync": variant(accumulate=True),
}
with open(os.path.join(sys.argv[1], "rank%d.json" % rank), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
'''


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


# readelf -S -W: "[Nr] Name Type Address Off Size ES Flg Lk Inf Al" (Flg may be empty).
SECTION = re.compile(r"^\s*\[\s*\d+\]\s+(\S+)\s+(\S+)\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)"
                     r"\s+[0-9a-f]+\s+([A-Za-z]*)\s+\d+\s+\d+\s+\d+\s*$")


def sections(path):
    """(name, type, file offset, size, flags) of every named section of an ELF file."""
    out = subprocess.run(["readelf", "-S", "-W", path], check=True, capture_output=True,
                         text=True).stdout
    found = []
    for line in out.splitlines():
        m = SECTION.match(line)
        if m:
            found.append((m.group(1), m.group(2), int(m.group(3), 16), int(m.group(4), 16),
                          m.group(5)))
    if not found:
        raise RuntimeError("readelf -S -W %s: no section table read:\n%s" % (path, out))
    return found


def loaded_extent(path):
    """Where the file's last section that the loader maps ends: what a stripped file holds, but
    for a few small tables (section names, headers)."""
    return max(off + size for _, kind, off, size, flags in sections(path)
               if "A" in flags and kind != "NOBITS")


def check_stripped(installed, built):
    """The installed extension (issue #40 item 8): no debug sections, and no bigger than what
    the loader maps of the build tree's extension plus 64 KiB of tables."""
    names = [name for name, _, _, _, _ in sections(installed)]
    debug = [n for n in names if n.startswith((".debug", ".zdebug"))]
    assert not debug, "%s carries debug sections %s" % (installed, debug)
    bound = loaded_extent(built) + 64 * 1024
    size = os.path.getsize(installed)
    assert size <= bound, ("%s: %d bytes, more than the %d the loader maps of %s plus 64 KiB"
                           % (installed, size, bound - 64 * 1024, built))
    print("installed extension: %d bytes, no debug sections (the build tree's: %d bytes, %d "
          "of them loaded)" % (size, os.path.getsize(built), bound - 64 * 1024))


def load_setup(copy):
    """The copy's setup.py as a module (its setup() runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("geofp8_setup", os.path.join(copy, "setup.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def expected_build(setup_py, tree):
    """The build the wheel must be (issue 44): the tree's CMake auto-detects CUDA unless it was
    configured with GEOFP8_ENABLE_CUDA=OFF, and setup.py's find_cuda must find what CMake found
    on this machine, so a new tree (pip install from a clone) gets the same build. The CUDA
    build is "cuda" + the toolkit's version, read from nvcc here."""
    with open(os.path.join(tree, "CMakeCache.txt")) as f:
        m = re.search(r"^GEOFP8_ENABLE_CUDA:BOOL=(\S+)$", f.read(), re.M)
    tree_cuda = m is None or m.group(1).upper() in ("ON", "1", "TRUE", "YES")
    found, missing = setup_py.find_cuda()
    print("setup.py's find_cuda: found %s, missing %s; the tree's GEOFP8_ENABLE_CUDA %s"
          % (found, missing, "ON" if tree_cuda else "OFF"))
    if not tree_cuda or missing:
        return "cpu"
    out = subprocess.run([found["nvcc"], "--version"], check=True, capture_output=True,
                         text=True).stdout
    release = re.search(r"release (\d+\.\d+)", out)
    assert release, "nvcc --version: no 'release X.Y' in %r" % out
    return "cuda" + release.group(1)


def check_cuda_choice(setup_py, tmp):
    """setup.py's GEOFP8_ENABLE_CUDA: auto, ON or OFF in any case; a bad value names the
    variable and the value; ON where nvcc or NCCL is missing names what is, auto builds the CPU
    engine there. A fake toolkit with nvcc and nccl.h but no libnccl stands in for one."""
    for bad in ("maybe", "1"):
        try:
            setup_py.cuda_mode(bad)
        except RuntimeError as e:
            assert "GEOFP8_ENABLE_CUDA" in str(e) and repr(bad) in str(e), e
        else:
            raise AssertionError("GEOFP8_ENABLE_CUDA=%s: accepted" % bad)
    for value, mode in ((None, "auto"), ("", "auto"), ("Auto", "auto"), ("ON", "on"),
                        (" off ", "off")):
        assert setup_py.cuda_mode(value) == mode, (value, setup_py.cuda_mode(value))
    root = os.path.join(tmp, "fake-cuda")
    os.makedirs(os.path.join(root, "bin"))
    os.makedirs(os.path.join(root, "include"))
    with open(os.path.join(root, "bin", "nvcc"), "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod(os.path.join(root, "bin", "nvcc"), 0o755)
    open(os.path.join(root, "include", "nccl.h"), "w").close()
    nowhere = [os.path.join(tmp, "no-system")]
    for cuda_root, want_missing in ((root, ["libnccl"]),
                                    (os.path.join(tmp, "none"), ["nvcc", "nccl.h", "libnccl"])):
        found, missing = setup_py.find_cuda(cuda_root, path="", system_dirs=nowhere)
        assert [m.split()[0] for m in missing] == want_missing, (cuda_root, missing)
        assert setup_py.cuda_choice("auto", missing) == "OFF"
        assert setup_py.cuda_choice("off", missing) == "OFF"
        try:
            setup_py.cuda_choice("on", missing)
        except RuntimeError as e:
            assert "GEOFP8_ENABLE_CUDA=ON" in str(e), e
            assert all(w + " (not in " in str(e) for w in want_missing), e
        else:
            raise AssertionError("GEOFP8_ENABLE_CUDA=ON with %s missing: accepted" % missing)
    assert setup_py.cuda_choice("auto", []) == "ON" and setup_py.cuda_choice("on", []) == "ON"
    print("ok: GEOFP8_ENABLE_CUDA auto/ON/OFF, a bad value, ON with libnccl or all missing")


def main():
    try:
        import torch  # noqa: F401
        import venv  # noqa: F401
        import build  # noqa: F401
    except ImportError as e:
        print("skipped: %s" % e)
        return 77
    src = os.environ["GEOFP8_SOURCE"]
    ctl = os.environ["GEOFP8CTL"]
    want_version = json.loads(subprocess.check_output([ctl, "version", "-o", "json"]))[
        "clientVersion"]

    tmp = tempfile.mkdtemp(prefix="geofp8-pip-")
    try:
        # Only what the wheel is made of, so the test writes nothing into the source tree (the
        # build tree is given, so the engine's sources are not needed).
        copy = os.path.join(tmp, "src")
        os.makedirs(os.path.join(copy, "client", "python"))
        for f in ("pyproject.toml", "setup.py", "CMakeLists.txt", "README.md"):
            shutil.copy(os.path.join(src, f), copy)
        shutil.copytree(os.path.join(src, "client", "python", "geofp8"),
                        os.path.join(copy, "client", "python", "geofp8"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        setup_py = load_setup(copy)
        check_cuda_choice(setup_py, tmp)
        tree = os.environ["GEOFP8_CMAKE_BUILD_DIR"]
        want_build = expected_build(setup_py, tree)
        build_env = {k: v for k, v in os.environ.items() if k != "GEOFP8_ENABLE_CUDA"}
        # GEOFP8_ENABLE_CUDA=OFF against a reused CUDA tree (or ON against a CPU one) is
        # refused, naming the tree's build, before anything is packaged.
        other = "OFF" if want_build != "cpu" else "ON"
        cmd = [sys.executable, "setup.py", "-q", "build_ext", "--build-temp",
               os.path.join(tmp, "bt"), "--build-lib", os.path.join(tmp, "bl")]
        print("+ GEOFP8_ENABLE_CUDA=%s %s" % (other, " ".join(cmd)), flush=True)
        refused = subprocess.run(cmd, cwd=copy, env=dict(build_env, GEOFP8_ENABLE_CUDA=other),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert refused.returncode != 0 and ("GEOFP8_ENABLE_CUDA=%s" % other) in refused.stdout \
            and ("the %s build" % want_build if other == "OFF" else "the cpu build") \
            in refused.stdout, refused.stdout
        print("ok: GEOFP8_ENABLE_CUDA=%s refused against the %s tree" % (other, want_build))

        dist_dir = os.path.join(tmp, "dist")
        cmd = [sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", dist_dir,
               copy]
        print("+", " ".join(cmd), flush=True)
        built = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=build_env)
        print(built.stdout, flush=True)
        assert built.returncode == 0, "the wheel build failed (exit %d)" % built.returncode
        # What the build says while it runs (pip -v shows these lines as they come).
        for line in ("geofp8: building the C++ extension", "geofp8: built in",
                     "geofp8: stripped _geofp8", "geofp8: the %s build" % want_build):
            assert line in built.stdout, "the build's output lacks %r" % line
        wheels = [f for f in os.listdir(dist_dir) if f.endswith(".whl")]
        assert len(wheels) == 1, wheels
        assert wheels[0].startswith("geofp8-%s-" % want_version), (wheels, want_version)

        venv_dir = os.path.join(tmp, "venv")
        run([sys.executable, "-m", "venv", "--system-site-packages", venv_dir])
        py = os.path.join(venv_dir, "bin", "python")
        run([py, "-m", "pip", "install", "--no-index", "--no-deps", "-q",
             os.path.join(dist_dir, wheels[0])])
        installed = glob.glob(os.path.join(venv_dir, "lib", "python*", "site-packages", "geofp8",
                                           "_geofp8*.so"))
        tree_so = glob.glob(os.path.join(tree, "client", "python", "geofp8", "_geofp8*.so"))
        assert len(installed) == 1 and len(tree_so) == 1, (installed, tree_so)
        check_stripped(installed[0], tree_so[0])

        work = os.path.join(tmp, "work")
        os.makedirs(work)
        with open(os.path.join(work, "step.py"), "w") as f:
            f.write(RANK_SCRIPT)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = "1"
        # --redirects/--tee: Debian's torch 1.13 under Python 3.11 fails at start without an
        # explicit mapping (docs/pytorch.md, "The example").
        run([py, "-m", "torch.distributed.run", "--standalone", "--redirects", "1:1", "--tee",
             "1:1", "--nproc_per_node", "2", "step.py", work], cwd=work, env=env, timeout=300)

        venv_real = os.path.realpath(venv_dir)
        for rank in range(2):
            with open(os.path.join(work, "rank%d.json" % rank)) as f:
                r = json.load(f)
            print("rank %d: %s" % (rank, r))
            assert os.path.realpath(r["file"]).startswith(venv_real + os.sep), \
                "rank %d imported %s, not the copy installed under %s" % (rank, r["file"],
                                                                          venv_real)
            assert r["version"] == want_version, (r["version"], want_version)
            # The build it reports (issue 44): the CUDA one where nvcc and NCCL are found.
            assert r["build_info"]["build"] == want_build, (r["build_info"], want_build)
            assert r["has_cuda"] == want_build.startswith("cuda"), (r["has_cuda"], want_build)
            assert r["build_info"]["version"] == want_version, r["build_info"]
            assert r["fp32_exact"], "policy fp32: gradients differ from the fp32 mean"
            assert r["geofp8_finite"] and r["geofp8_same_on_ranks"], r
            for option, ok in r["ddp_options"].items():
                assert ok, "DDP %s: gradients differ from the fp32 mean" % option
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("ok: wheel %s (the %s build) installed and ran 2 ranks from outside the tree"
          % (wheels[0], want_build))
    return 0


if __name__ == "__main__":
    sys.exit(main())
