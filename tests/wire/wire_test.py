#!/usr/bin/python3
# Wire tests: the real geofp8-coordinator on 127.0.0.1 (free port), driven by a Python client
# generated from proto/ at test time (independent of the C++ server code) and by geofp8ctl.
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import unittest
import urllib.request

COORDINATOR = os.environ["GEOFP8_COORDINATOR"]
CTL = os.environ["GEOFP8CTL"]
PROTO_DIR = os.environ["GEOFP8_PROTO_DIR"]
PYGEN = os.environ["GEOFP8_PYGEN_DIR"]
EXAMPLES = os.environ["GEOFP8_EXAMPLES_DIR"]


def generate_client():
    """protoc + grpc_python_plugin into the build dir. Debian's grpc_tools (1.14) bundles a
    protoc too old for proto3 `optional`, so the system protoc 3.21 generates the code."""
    os.makedirs(PYGEN, exist_ok=True)
    protos = []
    for root, _, files in os.walk(os.path.join(PROTO_DIR, "geofp8")):
        protos += [os.path.join(root, f) for f in files if f.endswith(".proto")]
    subprocess.run(["protoc", "-I" + PROTO_DIR, "--python_out=" + PYGEN,
                    "--grpc_python_out=" + PYGEN,
                    "--plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin"] + protos,
                   check=True)
    sys.path.insert(0, PYGEN)


generate_client()
import grpc  # noqa: E402
import yaml  # noqa: E402
from geofp8.v1 import geofp8_pb2 as pb  # noqa: E402
from geofp8.v1 import geofp8_pb2_grpc as rpc  # noqa: E402

SPEC2 = "name: wire\nworld_size: 2\nrestarts: {max_restarts: 1}\ntraining: {steps: 100}\n"


class Server:
    """One geofp8-coordinator process on a free port."""

    def __init__(self, data_dir, *extra):
        self.data_dir = data_dir
        # The ports come from --ready-file, written once the server serves (no log parsing). A
        # file left by a killed predecessor in the same folder is removed first.
        self.ready_file = os.path.join(data_dir, "ready.json")
        if os.path.exists(self.ready_file):
            os.remove(self.ready_file)
        self.proc = subprocess.Popen(
            [COORDINATOR, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
             "--data-dir", data_dir, "--tick-ms", "50", "--ready-file", self.ready_file, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.time() + 20
        while not os.path.exists(self.ready_file):
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the drain thread collect the last lines
                raise RuntimeError("coordinator exited: " + "".join(self.lines))
            if time.time() > deadline:
                raise RuntimeError("coordinator did not start: " + "".join(self.lines))
            time.sleep(0.02)
        with open(self.ready_file) as f:
            self.ready = json.load(f)
        self.address = self.ready["grpc"]
        self.port = int(self.address.rsplit(":", 1)[1])
        self.metrics_port = int(self.ready["metrics"].rsplit(":", 1)[1])
        assert self.ready["pid"] == self.proc.pid, self.ready

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def channel(self, credentials=None):
        if credentials:
            return grpc.secure_channel(self.address, credentials)
        return grpc.insecure_channel(self.address)

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stdout.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


class SimWorker:
    """A worker over the real Session stream: a send queue and a reader thread."""

    def __init__(self, channel, name, metadata=(), impersonate=None):
        stub = rpc.WorkerServiceStub(channel)
        if impersonate is None:
            r = stub.Register(pb.RegisterRequest(name=name, device="cpu", memory_bytes=1 << 30),
                              metadata=metadata, timeout=5)
            self.id, self.generation, self.secret = r.worker_id, r.generation, r.session_secret
        else:  # (id, generation, secret) of another worker, as an attacker would claim them
            self.id, self.generation, self.secret = impersonate
        self.out = queue.Queue()
        self.inbox = queue.Queue()
        self.error = None
        self.call = stub.Session(self._requests(), metadata=metadata)
        threading.Thread(target=self._read, daemon=True).start()
        self.send(heartbeat=pb.Heartbeat(unix_ms=int(time.time() * 1000)), seq=1)

    def _requests(self):
        while True:
            m = self.out.get()
            if m is None:
                return
            yield m

    def _read(self):
        try:
            for m in self.call:
                self.inbox.put(m)
        except grpc.RpcError as e:
            self.error = e
        self.inbox.put(None)

    def send(self, seq=0, **body):
        self.out.put(pb.WorkerMessage(worker_id=self.id, generation=self.generation, seq=seq,
                                      session_secret=self.secret, **body))

    def expect(self, kind, timeout=10):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                m = self.inbox.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                break
            if m is None:
                raise AssertionError("session ended while waiting for %s: %s" % (kind, self.error))
            if m.WhichOneof("body") == kind:
                return m
        raise AssertionError("no %s within %ss" % (kind, timeout))

    def wait_closed(self, timeout=10):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if self.inbox.get(timeout=0.1) is None:
                    return self.error
            except queue.Empty:
                pass
        raise AssertionError("session still open")

    def close(self):
        self.out.put(None)


def ctl(server, *args, token=None, extra_env=None, stdin=None):
    env = dict(os.environ)
    env.pop("GEOFP8_TOKEN", None)
    if token:
        env["GEOFP8_TOKEN"] = token
    if extra_env:
        env.update(extra_env)
    p = subprocess.run([CTL, "-s", server.address if server else "127.0.0.1:1", "--timeout", "5",
                        *args], capture_output=True, text=True, env=env, timeout=60,
                       input=stdin)
    return p.returncode, p.stdout, p.stderr


def wait_for(fn, timeout=10, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


class Base(unittest.TestCase):
    extra_args = ()

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="geofp8-wire-")
        self.server = Server(self.tmp.name, *self.extra_args)
        self.channel = self.server.channel()
        self.jobs = rpc.JobServiceStub(self.channel)
        self.policies = rpc.PolicyServiceStub(self.channel)
        self.workers_stub = rpc.WorkerServiceStub(self.channel)
        self.kv = rpc.RendezvousServiceStub(self.channel)
        self.sims = []

    def tearDown(self):
        for w in self.sims:
            w.close()
        self.channel.close()
        self.server.stop()
        self.tmp.cleanup()

    def scrape(self):
        return urllib.request.urlopen(
            "http://127.0.0.1:%d/metrics" % self.server.metrics_port, timeout=5).read().decode()

    def worker(self, name, channel=None, metadata=()):
        w = SimWorker(channel or self.channel, name, metadata)
        self.sims.append(w)
        return w

    def submit(self, spec=SPEC2, key=""):
        return self.jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, idempotency_key=key),
                                   timeout=5)

    def get(self, job_id):
        return self.jobs.GetJob(pb.GetJobRequest(job_id=job_id), timeout=5)


