// End to end: the real geofp8-coordinator and geofp8-worker processes on 127.0.0.1 running tiny
// jobs: success with bitwise-equal final parameters on every rank, a live policy change applied
// at its effective step, a late policy failing loudly, cancel, a dead worker's restart from the
// checkpoint (bitwise equal to an uninterrupted run), session re-registration after a
// coordinator restart, and /metrics.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cmath>
#include <filesystem>
#include <regex>

#include "tests/common/http_client.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;

// A tiny job: llama-tiny, fp8 with low-rank geometry on the matrices, checkpoints every 10.
// Geometry refreshes: the instant estimator every 10 steps, owners and offsets staggered, so the
// tests can tell which rank estimated what.
constexpr const char* kInstantEvery10 = "geometry_refresh: {estimator: instant, interval: 10}\n";

std::string TinySpec(const std::string& name, int steps, const std::string& extra_policy = "",
                     int world = 2, const std::string& refresh = kInstantEvery10) {
  return "name: " + name + "\nworld_size: " + std::to_string(world) +
         "\nbackend: gloo\n"
         "model: {preset: llama-tiny}\n"
         "data: {source: synthetic, seed: 1}\n"
         "training: {steps: " +
         std::to_string(steps) +
         ", batch_size: 4, seq_len: 32, lr: 0.002, warmup_steps: 5, seed: 3}\n"
         "exchange: {timeout_s: 10}\n"
         "policy:\n"
         "  default: {format: fp8_e4m3, scaling: block, block: 64, geometry: lowrank, rank: 4}\n" +
         extra_policy + refresh +
         "checkpoint: {dir: ckpt, every: 10}\n"
         "restarts: {max_restarts: 2}\n";
}

