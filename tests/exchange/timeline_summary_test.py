#!/usr/bin/python3
"""scripts/exchange_timeline.py --from-step on two hand-made rank files whose figures are known:
per-kind counts and medians of the steps kept, the start spread of paired spans and the time
every rank is inside them; the step before --from-step is left out."""
import json
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                      "exchange_timeline.py")


def span(rank, name, step, ts_us, dur_us):
    return {"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": ts_us, "dur": dur_us,
            "args": {"step": step, "group": 0}}


def main():
    # Step 5 has two all_gather spans per rank (two buckets); step 4 one that must not count.
    ranks = [
        [span(0, "all_gather", 4, 0, 90000), span(0, "all_gather", 5, 1000, 3000),
         span(0, "all_gather", 5, 10000, 2000), span(0, "encode", 5, 500, 400)],
        [span(1, "all_gather", 4, 0, 90000), span(1, "all_gather", 5, 1500, 2500),
         span(1, "all_gather", 5, 10200, 1800)],
    ]
    failures = []
    with tempfile.TemporaryDirectory(prefix="geofp8-timeline-") as d:
        files = []
        for r, spans in enumerate(ranks):
            path = os.path.join(d, "t.rank%d.json" % r)
            with open(path, "w") as f:
                json.dump({"traceEvents": spans}, f)
            files.append(path)
        out = subprocess.run([sys.executable, SCRIPT, "--from-step", "5"] + files,
                             capture_output=True, text=True)
        if out.returncode != 0:
            failures.append("exit %d: %s" % (out.returncode, out.stderr))
        lines = [line.split() for line in out.stdout.splitlines()]
        # rank 0: all_gather durations 3 and 2 ms (the step-4 one left out): median 2.5.
        if ["0", "all_gather", "2", "2.250", "2.500", "2.750"] not in lines:
            failures.append("rank 0 all_gather row missing or wrong:\n" + out.stdout)
        if ["1", "all_gather", "2", "1.975", "2.150", "2.325"] not in lines:
            failures.append("rank 1 all_gather row missing or wrong:\n" + out.stdout)
        # Paired spans: starts 1000/1500 and 10000/10200 us -> spreads 0.5, 0.2 ms (median
        # 0.35); both inside from 1500 to 4000 and from 10200 to 12000 -> 2.5, 1.8 (median 2.15).
        if ["all_gather", "2", "0.350", "2.150"] not in lines:
            failures.append("all_gather pairing row missing or wrong:\n" + out.stdout)
        # encode is on rank 0 only: no pairing row for it.
        if any(l[:1] == ["encode"] for l in lines):
            failures.append("a pairing row for a kind one rank lacks:\n" + out.stdout)
        bad = subprocess.run([sys.executable, SCRIPT, "--from-step", "6"] + files,
                             capture_output=True, text=True)
        if bad.returncode == 0 or "no span at step >= 6" not in bad.stderr:
            failures.append("--from-step past the last step: exit %d, %s"
                            % (bad.returncode, bad.stderr))
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