class ApiTest(Base):
    def test_submit_get_list_cancel(self):
        r = self.submit()
        self.assertTrue(r.created)
        self.assertEqual(r.job.state, pb.JOB_PENDING)
        job = self.get(r.job.id)
        self.assertEqual(job.world_size, 2)
        self.assertEqual(job.progress.total_steps, 100)
        self.assertEqual(len(job.events), 1)
        listed = self.jobs.ListJobs(pb.ListJobsRequest(states=[pb.JOB_PENDING]), timeout=5)
        self.assertEqual([j.id for j in listed.jobs], [r.job.id])
        c = self.jobs.CancelJob(pb.CancelJobRequest(job_id=r.job.id, reason="test"), timeout=5)
        self.assertEqual(c.state, pb.JOB_CANCELLED)
        with self.assertRaises(grpc.RpcError) as e:
            self.jobs.CancelJob(pb.CancelJobRequest(job_id=r.job.id), timeout=5)
        self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        with self.assertRaises(grpc.RpcError) as e:
            self.get("job-424242")
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_relative_path_flags_are_resolved_where_the_coordinator_starts(self):
        # Issue #40 item 1: every path flag may be relative to the directory it starts in.
        cwd = os.path.join(self.tmp.name, "cwd")
        os.makedirs(cwd)
        with open(os.path.join(cwd, "token"), "w") as f:
            f.write("t0ken\n")
        proc = subprocess.Popen(
            [COORDINATOR, "--listen", "127.0.0.1:0", "--metrics-listen", "", "--data-dir", "state",
             "--ready-file", "ready.json", "--token-file", "token"],
            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            ready = os.path.join(cwd, "ready.json")
            wait_for(lambda: os.path.exists(ready) or proc.poll() is not None, timeout=20,
                     what="the ready file")
            self.assertIsNone(proc.poll())
            self.assertTrue(os.path.exists(os.path.join(cwd, "state", "coordinator.db")))
            with open(ready) as f:
                address = json.load(f)["grpc"]
            rc, _, err = ctl(types.SimpleNamespace(address=address), "get", "jobs", token="t0ken")
            self.assertEqual(rc, 0, err)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        self.assertIn("(data %s/state, auth token" % os.path.realpath(cwd), out)

    def test_validation_errors_name_field_paths_and_server_keeps_serving(self):
        with open(os.path.join(EXAMPLES, "invalid.yaml")) as f:
            bad = f.read()
        with self.assertRaises(grpc.RpcError) as e:
            self.submit(bad)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        d = e.exception.details()
        self.assertIn("line 3: spec.world_size: must be in [1, 1024] (0)", d)
        self.assertIn("line 9: spec.policy.default.format: unknown value (fp7)", d)
        self.assertIn("line 6: spec.training.stepz: unknown field", d)
        # Still serving: health says SERVING and a valid submit works.
        check = self.channel.unary_unary("/grpc.health.v1.Health/Check",
                                         request_serializer=lambda b: b,
                                         response_deserializer=lambda b: b)
        self.assertEqual(check(b"", timeout=5), b"\x08\x01")  # status: SERVING
        self.assertTrue(self.submit().created)

    def test_idempotency_key(self):
        a = self.submit(key="same")
        b = self.submit(key="same")
        self.assertTrue(a.created)
        self.assertFalse(b.created)
        self.assertEqual(a.job.id, b.job.id)
        with self.assertRaises(grpc.RpcError) as e:
            self.submit("name: different\n", key="same")
        self.assertEqual(e.exception.code(), grpc.StatusCode.ALREADY_EXISTS)
        self.assertEqual(len(self.jobs.ListJobs(pb.ListJobsRequest(), timeout=5).jobs), 1)

    def test_rendezvous_kv(self):
        # A job id with no live attempt is refused; the rest runs with --debug-kv-any-job.
        with self.assertRaises(grpc.RpcError) as e:
            self.kv.Set(pb.KvSetRequest(job_id="j", key="k", value=b"v"), timeout=5)
        self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("no running attempt of job j", e.exception.details())
        self.channel.close()
        self.server.stop()
        self.server = Server(tempfile.mkdtemp(dir=self.tmp.name), "--debug-kv-any-job")
        self.channel = self.server.channel()
        self.kv = rpc.RendezvousServiceStub(self.channel)
        self.kv.Set(pb.KvSetRequest(job_id="j", key="nccl/unique_id", value=b"\x00\x01\xff"),
                    timeout=5)
        self.assertEqual(self.kv.Get(pb.KvGetRequest(job_id="j", key="nccl/unique_id"),
                                     timeout=5).value, b"\x00\x01\xff")
        with self.assertRaises(grpc.RpcError) as e:
            self.kv.Get(pb.KvGetRequest(job_id="j", key="missing"), timeout=5)
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        threading.Timer(0.2, lambda: self.kv.Set(
            pb.KvSetRequest(job_id="j", key="rank/1", value=b"addr"), timeout=5)).start()
        self.kv.Wait(pb.KvWaitRequest(job_id="j", keys=["rank/1"], timeout_ms=5000), timeout=10)
        with self.assertRaises(grpc.RpcError) as e:
            self.kv.Wait(pb.KvWaitRequest(job_id="j", keys=["never"], timeout_ms=100), timeout=5)
        self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertEqual(self.kv.Add(pb.KvAddRequest(job_id="j", key="n", delta=3), timeout=5).value, 3)
        self.assertEqual(self.kv.Add(pb.KvAddRequest(job_id="j", key="n", delta=4), timeout=5).value, 7)

    def test_metrics_endpoint(self):
        # Counters are there from the start, at 0 for every label value.
        body = self.scrape()
        for result in ("succeeded", "failed", "cancelled", "restarted"):
            self.assertIn('geofp8_jobs_total{result="%s"} 0' % result, body)
        self.assertIn('geofp8_policy_updates_total{author="user"} 0', body)
        self.assertIn('geofp8_policy_updates_total{author="auto"} 0', body)
        self.assertIn('geofp8_build_info{git_commit="', body)
        self.assertIn("process_open_fds ", body)
        self.assertIn("process_start_time_seconds ", body)
        r = self.submit()
        with self.assertRaises(grpc.RpcError):
            self.get("job-404")
        body = urllib.request.urlopen(
            "http://127.0.0.1:%d/metrics" % self.server.metrics_port, timeout=5).read().decode()
        self.assertIn('geofp8_jobs{state="pending"} 1', body)
        self.assertIn('geofp8_rpcs_total{code="NOT_FOUND",method="JobService/GetJob"} 1', body)
        self.assertIn('geofp8_rpcs_total{code="OK",method="JobService/SubmitJob"} 1', body)
        self.assertIn("geofp8_rpc_latency_seconds_bucket", body)
        self.assertIn("geofp8_policy_updates_total", body)
        self.assertIn('geofp8_workers{state="idle"} 0', body)
        # A cancel is counted as a cancel, not as a failure.
        self.jobs.CancelJob(pb.CancelJobRequest(job_id=r.job.id, reason="test"), timeout=5)
        body = self.scrape()
        self.assertIn('geofp8_jobs_total{result="cancelled"} 1', body)
        self.assertIn('geofp8_jobs_total{result="failed"} 0', body)

    def test_sigterm_is_graceful(self):
        self.server.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.server.proc.wait(15), 0)
        time.sleep(0.2)  # the drain thread reads the last lines
        self.assertTrue(any("shutting down" in l for l in self.server.lines))
        # The ready file named the serving process and goes away with it.
        self.assertEqual(self.server.ready["metrics"], "127.0.0.1:%d" % self.server.metrics_port)
        self.assertFalse(os.path.exists(self.server.ready_file))


