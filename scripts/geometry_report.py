#!/usr/bin/python3
"""Geometry gain on gradients dumped from real training (`geofp8-train --dump-grads DIR`).

For every matrix in DIR/shapes.json, runs `geofp8-tool analyze` without and with the low-rank
geometry on the averaged gradient and prints worst_band_error and rel_fro_error side by side.
Usage: scripts/geometry_report.py DUMP_STEP_DIR [--tool build/client/tool/geofp8-tool]
       [--rank 16] [--formats fp8_e4m3,nvfp4]
"""
import argparse
import json
import os
import subprocess
import sys


def analyze(tool, path, rows, cols, fmt, geometry, rank):
    cmd = [tool, "analyze", "--in", path, "--shape", "%dx%d" % (rows, cols), "--format", fmt,
           "--geometry", geometry, "--rank", str(rank)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit("geometry_report: %s failed: %s" % (" ".join(cmd), out.stderr.strip()))
    return json.loads(out.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dump_dir")
    p.add_argument("--tool", default="build/client/tool/geofp8-tool")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--formats", default="fp8_e4m3,nvfp4")
    a = p.parse_args()
    shapes_path = os.path.join(a.dump_dir, "shapes.json")
    if not os.path.exists(shapes_path):
        sys.exit("geometry_report: dump_dir: no shapes.json in %s" % a.dump_dir)
    with open(shapes_path) as f:
        shapes = json.load(f)
    print("| layer | shape | format | worst band, none | worst band, lowrank k=%d | gain "
          "| rel_fro none | rel_fro lowrank |" % a.rank)
    print("|---|---|---|---|---|---|---|---|")
    for layer in shapes["layers"]:
        path = os.path.join(a.dump_dir, layer["avg"])
        for fmt in a.formats.split(","):
            n = analyze(a.tool, path, layer["rows"], layer["cols"], fmt, "none", a.rank)
            g = analyze(a.tool, path, layer["rows"], layer["cols"], fmt, "lowrank", a.rank)
            gain = n["worst_band_error"] / max(g["worst_band_error"], 1e-30)
            print("| %s | %dx%d | %s | %.3g | %.3g | %.1f | %.3g | %.3g |" % (
                layer["name"], layer["rows"], layer["cols"], fmt, n["worst_band_error"],
                g["worst_band_error"], gain, n["rel_fro_error"], g["rel_fro_error"]))


if __name__ == "__main__":
    main()