std::string Scrape(int port) {
  return HttpExchange(port, "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
}

class WorkerE2ETest : public ::testing::Test {
 protected:
  // Starts n workers and waits until each is registered and idle.
  void StartWorkers(int n, std::vector<std::string> extra = {}) {
    std::vector<std::string> names;
    for (int i = 0; i < n; ++i) {
      names.push_back("w" + std::to_string(workers_.size()));
      workers_.push_back(
          std::make_unique<WorkerProcess>(coordinator_->address(), names.back(), extra));
    }
    const auto deadline = std::chrono::steady_clock::now() + seconds(30);
    for (;;) {
      size_t idle = 0;
      for (const auto& w : client_->Workers()) {
        idle += w.state() == v1::WORKER_IDLE &&
                std::find(names.begin(), names.end(), w.name()) != names.end();
      }
      if (idle == names.size()) return;
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << Everything(v1::Job());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  void SetUp() override {
    coordinator_ = std::make_unique<CoordinatorProcess>(
        std::vector<std::string>{"--heartbeat-timeout-ms", "2000"});
    client_ = std::make_unique<Client>(coordinator_->address());
  }
  std::string Everything(const v1::Job& job) {
    std::vector<WorkerProcess*> ws;
    for (auto& w : workers_) ws.push_back(w.get());
    return Describe(job, *coordinator_, ws);
  }

  std::unique_ptr<CoordinatorProcess> coordinator_;
  std::unique_ptr<Client> client_;
  std::vector<std::unique_ptr<WorkerProcess>> workers_;
};

TEST_F(WorkerE2ETest, TwoWorkersFinishATinyJobWithEqualChecksums) {
  StartWorkers(2);
  v1::Job job = client_->Submit(TinySpec("e2e", 30));
  job = client_->WaitFinal(job.id(), seconds(120));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << Everything(job);
  EXPECT_EQ(job.progress().step(), 29);
  EXPECT_EQ(job.progress().checkpoint_step(), 30);
  EXPECT_GT(job.progress().bytes_sent(), 0u);
  // fp8 with 64-element blocks: well under half of what fp32 would have sent.
  EXPECT_LT(job.progress().bytes_sent(), job.progress().bytes_baseline() / 2) << Everything(job);
  auto r0 = workers_[0]->Result(job.id());
  auto r1 = workers_[1]->Result(job.id());
  ASSERT_EQ(r0["success"], "1") << Everything(job);
  ASSERT_EQ(r1["success"], "1") << Everything(job);
  EXPECT_EQ(r0["steps"], "30");
  EXPECT_EQ(r0["checksum"], r1["checksum"]);
  EXPECT_NE(r0["checksum"], "0000000000000000");
  EXPECT_NE(r0["rank"], r1["rank"]);
  // Rank 0's last layer summaries (step 20): by then every matrix has been refreshed twice
  // (interval 10, offsets within it), so its drift is measured, and its residual-subspace error
  // is taken against a real basis, so it differs from the whole-space rel_fro_error.
  int matrices = 0;
  for (const v1::LayerSummary& l : job.layers()) {
    EXPECT_EQ(l.step(), 20) << l.layer();
    EXPECT_GT(l.rel_fro_error(), 0.0) << l.layer();
    if (l.layer().find("norm") != std::string::npos) {
      EXPECT_EQ(l.geometry_version(), 0u) << l.layer();
      EXPECT_EQ(l.drift(), 0.0) << l.layer();
      EXPECT_NEAR(l.residual_error(), l.rel_fro_error(), 1e-5 * l.rel_fro_error()) << l.layer();
      continue;
    }
    ++matrices;
    EXPECT_GE(l.geometry_version(), 2u) << l.layer();
    EXPECT_GT(l.drift(), 0.0) << l.layer();
    EXPECT_LE(l.drift(), 1.0) << l.layer();
    EXPECT_GT(l.residual_error(), 0.0) << l.layer();
    EXPECT_NE(l.residual_error(), l.rel_fro_error()) << l.layer();
  }
  EXPECT_EQ(matrices, 2 + 2 * 7) << Everything(job);  // tok_emb, lm_head, 7 per block
  // Each worker wrote its own checkpoint of the final state.
  EXPECT_TRUE(
      std::filesystem::exists(workers_[0]->data_dir() + "/ckpt/" + job.id() + "/w0.30.ckpt"));
  EXPECT_TRUE(
      std::filesystem::exists(workers_[1]->data_dir() + "/ckpt/" + job.id() + "/w1.30.ckpt"));
  // /metrics in Prometheus text format. The job has ended: its gauges are gone, its counters
  // (labelled with the job) stay, and hold whole bytes.
  const std::string m = Scrape(workers_[0]->MetricsPort());
  EXPECT_EQ(m.find("geofp8_worker_step{"), std::string::npos) << m;
  EXPECT_EQ(m.find("geofp8_quantization_rel_error{"), std::string::npos) << m;
  EXPECT_EQ(m.find("geofp8_worker_tokens_per_second{"), std::string::npos) << m;
  EXPECT_NE(m.find("geofp8_worker_steps_total 30"), std::string::npos) << m;
  const std::string bytes = "geofp8_exchange_bytes_total{format=\"fp8_e4m3\",job_id=\"" + job.id() +
                            "\",layer=\"layers.0.attn.wq\"} ";
  const size_t at = m.find(bytes);
  ASSERT_NE(at, std::string::npos) << m;
  const double b = std::stod(m.substr(at + bytes.size()));
  EXPECT_GT(b, 0) << m;
  EXPECT_EQ(b, std::floor(b)) << m;  // whole bytes
  EXPECT_NE(m.find("geofp8_exchange_seconds_count 30"), std::string::npos) << m;
  EXPECT_NE(m.find("geofp8_geometry_refresh_seconds_count 30"), std::string::npos) << m;
  EXPECT_NE(m.find("geofp8_worker_jobs_total{result=\"succeeded\"} 1"), std::string::npos) << m;
  EXPECT_NE(m.find("geofp8_worker_jobs_total{result=\"failed\"} 0"), std::string::npos) << m;
  EXPECT_NE(m.find("geofp8_build_info{git_commit=\""), std::string::npos) << m;
  EXPECT_NE(m.find("process_resident_memory_bytes "), std::string::npos) << m;
  // A refresh is counted by the rank that estimated it (the layer's owner), not by every rank.
  const std::string m1 = Scrape(workers_[1]->MetricsPort());
  for (const v1::LayerSummary& l : job.layers()) {
    if (l.layer().find("norm") != std::string::npos) continue;
    const std::string series = "geofp8_geometry_refreshes_total{job_id=\"" + job.id() +
                               "\",layer=\"" + l.layer() + "\"} 3";
    EXPECT_EQ(int(m.find(series) != std::string::npos) + int(m1.find(series) != std::string::npos),
              1)
        << series << "\n"
        << m << m1;
  }
  // Both workers are free again.
  EXPECT_TRUE(client_->WaitIdle(2, seconds(10)));
}

// The step a worker's log says it put `version` in force from (its policy.taken event line,
// docs/operations.md); -1 if it never did.
int64_t TakenStep(const std::string& log, uint64_t version) {
  const std::regex line(" event=policy\\.taken .* version=" + std::to_string(version) +
                        " step=(-?[0-9]+) ");
  std::smatch m;
  return std::regex_search(log, m, line) ? std::stoll(m[1].str()) : -1;
}

TEST_F(WorkerE2ETest, LivePolicyChangeTakesEffectAtItsStep) {
  StartWorkers(2, {"--debug-step-delay-ms", "40"});
  v1::Job job = client_->Submit(TinySpec("live", 60));
  job = client_->WaitStep(job.id(), 10, seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_RUNNING) << Everything(job);
  v1::LayerPatch patch;
  patch.set_layer("layers.*");
  patch.set_format(v1::FORMAT_BF16);
  patch.set_geometry(v1::GEOMETRY_NONE);
  const v1::Policy p = client_->UpdatePolicy(job.id(), patch, "test: bf16");
  ASSERT_EQ(p.version(), 2u);
  job = client_->WaitFinal(job.id(), seconds(120));
  // The coordinator fails a job whose rank reports a step at or after the step rank 0 took a
  // version at under an older version, so success means both ranks switched together.
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << Everything(job);
  const int64_t taken = TakenStep(workers_[0]->process().output(), 2);
  EXPECT_GE(taken, p.effective_step()) << workers_[0]->process().output();
  for (auto& w : workers_) {
    auto r = w->Result(job.id());
    EXPECT_EQ(r["policy_version"], "2");
    EXPECT_EQ(TakenStep(w->process().output(), 2), taken) << w->process().output();
  }
  EXPECT_EQ(workers_[0]->Result(job.id())["checksum"], workers_[1]->Result(job.id())["checksum"]);
  const std::string m = Scrape(workers_[0]->MetricsPort());
  EXPECT_NE(m.find("format=\"bf16\""), std::string::npos) << m;
}

// A version that reaches the ranks long after its effective step (a slow network) is taken
// late, at the same step on both, instead of failing the job (before: "policy v2 effective at
// step E arrived at step S", failed for good).
TEST_F(WorkerE2ETest, PolicyArrivingAfterItsEffectiveStepIsTakenLateOnEveryRank) {
  // margin 1 puts the effective step right after the largest reported one; the workers hold each
  // policy for 2 s, by which time both ranks have run far past it.
  StartWorkers(2, {"--debug-policy-delay-ms", "2000", "--debug-step-delay-ms", "10"});
  v1::Job job = client_->Submit(TinySpec("late", 600, "  margin: 1\n"));
  job = client_->WaitStep(job.id(), 20, seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_RUNNING) << Everything(job);
  v1::LayerPatch patch;
  patch.set_layer("*");
  patch.set_format(v1::FORMAT_BF16);
  const v1::Policy p = client_->UpdatePolicy(job.id(), patch, "test: late");
  job = client_->WaitFinal(job.id(), seconds(120));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << Everything(job);
  const int64_t taken = TakenStep(workers_[0]->process().output(), 2);
  // 2 s at 10+ ms a step: far more than the margin.
  EXPECT_GT(taken, p.effective_step() + 10) << workers_[0]->process().output();
  EXPECT_EQ(TakenStep(workers_[1]->process().output(), 2), taken);
  EXPECT_EQ(workers_[0]->Result(job.id())["policy_version"], "2");
  EXPECT_EQ(workers_[0]->Result(job.id())["checksum"], workers_[1]->Result(job.id())["checksum"]);
  EXPECT_TRUE(client_->WaitIdle(2, seconds(30))) << Everything(job);
}

// Auto mode: rank 0's probes reach the coordinator's policy engine, which turns geometry on
// with a new version; the ranks apply it at its effective step and finish. Under the default
// (ema) estimator the first probes judge the shadow basis, the later ones the deployed one, and
// both show in describe and in /metrics.
TEST_F(WorkerE2ETest, AutoPolicyProbesLeadToAnAutoVersion) {
  StartWorkers(2, {"--debug-step-delay-ms", "10"});
  std::string spec = TinySpec("auto", 80, "", 2, "");
  spec.replace(spec.find("geometry: lowrank, rank: 4"), 26, "geometry: none");
  spec +=
      "auto_policy: {enabled: true, probe_every: 10, min_gain: 1.0001, off_gain: 1.00001,"
      " max_cost_fraction: 1.0, geometry: lowrank, rank: 4, min_interval: 5,"
      " max_interval: 100}\n";
  v1::Job job = client_->Submit(spec);
  job = client_->WaitFinal(job.id(), seconds(120));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << Everything(job);
  EXPECT_GE(job.policy_version(), 2u) << Everything(job);
  bool auto_event = false;
  for (const auto& e : job.events())
    auto_event |= e.message().find("(auto): auto:") != std::string::npos;
  EXPECT_TRUE(auto_event) << Everything(job);
  EXPECT_EQ(workers_[0]->Result(job.id())["checksum"], workers_[1]->Result(job.id())["checksum"]);
  // Every matrix was probed at some step with a real basis; the describe rows carry the verdict.
  int probed = 0, deployed = 0;
  for (const v1::LayerSummary& l : job.layers()) {
    if (l.layer().find("norm") != std::string::npos) {
      EXPECT_EQ(l.probe_step(), 0) << l.layer();
      continue;
    }
    EXPECT_GT(l.probe_step(), 0) << l.layer() << "\n" << Everything(job);
    EXPECT_GT(l.probe_gain(), 0.0) << l.layer();
    EXPECT_NE(l.probe_basis(), v1::PROBE_BASIS_UNSPECIFIED) << l.layer();
    probed += l.probe_step() > 0;
    deployed += l.probe_basis() == v1::PROBE_BASIS_DEPLOYED;
  }
  EXPECT_EQ(probed, 2 + 2 * 7) << Everything(job);
  EXPECT_GT(deployed, 0) << Everything(job);  // geometry went on, then was judged as deployed
  // The probe gains were gauges of the job: gone with it.
  const std::string m = Scrape(workers_[0]->MetricsPort());
  EXPECT_EQ(m.find("geofp8_geometry_probe_gain{"), std::string::npos) << m;
}

TEST_F(WorkerE2ETest, CancelStopsEveryRankAtTheSameStep) {
  StartWorkers(2);
  v1::Job job = client_->Submit(TinySpec("cancel", 100000));
  job = client_->WaitStep(job.id(), 5, seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_RUNNING) << Everything(job);
  grpc::ClientContext ctx;
  auto stub = v1::JobService::NewStub(
      grpc::CreateChannel(coordinator_->address(), grpc::InsecureChannelCredentials()));
  v1::CancelJobRequest req;
  req.set_job_id(job.id());
  req.set_reason("test");
  v1::Job cancelled;
  ASSERT_TRUE(stub->CancelJob(&ctx, req, &cancelled).ok());
  ASSERT_TRUE(client_->WaitIdle(2, seconds(30))) << Everything(job);
  // Both ranks agree on the step they stopped at.
  const auto deadline = std::chrono::steady_clock::now() + seconds(20);
  std::map<std::string, std::string> r0, r1;
  while (std::chrono::steady_clock::now() < deadline && (r0.empty() || r1.empty())) {
    r0 = workers_[0]->Result(job.id());
    r1 = workers_[1]->Result(job.id());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(r0["stopped"], "1") << Everything(job);
  EXPECT_EQ(r1["stopped"], "1") << Everything(job);
  EXPECT_EQ(r0["steps"], r1["steps"]);
  EXPECT_EQ(client_->Get(job.id()).state(), v1::JOB_CANCELLED);
  // A cancel is not a failure. The rank that saw the Stop first counts "cancelled"; its peer may
  // have stopped on that rank's vote before its own Stop arrived ("stopped").
  int cancelled_ranks = 0;
  for (int w = 0; w < 2; ++w) {
    const std::string m = Scrape(workers_[w]->MetricsPort());
    EXPECT_NE(m.find("geofp8_worker_jobs_total{result=\"failed\"} 0"), std::string::npos) << m;
    EXPECT_NE(m.find("geofp8_worker_errors_total{kind=\"job_failed\"} 0"), std::string::npos) << m;
    cancelled_ranks +=
        m.find("geofp8_worker_jobs_total{result=\"cancelled\"} 1") != std::string::npos;
    EXPECT_EQ(m.find("geofp8_worker_step{"), std::string::npos) << m;
  }
  EXPECT_GE(cancelled_ranks, 1);
}

TEST_F(WorkerE2ETest, DeadWorkerRestartsTheJobFromItsCheckpoint) {
  StartWorkers(2, {"--debug-step-delay-ms", "20"});
  v1::Job job = client_->Submit(TinySpec("restart", 60, "", 2, ""));  // the default: ema
  job = client_->WaitStep(job.id(), 25, seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_RUNNING) << Everything(job);
  ASSERT_GE(job.progress().checkpoint_step(), 10) << Everything(job);
  // A spare worker joins, then w1 dies without a word.
  StartWorkers(1, {"--debug-step-delay-ms", "20"});
  workers_[1]->process().Kill(SIGKILL);
  job = client_->WaitFinal(job.id(), seconds(120));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << Everything(job);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.attempt(), 1);
  auto a = workers_[0]->Result(job.id(), 1);
  auto b = workers_[2]->Result(job.id(), 1);
  ASSERT_EQ(a["success"], "1") << Everything(job);
  ASSERT_EQ(b["success"], "1") << Everything(job);
  EXPECT_EQ(a["checksum"], b["checksum"]);
  // The spare had no checkpoint of its own: the state came from w0's by broadcast.
  EXPECT_NE(workers_[2]->process().output().find("resumed at step"), std::string::npos);
  // And the restart continued exactly: the same job run without a break ends bitwise equal.
  // The spec's default estimator (ema) folds every step into each matrix's sketch and activates
  // the derived geometry one step later, so a pending geometry and a sketch cross every
  // checkpoint; the checkpoint carries both.
  v1::Job straight = client_->Submit(TinySpec("straight", 60, "", 2, ""));
  straight = client_->WaitFinal(straight.id(), seconds(120));
  ASSERT_EQ(straight.state(), v1::JOB_SUCCEEDED) << Everything(straight);
  EXPECT_EQ(workers_[0]->Result(straight.id())["checksum"], a["checksum"]);
}

TEST_F(WorkerE2ETest, WorkerReRegistersAfterACoordinatorRestart) {
  StartWorkers(1);
  const auto before = client_->Workers();
  ASSERT_EQ(before.size(), 1u);
  const uint64_t gen = before[0].generation();
  // Heartbeats keep an idle worker alive past the 2 s timeout. Waited for on the coordinator's
  // own record, not a clock here: once its last heartbeat is more than a timeout after the first
  // one seen, the worker has lived through a whole timeout window; under load that just takes
  // longer. It must still be idle in the same generation (never expired and re-registered).
  const int64_t first_beat = before[0].last_heartbeat_unix_ms();
  const auto deadline = std::chrono::steady_clock::now() + seconds(60);
  v1::Worker now = client_->Workers()[0];
  while (now.last_heartbeat_unix_ms() <= first_beat + 2000) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline)
        << "no heartbeat recorded past the timeout window; last " << now.last_heartbeat_unix_ms()
        << " first " << first_beat << "\n"
        << workers_[0]->process().output();
    ASSERT_EQ(now.state(), v1::WORKER_IDLE) << workers_[0]->process().output();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    now = client_->Workers()[0];
  }
  ASSERT_EQ(now.state(), v1::WORKER_IDLE);
  ASSERT_EQ(now.generation(), gen);
  // Restart the coordinator on the same port and data directory.
  const std::string address = coordinator_->address();
  const std::string port = address.substr(address.rfind(':') + 1);
  coordinator_->process().Kill(SIGKILL);
  coordinator_->process().Wait();
  ChildProcess again({GEOFP8_COORDINATOR_BIN, "--listen", "127.0.0.1:" + port, "--metrics-listen",
                      "", "--data-dir", coordinator_->data_dir(), "--tick-ms", "50"});
  ASSERT_TRUE(again.WaitFor("serving on", seconds(20))) << again.output();
  Client client(address);
  ASSERT_TRUE(client.WaitIdle(1, seconds(30))) << workers_[0]->process().output();
  EXPECT_GT(client.Workers()[0].generation(), gen);
  EXPECT_NE(workers_[0]->process().output().find("registering again"), std::string::npos);
}

TEST(WorkerCliTest, ACudaDevicePastTheGpuCountIsRefusedWithBothNumbers) {
  TempDir gpus("geofp8-gpus");  // two GPUs as the driver would list them
  std::filesystem::create_directories(gpus.path() + "/0000:3b:00.0");
  std::filesystem::create_directories(gpus.path() + "/0000:af:00.0");
  ::setenv("GEOFP8_NVIDIA_GPUS_DIR", gpus.path().c_str(), 1);
  ChildProcess p({GEOFP8_WORKER_BIN, "--device", "cuda:7", "--metrics-port", "-1"});
  ::unsetenv("GEOFP8_NVIDIA_GPUS_DIR");
  EXPECT_EQ(p.Wait(), 2);
  EXPECT_NE(p.output().find("geofp8-worker: error: --device: cuda:7 names GPU 7, but this "
                            "machine has 2 GPUs"),
            std::string::npos)
      << p.output();
}

TEST(WorkerCliTest, BadFlagsAreNamedAndExitWith2) {
  for (const auto& [flag, value] :
       std::vector<std::pair<std::string, std::string>>{{"--device", "tpu"},
                                                        {"--capacity", "lots"},
                                                        {"--metrics-port", "70000"},
                                                        {"--coordinator", "nocolon"}}) {
    ChildProcess p({GEOFP8_WORKER_BIN, flag, value, "--metrics-port",
                    flag == "--metrics-port" ? value : "-1"});
    EXPECT_EQ(p.Wait(), 2) << flag;
    EXPECT_NE(p.output().find("geofp8-worker: error: " + flag), std::string::npos) << p.output();
  }
}

}  // namespace
}  // namespace geofp8::testing