class WorkerTest(Base):
    extra_args = ("--heartbeat-timeout-ms", "1500")

    def start_job(self, spec=SPEC2):
        job_id = self.submit(spec).job.id
        a, b = self.worker("a"), self.worker("b")
        ra = a.expect("assignment").assignment
        rb = b.expect("assignment").assignment
        self.assertEqual(sorted([ra.rank, rb.rank]), [0, 1])
        self.assertEqual(ra.job_id, job_id)
        self.assertEqual(self.get(job_id).state, pb.JOB_SCHEDULED)
        return job_id, a, b

    def test_assignment_progress_policy_effective_step(self):
        job_id, a, b = self.start_job()
        a.send(progress=pb.StepProgress(step=30, loss=3.0, bytes_sent=10, bytes_baseline=40))
        b.send(progress=pb.StepProgress(step=33, loss=3.1, bytes_sent=10, bytes_baseline=40))
        wait_for(lambda: self.get(job_id).state == pb.JOB_RUNNING, what="RUNNING")
        wait_for(lambda: self.get(job_id).progress.step == 33, what="step 33")
        r = self.policies.UpdatePolicy(pb.UpdatePolicyRequest(
            job_id=job_id, reason="wire", patches=[pb.LayerPatch(layer="*attn*", format=pb.FORMAT_NVFP4)]),
            timeout=5)
        self.assertEqual(r.policy.version, 2)
        self.assertEqual(r.policy.effective_step, 38)  # largest reported step 33 + margin 5
        for w in (a, b):
            p = w.expect("policy").policy
            self.assertEqual((p.version, p.effective_step), (2, 38))
        versions = self.policies.ListPolicyVersions(
            pb.ListPolicyVersionsRequest(job_id=job_id), timeout=5).policies
        self.assertEqual([v.version for v in versions], [1, 2])
        # A value this coordinator does not know (a newer client's): proto3 enums are open, so it
        # arrives as its number, and the error names the field and the number.
        with self.assertRaises(grpc.RpcError) as e:
            self.policies.UpdatePolicy(pb.UpdatePolicyRequest(
                job_id=job_id, patches=[pb.LayerPatch(layer="x", geometry=99)]), timeout=5)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("patches[0].geometry: unknown geofp8.v1.GeometryMode value (99)",
                      e.exception.details())
        for w in (a, b):
            w.send(finished=pb.JobFinished(success=True))
        wait_for(lambda: self.get(job_id).state == pb.JOB_SUCCEEDED, what="SUCCEEDED")

    def test_stale_generation_is_fenced(self):
        old = self.worker("w")
        old.expect("ack")
        # A second process under a live name is refused; it must not fence the first.
        with self.assertRaises(grpc.RpcError) as e:
            self.worker("w")
        self.assertEqual(e.exception.code(), grpc.StatusCode.ALREADY_EXISTS)
        self.assertIn("name: w is held by a live session (generation %d" % old.generation,
                      e.exception.details())
        old.send(heartbeat=pb.Heartbeat(), seq=2)
        self.assertEqual(old.expect("ack").ack.seq, 2)
        # Once its stream ends (its process died), the name is free again and the new
        # generation fences the old one.
        old.close()
        self.assertIsNone(old.wait_closed())
        deadline = time.time() + 10
        while True:
            try:
                new = self.worker("w")
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ALREADY_EXISTS or time.time() > deadline:
                    raise
                time.sleep(0.05)
        self.assertEqual(new.generation, old.generation + 1)
        self.assertEqual(new.expect("ack").ack.seq, 1)  # the first heartbeat's ack
        new.send(heartbeat=pb.Heartbeat(), seq=3)
        self.assertEqual(new.expect("ack").ack.seq, 3)

    def test_sessions_are_bound_to_their_worker(self):
        # Issue #31 item 3: the id and generation are public (ListWorkers); the secret is not.
        job_id, a, b = self.start_job()
        for secret in ("", "0" * 32):
            forged = SimWorker(self.channel, None, impersonate=(a.id, a.generation, secret))
            err = forged.wait_closed()
            self.assertEqual(err.code(), grpc.StatusCode.PERMISSION_DENIED, err)
            self.assertNotIn(a.secret, err.details())
        # A forged "failed, not restartable" report on a stream opened as b, naming a:
        # refused, and the stream ends.
        c = self.worker("c")
        c.expect("ack")
        c.out.put(pb.WorkerMessage(worker_id=a.id, generation=a.generation, seq=2,
                                   finished=pb.JobFinished(job_id=job_id, success=False,
                                                           reason="forged")))
        err = c.wait_closed()
        self.assertEqual(err.code(), grpc.StatusCode.PERMISSION_DENIED, err)
        self.assertIn("this stream belongs to worker c", err.details())
        # The real worker a is still connected and its job still scheduled.
        a.send(heartbeat=pb.Heartbeat(), seq=7)
        self.assertEqual(a.expect("ack").ack.seq, 7)
        self.assertEqual(self.get(job_id).state, pb.JOB_SCHEDULED)
        states = {w.id: w.state for w in rpc.WorkerServiceStub(self.channel).ListWorkers(
            pb.ListWorkersRequest(), timeout=5).workers}
        self.assertEqual(states[a.id], pb.WORKER_ASSIGNED)
        self.assertIn("geofp8_forged_sessions_total 2", self.scrape())

    def test_dead_worker_restarts_job_then_fails(self):
        job_id, a, b = self.start_job()
        # b's rank has run (a step reported): a worker that goes before its rank ran anything
        # is not charged a restart (issue 41, flapping workers).
        b.send(progress=pb.StepProgress(step=1, loss=3.0))
        # Only a keeps heartbeating; b is declared dead after 1.5 s and fenced.
        deadline = time.time() + 10
        while time.time() < deadline and self.get(job_id).restarts == 0:
            a.send(heartbeat=pb.Heartbeat())
            time.sleep(0.1)
        job = self.get(job_id)
        self.assertEqual(job.restarts, 1)
        self.assertIn("missed heartbeats", job.reason)
        self.assertIn("restart 1/1", job.reason)
        # The restart is counted as one, not as a failure.
        body = urllib.request.urlopen(
            "http://127.0.0.1:%d/metrics" % self.server.metrics_port, timeout=5).read().decode()
        self.assertIn('geofp8_jobs_total{result="restarted"} 1', body)
        self.assertIn('geofp8_jobs_total{result="failed"} 0', body)
        b.send(heartbeat=pb.Heartbeat())
        self.assertEqual(b.wait_closed().code(), grpc.StatusCode.FAILED_PRECONDITION)
        workers = {w.id: w for w in self.workers_stub.ListWorkers(
            pb.ListWorkersRequest(), timeout=5).workers}
        self.assertEqual(workers[b.id].state, pb.WORKER_DEAD)
        # Nobody heartbeats now: the job exhausts its restarts.
        b2 = self.worker("b")
        wait_for(lambda: self.get(job_id).state == pb.JOB_FAILED, what="FAILED")
        self.assertIn("no restarts left", self.get(job_id).reason)
        body = urllib.request.urlopen(
            "http://127.0.0.1:%d/metrics" % self.server.metrics_port, timeout=5).read().decode()
        self.assertIn('geofp8_jobs_total{result="failed"} 1', body)
        b2.close()

    def test_ctl_watch_shows_progress_until_success(self):
        job_id, a, b = self.start_job()
        result = {}

        def run_watch():
            result["out"] = ctl(self.server, "watch", job_id)

        t = threading.Thread(target=run_watch)
        t.start()
        for step in (10, 50, 100):
            for w in (a, b):
                w.send(progress=pb.StepProgress(step=step, loss=2.0, tokens_per_second=1500,
                                                bytes_sent=25 * step, bytes_baseline=100 * step))
            time.sleep(0.3)
        for w in (a, b):
            w.send(finished=pb.JobFinished(success=True))
        t.join(30)
        rc, out, err = result["out"]
        self.assertEqual(rc, 0, err)
        self.assertIn("100/100", out)
        self.assertIn("saved 75%", out)
        self.assertIn("ETA", out)
        self.assertIn("SUCCEEDED", out)
        rc, out, err = ctl(self.server, "get", "workers")
        self.assertEqual(rc, 0, err)
        self.assertIn("IDLE", out)


    def test_ctl_watch_piped_prints_state_changes_and_every_ten_percent(self):
        # SPEC2 runs 100 steps; every step is reported, so the stream carries ~100 updates.
        job_id, a, b = self.start_job()
        result = {}
        t = threading.Thread(target=lambda: result.update(out=ctl(self.server, "watch", "wire")))
        t.start()  # by name: "wire" is SPEC2's name
        for step in range(100):
            for w in (a, b):
                w.send(progress=pb.StepProgress(step=step, loss=2.0, bytes_sent=25 * step,
                                                bytes_baseline=100 * step))
            time.sleep(0.01)
        for w in (a, b):
            w.send(finished=pb.JobFinished(success=True))
        t.join(30)
        rc, out, err = result["out"]
        self.assertEqual(rc, 0, err)
        lines = [l for l in out.splitlines() if l.startswith("[")]
        # At most one line per state (SCHEDULED, RUNNING, SUCCEEDED) and per 10% bucket (0..10).
        self.assertLessEqual(len(lines), 3 + 11, out)
        self.assertIn("100/100", lines[-1])
        self.assertIn("SUCCEEDED", lines[-1])
        self.assertNotIn("\r", out)
        self.assertNotIn("\033", out)

    def test_ctl_watch_on_a_tty_redraws_one_line(self):
        import pty
        job_id, a, b = self.start_job()
        master, slave = pty.openpty()
        env = dict(os.environ)
        env.pop("GEOFP8_TOKEN", None)
        proc = subprocess.Popen([CTL, "-s", self.server.address, "watch", job_id],
                                stdout=slave, stderr=subprocess.PIPE, env=env)
        os.close(slave)
        chunks = []

        def drain():
            while True:
                try:
                    data = os.read(master, 4096)
                except OSError:
                    return
                if not data:
                    return
                chunks.append(data)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        for step in range(0, 100, 5):
            for w in (a, b):
                w.send(progress=pb.StepProgress(step=step, loss=2.0))
            time.sleep(0.05)
        for w in (a, b):
            w.send(finished=pb.JobFinished(success=True))
        self.assertEqual(proc.wait(30), 0, proc.stderr.read())
        proc.stderr.close()
        reader.join(5)
        os.close(master)
        out = b"".join(chunks).decode()
        # Redrawn in place: carriage return + clear line. Events get lines of their own above
        # the status line; the status line itself ends a line only once, at the end.
        self.assertIn("\r\x1b[K", out)
        lines = out.split("\r\n")
        self.assertEqual(lines[-1], "")
        for line in lines[:-2]:
            self.assertFalse(line.rsplit("\r\x1b[K", 1)[-1].startswith("["), repr(out))
        self.assertIn("100/100", lines[-2].rsplit("\r\x1b[K", 1)[-1])
        self.assertIn("SUCCEEDED", lines[-2].rsplit("\r\x1b[K", 1)[-1])


