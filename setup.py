"""Builds the geofp8 Python package with CMake (pyproject.toml names this file's backend).

The extension geofp8._geofp8 is the CMake target geofp8_python (client/python/CMakeLists.txt),
the CUDA build where nvcc and NCCL are found, else the CPU build; the pure Python files come
from client/python/geofp8. Environment:

  GEOFP8_CMAKE_BUILD_DIR  a CMake build tree to build in (an existing one is reused as it is
                          configured, e.g. build/); default: setuptools' build_temp/cmake
  GEOFP8_ENABLE_CUDA      auto (default): the CUDA build where nvcc, nccl.h and libnccl are
                          found, else the CPU build; ON: the CUDA build, an error naming what is
                          missing otherwise; OFF: the CPU build. A reused tree must match ON/OFF.
  GEOFP8_CMAKE_ARGS       more arguments for configuring a new tree (shell words), after
                          setup.py's own (e.g. -DCMAKE_CUDA_ARCHITECTURES="80;90"; a new tree
                          uses ccache as the compiler launcher when it is on the PATH, which
                          -DCMAKE_CXX_COMPILER_LAUNCHER= and the like turn off)
  CMAKE_BUILD_PARALLEL_LEVEL  build jobs (CMake's own variable; default: all CPUs)

A new tree is a Release build, and the extension is stripped of its debug information as it is
copied into the package (binutils' strip), whichever tree built it. CMake's and Ninja's output
(a line per compiled file) goes to pip's log: `pip install -v` shows it as it comes.
"""

import glob
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def project_version():
    """The VERSION of project(geofp8 ...) in CMakeLists.txt, which geofp8ctl version prints."""
    path = os.path.join(ROOT, "CMakeLists.txt")
    with open(path, encoding="utf-8") as f:
        m = re.search(r"^project\(geofp8\s+VERSION\s+([0-9][0-9.]*)", f.read(), re.M)
    if not m:
        raise RuntimeError("%s: no 'project(geofp8 VERSION x.y.z' line to take the version from"
                           % path)
    return m.group(1)


def progress(line):
    """A line of build progress, flushed at once: pip shows the backend's output as it comes
    with -v (and spins its spinner per line without)."""
    print("geofp8: " + line, flush=True)


def strip(path):
    """Drops the extension's debug information (a RelWithDebInfo tree's is most of its size);
    the symbols Python needs (PyInit__geofp8) are dynamic and stay."""
    tool = shutil.which("strip")
    if tool is None:
        raise RuntimeError("strip: not found (binutils); it removes the extension's debug "
                           "information from %s" % path)
    before = os.path.getsize(path)
    subprocess.check_call([tool, "--strip-unneeded", path])
    progress("stripped %s: %.1f MB -> %.1f MB" % (os.path.basename(path), before / 1e6,
                                                  os.path.getsize(path) / 1e6))


# Where CMake (cmake/Geofp8Dependencies.cmake) looks for the toolkit first.
CUDA_ROOT = "/usr/local/cuda"


def find_cuda(cuda_root=CUDA_ROOT, path=None, system_dirs=None):
    """What a CUDA build needs, found as CMake finds it: nvcc under cuda_root/bin, else on the
    PATH; nccl.h and libnccl.so under the toolkit (cuda_root's or the found nvcc's) or in the
    system's directories (libnccl.so itself, as CMake's find_library: libnccl.so.2 alone is a
    runtime without the development link). Returns ({"nvcc", "nccl.h", "libnccl"}: path found,
    [what is missing, with where it was looked for])."""
    found, missing = {}, []
    nvcc = os.path.join(cuda_root, "bin", "nvcc")
    if not os.access(nvcc, os.X_OK):
        nvcc = shutil.which("nvcc", path=path)
    if nvcc:
        found["nvcc"] = nvcc
    else:
        missing.append("nvcc (not in %s/bin nor on the PATH)" % cuda_root)
    roots = [cuda_root]
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    if system_dirs is None:
        arch = "%s-linux-gnu" % platform.machine()
        system_dirs = ["/usr", "/usr/local"]
        system_libs = ["/usr/lib/" + arch, "/usr/lib64", "/usr/lib", "/usr/local/lib"]
    else:
        system_libs = [os.path.join(d, "lib") for d in system_dirs]
    include_dirs = [os.path.join(r, "include") for r in roots + system_dirs]
    lib_dirs = [os.path.join(r, sub) for r in roots for sub in ("lib64", "lib")] + system_libs
    for name, dirs, patterns in (("nccl.h", include_dirs, ["nccl.h"]),
                                 ("libnccl", lib_dirs, ["libnccl.so"])):
        hits = [h for d in dict.fromkeys(dirs) for pat in patterns
                for h in sorted(glob.glob(os.path.join(d, pat)))]
        if hits:
            found[name] = hits[0]
        else:
            missing.append("%s (not in %s)" % (name, ", ".join(dict.fromkeys(dirs))))
    return found, missing


def cuda_mode(value):
    """auto, on or off from GEOFP8_ENABLE_CUDA's value (unset or empty: auto)."""
    mode = (value or "auto").strip().lower()
    if mode not in ("auto", "on", "off"):
        raise RuntimeError("GEOFP8_ENABLE_CUDA: must be auto, ON or OFF (got %r)" % value)
    return mode


