#!/usr/bin/python3
"""scripts/demo_compare.py report: the per-layer table, bytes and validation loss from saved
recordings.

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


def records(name, errs, loss0, bytes_sent, val):
    """20 steps of a job: layer a's error is errs[0] at every step, layer b's errs[1]; loss falls
    by 0.01 a step from loss0. Steps 0 and 1 carry a huge error that the 10% warm-up skips.
    Validation after steps 4, 9, 14 and 19 (eval_every 5) gives val[0..3]; the records in between
    carry the last one measured, as the coordinator's progress does, and none before step 4.
    Steps in the records are counted as geofp8ctl prints them (steps done)."""
    out = []
    for step in range(20):
        early = step < 2
        measured = [i for i in range(4) if 5 * i + 4 <= step]
        out.append({
            "t": step, "id": "job-%s" % name, "name": name,
            "state": "succeeded" if step == 19 else "running",
            "step": step + 1, "total_steps": 20, "loss": loss0 - 0.01 * step,
            "bytes_sent": bytes_sent, "bytes_baseline": 4 * 2**20, "policy_version": 1,
            "val_loss": val[measured[-1]] if measured else None,
            "val_step": 5 * measured[-1] + 5 if measured else 0,  # steps done, as geofp8ctl
            "layers": [{"layer": "a", "step": step, "rel_fro_error": 9.0 if early else errs[0]},
                       {"layer": "b", "step": step, "rel_fro_error": 9.0 if early else errs[1]}],
        })
    return out


class DemoCompareTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="geofp8-demo-compare-")
        self.euc = os.path.join(self.tmp.name, "euc.jsonl")
        self.geo = os.path.join(self.tmp.name, "geo.jsonl")
        for path, recs in ((self.euc, records("e", (0.04, 0.02), 3.0, 2**20,
                                              (3.5, 3.25, 3.125, 3.0))),
                           (self.geo, records("g", (0.01, 0.02), 2.9, 2**20,
                                              (3.5, 3.0, 2.875, 2.9375)))):
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
        # 1 MiB of 4 MiB = 25%; 4 validations; the final one after 20 steps (val_step 20); the
        # best the smallest of the four (GeoFP8's third, 2.875, below its final 2.9375).
        self.assertIn("| Euclidean FP8 | e (job-e) | SUCCEEDED | 20/20 | 1.0 MiB | 4.0 MiB | "
                      "25.0% | 4 | 3.0000 (step 20) | 3.0000 |", p.stdout)
        self.assertIn("| GeoFP8 | g (job-g) | SUCCEEDED | 20/20 | 1.0 MiB | 4.0 MiB | 25.0% | "
                      "4 | 2.9375 (step 20) | 2.8750 |", p.stdout)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertGreater(os.path.getsize(png), 10000)
        with open(summary) as f:
            s = json.load(f)
        self.assertEqual(s["layers"]["a"], {"euclidean": 0.04, "geofp8": 0.01})
        self.assertEqual(s["runs"]["GeoFP8"]["bytes_sent"], 2**20)
        self.assertEqual(s["runs"]["GeoFP8"]["val_loss"],
                         [[5, 3.5], [10, 3.0], [15, 2.875], [20, 2.9375]])

    def test_a_run_without_validation_is_an_error(self):
        with open(self.geo) as f:
            recs = [json.loads(line) for line in f]
        with open(self.geo, "w") as f:
            for r in recs:
                r["val_loss"] = None
                f.write(json.dumps(r) + "\n")
        p = self.run_report()
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("GeoFP8: no validation loss recorded", p.stderr)

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