class PersistenceTest(Base):
    def keyed(self, key):
        """SPEC2 under key, named after it: names are unique among unfinished jobs."""
        return self.submit(SPEC2.replace("name: wire", "name: wire-" + key), key)

    def test_kill9_keeps_every_acknowledged_job_and_policy(self):
        ids = [self.keyed("key-%d" % i).job.id for i in range(5)]
        v = self.policies.UpdatePolicy(pb.UpdatePolicyRequest(
            job_id=ids[2], patches=[pb.LayerPatch(layer="*", format=pb.FORMAT_BF16)]), timeout=5)
        self.assertEqual(v.policy.version, 2)
        self.channel.close()
        self.server.kill9()
        self.server = Server(self.tmp.name)
        self.channel = self.server.channel()
        self.jobs = rpc.JobServiceStub(self.channel)
        self.policies = rpc.PolicyServiceStub(self.channel)
        listed = self.jobs.ListJobs(pb.ListJobsRequest(), timeout=5).jobs
        self.assertEqual(sorted(j.id for j in listed), sorted(ids))
        p = self.policies.GetPolicy(pb.GetPolicyRequest(job_id=ids[2]), timeout=5)
        self.assertEqual(p.version, 2)
        self.assertEqual(p.patches[0].format, pb.FORMAT_BF16)
        again = self.keyed("key-3")
        self.assertFalse(again.created)
        self.assertEqual(again.job.id, ids[3])
        self.assertEqual(len(self.jobs.ListJobs(pb.ListJobsRequest(), timeout=5).jobs), 5)

    def test_kill9_during_a_stream_of_submits(self):
        acked = []
        stop = threading.Event()

        def submitter():
            i = 0
            while not stop.is_set():
                try:
                    acked.append(self.keyed("s-%d" % i).job.id)
                except grpc.RpcError:
                    return
                i += 1

        t = threading.Thread(target=submitter)
        t.start()
        time.sleep(1.0)
        self.server.kill9()
        stop.set()
        t.join(10)
        self.assertGreater(len(acked), 0)
        self.channel.close()
        self.server = Server(self.tmp.name)
        self.channel = self.server.channel()
        self.jobs = rpc.JobServiceStub(self.channel)
        present, token = set(), ""
        while True:  # every page (ListJobs is paged, newest first)
            page = self.jobs.ListJobs(pb.ListJobsRequest(page_size=1000, page_token=token),
                                      timeout=5)
            present |= {j.id for j in page.jobs}
            token = page.next_page_token
            if not token:
                break
        self.assertTrue(set(acked) <= present, set(acked) - present)