def cuda_choice(mode, missing):
    """ON or OFF for a new tree's CMake GEOFP8_ENABLE_CUDA, from cuda_mode's mode and what
    find_cuda did not find; ON with something missing is an error that names it."""
    if mode == "off":
        return "OFF"
    if not missing:
        return "ON"
    if mode == "on":
        raise RuntimeError(
            "GEOFP8_ENABLE_CUDA=ON: the CUDA build needs the CUDA toolkit's nvcc and NCCL; "
            "missing: %s. Install them (or put nvcc on the PATH), or unset GEOFP8_ENABLE_CUDA "
            "for the CPU build" % "; ".join(missing))
    return "OFF"


def configure_command(build_dir, cuda):
    """The cmake command that configures a new tree: Release, the CUDA build or not (cuda: ON
    or OFF), no tests or benches; ccache as the compilers' launcher (nvcc's too) when it is on
    the PATH; then GEOFP8_CMAKE_ARGS, which can override any of it."""
    args = ["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
            "-DGEOFP8_ENABLE_CUDA=" + cuda, "-DGEOFP8_BUILD_TESTS=OFF",
            "-DGEOFP8_BUILD_BENCH=OFF", "-DPython_EXECUTABLE=" + sys.executable]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    ccache = shutil.which("ccache")
    if ccache:
        args += ["-DCMAKE_%s_COMPILER_LAUNCHER=%s" % (lang, ccache)
                 for lang in ("C", "CXX") + (("CUDA",) if cuda == "ON" else ())]
    return args + shlex.split(os.environ.get("GEOFP8_CMAKE_ARGS", ""))


def tree_build(pkg):
    """The build ("cuda13.0", "cpu") that the tree's generated _version.py names."""
    values = {}
    with open(os.path.join(pkg, "_version.py"), encoding="utf-8") as f:
        exec(f.read(), values)  # noqa: S102 (CMake's own output)
    return values["build"]


class CMakeBuild(build_ext):
    """Configures (when the tree is new) and builds the geofp8_python target, then copies the
    extension and the generated _version.py next to the package's .py files."""

    def run(self):
        build_dir = os.environ.get("GEOFP8_CMAKE_BUILD_DIR") or os.path.join(
            os.path.abspath(self.build_temp), "cmake")
        build_dir = os.path.abspath(build_dir)
        os.makedirs(build_dir, exist_ok=True)
        requested = os.environ.get("GEOFP8_ENABLE_CUDA")
        mode = cuda_mode(requested)
        reused = os.path.isfile(os.path.join(build_dir, "CMakeCache.txt"))
        cuda = None
        if reused:
            progress("reusing the configured tree %s as it is (CUDA included or not)" % build_dir)
        else:
            found, missing = find_cuda()
            cuda = cuda_choice(mode, missing)
            if cuda == "ON":
                progress("the CUDA build: nvcc %s, NCCL %s" % (found["nvcc"], found["libnccl"]))
            elif mode == "off":
                progress("the CPU build (GEOFP8_ENABLE_CUDA=%s)" % requested)
            else:
                progress("the CPU build: missing %s (docs/pytorch.md, \"CUDA\")"
                         % "; ".join(missing))
            args = configure_command(build_dir, cuda)
            progress("configuring: " + " ".join(args))
            subprocess.check_call(args)
        build = ["cmake", "--build", build_dir, "--target", "geofp8_python"]
        if "CMAKE_BUILD_PARALLEL_LEVEL" not in os.environ:
            build += ["-j", str(os.cpu_count() or 1)]
        progress("building the C++ extension (minutes on a few cores; a line per file "
                 "follows): " + " ".join(build))
        started = time.monotonic()
        subprocess.check_call(build)
        progress("built in %.0f s" % (time.monotonic() - started))

        pkg = os.path.join(build_dir, "client", "python", "geofp8")
        built = glob.glob(os.path.join(pkg, "_geofp8*.so"))
        if len(built) != 1 or not os.path.isfile(os.path.join(pkg, "_version.py")):
            raise RuntimeError(
                "%s: the CMake build made no geofp8/_geofp8*.so and _version.py (found %s); the "
                "module needs pybind11-dev, python3-dev and gRPC (see the configure output)"
                % (pkg, built or "none"))
        which = tree_build(pkg)
        progress("the %s build" % which)
        if (mode == "on" or cuda == "ON") and not which.startswith("cuda"):
            raise RuntimeError(
                "GEOFP8_ENABLE_CUDA=%s: %s built the cpu build, without the CUDA/NCCL path; %s"
                % (requested or "auto", build_dir,
                   "reconfigure this reused tree with -DGEOFP8_ENABLE_CUDA=ON, or build in "
                   "another GEOFP8_CMAKE_BUILD_DIR" if reused else
                   "CMake found less than setup.py did: see its configure output for CUDA, "
                   "cuBLAS and NCCL"))
        if mode == "off" and which != "cpu":
            raise RuntimeError(
                "GEOFP8_ENABLE_CUDA=%s: the reused tree %s is the %s build; reconfigure it with "
                "-DGEOFP8_ENABLE_CUDA=OFF, or build in another GEOFP8_CMAKE_BUILD_DIR"
                % (requested, build_dir, which))
        for ext in self.extensions:
            dest = self.get_ext_fullpath(ext.name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(built[0], dest)
            strip(dest)
            shutil.copyfile(os.path.join(pkg, "_version.py"),
                            os.path.join(os.path.dirname(dest), "_version.py"))


# setuptools runs this file as __main__; tests import it for find_cuda and cuda_choice.
if __name__ == "__main__":
    setup(
        version=project_version(),
        ext_modules=[Extension("geofp8._geofp8", sources=[])],
        cmdclass={"build_ext": CMakeBuild},
        zip_safe=False,
    )
