"""Builds the geofp8 Python package with CMake (pyproject.toml names this file's backend).

The extension geofp8._geofp8 is the CMake target geofp8_python (client/python/CMakeLists.txt),
built with CUDA off unless GEOFP8_ENABLE_CUDA=ON; the pure Python files come from
client/python/geofp8. Environment:

  GEOFP8_CMAKE_BUILD_DIR  a CMake build tree to build in (an existing one is reused as it is
                          configured, e.g. build/); default: setuptools' build_temp/cmake
  GEOFP8_ENABLE_CUDA      ON to configure a new tree with the CUDA kernels (default OFF)
  GEOFP8_CMAKE_ARGS       more arguments for configuring a new tree (shell words)
  CMAKE_BUILD_PARALLEL_LEVEL  build jobs (CMake's own variable; default: all CPUs)

A new tree is a Release build, and the extension is stripped of its debug information as it is
copied into the package (binutils' strip), whichever tree built it. CMake's and Ninja's output
(a line per compiled file) goes to pip's log: `pip install -v` shows it as it comes.
"""

import glob
import os
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


class CMakeBuild(build_ext):
    """Configures (when the tree is new) and builds the geofp8_python target, then copies the
    extension and the generated _version.py next to the package's .py files."""

    def run(self):
        build_dir = os.environ.get("GEOFP8_CMAKE_BUILD_DIR") or os.path.join(
            os.path.abspath(self.build_temp), "cmake")
        build_dir = os.path.abspath(build_dir)
        os.makedirs(build_dir, exist_ok=True)
        if not os.path.isfile(os.path.join(build_dir, "CMakeCache.txt")):
            cuda = os.environ.get("GEOFP8_ENABLE_CUDA", "OFF").upper()
            if cuda not in ("ON", "OFF"):
                raise RuntimeError("GEOFP8_ENABLE_CUDA: must be ON or OFF (got %r)"
                                   % os.environ["GEOFP8_ENABLE_CUDA"])
            args = ["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                    "-DGEOFP8_ENABLE_CUDA=" + cuda, "-DGEOFP8_BUILD_TESTS=OFF",
                    "-DGEOFP8_BUILD_BENCH=OFF", "-DPython_EXECUTABLE=" + sys.executable]
            if shutil.which("ninja"):
                args += ["-G", "Ninja"]
            args += shlex.split(os.environ.get("GEOFP8_CMAKE_ARGS", ""))
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
        for ext in self.extensions:
            dest = self.get_ext_fullpath(ext.name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(built[0], dest)
            strip(dest)
            shutil.copyfile(os.path.join(pkg, "_version.py"),
                            os.path.join(os.path.dirname(dest), "_version.py"))


setup(
    version=project_version(),
    ext_modules=[Extension("geofp8._geofp8", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