class AuthTest(Base):
    extra_args = ("--token-file", os.path.join(tempfile.gettempdir(), "geofp8-wire-token-%d" % os.getpid()))

    @classmethod
    def setUpClass(cls):
        with open(cls.extra_args[1], "w") as f:
            f.write("s3cret\n")

    def test_mutating_rpcs_need_the_token(self):
        with self.assertRaises(grpc.RpcError) as e:
            self.submit()
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        with self.assertRaises(grpc.RpcError) as e:
            self.jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=SPEC2), timeout=5,
                                metadata=[("authorization", "Bearer wrong")])
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        r = self.jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=SPEC2), timeout=5,
                                metadata=[("authorization", "Bearer s3cret")])
        self.assertTrue(r.created)
        # Reads need it too (issue #31: a job's reason and events are the token holder's).
        for read in (lambda: self.get(r.job.id),
                     lambda: self.jobs.ListJobs(pb.ListJobsRequest(), timeout=5),
                     lambda: rpc.WorkerServiceStub(self.channel).ListWorkers(
                         pb.ListWorkersRequest(), timeout=5),
                     lambda: rpc.PolicyServiceStub(self.channel).ListPolicyVersions(
                         pb.ListPolicyVersionsRequest(job_id=r.job.id), timeout=5)):
            with self.assertRaises(grpc.RpcError) as e:
                read()
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        got = self.jobs.GetJob(pb.GetJobRequest(job_id=r.job.id), timeout=5,
                               metadata=[("authorization", "Bearer s3cret")])
        self.assertEqual(got.id, r.job.id)
        with self.assertRaises(grpc.RpcError) as e:
            SimWorker(self.channel, "w")
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        rc, _, err = ctl(self.server, "submit", "-f", os.path.join(EXAMPLES, "tiny-fp8.yaml"))
        self.assertEqual(rc, 6, err)
        self.assertIn("UNAUTHENTICATED".lower(), err.lower() + "unauthenticated")
        rc, out, err = ctl(self.server, "submit", "-f", os.path.join(EXAMPLES, "tiny-fp8.yaml"),
                           token="s3cret")
        self.assertEqual(rc, 0, err)

    def test_a_missing_or_refused_token_names_every_way_to_give_one(self):
        # Issue #40 item 7: a read needs the token too, and the error says where the refused one
        # came from and lists the flag, the environment and a context's token file.
        env = {"GEOFP8_CONFIG": os.path.join(self.tmp.name, "ctl-config.yaml")}
        ways = ("--token-file FILE", "env GEOFP8_TOKEN", "geofp8ctl config set-context NAME",
                "--token-file FILE, then --context NAME", "--token TOKEN")
        rc, _, err = ctl(self.server, "get", "jobs", extra_env=env)
        self.assertEqual(rc, 6, err)
        self.assertIn("missing bearer token (this coordinator requires one); no token was given: "
                      "give the coordinator's token with", err)
        for way in ways:
            self.assertIn(way, err)
        rc, _, err = ctl(self.server, "get", "jobs", token="wrong", extra_env=env)
        self.assertEqual(rc, 6, err)
        self.assertIn("; the token from env GEOFP8_TOKEN was refused: give", err)
        wrong = os.path.join(self.tmp.name, "wrong-token")
        with open(wrong, "w") as f:
            f.write("wrong\n")
        rc, _, err = ctl(self.server, "get", "jobs", "--token-file", wrong, extra_env=env)
        self.assertEqual(rc, 6, err)
        self.assertIn("; the token from --token-file %s was refused: give" % wrong, err)
        rc, _, err = ctl(self.server, "config", "set-context", "c", "--server", self.server.address,
                         "--token-file", wrong, extra_env=env)
        self.assertEqual(rc, 0, err)
        rc, _, err = ctl(self.server, "--context", "c", "get", "jobs", extra_env=env)
        self.assertEqual(rc, 6, err)
        self.assertIn("; the token from context c's token-file %s was refused: give" % wrong, err)
        for way in ways:
            self.assertIn(way, err)
        # --help says reads need it too.
        out = subprocess.run([CTL, "--help"], capture_output=True, text=True).stdout
        self.assertIn("every call to a coordinator that requires one, reads", " ".join(out.split()))


