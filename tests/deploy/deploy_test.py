#!/usr/bin/python3
# Checks the deployment assets against the programs they deploy: manifests parse, every flag they
# pass exists in the binary's --help, every metric the dashboard queries is exported, every Helm
# value a template reads is defined, and a real Prometheus server scrapes a real coordinator.
import http.client
import json
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
    for sub in ("server", "worker"):
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


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:], verbosity=2)
