#!/usr/bin/python3
"""scripts/perf_tree.py on hand-made `perf script -F ip,sym` stacks whose shares are known: the
share under the root, callee paths in depth-first order with larger subtrees first, names without
anonymous namespaces or arguments, samples outside the root left out, and an error naming the
root when no sample passes through it."""
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                      "perf_tree.py")


def stack(*frames):
    """perf script prints the innermost frame first; `frames` are given outermost first."""
    return "".join("\t%x %s\n" % (0x1000 + i, f) for i, f in enumerate(reversed(frames))) + "\n"


def main():
    text = (stack("main", "Exchange(int)", "Refresh()", "(anonymous namespace)::Eigen(double*)") * 3
            + stack("main", "Exchange(int)", "Refresh()", "Orthonormalize()")
            + stack("main", "Exchange(int)", "Encode()") * 4
            + stack("main", "Other()") * 2)
    failures = []
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        out = subprocess.run([sys.executable, SCRIPT, path, "Exchange", "--depth", "2"],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        want = ["10 samples, 8 (80.0%) under Exchange",
                "  50.0%  Encode",
                "  50.0%  Refresh",
                "  37.5%      Eigen",
                "  12.5%      Orthonormalize"]
        if out != want:
            failures.append("tree:\n%s\nwant:\n%s" % ("\n".join(out), "\n".join(want)))
        bad = subprocess.run([sys.executable, SCRIPT, path, "Nowhere"], capture_output=True,
                             text=True)
        if bad.returncode == 0 or "Nowhere" not in bad.stderr:
            failures.append("no sample under the root: exit %d, stderr %r" % (bad.returncode,
                                                                             bad.stderr))
    finally:
        os.unlink(path)
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