class TlsTest(Base):
    @classmethod
    def setUpClass(cls):
        cls.certs = tempfile.mkdtemp(prefix="geofp8-certs-")
        c = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, cwd=cls.certs)
        c("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
          "-days", "2", "-subj", "/CN=geofp8-test-ca")
        for name, cn in (("server", "localhost"), ("client", "geofp8-client")):
            c("req", "-newkey", "rsa:2048", "-nodes", "-keyout", name + ".key", "-out",
              name + ".csr", "-subj", "/CN=" + cn)
            with open(os.path.join(cls.certs, name + ".ext"), "w") as f:
                f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
            c("x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key",
              "-CAcreateserial", "-out", name + ".pem", "-days", "2", "-extfile", name + ".ext")
        p = lambda n: os.path.join(cls.certs, n)
        cls.extra_args = ("--tls-cert", p("server.pem"), "--tls-key", p("server.key"),
                          "--tls-client-ca", p("ca.pem"))

    def read(self, name):
        with open(os.path.join(self.certs, name), "rb") as f:
            return f.read()

    def test_mutual_tls(self):
        creds = grpc.ssl_channel_credentials(root_certificates=self.read("ca.pem"),
                                             private_key=self.read("client.key"),
                                             certificate_chain=self.read("client.pem"))
        ch = self.server.channel(creds)
        jobs = rpc.JobServiceStub(ch)
        self.assertTrue(jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=SPEC2), timeout=5).created)
        # Without a client certificate the handshake is refused.
        no_cert = self.server.channel(grpc.ssl_channel_credentials(root_certificates=self.read("ca.pem")))
        with self.assertRaises(grpc.RpcError) as e:
            rpc.JobServiceStub(no_cert).ListJobs(pb.ListJobsRequest(), timeout=3)
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
        ch.close()
        no_cert.close()
        p = lambda n: os.path.join(self.certs, n)
        rc, out, err = ctl(self.server, "--tls-ca", p("ca.pem"), "--tls-cert", p("client.pem"),
                           "--tls-key", p("client.key"), "get", "jobs")
        self.assertEqual(rc, 0, err)
        self.assertIn("wire", out)
        rc, out, err = ctl(self.server, "get", "jobs")  # plaintext against TLS
        self.assertEqual(rc, 4, err)


