#!/usr/bin/python3
"""scripts/demo_compare.py report: the per-layer table, bytes and loss from saved recordings.

The recordings are written here with known values, so every printed number is checked against
arithmetic done by hand in the comments.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                      "demo_compare.py")


def records(name, errs, loss0, bytes_sent):
    """20 steps of a job: layer a's error is errs[0] at every step, layer b's errs[1]; loss falls
    by 0.01 a step from loss0. Steps 0 and 1 carry a huge error that the 10% warm-up skips."""
    out = []
    for step in range(20):
        early = step < 2
        out.append({
            "t": step, "id": "job-%s" % name, "name": name,
            "state": "JOB_SUCCEEDED" if step == 19 else "JOB_RUNNING",
            "step": step, "total_steps": 20, "loss": loss0 - 0.01 * step,
            "bytes_sent": bytes_sent, "bytes_baseline": 4 * 2**20, "policy_version": 1,
            "layers": [{"layer": "a", "step": step, "rel_fro_error": 9.0 if early else errs[0]},
                       {"layer": "b", "step": step, "rel_fro_error": 9.0 if early else errs[1]}],
        })
    return out


class DemoCompareTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="geofp8-demo-compare-")
        self.euc = os.path.join(self.tmp.name, "euc.jsonl")
        self.geo = os.path.join(self.tmp.name, "geo.jsonl")
        for path, recs in ((self.euc, records("e", (0.04, 0.02), 3.0, 2**20)),
                           (self.geo, records("g", (0.01, 0.02), 2.9, 2**20))):
            with open(path, "w") as f:
                for r in recs:
                    f.write(json.dumps(r) + "\n")
                    f.write(json.dumps(r) + "\n")  # a poll that saw the same step twice

    def tearDown(self):
        self.tmp.cleanup()

    def run_report(self, *extra):
        return subprocess.run([sys.executable, SCRIPT, "report", "--euclid", self.euc, "--geo",
                               self.geo, *extra], capture_output=True, text=True, timeout=120)

    def test_table_bytes_loss_and_png(self):
        png = os.path.join(self.tmp.name, "out.png")
        summary = os.path.join(self.tmp.name, "out.json")
        p = self.run_report("--png", png, "--json", summary)
        self.assertEqual(p.returncode, 0, p.stderr)
        # Layer a: 0.04 / 0.01 = 4x; b: equal; medians over layers 0.03 and 0.015 = 2x. The
        # warm-up steps (0 and 1 < 10% of 20) and their 9.0 never reach a median.
        self.assertIn("| a | 0.04 | 0.01 | 4.00x |", p.stdout)
        self.assertIn("| b | 0.02 | 0.02 | 1.00x |", p.stdout)
        self.assertIn("| median over layers | 0.03 | 0.015 | 2.00x |", p.stdout)
        # 1 MiB of 4 MiB = 25%; final loss = mean of steps 10..19 = loss0 - 0.01 * 14.5.
        self.assertIn("| Euclidean FP8 | e (job-e) | SUCCEEDED | 20/20 | 1.0 MiB | 4.0 MiB | "
                      "25.0% | 2.8550 |", p.stdout)
        self.assertIn("| GeoFP8 | g (job-g) | SUCCEEDED | 20/20 | 1.0 MiB | 4.0 MiB | 25.0% | "
                      "2.7550 |", p.stdout)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertGreater(os.path.getsize(png), 10000)
        with open(summary) as f:
            s = json.load(f)
        self.assertEqual(s["layers"]["a"], {"euclidean": 0.04, "geofp8": 0.01})
        self.assertEqual(s["runs"]["GeoFP8"]["bytes_sent"], 2**20)

    def test_bad_inputs_name_the_file(self):
        with open(self.geo, "a") as f:
            f.write("{not json\n")
        p = self.run_report()
        self.assertNotEqual(p.returncode, 0)
        self.assertIn(self.geo + ":41: not JSON", p.stderr)
        p = self.run_report("--skip-fraction", "1.5")
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--skip-fraction: must be in [0, 1) (1.5)", p.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
