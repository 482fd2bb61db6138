#!/usr/bin/python3
"""Writes Prometheus file_sd target files from GeoFP8 ready files.

  targets_from_ready.py READY_DIR TARGETS_DIR

READY_DIR holds the daemons' --ready-file outputs (scripts/demo.sh writes coordinator.ready.json
and worker-N.ready.json into demo-out/). TARGETS_DIR gets coordinator.json and workers.json, the
files deploy/prometheus/prometheus.yml reads. Exit 2 on a usage error or an unreadable ready file.
"""
import glob
import json
import os
import sys


def metrics_target(path):
    with open(path) as f:
        ready = json.load(f)
    if not isinstance(ready, dict) or "metrics" not in ready:
        raise ValueError("%s: no \"metrics\" field" % path)
    return ready["metrics"]  # "host:port", or null when /metrics is off


def write(path, targets, labels):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump([{"targets": targets, "labels": labels}] if targets else [], f, indent=2)
        f.write("\n")
    os.replace(tmp, path)  # Prometheus never reads a half-written file


def main(argv):
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    ready_dir, out_dir = argv
    if not os.path.isdir(ready_dir):
        print("targets_from_ready.py: error: READY_DIR %r is not a directory" % ready_dir,
              file=sys.stderr)
        return 2
    os.makedirs(out_dir, exist_ok=True)
    try:
        coord = [p for p in [os.path.join(ready_dir, "coordinator.ready.json")] if os.path.exists(p)]
        coord_targets = [t for t in map(metrics_target, coord) if t]
        worker_targets = [t for t in map(metrics_target,
                                         sorted(glob.glob(os.path.join(ready_dir, "worker-*.ready.json"))))
                          if t]
    except (OSError, ValueError) as e:
        print("targets_from_ready.py: error: %s" % e, file=sys.stderr)
        return 2
    write(os.path.join(out_dir, "coordinator.json"), coord_targets, {"component": "coordinator"})
    write(os.path.join(out_dir, "workers.json"), worker_targets, {"component": "worker"})
    print("targets_from_ready.py: %d coordinator, %d worker targets in %s"
          % (len(coord_targets), len(worker_targets), out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
