#!/usr/bin/python3
# Checks the deployment assets against the programs they deploy: manifests parse, every flag they
# pass exists in the binary's --help, every metric the dashboard queries is exported, every Helm
# value a template reads is defined, and a real Prometheus server scrapes a real coordinator.
import http.client
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.parse
import urllib.request

import yaml

ROOT = os.environ["GEOFP8_SOURCE_DIR"]
COORDINATOR = os.environ["GEOFP8_COORDINATOR"]
WORKER = os.environ["GEOFP8_WORKER"]
CTL = os.environ.get("GEOFP8CTL", "")
DASHBOARD = os.path.join(ROOT, "helm/geofp8/dashboards/geofp8-overview.json")
TEMPLATES = os.path.join(ROOT, "helm/geofp8/templates")


def read(path):
    with open(path) as f:
        return f.read()


def help_flags(binary):
    out = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out))


def source_metric_names():
    names = set()
    for sub in ("server", "worker", "kernels/common"):
        for root, _, files in os.walk(os.path.join(ROOT, sub)):
            for f in files:
                if f.endswith((".cc", ".h")):
                    text = read(os.path.join(root, f))
                    names.update(re.findall(r'"(geofp8_[a-z0-9_]+)"', text))
    return names


def manifest_args():
    """(binary name, [flags]) for every container in deploy/k8s and the Helm templates."""
    texts = [read(os.path.join(ROOT, "deploy/k8s/geofp8.yaml"))]
    texts += [read(os.path.join(TEMPLATES, f)) for f in os.listdir(TEMPLATES)]
    found = []
    for text in texts:
        for block in re.split(r"\n\s*- name: ", text):
            cmd = re.search(r'command: \["(geofp8-[a-z]+)"\]', block)
            if cmd:
                found.append((cmd.group(1), re.findall(r"(--[a-z][a-z0-9-]*)=", block)))
    return found


