#!/usr/bin/python3
# Checks the deployment assets against the programs they deploy: manifests parse, every flag they
# pass exists in the binary's --help, every metric the dashboard queries is exported, every Helm
# value a template reads is defined, and a real Prometheus server scrapes a real coordinator.
import contextlib
import http.client
import io
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
    for sub in ("server", "worker", "platform/common"):
        for root, _, files in os.walk(os.path.join(ROOT, sub)):
            for f in files:
                if f.endswith((".cc", ".h")):
                    text = read(os.path.join(root, f))
                    names.update(re.findall(r'"(geofp8_[a-z0-9_]+)"', text))
    return names


CHART = os.path.join(ROOT, "helm/geofp8")
RAW_MANIFEST = os.path.join(ROOT, "deploy/k8s/geofp8.yaml")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import helm_render  # noqa: E402  (tests/deploy/helm_render.py)

# The value sets the chart is rendered with: every TLS/token combination plus the placement,
# pull-secret and account knobs. Each must render, validate and pass only real flags.
TLS = {"serverSecret": "geofp8-server-tls", "caSecret": "geofp8-ca"}
MTLS = dict(TLS, mutual=True, workerSecret="geofp8-worker-tls")
VALUE_SETS = {
    "defaults": {},
    "token": {"tokenSecret": "geofp8-token"},
    "tls": {"tls": TLS},
    "tls+token+monitoring": {"tls": TLS, "tokenSecret": "geofp8-token",
                             "metrics": {"serviceMonitor": True, "grafanaDashboard": True}},
    "mtls": {"tls": MTLS},
    "mtls+token+everything": {
        "tls": MTLS, "tokenSecret": "geofp8-token",
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccount": {"create": False, "name": "training"},
        "coordinator": {"nodeSelector": {"pool": "control"}, "storageClassName": "fast"},
        "worker": {"replicas": 8, "nodeSelector": {"pool": "cpu"},
                   "tolerations": [{"key": "dedicated", "operator": "Exists",
                                    "effect": "NoSchedule"}],
                   "affinity": {"podAntiAffinity": {}}},
        "metrics": {"serviceMonitor": True, "grafanaDashboard": False}},
    "pod-extras": {"coordinator": {}, "worker": {}},  # filled in below from POD_EXTRAS
}
# Every pod extra (issue 29) on both components, with a ServiceMonitor and a worker PDB.
POD_EXTRAS = {
    "image": {"repository": "registry.example/geofp8", "tag": "0.1.0-custom",
              "pullPolicy": "Always"},
    "env": [{"name": "GEOFP8_EXTRA", "value": "1"},
            {"name": "FROM_FIELD", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
    "envFrom": [{"configMapRef": {"name": "job-env"}}, {"secretRef": {"name": "job-secrets"}}],
    "extraVolumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}],
    "extraVolumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
    "podAnnotations": {"example.com/team": "training"},
    "priorityClassName": "training-high",
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                   "whenUnsatisfiable": "ScheduleAnyway"}],
}
VALUE_SETS["pod-extras"] = {
    "coordinator": dict(POD_EXTRAS),
    "worker": dict(POD_EXTRAS, shmSize="2Gi",
                   podDisruptionBudget={"enabled": True, "maxUnavailable": "25%"}),
    "metrics": {"serviceMonitor": True, "serviceMonitorLabels": {"release": "kube-prometheus"},
                "serviceMonitorInterval": "30s"},
}
# A user's own script as a command: job through the chart (issue 29): the script in a ConfigMap
# (kubectl create configmap my-train --from-file=train.py) mounted with extraVolumes, the
# directory on PYTHONPATH through env (the worker passes its environment on to the program).
COMMAND_JOB_VALUES = {"worker": {
    "extraVolumes": [{"name": "job-code", "configMap": {"name": "my-train"}}],
    "extraVolumeMounts": [{"name": "job-code", "mountPath": "/opt/job", "readOnly": True}],
    "env": [{"name": "PYTHONPATH", "value": "/opt/job"}],
    "shmSize": "1Gi"}}
COMMAND_JOB_SPEC = """
name: my-train
world_size: 2
backend: gloo
command: [python3, /opt/job/train.py, --steps, "20"]
"""
# The coordinator alone, for clusters that bring their own launcher (issue 43).
COORDINATOR_ONLY = {"worker": {"enabled": False}}
# Value sets the chart must refuse, and the message that says why.
BAD_TLS = {
    "server cert without CA": ({"tls": {"serverSecret": "s"}}, "tls.caSecret is required"),
    "CA without server cert": ({"tls": {"caSecret": "c"}}, "tls.serverSecret is empty"),
    "mutual without worker cert": ({"tls": dict(TLS, mutual=True)}, "tls.workerSecret"),
    "worker cert without mutual": ({"tls": dict(TLS, workerSecret="w")}, "tls.mutual is false"),
}


def render(overrides):
    return helm_render.Renderer(CHART, [overrides]).manifests()


def containers_of(doc):
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec, spec.get("containers", [])


def split_args(args):
    """{flag: value} of --flag=value arguments; a bare --flag maps to None."""
    out = {}
    for a in args:
        flag, _, value = a.partition("=")
        out[flag] = value if _ else None
    return out


DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def validate(docs):
    """Structural checks of rendered manifests; returns a list of problems (empty when fine)."""
    errs = []
    services = [d for d in docs if d["kind"] == "Service"]
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for d in docs:
        where = "%s/%s" % (d.get("kind"), d.get("metadata", {}).get("name"))
        for key in ("apiVersion", "kind", "metadata"):
            if key not in d:
                errs.append("%s: no %s" % (where, key))
        name = d.get("metadata", {}).get("name")
        if not isinstance(name, str) or not DNS1123.match(name) or len(name) > 63:
            errs.append("%s: metadata.name %r is not a DNS-1123 label" % (where, name))
        for k, v in (d.get("metadata", {}).get("labels") or {}).items():
            if not isinstance(v, str):
                errs.append("%s: label %s=%r is not a string" % (where, k, v))
        if d["kind"] in ("ConfigMap", "Secret"):
            for k, v in (d.get("data") or {}).items():
                if not isinstance(v, str):
                    errs.append("%s: data.%s is not a string" % (where, k))
                elif k.endswith(".json"):
                    try:
                        json.loads(v)
                    except ValueError as e:
                        errs.append("%s: data.%s is not JSON: %s" % (where, k, e))
        if d["kind"] == "Service":
            for p in d["spec"]["ports"]:
                if not isinstance(p["port"], int) or not 0 < p["port"] < 65536:
                    errs.append("%s: port %r" % (where, p["port"]))
    for w in workloads:
        where = "%s/%s" % (w["kind"], w["metadata"]["name"])
        spec, containers = containers_of(w)
        pod_labels = w["spec"]["template"]["metadata"]["labels"]
        for k, v in w["spec"]["selector"]["matchLabels"].items():
            if pod_labels.get(k) != v:
                errs.append("%s: selector %s=%s does not match the pod labels" % (where, k, v))
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        volumes.update({c["metadata"]["name"]: {"pvc": True}
                        for c in w["spec"].get("volumeClaimTemplates", [])})
        sa = spec.get("serviceAccountName")
        if sa and not any(d["kind"] == "ServiceAccount" and d["metadata"]["name"] == sa
                          for d in docs) and sa != "training":
            errs.append("%s: serviceAccountName %s is neither created nor the one asked for"
                        % (where, sa))
        if not containers:
            errs.append("%s: no containers" % where)
        for c in containers:
            cw = "%s container %s" % (where, c.get("name"))
            if not isinstance(c.get("image"), str) or ":" not in c["image"]:
                errs.append("%s: image %r" % (cw, c.get("image")))
            for field in ("command", "args"):
                for a in c.get(field, []):
                    if not isinstance(a, str):
                        errs.append("%s: %s item %r is not a string" % (cw, field, a))
            ports = {}
            for p in c.get("ports", []):
                if not isinstance(p.get("containerPort"), int) or not 0 < p["containerPort"] < 65536:
                    errs.append("%s: containerPort %r" % (cw, p.get("containerPort")))
                if len(p.get("name", "")) > 15:
                    errs.append("%s: port name %s longer than 15" % (cw, p["name"]))
                ports[p.get("name")] = p.get("containerPort")
            for probe in ("readinessProbe", "livenessProbe"):
                pr = c.get(probe)
                if pr is None:
                    errs.append("%s: no %s" % (cw, probe))
                    continue
                handler = pr.get("httpGet") or pr.get("tcpSocket") or pr.get("grpc")
                if handler is None:
                    errs.append("%s: %s has no handler" % (cw, probe))
                    continue
                port = handler.get("port")
                if port not in ports and port not in ports.values():
                    errs.append("%s: %s uses port %r, which the container does not declare"
                                % (cw, probe, port))
                if "grpc" in pr and any(a.startswith("--tls-cert") for a in c.get("args", [])):
                    errs.append("%s: a grpc %s cannot speak TLS" % (cw, probe))
            for e in c.get("env", []):
                if "value" in e and not isinstance(e["value"], str):
                    errs.append("%s: env %s is not a string" % (cw, e["name"]))
            res = c.get("resources", {})
            if not res.get("requests") or not res.get("limits"):
                errs.append("%s: resources need requests and limits" % cw)
            sc = dict(spec.get("securityContext") or {}, **(c.get("securityContext") or {}))
            if sc.get("runAsNonRoot") is not True:
                errs.append("%s: not runAsNonRoot" % cw)
            if w["spec"].get("volumeClaimTemplates") and not isinstance(
                    (spec.get("securityContext") or {}).get("fsGroup"), int):
                errs.append("%s: a PVC without fsGroup is not writable by uid 10001" % cw)
            mounts = {}
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    errs.append("%s: mounts undeclared volume %s" % (cw, m["name"]))
                mounts[m["mountPath"]] = volumes.get(m["name"], {})
            if sc.get("readOnlyRootFilesystem") and "/tmp" not in mounts:
                errs.append("%s: read-only root without a writable /tmp" % cw)
            # Every file argument must come from a mounted Secret that provides that key.
            for flag, value in split_args(c.get("args", [])).items():
                if not value or not value.startswith("/etc/"):
                    continue
                base = os.path.dirname(value)
                vol = mounts.get(base)
                if vol is None:
                    errs.append("%s: %s=%s is on no mounted volume" % (cw, flag, value))
                    continue
                secret = vol.get("secret", {})
                keys = [i["path"] for i in secret.get("items", [])]
                if not secret.get("secretName") or os.path.basename(value) not in keys:
                    errs.append("%s: %s=%s: volume does not provide that key (items %s)"
                                % (cw, flag, value, keys))
        # A Service must target ports that its pods declare by name.
    for svc in services:
        sel = svc["spec"]["selector"]
        targets = [w for w in workloads
                   if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v
                          for k, v in sel.items())]
        if not targets:
            errs.append("Service/%s selects no workload" % svc["metadata"]["name"])
        for w in targets:
            names = {p["name"] for c in containers_of(w)[1] for p in c.get("ports", [])}
            for p in svc["spec"]["ports"]:
                if isinstance(p.get("targetPort"), str) and p["targetPort"] not in names:
                    errs.append("Service/%s targets port %s its pods lack"
                                % (svc["metadata"]["name"], p["targetPort"]))
    for sm in [d for d in docs if d["kind"] == "ServiceMonitor"]:
        ports = {p["name"] for s in services for p in s["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            if ep["port"] not in ports:
                errs.append("ServiceMonitor scrapes port %s no Service has" % ep["port"])
    return errs


def flag_problems(docs, help_of):
    """Flags the containers pass that their binary's --help does not list, and secrets on the
    command line."""
    errs = []
    for d in docs:
        for c in containers_of(d)[1]:
            binary = c["command"][0]
            for flag in split_args(c["args"]):
                if flag not in help_of[binary]:
                    errs.append("%s has no flag %s" % (binary, flag))
                if flag == "--token":
                    errs.append("%s gets its token on the command line" % binary)
    return errs


def workload(docs, component):
    return next(d for d in docs if d["kind"] == "StatefulSet"
                and d["metadata"]["name"].endswith(component))


class ManifestTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.help = {"geofp8-coordinator": help_flags(COORDINATOR),
                    "geofp8-worker": help_flags(WORKER)}

    def test_plain_manifests_parse(self):
        docs = list(yaml.safe_load_all(read(RAW_MANIFEST)))
        kinds = sorted(d["kind"] for d in docs)
        self.assertEqual(kinds, ["Namespace", "Service", "Service", "StatefulSet", "StatefulSet"])
        yaml.safe_load(read(os.path.join(CHART, "values.yaml")))
        yaml.safe_load(read(os.path.join(CHART, "Chart.yaml")))

    def test_raw_manifest_validates_and_requires_a_token(self):
        docs = [d for d in yaml.safe_load_all(read(RAW_MANIFEST)) if d["kind"] != "Namespace"]
        self.assertEqual(validate(docs), [])
        self.assertEqual(flag_problems(docs, self.help), [])
        for d in docs:
            for c in containers_of(d)[1]:
                args = split_args(c["args"])
                listen = args.get("--listen", args.get("--metrics-host", ""))
                if "0.0.0.0" in (listen or "") or c["command"][0] == "geofp8-worker":
                    self.assertIn("--token-file", args,
                                  "%s listens on all addresses without auth" % c["name"])

    def test_raw_manifest_matches_the_charts_security_and_flags(self):
        # Issue #40 item 7: the raw manifest runs the daemons as the chart does (with a token):
        # the same pod and container security contexts (seccomp included) and the same flags
        # with the same values, except these, which the chart derives from its release or passes
        # at the daemons' own defaults.
        differ = {"--coordinator",  # the chart's Service is named after the release
                  "--log-format",  # text: the daemons' default
                  "--heartbeat-timeout-ms"}  # 6000: the coordinator's default
        raw = [d for d in yaml.safe_load_all(read(RAW_MANIFEST)) if d["kind"] != "Namespace"]
        chart = [d for _, d in render({"tokenSecret": "geofp8-token"})]
        for component in ("coordinator", "worker"):
            raw_pod, (raw_c,) = containers_of(workload(raw, component))
            chart_pod, (chart_c,) = containers_of(workload(chart, component))
            self.assertEqual(raw_pod["securityContext"], chart_pod["securityContext"], component)
            self.assertEqual(raw_c["securityContext"], chart_c["securityContext"], component)
            raw_args = split_args(raw_c["args"])
            chart_args = split_args(chart_c["args"])
            for flag in set(raw_args) | set(chart_args):
                if flag in differ:
                    continue
                self.assertEqual(raw_args.get(flag, "absent"), chart_args.get(flag, "absent"),
                                 "%s %s" % (component, flag))

    def test_helm_values_read_by_templates_are_defined(self):
        values = yaml.safe_load(read(os.path.join(CHART, "values.yaml")))
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

    def test_dockerignore_keeps_build_trees_out_of_the_context(self):
        # deploy/docker/Dockerfile builds with the repository root as its context.
        self.assertIn("COPY . .", read(os.path.join(ROOT, "deploy/docker/Dockerfile")))
        lines = [l.strip() for l in read(os.path.join(ROOT, ".dockerignore")).splitlines()
                 if l.strip() and not l.startswith("#")]
        for pattern in (".git", "build", "build-*", "demo-out"):
            self.assertIn(pattern, lines)
        for needed in ("CMakeLists.txt", "scripts", "examples", "proto", "server", "worker"):
            self.assertFalse(any(l.rstrip("/") == needed for l in lines), needed)


class HelmChartTest(unittest.TestCase):
    """Renders helm/geofp8 with tests/deploy/helm_render.py (Debian 12 packages no helm) for every
    value set above and checks the output the way a cluster and the binaries would."""

    @classmethod
    def setUpClass(cls):
        cls.help = {"geofp8-coordinator": help_flags(COORDINATOR),
                    "geofp8-worker": help_flags(WORKER)}
        cls.schema = json.loads(read(os.path.join(CHART, "values.schema.json")))

    def schema_errors(self, values):
        import jsonschema  # python3-jsonschema (scripts/lib/common.sh)
        v = jsonschema.Draft7Validator(self.schema)
        return ["%s: %s" % ("/".join(map(str, e.path)), e.message) for e in v.iter_errors(values)]

    def test_every_value_set_renders_validates_and_passes_real_flags(self):
        for label, overrides in VALUE_SETS.items():
            with self.subTest(values=label):
                r = helm_render.Renderer(CHART, [overrides])
                self.assertEqual(self.schema_errors(r.values), [])
                docs = r.manifests()
                kinds = sorted(d["kind"] for _, d in docs)
                self.assertEqual(kinds.count("StatefulSet"), 2, kinds)
                docs = [d for _, d in docs]
                self.assertEqual(validate(docs), [])
                self.assertEqual(flag_problems(docs, self.help), [])
                notes = r.render()["NOTES.txt"]
                self.assertIn("geofp8ctl --server", notes)

    def test_tls_and_token_flags_follow_the_values(self):
        for label, overrides in VALUE_SETS.items():
            with self.subTest(values=label):
                docs = [d for _, d in render(overrides)]
                coord = split_args(containers_of(workload(docs, "coordinator"))[1][0]["args"])
                wspec, wc = containers_of(workload(docs, "worker"))
                worker = split_args(wc[0]["args"])
                tls = overrides.get("tls", {})
                token = "tokenSecret" in overrides
                self.assertEqual("--token-file" in coord, token)
                self.assertEqual("--token-file" in worker, token)
                self.assertEqual("--tls-cert" in coord, bool(tls))
                self.assertEqual("--tls-client-ca" in coord, bool(tls.get("mutual")))
                self.assertEqual("--tls-ca" in worker, bool(tls.get("caSecret")))
                self.assertEqual("--tls-cert" in worker, bool(tls.get("mutual")))
                # Workers never mount the coordinator's Secret (and so never its tls.key).
                secrets = {v["secret"]["secretName"] for v in wspec.get("volumes", [])
                           if "secret" in v}
                self.assertNotIn(TLS["serverSecret"], secrets)

    @unittest.skipIf(shutil.which("openssl") is None, "openssl not installed")
    def test_coordinator_probe_answers_with_mtls_args(self):
        # Runs the coordinator with exactly the arguments the chart renders for mTLS + token
        # (files and addresses moved to a temp dir) and asks its readiness probe over plain HTTP.
        docs = [d for _, d in render(VALUE_SETS["mtls+token+everything"])]
        c = containers_of(workload(docs, "coordinator"))[1][0]
        probe = c["readinessProbe"]["httpGet"]
        self.assertEqual(probe["port"], "metrics")
        with tempfile.TemporaryDirectory() as tmp:
            def ssl(*args):
                subprocess.run(["openssl"] + list(args), cwd=tmp, check=True,
                               capture_output=True, timeout=30)
            ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=geofp8-test-ca", "-days", "1")
            ssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=geofp8-coordinator")
            ssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", "tls.crt", "-days", "1")
            with open(os.path.join(tmp, "token"), "w") as f:
                f.write("s3cret\n")
            args = []
            for a in c["args"]:
                flag, _, value = a.partition("=")
                if value.startswith("/etc/geofp8/"):
                    value = os.path.join(tmp, os.path.basename(value))
                elif value.startswith("0.0.0.0:"):
                    value = "127.0.0.1:0"
                elif flag == "--data-dir":
                    value = os.path.join(tmp, "data")
                args.append("%s=%s" % (flag, value))
            self.assertIn("--tls-client-ca=%s" % os.path.join(tmp, "ca.crt"), args)
            ready = os.path.join(tmp, "ready.json")
            log = open(os.path.join(tmp, "coordinator.log"), "w+")
            proc = subprocess.Popen([COORDINATOR] + args + ["--ready-file", ready],
                                    stdout=log, stderr=subprocess.STDOUT, text=True)
            try:
                deadline = time.time() + 30
                while not os.path.exists(ready) and proc.poll() is None and time.time() < deadline:
                    time.sleep(0.05)
                if proc.poll() is not None:
                    log.seek(0)
                    self.fail("coordinator exited %d: %s" % (proc.returncode, log.read()))
                with open(ready) as f:
                    metrics = json.load(f)["metrics"]
                with urllib.request.urlopen("http://%s%s" % (metrics, probe["path"]),
                                            timeout=10) as r:
                    self.assertEqual(r.status, 200)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
                log.close()

    def test_inconsistent_tls_values_fail_with_a_message(self):
        for label, (overrides, message) in BAD_TLS.items():
            with self.subTest(case=label):
                with self.assertRaises(helm_render.RenderError) as cm:
                    render(overrides)
                self.assertIn(message, str(cm.exception))

    def test_gpu_workers(self):
        # geofp8-worker takes --device cuda only where the driver lists a GPU (an empty listing
        # here: exit 2 naming it).
        with tempfile.TemporaryDirectory() as no_gpus:
            r = subprocess.run([WORKER, "--device", "cuda", "--metrics-port", "-1"],
                               capture_output=True, text=True, timeout=30,
                               env=dict(os.environ, GEOFP8_NVIDIA_GPUS_DIR=no_gpus))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("no GPU", r.stderr)
        self.assertEqual(yaml.safe_load(read(os.path.join(CHART, "values.yaml")))
                         ["worker"]["device"], "cpu")
        # The schema allows cuda only with a GPU count, and a GPU count only with cuda.
        for bad in ({"device": "cuda"}, {"device": "cuda", "gpus": 0}, {"gpus": 1},
                    {"device": "cuda:1", "gpus": 2}, {"device": "cuda", "gpus": -1}):
            with self.subTest(worker=bad):
                values = helm_render.Renderer(CHART, [{"worker": bad}]).values
                self.assertTrue(any("gpus" in e or "device" in e
                                    for e in self.schema_errors(values)), bad)
        gpu = {"device": "cuda", "gpus": 1, "nodeSelector": {"nvidia.com/gpu.present": "true"},
               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                "effect": "NoSchedule"}]}
        r = helm_render.Renderer(CHART, [{"worker": gpu}])
        self.assertEqual(self.schema_errors(r.values), [])
        docs = [d for _, d in r.manifests()
                if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-worker")]
        self.assertEqual(len(docs), 1)
        spec, containers = containers_of(docs[0])
        self.assertIn("--device=cuda", containers[0]["args"])
        # GPU workers run the GPU image (geofp8's CUDA build), the CPU ones the CPU image.
        self.assertEqual(containers[0]["image"], "geofp8-worker-cuda:0.1.0")
        res = containers[0]["resources"]
        self.assertEqual(res["limits"]["nvidia.com/gpu"], 1)
        self.assertEqual(res["limits"]["cpu"], "2")  # the default limits are kept
        self.assertEqual(res["requests"]["memory"], "2Gi")
        self.assertNotIn("nvidia.com/gpu", res["requests"])
        self.assertEqual(spec["nodeSelector"], gpu["nodeSelector"])
        self.assertEqual(spec["tolerations"], gpu["tolerations"])
        # CPU workers ask for no GPU.
        cpu = [d for _, d in render({}) if d["kind"] == "StatefulSet"
               and d["metadata"]["name"].endswith("-worker")]
        self.assertNotIn("nvidia.com/gpu", containers_of(cpu[0])[1][0]["resources"]["limits"])
        self.assertEqual(containers_of(cpu[0])[1][0]["image"], "geofp8-worker:0.1.0")

    def test_gpu_workers_refuse_the_cpu_image(self):
        # The CPU image's geofp8 has has_cuda False: worker.device cuda with it is refused, by
        # the schema (the default repository's name) and by the templates (image.repository +
        # "-worker", whatever the repository), either naming worker.image.repository.
        gpu = {"device": "cuda", "gpus": 1}
        for repo in ("geofp8-worker", "registry.example.com/ml/geofp8-worker"):
            with self.subTest(repository=repo):
                values = helm_render.Renderer(
                    CHART, [{"worker": dict(gpu, image={"repository": repo})}]).values
                errs = self.schema_errors(values)
                self.assertTrue(any(e.startswith("worker/image/repository:") for e in errs),
                                errs)
        for overrides in ({"image": {"repository": "reg.example/gfp"},
                           "worker": dict(gpu, image={"repository": "reg.example/gfp-worker"})},
                          {"worker": dict(gpu, image={"repository": "geofp8-worker"})}):
            with self.subTest(templates=overrides):
                with self.assertRaises(helm_render.RenderError) as cm:
                    helm_render.Renderer(CHART, [overrides]).render()
                self.assertIn("worker.device=cuda needs the GPU worker image", str(cm.exception))
                self.assertIn("worker.image.repository", str(cm.exception))
        # Accepted: the default (image.repository + "-worker-cuda", with a registry too), a
        # GPU image named outright, and the CPU image's repository for CPU workers.
        for overrides, image in (
                ({"worker": gpu}, "geofp8-worker-cuda:0.1.0"),
                ({"image": {"repository": "reg.example/gfp", "tag": "1.2.3"}, "worker": gpu},
                 "reg.example/gfp-worker-cuda:1.2.3"),
                ({"worker": dict(gpu, image={"repository": "reg.example/my-gpu-image",
                                             "tag": "7"})}, "reg.example/my-gpu-image:7"),
                ({"worker": {"image": {"repository": "geofp8-worker"}}}, "geofp8-worker:0.1.0")):
            with self.subTest(accepted=overrides):
                r = helm_render.Renderer(CHART, [overrides])
                self.assertEqual(self.schema_errors(r.values), [])
                rendered = r.render()
                self.assertIn("(image %s)" % image, rendered["NOTES.txt"])
                workers = [d for _, d in r.manifests() if d["kind"] == "StatefulSet"
                           and d["metadata"]["name"].endswith("-worker")]
                self.assertEqual(containers_of(workers[0])[1][0]["image"], image)

    def test_pod_extras_reach_both_pods(self):
        r = helm_render.Renderer(CHART, [VALUE_SETS["pod-extras"]])
        self.assertEqual(self.schema_errors(r.values), [])
        docs = [d for _, d in r.manifests()]
        for component in ("coordinator", "worker"):
            with self.subTest(component=component):
                w = workload(docs, component)
                spec, (c,) = containers_of(w)
                self.assertEqual(c["image"], "registry.example/geofp8:0.1.0-custom")
                self.assertEqual(c["imagePullPolicy"], "Always")
                env = {e["name"]: e for e in c["env"]}
                self.assertEqual(env["GEOFP8_EXTRA"]["value"], "1")
                self.assertIn("valueFrom", env["FROM_FIELD"])
                self.assertEqual(c["envFrom"], POD_EXTRAS["envFrom"])
                self.assertIn({"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}},
                              spec["volumes"])
                self.assertIn(POD_EXTRAS["extraVolumeMounts"][0], c["volumeMounts"])
                self.assertEqual(w["spec"]["template"]["metadata"]["annotations"],
                                 POD_EXTRAS["podAnnotations"])
                self.assertEqual(spec["priorityClassName"], "training-high")
                self.assertEqual(spec["topologySpreadConstraints"],
                                 POD_EXTRAS["topologySpreadConstraints"])
        # The worker keeps the chart's own variables next to the user's, and gets /dev/shm.
        spec, (c,) = containers_of(workload(docs, "worker"))
        self.assertEqual([e["name"] for e in c["env"]][:2], ["POD_NAME", "POD_IP"])
        shm = next(v for v in spec["volumes"] if v["name"] == "shm")
        self.assertEqual(shm["emptyDir"], {"medium": "Memory", "sizeLimit": "2Gi"})
        self.assertIn({"name": "shm", "mountPath": "/dev/shm"}, c["volumeMounts"])
        pdb = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
        self.assertEqual(len(pdb), 1)
        self.assertEqual(pdb[0]["apiVersion"], "policy/v1")
        self.assertEqual(pdb[0]["spec"]["maxUnavailable"], "25%")
        self.assertEqual(pdb[0]["spec"]["selector"]["matchLabels"],
                         workload(docs, "worker")["spec"]["selector"]["matchLabels"])
        (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
        self.assertEqual(sm["metadata"]["labels"]["release"], "kube-prometheus")
        self.assertEqual({e["interval"] for e in sm["spec"]["endpoints"]}, {"30s"})
        # Defaults: the global repository with each component's suffix (the two images
        # scripts/image.sh builds), no PDB, no /dev/shm volume, the 10s interval.
        docs = [d for _, d in render({"metrics": {"serviceMonitor": True}})]
        self.assertEqual(containers_of(workload(docs, "coordinator"))[1][0]["image"],
                         "geofp8-coordinator:0.1.0")
        spec, (c,) = containers_of(workload(docs, "worker"))
        self.assertEqual(c["image"], "geofp8-worker:0.1.0")
        self.assertNotIn("shm", [v["name"] for v in spec["volumes"]])
        self.assertNotIn("PodDisruptionBudget", [d["kind"] for d in docs])
        (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
        self.assertEqual({e["interval"] for e in sm["spec"]["endpoints"]}, {"10s"})
        # Only the worker's image overridden: the coordinator keeps the global one.
        docs = [d for _, d in render({"worker": {"image": {"tag": "gpu"}}})]
        self.assertEqual(containers_of(workload(docs, "worker"))[1][0]["image"],
                         "geofp8-worker:gpu")
        self.assertEqual(containers_of(workload(docs, "coordinator"))[1][0]["image"],
                         "geofp8-coordinator:0.1.0")
        # A component's own repository is taken as it is, without a suffix.
        docs = [d for _, d in render({"coordinator": {"image": {"repository": "mine/coord"}}})]
        self.assertEqual(containers_of(workload(docs, "coordinator"))[1][0]["image"],
                         "mine/coord:0.1.0")

    def test_schema_rejects_bad_pod_extras(self):
        for bad in ({"worker": {"shmSize": "1GB"}}, {"worker": {"env": [{"value": "x"}]}},
                    {"worker": {"env": {"PYTHONPATH": "/x"}}},
                    {"worker": {"podDisruptionBudget": {"maxUnavailable": "many"}}},
                    {"worker": {"podDisruptionBudget": {"enable": True}}},
                    {"worker": {"extraVolumeMounts": [{"name": "x", "mountPath": "rel"}]}},
                    {"coordinator": {"shmSize": "1Gi"}},
                    {"coordinator": {"image": {"tags": "x"}}},
                    {"coordinator": {"priorityClassName": "Not A Name"}},
                    {"worker": {"topologySpreadConstraints": [{"maxSkew": 1}]}},
                    {"metrics": {"serviceMonitorInterval": "10"}},
                    {"metrics": {"serviceMonitorLabels": {"a": 1}}}):
            with self.subTest(values=bad):
                values = helm_render.Renderer(CHART, [bad]).values
                self.assertNotEqual(self.schema_errors(values), [])

    def test_command_job_through_the_chart(self):
        r = helm_render.Renderer(CHART, [COMMAND_JOB_VALUES])
        self.assertEqual(self.schema_errors(r.values), [])
        docs = [d for _, d in r.manifests()]
        self.assertEqual(validate(docs), [])
        self.assertEqual(flag_problems(docs, self.help), [])
        spec, (c,) = containers_of(workload(docs, "worker"))
        # The worker runs command: jobs only with --allow-commands, which it has.
        self.assertIn("--allow-commands", split_args(c["args"]))
        self.assertIn("--allow-commands", self.help["geofp8-worker"])
        # The spec's script is on a mounted volume, that volume is the user's ConfigMap, and
        # PYTHONPATH names the mounted directory.
        job = yaml.safe_load(COMMAND_JOB_SPEC)
        script = next(a for a in job["command"] if a.endswith(".py"))
        volumes = {v["name"]: v for v in spec["volumes"]}
        mount = next(m for m in c["volumeMounts"]
                     if script.startswith(m["mountPath"].rstrip("/") + "/"))
        self.assertEqual(volumes[mount["name"]]["configMap"]["name"], "my-train")
        env = {e["name"]: e.get("value") for e in c["env"]}
        self.assertEqual(env["PYTHONPATH"], mount["mountPath"])
        self.assertTrue(mount.get("readOnly"))
        # The program's working directory and checkpoints live under --data-dir, which is the
        # writable checkpoint volume (the root filesystem is read-only).
        data_dir = split_args(c["args"])["--data-dir"]
        self.assertIn({"name": "checkpoints", "mountPath": data_dir}, c["volumeMounts"])

    def test_command_job_runs_with_the_rendered_worker(self):
        # The rendered worker container, run here: its args (cluster addresses and paths moved
        # to a temp dir) and env (the ConfigMap's mount path moved likewise), two workers and a
        # coordinator; the user's script imports a module from the mounted directory through
        # PYTHONPATH and the job succeeds.
        if not CTL:
            self.skipTest("GEOFP8CTL not set")
        docs = [d for _, d in render(COMMAND_JOB_VALUES)]
        _, (c,) = containers_of(workload(docs, "worker"))
        mount = next(m for m in c["volumeMounts"] if m["name"] == "job-code")["mountPath"]
        with tempfile.TemporaryDirectory(prefix="geofp8-chartjob-") as tmp:
            code = os.path.join(tmp, "configmap-my-train")
            os.makedirs(code)
            with open(os.path.join(code, "jobhelper.py"), "w") as f:
                f.write("def where():\n    return __file__\n")
            with open(os.path.join(code, "train.py"), "w") as f:
                f.write("import os, jobhelper\nprint('rank', os.environ['RANK'], 'helper',"
                        " jobhelper.where(), flush=True)\n")
            ready = os.path.join(tmp, "coord-ready.json")
            coord = subprocess.Popen([COORDINATOR, "--listen", "127.0.0.1:0", "--metrics-listen",
                                      "127.0.0.1:0", "--data-dir", os.path.join(tmp, "coord"),
                                      "--ready-file", ready], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
            procs = [coord]
            try:
                address = wait_ready_file(ready, coord, "coordinator")["grpc"]
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                for e in c["env"]:
                    if "value" in e:
                        env[e["name"]] = e["value"].replace(mount, code)
                self.assertEqual(env["PYTHONPATH"], code)
                logs = []
                for i in range(2):
                    args = []
                    for a in c["args"]:
                        flag, _, value = a.partition("=")
                        value = {"--coordinator": address, "--name": "w%d" % i,
                                 "--advertise-host": "127.0.0.1", "--metrics-host": "127.0.0.1",
                                 "--metrics-port": "0",
                                 "--data-dir": os.path.join(tmp, "w%d" % i)}.get(flag, value)
                        args.append("%s=%s" % (flag, value) if _ else flag)
                    wready = os.path.join(tmp, "w%d-ready.json" % i)
                    logs.append(open(os.path.join(tmp, "w%d.log" % i), "w+"))
                    procs.append(subprocess.Popen([WORKER] + args + ["--ready-file", wready],
                                                  env=env, stdout=logs[-1],
                                                  stderr=subprocess.STDOUT))
                    wait_ready_file(wready, procs[-1], "worker %d" % i)
                job = yaml.safe_load(COMMAND_JOB_SPEC)
                job["command"] = [sys.executable] + [a.replace(mount, code)
                                                     for a in job["command"][1:]]
                spec = os.path.join(tmp, "job.yaml")
                with open(spec, "w") as f:
                    yaml.safe_dump(job, f)

                def ctl(*args):
                    r = subprocess.run([CTL, "-s", address] + list(args), capture_output=True,
                                       text=True, timeout=30)
                    self.assertEqual(r.returncode, 0, r.stderr)
                    return r.stdout
                job_id = json.loads(ctl("-o", "json", "submit", "-f", spec))["job"]["id"]
                deadline = time.time() + 120
                while time.time() < deadline:
                    j = json.loads(ctl("-o", "json", "get", "job", job_id))
                    if j.get("state") in ("succeeded", "failed", "cancelled"):
                        break
                    time.sleep(0.2)
                outs = []
                for i in range(2):
                    for root, _, files in os.walk(os.path.join(tmp, "w%d" % i, "jobs")):
                        for name in files:
                            if name.endswith(".out"):
                                outs.append(read(os.path.join(root, name)))
                self.assertEqual(j.get("state"), "succeeded", (j, outs))
                helper = os.path.join(code, "jobhelper.py")
                self.assertEqual(sorted(o.strip() for o in outs),
                                 ["rank %d helper %s" % (r, helper) for r in range(2)])
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    p.wait(timeout=30)

    def test_notes_submit_command_parses(self):
        # The NOTES.txt geofp8ctl line, run as written against a closed port: "unreachable"
        # (exit 4) means geofp8ctl took its arguments; a usage error is exit 2.
        if not CTL:
            self.skipTest("GEOFP8CTL not set")
        notes = helm_render.Renderer(CHART).render()["NOTES.txt"]
        (line,) = [l.strip() for l in notes.splitlines() if l.strip().startswith("geofp8ctl ")]
        argv = line.split()
        argv[argv.index("--server") + 1] = "127.0.0.1:%d" % free_port()
        r = subprocess.run([CTL] + argv[1:], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 4, "%s: %s" % (line, r.stderr))
        self.assertIn("unreachable", r.stderr)

    def test_coordinator_only_passes_real_flags(self):
        # worker.enabled: false (issue 43): the coordinator's flags are real, and so is every flag
        # of the geofp8-worker line the NOTES tell users to run against it.
        for overrides in (COORDINATOR_ONLY, {"worker": {"enabled": False}, "tokenSecret": "t",
                                             "tls": MTLS}):
            with self.subTest(values=overrides):
                r = helm_render.Renderer(CHART, [overrides])
                self.assertEqual(self.schema_errors(r.values), [])
                docs = [d for _, d in r.manifests()]
                self.assertEqual([d["kind"] for d in docs].count("StatefulSet"), 1)
                self.assertEqual(validate(docs), [])
                self.assertEqual(flag_problems(docs, self.help), [])
                notes = r.render()["NOTES.txt"]
                told = set(re.findall(r"(--[a-z][a-z0-9-]*)", "\n".join(
                    l for l in notes.splitlines() if "geofp8ctl" not in l)))
                self.assertIn("--coordinator", told)
                self.assertEqual(sorted(told - self.help["geofp8-worker"]), [])

    def test_schema_rejects_bad_values(self):
        for bad in ({"worker": {"replicas": 0}}, {"coordinator": {"grpcPort": "7070"}},
                    {"tls": {"mutual": "yes"}}, {"tokenSecret": "Not A Name"},
                    {"wroker": {}}, {"coordinator": {"heartbeatTimeoutMs": 1000000}}):
            with self.subTest(values=bad):
                values = helm_render.Renderer(CHART, [bad]).values
                self.assertNotEqual(self.schema_errors(values), [])

    def test_renderer_refuses_what_it_does_not_implement(self):
        # A template outside the subset must fail loudly, not render something else.
        for src in ("{{ range .Values.x }}{{ end }}", "{{ $x := 1 }}", "{{ upper .Values.a }}",
                    "{{ if .Values.a }}unterminated"):
            with self.subTest(src=src):
                with self.assertRaises(helm_render.RenderError):
                    nodes = helm_render.parse(src, "t", {})
                    r = helm_render.Renderer(CHART)
                    r._run(nodes, r.root, "t")
        r = helm_render.Renderer(CHART, [{"x": {"n": 2000000}}])
        with self.assertRaises(helm_render.RenderError):  # helm would print 2e+06
            r._run(helm_render.parse("{{ .Values.x.n }}", "t", {}), r.root, "t")

    def test_chart_packaging_files(self):
        self.assertTrue(os.path.isfile(os.path.join(CHART, ".helmignore")))
        self.assertTrue(os.path.isfile(os.path.join(TEMPLATES, "NOTES.txt")))
        self.assertEqual(self.schema_errors(yaml.safe_load(read(os.path.join(CHART, "values.yaml")))),
                         [])


class HelmRenderCliTest(unittest.TestCase):
    """tests/deploy/helm_render.py as docs/deploy.md offers it (issue 43): like `helm template`,
    its stdout is manifests only, fit for `kubectl apply -f -`, and values that break
    values.schema.json fail the render naming the value path. Needs no built binaries."""

    SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helm_render.py")
    NOTES_LINES = ("is installed as release", "port-forward", "WARNING:", "geofp8ctl ")

    def cli(self, *args):
        # One short process each; the timeout only guards a hang on a loaded machine.
        return subprocess.run([sys.executable, self.SCRIPT, CHART] + list(args),
                              capture_output=True, text=True, timeout=120)

    def cli_in_process(self, overrides):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = helm_render.main([CHART, "--set-json", json.dumps(overrides)])
        return rc, out.getvalue(), err.getvalue()

    def assert_manifests_only(self, stdout, label):
        for line in self.NOTES_LINES:  # assertFalse: a failure should not print every manifest
            self.assertFalse(line in stdout, "%s: NOTES.txt (%r) in the manifests" % (label, line))
        docs = list(yaml.safe_load_all(stdout))
        self.assertTrue(docs, label)
        for d in docs:
            self.assertIsInstance(d, dict, "%s: a document that is not an object: %r" % (label, d))
            self.assertIn("apiVersion", d, label)
            self.assertIn("kind", d, label)
        return docs

    def test_output_is_manifests_without_notes(self):
        r = self.cli()
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stderr, "")
        docs = self.assert_manifests_only(r.stdout, "defaults")
        self.assertEqual(sorted(d["kind"] for d in docs).count("StatefulSet"), 2)
        self.assertEqual(validate(docs), [])
        # --notes puts NOTES.txt on stderr and leaves stdout as it was.
        n = self.cli("--notes")
        self.assertEqual((n.returncode, n.stdout), (0, r.stdout))
        self.assertIn("is installed as release", n.stderr)
        for label, overrides in dict(VALUE_SETS, **{"coordinator-only": COORDINATOR_ONLY}).items():
            with self.subTest(values=label):
                rc, out, err = self.cli_in_process(overrides)
                self.assertEqual((rc, err), (0, ""))
                self.assert_manifests_only(out, label)

    def test_wrong_type_fails_naming_the_path(self):
        for overrides, path, words in (
                ({"worker": {"replicas": "four"}}, "worker.replicas",
                 "'four' is not of type 'integer'"),
                ({"tls": {"mutual": "yes"}}, "tls.mutual", "'yes' is not of type 'boolean'"),
                ({"worker": {"enabled": "no"}}, "worker.enabled", "'no' is not of type 'boolean'"),
                ({"coordinator": {"env": [{"name": "A", "value": 1}]}},
                 "coordinator.env[0].value", "1 is not of type 'string'")):
            with self.subTest(values=overrides):
                r = self.cli("--set-json", json.dumps(overrides))
                self.assertEqual(r.returncode, 1, r.stderr)
                self.assertEqual(r.stdout, "")
                self.assertIn("values.schema.json", r.stderr)
                self.assertIn("- %s: %s" % (path, words), r.stderr)

    def test_cuda_with_the_cpu_image_fails_naming_the_value(self):
        r = self.cli("--set-json", json.dumps(
            {"worker": {"device": "cuda", "gpus": 1, "image": {"repository": "geofp8-worker"}}}))
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertEqual(r.stdout, "")
        self.assertIn("- worker.image.repository: 'geofp8-worker' should not be valid", r.stderr)

    def test_unknown_key_fails_naming_the_path(self):
        with tempfile.TemporaryDirectory() as tmp:
            values = os.path.join(tmp, "my-values.yaml")
            with open(values, "w") as f:
                f.write("worker:\n  replcias: 8\n")
            for args, path in (
                    (["-f", values], "worker.replcias"),
                    (["--set-json", '{"wroker": {"replicas": 8}}'], "wroker"),
                    (["--set-json", '{"securityContext": {"readOnlyRootFileSystem": true}}'],
                     "securityContext.readOnlyRootFileSystem"),
                    (["--set-json",
                      '{"worker": {"tolerations": [{"key": "a", "operater": "Exists"}]}}'],
                     "worker.tolerations[0].operater")):
                with self.subTest(args=args):
                    r = self.cli(*args)
                    self.assertEqual(r.returncode, 1, r.stderr)
                    self.assertEqual(r.stdout, "")
                    self.assertIn("- %s: unknown key" % path, r.stderr)

    def test_coordinator_only_renders_no_workers(self):
        for label, overrides in (
                ("coordinator-only", COORDINATOR_ONLY),
                ("coordinator-only+pdb+token+mtls",
                 {"worker": {"enabled": False, "podDisruptionBudget": {"enabled": True}},
                  "tokenSecret": "geofp8-token", "tls": MTLS,
                  "metrics": {"serviceMonitor": True}})):
            with self.subTest(values=label):
                rc, out, err = self.cli_in_process(overrides)
                self.assertEqual((rc, err), (0, ""))
                docs = self.assert_manifests_only(out, label)
                self.assertEqual(validate(docs), [])
                pods = [d for d in docs
                        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job", "Pod")]
                self.assertEqual([d["metadata"]["name"] for d in pods], ["geofp8-coordinator"])
                for d in docs:
                    self.assertNotEqual(d["metadata"].get("labels", {}).get(
                        "app.kubernetes.io/component"), "worker", d["kind"])
                    self.assertNotIn("worker", d["metadata"]["name"], d["kind"])
                notes = helm_render.Renderer(CHART, [overrides]).render()["NOTES.txt"]
                self.assertIn("worker.enabled is false", notes)
                self.assertIn("geofp8-worker --coordinator=geofp8-coordinator.default.svc:7070",
                              notes)
                self.assertNotIn("statefulset/geofp8-worker", notes)


class PrometheusConfigTest(unittest.TestCase):
    CONFIG = os.path.join(ROOT, "deploy/prometheus/prometheus.yml")
    TARGETS = os.path.join(ROOT, "deploy/prometheus/targets_from_ready.py")

    def test_config_has_no_fixed_demo_ports(self):
        # scripts/demo.sh starts every daemon on port 0, so fixed targets would never match.
        demo = read(os.path.join(ROOT, "scripts/demo.sh"))
        self.assertIn("--metrics-port 0", demo)
        cfg = yaml.safe_load(read(self.CONFIG))
        jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
        self.assertEqual(set(jobs), {"geofp8-coordinator", "geofp8-worker"})
        for j in jobs.values():
            self.assertNotIn("static_configs", j)
            self.assertTrue(j["file_sd_configs"][0]["files"])

    @unittest.skipIf(shutil.which("promtool") is None, "promtool not installed")
    def test_promtool_accepts_config(self):
        r = subprocess.run(["promtool", "check", "config", self.CONFIG],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_targets_from_ready_files(self):
        with tempfile.TemporaryDirectory() as tmp:
            for name, metrics in (("coordinator", "127.0.0.1:4001"), ("worker-0", "127.0.0.1:4002"),
                                  ("worker-1", None)):
                with open(os.path.join(tmp, name + ".ready.json"), "w") as f:
                    json.dump({"metrics": metrics, "pid": 1}, f)
            out = os.path.join(tmp, "targets")
            r = subprocess.run([sys.executable, self.TARGETS, tmp, out],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(out, "coordinator.json")) as f:
                self.assertEqual(json.load(f)[0]["targets"], ["127.0.0.1:4001"])
            with open(os.path.join(out, "workers.json")) as f:
                self.assertEqual(json.load(f)[0]["targets"], ["127.0.0.1:4002"])
            r = subprocess.run([sys.executable, self.TARGETS, os.path.join(tmp, "nope"), out],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 2)
            self.assertIn("READY_DIR", r.stderr)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_coordinator(data_dir, ready_file):
    """Starts geofp8-coordinator on free ports; returns (process, metrics port)."""
    proc = subprocess.Popen([COORDINATOR, "--listen", "127.0.0.1:0", "--metrics-listen",
                             "127.0.0.1:0", "--data-dir", data_dir, "--ready-file", ready_file],
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
    """A real Prometheus server, run with the shipped deploy/prometheus/prometheus.yml and the
    targets targets_from_ready.py derives from the coordinator's ready file (as docs/deploy.md
    tells a demo user), scrapes a real coordinator; the dashboard's jobs query answers."""

    def test_scrape(self):
        tmp = tempfile.mkdtemp()
        procs = []
        try:
            ready_dir = os.path.join(tmp, "ready")
            os.makedirs(ready_dir)
            ready = os.path.join(ready_dir, "coordinator.ready.json")
            coord, metrics_port = start_coordinator(os.path.join(tmp, "coord"), ready)
            procs.append(coord)
            deadline = time.time() + 30
            while not os.path.exists(ready) and time.time() < deadline:
                time.sleep(0.05)
            r = subprocess.run([sys.executable, PrometheusConfigTest.TARGETS, ready_dir,
                                os.path.join(tmp, "targets")], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            cfg = yaml.safe_load(read(PrometheusConfigTest.CONFIG))
            cfg["global"]["scrape_interval"] = "1s"  # only the pace differs from the shipped file
            config = os.path.join(tmp, "prometheus.yml")
            with open(config, "w") as f:
                yaml.safe_dump(cfg, f)
            with open(os.path.join(tmp, "targets", "coordinator.json")) as f:
                self.assertEqual(json.load(f)[0]["targets"], ["127.0.0.1:%d" % metrics_port])
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
training: {steps: 120, batch_size: 4, seq_len: 32, lr: 0.002, warmup_steps: 5, seed: 3,
           eval_every: 5, eval_batches: 2}
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
    return field(job, "state")  # lower case, as the table and --state name it


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
        after = time.time()

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
            elif "geofp8_worker_val_loss" in expr:
                # avg by (job_id): validation is collective (the batches are split over the ranks
                # and the sums all-reduced), so both ranks export the same value, measured after
                # a step that ends an eval_every period of 5.
                values = list(raw("geofp8_worker_val_loss").values())
                self.assertEqual(len(values), 2)
                self.assertAlmostEqual(list(result.values())[0], sum(values) / 2, places=9)
                self.assertTrue(all(0 < v < 20 for v in values), values)
                for step in raw("geofp8_worker_val_step").values():
                    self.assertEqual((step + 1) % 5, 0, step)
                coordinator = field(reported, "progress")
                # geofp8ctl counts steps done (val_step 5 = after the 5th step), /metrics the
                # index of the last step (4).
                self.assertEqual(field(coordinator, "val_step") % 5, 0, coordinator)
                self.assertTrue(0 < field(coordinator, "val_loss") < 20, coordinator)
            elif "geofp8_worker_loss" in expr:  # avg by (job_id): the ranks report one loss
                values = list(raw("geofp8_worker_loss").values())
                self.assertEqual(len(values), 2)
                self.assertAlmostEqual(list(result.values())[0], sum(values) / 2, places=9)
            elif "geofp8_worker_tokens_per_second" in expr:
                # Each rank reports the job's tokens/s over all ranks: the panel takes one rank's,
                # not the sum of two (2x).
                values = list(raw("geofp8_worker_tokens_per_second").values())
                (got,) = result.values()
                self.assertEqual(got, max(values))
                # The coordinator's figure is one rank's smoothed report (decay 0.8 per step) from
                # a moment between two scrapes, and a loaded machine's step times jitter: compare
                # it with the range the scrapes saw over the last 20 s, not with one sample. A
                # factor sqrt(2) either side (halfway to 2x on a log scale) still tells a rank's
                # job total from a sum or a per-rank share.
                window = "geofp8_worker_tokens_per_second%s[20s]" % sel
                lo = min(prom.query("min_over_time(%s)" % window, after).values())
                hi = max(prom.query("max_over_time(%s)" % window, after).values())
                coordinator = field(field(reported, "progress"), "tokens_per_second")
                self.assertTrue(lo / math.sqrt(2) < coordinator < hi * math.sqrt(2),
                                (lo, coordinator, hi))
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
            if state(job) in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.5)
        self.assertEqual(state(job), "succeeded", job)
        time.sleep(3)
        for gauge in ("geofp8_worker_step", "geofp8_worker_loss", "geofp8_worker_tokens_per_second",
                      "geofp8_quantization_rel_error", "geofp8_worker_policy_version",
                      "geofp8_worker_val_loss", "geofp8_worker_val_step"):
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


# The documents that show the daemons' and geofp8ctl's command lines.
DOCS = sorted([os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
               if f.endswith(".md")] +
              [os.path.join(ROOT, p) for p in ("README.md", "worker/daemon/README.md")])
PROGRAM_RE = re.compile(r"(?:^|[\s/`(])(geofp8-coordinator|geofp8-worker|geofp8ctl)(?=\s|$)")
FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# Where one command of a line ends and the next begins.
COMMAND_END_RE = re.compile(r"\s(?:\||\|\||&&|;|#)\s|\$\(|\)")


def ctl_help_flags():
    """geofp8ctl's flags: those of --help and of every subcommand's, down the tree."""
    flags = set()

    def walk(path):
        out = subprocess.run([CTL, *path, "--help"], capture_output=True, text=True).stdout
        flags.update(FLAG_RE.findall(out))
        section = out.split("Subcommands:\n", 1)
        if len(section) == 2:
            for line in section[1].splitlines():
                m = re.match(r"  ([a-z][a-z-]*)\s", line)
                if m:
                    walk(path + [m.group(1)])
    walk([])
    return flags


def command_texts(text):
    """The texts that may hold a command line: each line of a fenced block (backslash
    continuations joined) and each inline code span."""
    out = []
    fenced = False
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            pending += line
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            out.append(pending)
            pending = ""
        else:
            out.extend(re.findall(r"`([^`]+)`", line))
    return out


def doc_flag_mentions(path):
    """(program, flag, where) for every flag a command line of the document passes to one of
    the programs, and for worker/daemon/README.md every flag of its flag table."""
    text = read(path)
    found = []
    for cmd in command_texts(text):
        for m in PROGRAM_RE.finditer(cmd):
            rest = cmd[m.end():]
            end = COMMAND_END_RE.search(rest)
            rest = rest[:end.start()] if end else rest
            nested = PROGRAM_RE.search(rest)
            rest = rest[:nested.start()] if nested else rest
            for flag in FLAG_RE.findall(rest):
                found.append((m.group(1), flag, cmd.strip()))
    if path.endswith("worker/daemon/README.md"):
        for line in text.splitlines():
            if line.startswith("| `--"):
                cell = line.split("|")[1]
                for flag in FLAG_RE.findall(cell):
                    found.append(("geofp8-worker", flag, line[:60]))
    return found


class LauncherRecipeTest(unittest.TestCase):
    """examples/launchers/pytorchjob.yaml (issue 43): the sidecar's flags are the worker's, the
    training container finds the sidecar's socket, and both run as the chart's uid."""

    def test_pytorchjob_sidecar(self):
        doc = yaml.safe_load(read(os.path.join(ROOT, "examples/launchers/pytorchjob.yaml")))
        self.assertEqual(doc["kind"], "PyTorchJob")
        help_of = {"geofp8-worker": help_flags(WORKER)}
        for role, replica in doc["spec"]["pytorchReplicaSpecs"].items():
            pod = replica["template"]["spec"]
            self.assertEqual(pod["securityContext"]["runAsUser"], 10001, role)
            containers = {c["name"]: c for c in pod["containers"]}
            sidecar = containers["geofp8-worker"]
            self.assertEqual(flag_problems([{"spec": {"template": {"spec": {
                "containers": [sidecar]}}}}], help_of), [], role)
            args = split_args(sidecar["args"])
            self.assertNotIn("--allow-commands", args)
            env = {e["name"]: e.get("value") for e in containers["pytorch"]["env"]}
            socket = env["GEOFP8_HOOK_ADDRESS"].replace("{local_rank}", "0")
            self.assertEqual(socket, "unix:" + args["--attach"], role)
            self.assertEqual(env["GEOFP8_JOB"], doc["metadata"]["name"])
            self.assertEqual(env["GEOFP8_TOKEN_FILE"], args["--token-file"])


class DocsFlagsTest(unittest.TestCase):
    """Every flag the docs pass to geofp8-coordinator, geofp8-worker or geofp8ctl on a command
    line (and every flag of the worker's flag table) is one its --help lists (issue #40)."""

    @classmethod
    def setUpClass(cls):
        cls.help = {"geofp8-coordinator": help_flags(COORDINATOR),
                    "geofp8-worker": help_flags(WORKER),
                    "geofp8ctl": ctl_help_flags()}

    def test_scanner_finds_flags_on_command_lines(self):
        text = ("```sh\ngeofp8-worker --coordinator a:1 \\\n  --data-dir d | geofp8ctl get jobs "
                "--watch\n```\nRun `build/client/ctl/geofp8ctl logs JOB --stderr` or "
                "`geofp8-train --steps 3`.\n")
        with tempfile.NamedTemporaryFile("w", suffix=".md") as f:
            f.write(text)
            f.flush()
            found = sorted((p, flag) for p, flag, _ in doc_flag_mentions(f.name))
        self.assertEqual(found, [("geofp8-worker", "--coordinator"),
                                 ("geofp8-worker", "--data-dir"), ("geofp8ctl", "--stderr"),
                                 ("geofp8ctl", "--watch")])

    def test_every_documented_flag_exists(self):
        problems = []
        counts = {p: 0 for p in self.help}
        for path in DOCS:
            for program, flag, where in doc_flag_mentions(path):
                counts[program] += 1
                if flag not in self.help[program]:
                    problems.append("%s: %s has no flag %s (in: %s)" % (
                        os.path.relpath(path, ROOT), program, flag, where))
        self.assertEqual(problems, [])
        # The scan found the programs' command lines at all.
        for program, n in counts.items():
            self.assertGreater(n, 5, program)

    def test_every_help_flag_of_the_worker_is_in_its_table(self):
        table = {flag for p, flag, _ in doc_flag_mentions(
            os.path.join(ROOT, "worker/daemon/README.md")) if p == "geofp8-worker"}
        self.assertEqual(sorted(self.help["geofp8-worker"] - table - {"--help"}), [])


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:], verbosity=2)