class CtlTest(Base):
    def test_commands_outputs_and_exit_codes(self):
        tiny = os.path.join(EXAMPLES, "tiny-fp8.yaml")
        rc, out, err = ctl(self.server, "submit", "-f", tiny, "--idempotency-key", "k")
        self.assertEqual(rc, 0, err)
        self.assertIn("job/job-000001 created", out)
        rc, out, err = ctl(self.server, "-o", "json", "submit", "-f", tiny, "--idempotency-key", "k")
        self.assertEqual(rc, 0, err)
        self.assertFalse(json.loads(out)["created"])
        rc, out, err = ctl(self.server, "get", "jobs")
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.splitlines()[0].split()[:3], ["ID", "NAME", "STATE"])
        self.assertIn("tiny-fp8", out)
        rc, out, err = ctl(self.server, "-o", "yaml", "get", "job", "job-000001")
        self.assertEqual(rc, 0, err)
        doc = yaml.safe_load(out)
        self.assertEqual(doc["state"], "pending")  # as the table and --state name it
        self.assertEqual(doc["world_size"], 2)
        rc, out, err = ctl(self.server, "-o", "json", "get", "jobs")
        self.assertEqual(json.loads(out)["jobs"][0]["id"], "job-000001")
        rc, out, err = ctl(self.server, "describe", "job", "job-000001")
        self.assertEqual(rc, 0, err)
        self.assertIn("Events:", out)
        self.assertIn("(default)  fp8_e4m3", out)
        rc, out, err = ctl(self.server, "policy", "set", "job-000001", "--layer", "*mlp*",
                           "--format", "nvfp4", "--geometry", "diag")
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.strip(), "job/job-000001 policy v2 effective at step 5")
        rc, out, err = ctl(self.server, "policy", "apply", "job-000001", "-f",
                           os.path.join(EXAMPLES, "patch-attn-nvfp4.yaml"))
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.strip(), "job/job-000001 policy v3 effective at step 5")
        rc, out, err = ctl(self.server, "policy", "get", "job-000001")
        self.assertIn("policy v3", out)
        self.assertIn("*attn*", out)
        rc, out, err = ctl(self.server, "policy", "history", "job-000001")
        self.assertEqual(len(out.strip().splitlines()), 4)
        # `policy get -o yaml` prints the patch-file schema; applying it back changes nothing.
        rc, doc, err = ctl(self.server, "-o", "yaml", "policy", "get", "job-000001")
        self.assertEqual(rc, 0, err)
        parsed = yaml.safe_load(doc)
        self.assertEqual(parsed["default"]["format"], "fp8_e4m3")
        self.assertEqual([p["match"] for p in parsed["layers"]], ["*mlp*", "*attn*"])
        rc, out, err = ctl(self.server, "policy", "apply", "job-000001", "-f", "-", stdin=doc)
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.strip(),
                         "job/job-000001 policy v3 unchanged (the update matches the version "
                         "in force)")
        rc, out, err = ctl(self.server, "policy", "history", "job-000001")
        self.assertEqual(len(out.strip().splitlines()), 4)
        # An edited document is a real update: the new default lands in v4, the layers stay.
        rc, out, err = ctl(self.server, "policy", "apply", "job-000001", "-f", "-",
                           stdin=doc.replace("format: fp8_e4m3", "format: fp8_e5m2", 1))
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.strip(), "job/job-000001 policy v4 effective at step 5")
        rc, out, err = ctl(self.server, "-o", "yaml", "policy", "get", "job-000001")
        self.assertEqual(yaml.safe_load(out)["default"]["format"], "fp8_e5m2")
        self.assertEqual(yaml.safe_load(out)["layers"], parsed["layers"])
        # policy set names a rotation as the job spec does: the transform and its block.
        rc, out, err = ctl(self.server, "policy", "set", "job-000001", "--layer", "*attn*",
                           "--geometry", "lowrank+hadamard", "--hadamard-block", "32")
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.strip(), "job/job-000001 policy v5 effective at step 5")
        rc, out, err = ctl(self.server, "-o", "yaml", "policy", "get", "job-000001")
        last = yaml.safe_load(out)["layers"][-1]
        self.assertEqual((last["match"], last["geometry"], last["hadamard_block"]),
                         ("*attn*", "lowrank+hadamard", 32), out)
        rc, out, err = ctl(self.server, "policy", "get", "job-000001")
        self.assertIn("lowrank+hadamard", out)
        rc, _, err = ctl(self.server, "policy", "set", "job-000001", "--layer", "x",
                         "--geometry", "hadamard+lowrank")
        self.assertEqual(rc, 2, err)
        self.assertIn("--geometry: unknown value (hadamard+lowrank); accepted: none, diag, "
                      "lowrank, hadamard, diag+hadamard, lowrank+hadamard", err)
        rc, out, err = ctl(self.server, "policy", "get", "job-000001", "--version", "9")
        self.assertEqual(rc, 3, err)
        # Exit codes: usage 2, not found 3, unreachable 4, rejected 5.
        rc, _, err = ctl(self.server, "get", "job", "job-999999")
        self.assertEqual(rc, 3, err)
        self.assertIn("job job-999999 not found", err)
        rc, _, err = ctl(self.server, "frobnicate")
        self.assertEqual(rc, 2, err)
        rc, _, err = ctl(self.server, "policy", "set", "job-000001", "--layer", "x", "--format", "fp7")
        self.assertEqual(rc, 2, err)
        self.assertIn("--format: unknown value (fp7)", err)
        rc, _, err = ctl(self.server, "submit", "-f", "/nonexistent.yaml")
        self.assertEqual(rc, 2, err)
        rc, _, err = ctl(self.server, "submit", "-f", os.path.join(EXAMPLES, "invalid.yaml"))
        self.assertEqual(rc, 5, err)
        self.assertIn("line 3: spec.world_size", err)
        self.assertEqual(len(err.strip().splitlines()), 1)
        rc, _, err = ctl(self.server, "watch", "job-404")
        self.assertEqual(rc, 3, err)
        rc, out, err = ctl(self.server, "-o", "json", "get", "workers")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out).get("workers", []), [])
        rc, _, err = ctl(None, "get", "jobs")
        self.assertEqual(rc, 4, err)
        self.assertIn("unreachable", err)
        rc, out, err = ctl(self.server, "cancel", "job-000001")
        self.assertEqual(rc, 0, err)
        self.assertIn("CANCELLED", out)
        rc, _, err = ctl(self.server, "cancel", "job-000001")
        self.assertEqual(rc, 5, err)

    def test_kubectl_conveniences(self):
        env = dict(os.environ)
        env.pop("GEOFP8_SERVER", None)
        env["GEOFP8_CONFIG"] = os.path.join(self.tmp.name, "none.yaml")

        def raw(*args, extra=None):
            e = dict(env)
            e.update(extra or {})
            p = subprocess.run([CTL, *args], capture_output=True, text=True, env=e, timeout=60)
            return p.returncode, p.stdout, p.stderr

        # Bare: the help, exit 0. Unknown commands are named, with the list, exit 2.
        rc, out, err = raw()
        self.assertEqual(rc, 0, err)
        self.assertIn("Subcommands:", out)
        rc, _, err = ctl(self.server, "frobnicate")
        self.assertEqual(rc, 2, err)
        self.assertIn('unknown command "frobnicate" for "geofp8ctl"', err)
        self.assertIn("submit, get, describe, watch", err)
        rc, _, err = ctl(self.server, "get", "jbos")
        self.assertEqual(rc, 2, err)
        self.assertIn('unknown command "jbos" for "geofp8ctl get"', err)
        rc, _, err = ctl(self.server, "get")
        self.assertEqual(rc, 2, err)
        self.assertIn("a subcommand is required: jobs, job, workers", err)
        rc, out, err = raw("version")
        self.assertEqual(rc, 0, err)
        self.assertRegex(out, r"^Client Version: \d+\.\d+\.\d+ \(git [^)]+\)\n$")
        rc, out, err = raw("-o", "json", "version")
        self.assertEqual(sorted(json.loads(out)), ["clientVersion", "gitDescribe"])

        # Names YAML would read as other types, and jobs by name.
        def submit(name):
            return ctl(self.server, "submit", "-f", "-",
                       stdin=SPEC2.replace("name: wire", "name: '%s'" % name))
        for name in ("true", "1.5"):
            rc, _, err = submit(name)
            self.assertEqual(rc, 0, err)
        # Names are unique among unfinished jobs: refused (exit 5) naming the live job.
        rc, _, err = submit("1.5")
        self.assertEqual(rc, 5, err)
        self.assertIn("job job-000002 (PENDING) is already named 1.5", err)
        rc, _, err = ctl(self.server, "cancel", "job-000002")
        self.assertEqual(rc, 0, err)
        rc, out, err = submit("1.5")
        self.assertEqual((rc, out), (0, "job/job-000003 created (PENDING)\n"), err)
        rfc3339 = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$"
        rc, out, err = ctl(self.server, "-o", "yaml", "get", "job", "true")
        self.assertEqual(rc, 0, err)
        doc = yaml.safe_load(out)
        self.assertEqual(doc["name"], "true")
        self.assertEqual(doc["id"], "job-000001")
        self.assertRegex(doc["created_time"], rfc3339)  # a string: YAML quotes it
        self.assertNotIn("unix_ms", out)
        rc, out, err = ctl(self.server, "-o", "json", "get", "job", "job-000002")
        doc = json.loads(out)
        self.assertEqual((doc["name"], doc["state"]), ("1.5", "cancelled"))
        for field in ("created_time", "updated_time"):
            self.assertRegex(doc[field], rfc3339, field)
        self.assertEqual([e["state"] for e in doc["events"]], ["pending", "cancelled"])
        self.assertRegex(doc["events"][0]["time"], rfc3339)
        self.assertIsInstance(doc["policy_version"], int)
        self.assertIsInstance(doc["progress"]["total_steps"], int)
        # A name is the newest job of that name.
        rc, out, err = ctl(self.server, "describe", "job", "1.5")
        self.assertEqual(rc, 0, err)
        self.assertIn("job-000003", out)
        # delete job: a finished job only; its id is never issued again.
        rc, _, err = ctl(self.server, "delete", "job", "1.5")
        self.assertEqual(rc, 5, err)
        self.assertIn("job job-000003 (1.5) is PENDING", err)
        rc, out, err = ctl(self.server, "delete", "job", "job-000002")
        self.assertEqual((rc, out), (0, "job/job-000002 deleted\n"), err)
        rc, _, err = ctl(self.server, "get", "job", "job-000002")
        self.assertEqual(rc, 3, err)
        rc, _, err = ctl(self.server, "delete", "job", "job-000002")
        self.assertEqual(rc, 3, err)
        # The deleted job leaves the gauge but stays counted: a counter never goes down.
        body = self.scrape()
        self.assertIn('geofp8_jobs{state="cancelled"} 0', body)
        self.assertIn('geofp8_jobs_total{result="cancelled"} 1', body)
        rc, _, err = ctl(self.server, "cancel", "1.5")
        self.assertEqual(rc, 0, err)
        rc, out, err = submit("1.5")
        self.assertEqual((rc, out), (0, "job/job-000004 created (PENDING)\n"), err)
        rc, out, err = ctl(self.server, "-o", "json", "delete", "job", "job-000004")
        self.assertEqual(rc, 5, err)
        rc, _, err = ctl(self.server, "get", "job", "nosuch")
        self.assertEqual(rc, 3, err)
        self.assertIn("job nosuch not found", err)

        # -o name, wide, jsonpath.
        rc, out, err = ctl(self.server, "-o", "name", "get", "jobs")
        self.assertEqual(out.splitlines(), ["job/job-000004", "job/job-000003", "job/job-000001"])
        rc, out, err = ctl(self.server, "-o", "wide", "get", "jobs")
        self.assertEqual(out.splitlines()[0].split()[:4], ["ID", "NAME", "STATE", "STEP"])
        self.assertIn("LOSS", out.splitlines()[0])
        rc, out, err = ctl(self.server, "-o", "jsonpath={.jobs[*].name}", "get", "jobs")
        self.assertEqual((rc, out), (0, "1.5 1.5 true"), err)  # as kubectl: no newline added
        rc, out, err = ctl(self.server, "-o", "jsonpath={.progress.total_steps}", "get", "job",
                           "true")
        self.assertEqual(out, "100")
        rc, out, err = ctl(self.server, "-o", "jsonpath={.progress.step}/{.progress.total_steps}"
                           '{"\\n"}', "get", "job", "true")
        self.assertEqual((rc, out), (0, "0/100\n"), err)
        rc, _, err = ctl(None, "-o", "jsonpath={.jobs[?(@.name=='x')]}", "get", "jobs")
        self.assertEqual(rc, 2, err)  # refused before any call: the server is unreachable
        self.assertIn("only [N], [-N], [*]", err)
        rc, _, err = ctl(self.server, "-o", "jsonpath={.nope}", "get", "job", "true")
        self.assertEqual(rc, 2, err)
        self.assertIn("no field 'nope'", err)
        rc, _, err = ctl(self.server, "-o", "xml", "get", "jobs")
        self.assertEqual(rc, 2, err)
        self.assertIn("-o: unknown output format (xml)", err)
        rc, out, err = ctl(self.server, "-o", "name", "cancel", "true")
        self.assertEqual((rc, out), (0, "job/job-000001\n"), err)

        # Completion: the script parses, lists the commands, and completes job ids and names.
        rc, script, err = raw("completion", "bash")
        self.assertEqual(rc, 0, err)
        path = os.path.join(self.tmp.name, "completion.bash")
        with open(path, "w") as f:
            f.write(script)
        subprocess.run(["bash", "-n", path], check=True)
        probe = ('source "$1"; COMP_WORDS=("$2" ""); COMP_CWORD=1; _geofp8ctl; '
                 'echo "${COMPREPLY[*]}"; COMP_WORDS=("$2" get job ""); COMP_CWORD=3; '
                 '_geofp8ctl; echo "${COMPREPLY[*]}"')
        p = subprocess.run(["bash", "-c", probe, "bash", path, CTL], capture_output=True,
                           text=True, timeout=60,
                           env=dict(env, GEOFP8_SERVER=self.server.address))
        first, second = p.stdout.splitlines()
        for cmd in ("submit", "get", "describe", "watch", "cancel", "delete", "policy", "config",
                    "version", "completion"):
            self.assertIn(cmd, first.split())
        self.assertEqual(set(second.split()), {"job-000001", "job-000003", "job-000004", "true",
                                               "1.5"}, p.stderr)
        rc, script, err = raw("completion", "zsh")
        self.assertIn("bashcompinit", script)
        rc, _, err = raw("completion", "fish")
        self.assertEqual(rc, 2, err)

        # A config file with contexts; flags override it; errors name file, line and field.
        cfg = os.path.join(self.tmp.name, "cfg", "config.yaml")
        rc, out, err = raw("--config", cfg, "config", "set-context", "dead", "--server",
                           "127.0.0.1:1")
        self.assertEqual((rc, out.strip()), (0, 'context "dead" created in ' + cfg), err)
        rc, out, err = raw("--config", cfg, "config", "set-context", "local", "--server",
                           self.server.address)
        self.assertEqual(rc, 0, err)
        rc, out, err = raw("--config", cfg, "config", "current-context")
        self.assertEqual(out, "dead\n")  # the first context became current
        rc, out, err = raw("--config", cfg, "--timeout", "2", "get", "jobs")
        self.assertEqual(rc, 4, err)
        self.assertIn("127.0.0.1:1", err)
        rc, out, err = raw("--config", cfg, "--context", "local", "get", "jobs")
        self.assertEqual(rc, 0, err)
        rc, out, err = raw("--config", cfg, "-s", self.server.address, "get", "jobs")
        self.assertEqual(rc, 0, err)  # the flag wins over the context
        rc, out, err = raw("config", "use-context", "local", extra={"GEOFP8_CONFIG": cfg})
        self.assertEqual(rc, 0, err)
        rc, out, err = raw("config", "get-contexts", extra={"GEOFP8_CONFIG": cfg})
        self.assertEqual([l.split()[:2] for l in out.splitlines()[1:]],
                         [["dead", "127.0.0.1:1"], ["*", "local"]])
        rc, out, err = raw("-o", "name", "get", "jobs", extra={"GEOFP8_CONFIG": cfg})
        self.assertEqual(rc, 0, err)
        self.assertEqual(len(out.splitlines()), 3)
        rc, _, err = raw("--config", cfg, "config", "use-context", "nope")
        self.assertEqual(rc, 3, err)
        self.assertIn("no context named nope in " + cfg, err)
        rc, _, err = raw("--config", cfg, "config", "set-context", "tok", "--server",
                         self.server.address, "--token-file", "/nonexistent/token")
        rc, _, err = raw("--config", cfg, "--context", "tok", "get", "jobs")
        self.assertEqual(rc, 2, err)
        self.assertIn(cfg + ": context tok: token-file: cannot read /nonexistent/token", err)
        bad = os.path.join(self.tmp.name, "bad.yaml")
        with open(bad, "w") as f:
            f.write("current-context: a\ncontexts:\n  - name: a\n    sever: x\n")
        rc, _, err = raw("--config", bad, "get", "jobs")
        self.assertEqual(rc, 2, err)
        self.assertIn(bad + ":4: contexts[0].sever: unknown field", err)
        rc, _, err = raw("get", "jobs", extra={"GEOFP8_CONFIG": bad})
        self.assertEqual(rc, 2, err)
        rc, _, err = raw("--config", os.path.join(self.tmp.name, "missing.yaml"), "get", "jobs")
        self.assertEqual(rc, 2, err)
        self.assertIn("missing.yaml: cannot read", err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