class ManifestTest(unittest.TestCase):
    def test_plain_manifests_parse(self):
        docs = list(yaml.safe_load_all(read(os.path.join(ROOT, "deploy/k8s/geofp8.yaml"))))
        kinds = sorted(d["kind"] for d in docs)
        self.assertEqual(kinds, ["Namespace", "Service", "Service", "StatefulSet", "StatefulSet"])
        yaml.safe_load(read(os.path.join(ROOT, "helm/geofp8/values.yaml")))
        yaml.safe_load(read(os.path.join(ROOT, "helm/geofp8/Chart.yaml")))

    def test_every_flag_exists_in_the_binary(self):
        flags = {"geofp8-coordinator": help_flags(COORDINATOR),
                 "geofp8-worker": help_flags(WORKER)}
        containers = manifest_args()
        self.assertGreaterEqual(len(containers), 4)
        for binary, used in containers:
            for flag in used:
                self.assertIn(flag, flags[binary], "%s has no flag %s" % (binary, flag))

    def test_helm_values_read_by_templates_are_defined(self):
        values = yaml.safe_load(read(os.path.join(ROOT, "helm/geofp8/values.yaml")))
        for f in os.listdir(TEMPLATES):
            for path in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", read(os.path.join(TEMPLATES, f))):
                node = values
                for key in path.split("."):
                    self.assertIn(key, node, "%s: .Values.%s is not in values.yaml" % (f, path))
                    node = node[key]

    def test_dashboard_queries_exported_metrics(self):
        dash = json.loads(read(DASHBOARD))
        exported = source_metric_names()
        exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
        self.assertGreaterEqual(len(exprs), 10)
        for expr in exprs:
            for name in re.findall(r"geofp8_[a-z0-9_]+", expr):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                self.assertIn(base, exported, "dashboard queries %s, which nothing exports" % name)

    @unittest.skipIf(shutil.which("promtool") is None, "promtool not installed")
    def test_prometheus_config_is_valid(self):
        r = subprocess.run(["promtool", "check", "config",
                            os.path.join(ROOT, "deploy/prometheus/prometheus.yml")],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_coordinator(data_dir):
    """Starts geofp8-coordinator on free ports; returns (process, metrics port)."""
    proc = subprocess.Popen([COORDINATOR, "--listen", "127.0.0.1:0", "--metrics-listen",
                             "127.0.0.1:0", "--data-dir", data_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "metrics on" in line:
            port = int(line.rsplit(":", 1)[1].split("/")[0])
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, port
    raise RuntimeError("coordinator exited before serving /metrics")


def start_prometheus(tmp, config):
    """Starts Prometheus on a free port, retrying if another process took the port first."""
    for attempt in range(5):
        port = free_port()
        proc = subprocess.Popen(["prometheus", "--config.file=" + config,
                                 "--storage.tsdb.path=" + os.path.join(tmp, "tsdb%d" % attempt),
                                 "--web.listen-address=127.0.0.1:%d" % port],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while time.time() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen("http://127.0.0.1:%d/-/ready" % port, timeout=2).read()
                return proc, port
            except (OSError, http.client.HTTPException):
                time.sleep(0.2)
        proc.terminate()
        proc.wait(timeout=30)
    raise RuntimeError("prometheus did not become ready")


@unittest.skipIf(shutil.which("prometheus") is None, "prometheus not installed")
class PrometheusScrapeTest(unittest.TestCase):
    """A real Prometheus server scrapes a real coordinator; the dashboard's jobs query answers."""

    def test_scrape(self):
        tmp = tempfile.mkdtemp()
        procs = []
        try:
            coord, metrics_port = start_coordinator(os.path.join(tmp, "coord"))
            procs.append(coord)
            config = os.path.join(tmp, "prometheus.yml")
            with open(config, "w") as f:
                f.write("global: {scrape_interval: 1s}\nscrape_configs:\n"
                        "  - job_name: geofp8-coordinator\n"
                        "    static_configs: [{targets: ['127.0.0.1:%d']}]\n" % metrics_port)
            prom, prom_port = start_prometheus(tmp, config)
            procs.append(prom)
            query = urllib.parse.quote("sum by (state) (geofp8_jobs)")
            url = "http://127.0.0.1:%d/api/v1/query?query=%s" % (prom_port, query)
            states, deadline = set(), time.time() + 60
            while time.time() < deadline and "pending" not in states:
                time.sleep(1)
                try:
                    body = json.load(urllib.request.urlopen(url, timeout=5))
                except (OSError, http.client.HTTPException):
                    continue
                states = {r["metric"].get("state") for r in body["data"]["result"]}
            self.assertIn("pending", states, "Prometheus never saw geofp8_jobs{state=pending}")
            self.assertIn("running", states)
        finally:
            for p in reversed(procs):
                p.terminate()
                p.wait(timeout=30)
            shutil.rmtree(tmp, ignore_errors=True)


SPEC = """name: dash
world_size: 2
backend: gloo
model: {preset: llama-tiny}
data: {source: synthetic, seed: 1}
training: {steps: 120, batch_size: 4, seq_len: 32, lr: 0.002, warmup_steps: 5, seed: 3}
policy:
  default: {format: fp8_e4m3, scaling: block, block: 64, geometry: lowrank, rank: 4}
geometry_refresh: {estimator: ema, interval: 10}
"""


def wait_ready_file(path, proc, what):
    deadline = time.time() + 30
    while not os.path.exists(path):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError("%s did not write %s" % (what, path))
        time.sleep(0.05)
    time.sleep(0.05)  # written whole before the rename, but be gentle
    with open(path) as f:
        return json.load(f)


class Prometheus:
    def __init__(self, port):
        self.port = port

    def query(self, expr, at=None):
        """Instant vector as {frozenset(labels without __name__): value}."""
        q = {"query": expr}
        if at is not None:
            q["time"] = "%.3f" % at
        url = "http://127.0.0.1:%d/api/v1/query?%s" % (self.port, urllib.parse.urlencode(q))
        body = json.load(urllib.request.urlopen(url, timeout=10))
        if body["status"] != "success":
            raise AssertionError("%s: %s" % (expr, body))
        return {frozenset((k, v) for k, v in r["metric"].items() if k != "__name__"):
                float(r["value"][1]) for r in body["data"]["result"]}


def field(d, name):
    """A field of geofp8ctl's JSON, by its proto name or its lowerCamelCase JSON name."""
    camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), name)
    return d[name] if name in d else d[camel]


def state(job):
    return field(job, "state").replace("JOB_", "")


def by(series, *keys):
    """Groups raw series {labels: value} by the label keys: {tuple of values: [values]}."""
    out = {}
    for labels, v in series.items():
        d = dict(labels)
        out.setdefault(tuple(d.get(k, "") for k in keys), []).append(v)
    return out


@unittest.skipIf(shutil.which("prometheus") is None,
                 "prometheus not installed (Debian package prometheus; scripts/lib/common.sh "
                 "ensure_packages installs it)")
class DashboardQueryTest(unittest.TestCase):
    """A real Prometheus scrapes a real coordinator and two workers running a real job. Every
    query of the dashboard (with $job set to the job) is evaluated by Prometheus and its value
    checked against the raw series the ranks export and against what the job reports to the
    coordinator (geofp8ctl get job -o json), during the job and after it."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.procs = []

    def tearDown(self):
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start(self, argv, ready, what):
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return wait_ready_file(ready, proc, what)

    def ctl(self, *args):
        r = subprocess.run([CTL, "-s", self.server, "--timeout", "10", *args],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r.stdout

    def test_every_dashboard_query_answers_the_job(self):
        t = self.tmp
        coord = self.start([COORDINATOR, "--listen", "127.0.0.1:0", "--metrics-listen",
                            "127.0.0.1:0", "--data-dir", os.path.join(t, "coord"), "--tick-ms",
                            "50", "--ready-file", os.path.join(t, "coord.json")],
                           os.path.join(t, "coord.json"), "coordinator")
        self.server = coord["grpc"]
        targets = [coord["metrics"]]
        for i in range(2):
            ready = os.path.join(t, "w%d.json" % i)
            w = self.start([WORKER, "--coordinator", self.server, "--name", "w%d" % i,
                            "--metrics-port", "0", "--data-dir", os.path.join(t, "w%d" % i),
                            "--ready-file", ready, "--debug-step-delay-ms", "150"], ready,
                           "worker %d" % i)
            targets.append(w["metrics"])
        config = os.path.join(t, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:\n"
                    "  - job_name: geofp8\n    static_configs: [{targets: %s}]\n"
                    % json.dumps(targets))
        prom_proc, prom_port = start_prometheus(t, config)
        self.procs.append(prom_proc)
        prom = Prometheus(prom_port)
        spec = os.path.join(t, "dash.yaml")
        with open(spec, "w") as f:
            f.write(SPEC)
        self.ctl("submit", "-f", spec)
        job = json.loads(self.ctl("get", "job", "dash", "-o", "json"))
        job_id = field(job, "id")
        sel = '{job_id="%s"}' % job_id

        # Running, past a few steps, and every daemon scraped at least 5 times (rates need two
        # samples in their window).
        deadline = time.time() + 90
        while time.time() < deadline:
            step = prom.query("max(geofp8_worker_step%s)" % sel)
            scrapes = prom.query("count_over_time(up[1m])")
            if (step and min(step.values()) >= 10 and len(scrapes) == 3
                    and min(scrapes.values()) >= 5):
                break
            time.sleep(0.5)
        else:
            self.fail("Prometheus never saw step 10 of job %s after 5 scrapes" % job_id)
        at = time.time()
        reported = json.loads(self.ctl("get", "job", job_id, "-o", "json"))

        dash = json.loads(read(DASHBOARD))
        self.assertIn("job", [v["name"] for v in dash["templating"]["list"]])
        checked = set()

        def raw(name):
            return prom.query(name + sel, at)

        def check(expr, result):
            self.assertTrue(result, "%s: no data" % expr)
            if "geofp8_worker_step{" in expr:  # max by (job_id)
                self.assertEqual(result, {frozenset({("job_id", job_id)}):
                                          max(raw("geofp8_worker_step").values())})
                self.assertGreaterEqual(list(result.values())[0], 10)
            elif "geofp8_worker_loss" in expr:  # avg by (job_id): the ranks report one loss
                values = list(raw("geofp8_worker_loss").values())
                self.assertEqual(len(values), 2)
                self.assertAlmostEqual(list(result.values())[0], sum(values) / 2, places=9)
            elif "geofp8_worker_tokens_per_second" in expr:
                # Each rank reports the job's tokens/s over all ranks: the panel takes one rank's,
                # not the sum. The coordinator's figure is a rank's report from up to a scrape
                # interval away (the EMA moves a little between steps); a sum over the two ranks
                # would be 2x, i.e. 100% off. 40% (about sqrt(2), halfway between 1x and 2x on a
                # log scale) tells the two apart with room for a loaded machine's jitter.
                values = list(raw("geofp8_worker_tokens_per_second").values())
                (got,) = result.values()
                self.assertEqual(got, max(values))
                coordinator = field(field(reported, "progress"), "tokens_per_second")
                self.assertLess(abs(got / coordinator - 1), 0.4, (got, coordinator))
            elif "geofp8_exchange_bytes_total" in expr:
                layers = {k[0] for k in by(raw("geofp8_exchange_bytes_total"), "layer")}
                self.assertEqual({dict(k)["layer"] for k in result}, layers)
                self.assertTrue(all(v > 0 for v in result.values()), result)
            elif "geofp8_quantization_rel_error" in expr or "geofp8_geometry_drift" in expr:
                name = re.search(r"geofp8_[a-z_]+", expr).group(0)
                expected = {frozenset({("job_id", job_id), ("layer", k[0])}): max(v)
                            for k, v in by(raw(name), "layer").items()}
                self.assertEqual(result, expected)
            elif "geofp8_worker_policy_version" in expr:
                self.assertEqual(result, {frozenset({("job_id", job_id)}): 1.0})
            elif "skipped_steps" in expr:
                self.assertEqual(list(result.values()), [0.0])
            elif "geofp8_jobs_total" in expr:  # the coordinator's: every result from the start
                self.assertEqual(result, {frozenset({("result", r)}): 0.0 for r in
                                          ("succeeded", "failed", "cancelled", "restarted")})
            elif "geofp8_worker_jobs_total" in expr:
                self.assertEqual(result, {frozenset({("result", r)}): 0.0 for r in
                                          ("succeeded", "failed", "cancelled", "stopped")})
            elif "geofp8_jobs" in expr:
                self.assertEqual(result[frozenset({("state", "running")})], 1.0)
            elif "geofp8_workers" in expr:
                self.assertEqual(result[frozenset({("state", "assigned")})], 2.0)
            elif "histogram_quantile" in expr:
                # A quantile in seconds. Per RPC method, one with no request in the last minute
                # has a zero rate and so NaN; the step and exchange times have one every step.
                finite = [v for v in result.values() if not math.isnan(v)]
                if "method" not in expr:
                    self.assertEqual(len(finite), len(result), result)
                self.assertTrue(finite, result)
                self.assertTrue(all(0 < v < 60 for v in finite), result)
            elif "process_resident_memory_bytes" in expr:
                self.assertEqual(len(result), 3)  # coordinator and both workers
                self.assertTrue(all(v > 1e6 for v in result.values()), result)
            else:
                self.fail("dashboard query without a value check here: " + expr)
            checked.add(expr)

        for panel in dash["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$job", job_id)  # [a-z0-9-]: no regex escaping needed
                with self.subTest(panel=panel["title"], expr=expr):
                    check(expr, prom.query(expr, at))
        self.assertEqual(len(checked), sum(len(p["targets"]) for p in dash["panels"]))
        # The live expositions (with a job's series in them) pass promtool's lint.
        if shutil.which("promtool"):
            for target in targets:
                text = urllib.request.urlopen("http://%s/metrics" % target, timeout=5).read()
                r = subprocess.run(["promtool", "check", "metrics"], input=text,
                                   capture_output=True)
                self.assertEqual(r.returncode, 0, (target, r.stdout, r.stderr))

        # After the job: its gauges are gone (evaluated after two more scrapes), the byte counters
        # add up to the bytes the ranks reported, and the results count one success.
        deadline = time.time() + 120
        while time.time() < deadline:
            job = json.loads(self.ctl("get", "job", job_id, "-o", "json"))
            if state(job) in ("SUCCEEDED", "FAILED", "CANCELLED"):
                break
            time.sleep(0.5)
        self.assertEqual(state(job), "SUCCEEDED", job)
        time.sleep(3)
        for gauge in ("geofp8_worker_step", "geofp8_worker_loss", "geofp8_worker_tokens_per_second",
                      "geofp8_quantization_rel_error", "geofp8_worker_policy_version"):
            self.assertEqual(prom.query(gauge + sel), {}, gauge)
        series = prom.query("geofp8_exchange_bytes_total" + sel)
        self.assertTrue(series)
        self.assertTrue(all(v == int(v) for v in series.values()), series)  # whole bytes
        # Each (rank, layer, format) counter holds the floor of its exact share: short by < 1.
        total = sum(series.values())
        reported_bytes = int(field(field(job, "progress"), "bytes_sent"))
        self.assertLessEqual(total, reported_bytes)
        self.assertGreater(total, reported_bytes - len(series))
        self.assertEqual(prom.query("sum by (result) (geofp8_jobs_total)")[
            frozenset({("result", "succeeded")})], 1.0)
        self.assertEqual(prom.query("sum by (result) (geofp8_worker_jobs_total)")[
            frozenset({("result", "succeeded")})], 2.0)
        info = prom.query("geofp8_build_info")
        self.assertEqual(len(info), 3)
        self.assertTrue(all(v == 1 for v in info.values()))


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:], verbosity=2)
