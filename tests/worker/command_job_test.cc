// `command:` jobs end to end: the real geofp8-coordinator and geofp8-worker processes run
// hook_script (hook_script_main.cc, a user program written against worker/hook/hook_client.h)
// as each rank. Checked: the torchrun/GEOFP8_* environment and a working MASTER_ADDR:MASTER_PORT,
// a live policy update applied by both ranks at the same step, progress/summaries/checkpoints
// relayed to the job, per-rank logs, the worker's rank events (rank.started, policy.taken,
// job.progress, rank.finished, rank.failed at level error) parsed from its log, a killed rank
// restarted by the restart policy (or failing with the signal named when none are left), exit
// codes, a missing program, and bad specs.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>
#include <vector>

#include "tests/common/http_client.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;

std::map<std::string, std::string> ReadKeyValues(const std::string& path) {
  std::map<std::string, std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// (attempt, step) -> policy version in force, from hook_script's versions file.
std::map<std::pair<int, int64_t>, uint64_t> ReadVersions(const std::string& path) {
  std::map<std::pair<int, int64_t>, uint64_t> out;
  std::ifstream in(path);
  int attempt;
  int64_t step;
  uint64_t version;
  while (in >> attempt >> step >> version) out[{attempt, step}] = version;
  return out;
}

// One logfmt line (platform/common/log.h) as key -> value, quotes and escapes undone.
std::map<std::string, std::string> ParseLogfmt(const std::string& line) {
  std::map<std::string, std::string> out;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && line[i] == ' ') ++i;
    const size_t eq = line.find('=', i);
    if (eq == std::string::npos) break;
    const std::string key = line.substr(i, eq - i);
    std::string value;
    i = eq + 1;
    if (i < line.size() && line[i] == '"') {
      for (++i; i < line.size() && line[i] != '"'; ++i) {
        if (line[i] == '\\' && i + 1 < line.size()) ++i;
        value += line[i];
      }
      ++i;
    } else {
      const size_t end = std::min(line.find(' ', i), line.size());
      value = line.substr(i, end - i);
      i = end;
    }
    out[key] = value;
  }
  return out;
}

// The daemon's `event` lines of `job`, in order.
std::vector<std::map<std::string, std::string>> Events(const std::string& output,
                                                       const std::string& event,
                                                       const std::string& job) {
  std::vector<std::map<std::string, std::string>> out;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    auto f = ParseLogfmt(line);
    if (f["event"] == event && f["job"] == job) out.push_back(std::move(f));
  }
  return out;
}

// Waits until `w` has logged `event` for `job` (the end is logged after the coordinator heard it).
std::vector<std::map<std::string, std::string>> WaitEvents(WorkerProcess& w,
                                                           const std::string& event,
                                                           const std::string& job) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    auto e = Events(w.process().output(), event, job);
    if (!e.empty() || std::chrono::steady_clock::now() >= deadline) return e;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

class CommandJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    coordinator_ = std::make_unique<CoordinatorProcess>(
        std::vector<std::string>{"--heartbeat-timeout-ms", "2000"});
    client_ = std::make_unique<Client>(coordinator_->address());
  }
  // Workers that run command jobs (--allow-commands), plus `extra` flags.
  void StartWorkers(int n, std::vector<std::string> extra = {}) {
    extra.insert(extra.begin(), "--allow-commands");
    for (int i = 0; i < n; ++i) {
      workers_.push_back(
          std::make_unique<WorkerProcess>(coordinator_->address(), "w" + std::to_string(i), extra));
    }
    ASSERT_TRUE(client_->WaitIdle(size_t(n), seconds(30))) << Everything(v1::Job());
  }
  std::string Everything(const v1::Job& job) {
    std::vector<WorkerProcess*> ws;
    for (auto& w : workers_) ws.push_back(w.get());
    return Describe(job, *coordinator_, ws);
  }
  // A job running hook_script on `world` ranks, writing into out_.
  std::string Spec(const std::string& name, int world, int steps, int max_restarts,
                   const std::string& extra_args = "") {
    return "name: " + name + "\nworld_size: " + std::to_string(world) +
           "\ncommand: [" GEOFP8_HOOK_SCRIPT_BIN ", --out, " + out_.path() + ", --steps, " +
           std::to_string(steps) + ", --sleep-ms, 40, --checkpoint-every, 5" + extra_args +
           "]\n"
           "training: {steps: " +
           std::to_string(steps) +
           "}\n"
           "policy:\n"
           "  default: {format: fp8_e4m3}\n"
           // 10 steps of 40 ms: time enough for a version to reach every rank's program.
           "  margin: 10\n"
           "restarts: {max_restarts: " +
           std::to_string(max_restarts) + "}\n";
  }
  std::string EnvFile(int rank, int attempt) const {
    return out_.path() + "/rank" + std::to_string(rank) + ".attempt" + std::to_string(attempt) +
           ".env";
  }
  // Waits for rank's env file of `attempt` and returns the program's pid.
  pid_t WaitPid(int rank, int attempt) {
    const auto deadline = std::chrono::steady_clock::now() + seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      auto env = ReadKeyValues(EnvFile(rank, attempt));
      if (env.count("master_connections")) return pid_t(std::stol(env["pid"]));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

  TempDir out_{"geofp8-hook-out"};
  std::unique_ptr<CoordinatorProcess> coordinator_;
  std::unique_ptr<Client> client_;
  std::vector<std::unique_ptr<WorkerProcess>> workers_;
};

TEST_F(CommandJobTest, TwoRanksRunToSuccessAndApplyALivePolicyAtTheSameStep) {
  const std::string token = out_.path() + "/token";
  std::ofstream(token) << "s3cret-token\n";
  // The program gets the documented variables and --command-env's, nothing else of the worker's.
  ::setenv("GEOFP8_TEST_WORKER_SECRET", "aws-key", 1);
  ::setenv("GEOFP8_TEST_PASSED", "1", 1);
  StartWorkers(2, {"--token-file", token, "--command-env", "GEOFP8_TEST_PASSED",
                   "--log-progress-every", "10"});
  ::unsetenv("GEOFP8_TEST_WORKER_SECRET");
  ::unsetenv("GEOFP8_TEST_PASSED");
  v1::Job job = client_->Submit(Spec("cmd", 2, 40, 0));
  job = client_->WaitStep(job.id(), 5, seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_RUNNING) << Everything(job);
  v1::LayerPatch patch;
  patch.set_layer("layers.*");
  patch.set_format(v1::FORMAT_NVFP4);
  const v1::Policy v2 = client_->UpdatePolicy(job.id(), patch, "test: nvfp4");
  ASSERT_EQ(v2.version(), 2u);
  job = client_->WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << Everything(job);

  // Both ranks ran every step, under v1 before the effective step and v2 from it on.
  const auto r0 = ReadVersions(out_.path() + "/rank0.versions");
  const auto r1 = ReadVersions(out_.path() + "/rank1.versions");
  ASSERT_EQ(r0.size(), 40u) << Everything(job);
  EXPECT_EQ(r0, r1) << Everything(job);
  for (int64_t s = 0; s < 40; ++s) {
    EXPECT_EQ(r0.at({0, s}), s < v2.effective_step() ? 1u : 2u) << "step " << s;
  }
  EXPECT_GT(v2.effective_step(), 5);
  EXPECT_LT(v2.effective_step(), 40);

  // The environment, and a rendezvous on MASTER_ADDR:MASTER_PORT that worked.
  auto e0 = ReadKeyValues(EnvFile(0, 0));
  auto e1 = ReadKeyValues(EnvFile(1, 0));
  EXPECT_EQ(e0["RANK"], "0");
  EXPECT_EQ(e1["RANK"], "1");
  for (auto* e : {&e0, &e1}) {
    EXPECT_EQ((*e)["WORLD_SIZE"], "2");
    EXPECT_EQ((*e)["LOCAL_RANK"], "0");
    EXPECT_EQ((*e)["LOCAL_WORLD_SIZE"], "1");
    EXPECT_EQ((*e)["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ((*e)["master_connections"], "1");
    EXPECT_EQ((*e)["GEOFP8_JOB_ID"], job.id());
    EXPECT_EQ((*e)["GEOFP8_ATTEMPT"], "0");
    EXPECT_EQ((*e)["GEOFP8_RESUME_STEP"], "0");
    EXPECT_EQ((*e)["GEOFP8_COORDINATOR"], coordinator_->address());
    EXPECT_EQ((*e)["GEOFP8_HOOK_ADDRESS"].rfind("unix:", 0), 0u);
    EXPECT_EQ((*e)["token_in_env"], "0");
    EXPECT_EQ((*e)["secret_in_env"], "0");
    EXPECT_EQ((*e)["passed_in_env"], "1");
    EXPECT_EQ((*e)["path_in_env"], "1");
    // The token reaches the program as a file only its user can read, removed when it ends.
    EXPECT_EQ((*e)["token_file_token"], "s3cret-token");
    EXPECT_EQ((*e)["token_file_mode"], std::to_string(0600));
    const std::string tf = (*e)["GEOFP8_TOKEN_FILE"];
    EXPECT_FALSE(tf.empty());
    EXPECT_FALSE(std::filesystem::exists(tf)) << tf;
  }
  EXPECT_EQ(e0["MASTER_PORT"], e1["MASTER_PORT"]);
  EXPECT_GT(std::stoi(e0["MASTER_PORT"]), 0);

  // Progress, summaries and checkpoints reached the job as the trainer's would.
  EXPECT_EQ(job.progress().step(), 39);
  EXPECT_EQ(job.progress().total_steps(), 40);
  EXPECT_EQ(job.progress().checkpoint_step(), 40);
  EXPECT_EQ(job.progress().bytes_sent(), 2u * 40 * 100);  // hook_script: 100 bytes per step
  EXPECT_EQ(job.progress().bytes_baseline(), 2u * 40 * 400);
  EXPECT_EQ(job.policy_version(), 2u);
  ASSERT_EQ(job.layers_size(), 2) << Everything(job);
  for (const auto& l : job.layers()) EXPECT_EQ(l.step(), 35) << l.layer();

  // Per-rank logs, kept in each worker's data directory; the working directory is there too.
  for (auto& w : workers_) {
    const auto result = w->Result(job.id());
    ASSERT_EQ(result.at("success"), "1");
    const std::string dir = w->data_dir() + "/jobs/" + job.id() + "/0";
    const std::string rank = result.at("rank");
    EXPECT_NE(ReadFile(dir + "/rank" + rank + ".out").find("hook_script: rank " + rank),
              std::string::npos);
    EXPECT_TRUE(std::filesystem::exists(dir + "/rank" + rank + ".err"));
    for (const char* f : {".out", ".err"}) {
      EXPECT_EQ(std::filesystem::status(dir + "/rank" + rank + f).permissions() &
                    std::filesystem::perms::all,
                std::filesystem::perms::owner_read | std::filesystem::perms::owner_write)
          << f;
    }
    EXPECT_EQ(ReadKeyValues(EnvFile(std::stoi(rank), 0))["cwd"],
              std::filesystem::canonical(dir).string());
    EXPECT_EQ(result.at("steps"), "40");

    // The worker logged the built-in trainer's rank events for this rank (docs/operations.md).
    const auto finished = WaitEvents(*w, "rank.finished", job.id());
    const std::string out = w->process().output();
    ASSERT_EQ(finished.size(), 1u) << out;
    EXPECT_EQ(finished[0].at("level"), "info");
    EXPECT_EQ(finished[0].at("rank"), rank);
    EXPECT_EQ(finished[0].at("attempt"), "0");
    EXPECT_EQ(finished[0].at("step"), "40");
    EXPECT_EQ(finished[0].at("result"), "succeeded");
    EXPECT_TRUE(finished[0].count("seconds")) << out;
    const auto started = Events(out, "rank.started", job.id());
    ASSERT_EQ(started.size(), 1u) << out;
    EXPECT_EQ(started[0].at("level"), "info");
    EXPECT_EQ(started[0].at("rank"), rank);
    EXPECT_EQ(started[0].at("world_size"), "2");
    EXPECT_EQ(started[0].at("step"), "0");
    std::map<std::string, std::map<std::string, std::string>> taken;
    for (auto& e : Events(out, "policy.taken", job.id())) taken[e.at("version")] = e;
    ASSERT_EQ(taken.count("2"), 1u) << out;
    EXPECT_EQ(taken["2"].at("rank"), rank);
    EXPECT_EQ(taken["2"].at("step"), std::to_string(v2.effective_step()));
    EXPECT_EQ(taken["2"].at("effective_step"), std::to_string(v2.effective_step()));
    // job.progress: rank 0 only, every --log-progress-every 10 steps.
    std::vector<std::string> progress;
    for (auto& e : Events(out, "job.progress", job.id())) {
      EXPECT_EQ(e.at("rank"), "0");
      EXPECT_TRUE(e.count("loss") && e.count("policy_version")) << out;
      progress.push_back(e.at("step") + " " + e.at("msg"));
    }
    const std::vector<std::string> every10 = {"9 step 10/40", "19 step 20/40", "29 step 30/40",
                                              "39 step 40/40"};
    EXPECT_EQ(progress, rank == "0" ? every10 : std::vector<std::string>{}) << out;
    EXPECT_TRUE(Events(out, "rank.failed", job.id()).empty()) << out;
  }
  // The worker's /metrics counted the relayed steps, and the job's gauges ended with the job.
  const int port = workers_[0]->MetricsPort();
  ASSERT_GT(port, 0);
  const std::string metrics =
      HttpExchange(port, "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  EXPECT_EQ(metrics.find("geofp8_worker_step{job_id=\"" + job.id() + "\"}"), std::string::npos);
  const std::string counter = "\ngeofp8_worker_steps_total ";
  const size_t at = metrics.find(counter);
  ASSERT_NE(at, std::string::npos) << metrics;
  EXPECT_GE(std::stod(metrics.substr(at + counter.size())), 40.0);
}

// A worker started with a relative --data-dir (the default, geofp8-worker-data, is one) runs
// command jobs (issue #40 item 1): the worker resolves its path flags where it starts, so the
// program, which runs in its job's directory, gets working paths for its output, the hook socket,
// the spec and the checkpoints.
TEST_F(CommandJobTest, AWorkerWithARelativeDataDirRunsCommandJobs) {
  TempDir cwd("geofp8-worker-cwd");
  ChildProcess worker({GEOFP8_WORKER_BIN, "--coordinator", coordinator_->address(), "--name", "rel",
                       "--metrics-port", "-1", "--allow-commands", "--data-dir", "worker-data",
                       "--ready-file", "ready.json"},
                      cwd.path());
  ASSERT_TRUE(client_->WaitIdle(1, seconds(30))) << worker.output();
  const std::string data = cwd.path() + "/worker-data";
  EXPECT_NE(worker.output().find("(device cpu, data " + data + ")"), std::string::npos)
      << worker.output();
  EXPECT_TRUE(std::filesystem::exists(cwd.path() + "/ready.json")) << worker.output();

  v1::Job job = client_->Submit("name: rel-true\ncommand: [/bin/true]\n");
  job = client_->WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << job.reason() << "\n" << worker.output();

  ASSERT_TRUE(client_->WaitIdle(1, seconds(30)));
  job = client_->Submit(
      "name: rel-sh\ncommand: [/bin/sh, -c, 'echo out of rank $RANK; echo to stderr >&2; "
      "test -r \"$GEOFP8_JOB_SPEC\" && test -d \"$GEOFP8_CHECKPOINT_DIR\" && "
      "test -S \"${GEOFP8_HOOK_ADDRESS#unix:}\"']\n");
  job = client_->WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << job.reason() << "\n" << worker.output();
  const std::string dir = data + "/jobs/" + job.id() + "/0";
  EXPECT_EQ(ReadFile(dir + "/rank0.out"), "out of rank 0\n");
  EXPECT_EQ(ReadFile(dir + "/rank0.err"), "to stderr\n");

  // A program on the hook: it attaches, reports steps and checkpoints.
  ASSERT_TRUE(client_->WaitIdle(1, seconds(30)));
  job = client_->Submit(Spec("rel-hook", 1, 10, 0));
  job = client_->WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << job.reason() << "\n" << worker.output();
  EXPECT_EQ(job.progress().step(), 9);
  EXPECT_EQ(job.progress().checkpoint_step(), 10);
}

TEST_F(CommandJobTest, GpuWorkersReportTheirGpuAndHandItToTheProgram) {
  // Two GPUs as the driver lists them (GEOFP8_NVIDIA_GPUS_DIR stands in for
  // /proc/driver/nvidia/gpus); both workers offer the second.
  TempDir gpus("geofp8-gpus");
  std::filesystem::create_directories(gpus.path() + "/0000:3b:00.0");
  std::filesystem::create_directories(gpus.path() + "/0000:af:00.0");
  ::setenv("GEOFP8_NVIDIA_GPUS_DIR", gpus.path().c_str(), 1);
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  StartWorkers(2, {"--device", "cuda:1"});
  ::unsetenv("GEOFP8_NVIDIA_GPUS_DIR");
  for (const v1::Worker& w : client_->Workers()) EXPECT_EQ(w.device(), "cuda:1");
  v1::Job job = client_->Submit(Spec("gpu", 2, 3, 0));
  job = client_->WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << Everything(job);
  for (int rank = 0; rank < 2; ++rank) {
    auto e = ReadKeyValues(EnvFile(rank, 0));
    EXPECT_EQ(e["CUDA_VISIBLE_DEVICES"], "1") << "rank " << rank;
    EXPECT_EQ(e["GEOFP8_DEVICE"], "cuda:0") << "rank " << rank;
    EXPECT_EQ(e["LOCAL_RANK"], "0") << "rank " << rank;
  }
}

TEST_F(CommandJobTest, AKilledRankRestartsTheJobFromItsCheckpoint) {
  StartWorkers(2);
  v1::Job job = client_->Submit(Spec("cmd-kill", 2, 40, 1));
  const pid_t pid = WaitPid(1, 0);
  ASSERT_GT(pid, 0) << Everything(client_->Get(job.id()));
  job = client_->WaitStep(job.id(), 12, seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_RUNNING) << Everything(job);
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  job = client_->WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << Everything(job);
  EXPECT_EQ(job.restarts(), 1);
  bool named = false;
  for (const auto& e : job.events()) {
    named |= e.message().find("rank 1 failed: command '" GEOFP8_HOOK_SCRIPT_BIN
                              "' was killed by SIGKILL") != std::string::npos;
  }
  EXPECT_TRUE(named) << Everything(job);
  // The second attempt resumed from the recovery point rank 0 reported (every 5 steps).
  auto e = ReadKeyValues(EnvFile(0, 1));
  const int64_t resume = std::stoll(e["GEOFP8_RESUME_STEP"]);
  EXPECT_GE(resume, 10);
  EXPECT_EQ(resume % 5, 0);
  EXPECT_EQ(e["GEOFP8_ATTEMPT"], "1");
  const auto r0 = ReadVersions(out_.path() + "/rank0.versions");
  EXPECT_EQ(r0.count({1, resume}), 1u);
  EXPECT_EQ(r0.count({1, resume - 1}), 0u);
  EXPECT_EQ(r0.count({1, 39}), 1u);
}

TEST_F(CommandJobTest, AKilledRankFailsTheJobWhenNoRestartsAreLeft) {
  StartWorkers(2);
  v1::Job job = client_->Submit(Spec("cmd-kill0", 2, 200, 0));
  const pid_t pid = WaitPid(0, 0);
  ASSERT_GT(pid, 0) << Everything(client_->Get(job.id()));
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  job = client_->WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_FAILED) << Everything(job);
  EXPECT_NE(job.reason().find("was killed by SIGKILL"), std::string::npos) << job.reason();
  EXPECT_NE(job.reason().find("no restarts left"), std::string::npos) << job.reason();
  // The other rank's program was stopped with its attempt: it did not run to step 200.
  EXPECT_LT(ReadVersions(out_.path() + "/rank1.versions").size(), 200u);
}

TEST_F(CommandJobTest, ExitCodesAndMissingProgramsFailWithTheirReason) {
  StartWorkers(1);
  // A non-zero exit: the code and where the output is, never the output itself (issue #31:
  // the reason is shown to every reader of the job).
  v1::Job job = client_->Submit(Spec("cmd-exit", 1, 3, 0, ", --exit-code, 3"));
  job = client_->WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_FAILED) << Everything(job);
  const std::string dir = workers_[0]->data_dir() + "/jobs/" + job.id() + "/0";
  // ... and the command that shows it (issue #40 item 3).
  EXPECT_NE(job.reason().find("exited with code 3; its output stays on worker w0 (" + dir +
                              "/rank0.err, " + dir + "/rank0.out): geofp8ctl logs " + job.id() +
                              " --rank 0 --attempt 0 --stderr; no restarts left"),
            std::string::npos)
      << job.reason();
  EXPECT_EQ(job.reason().find("failing on purpose"), std::string::npos) << job.reason();
  EXPECT_NE(ReadFile(dir + "/rank0.err").find("failing on purpose"), std::string::npos);
  // The failure is the worker's rank.failed at level error, as for the built-in trainer.
  {
    const auto failed = WaitEvents(*workers_[0], "rank.failed", job.id());
    ASSERT_EQ(failed.size(), 1u) << workers_[0]->process().output();
    EXPECT_EQ(failed[0].at("level"), "error");
    EXPECT_EQ(failed[0].at("rank"), "0");
    EXPECT_NE(failed[0].at("msg").find("exited with code 3"), std::string::npos);
    EXPECT_TRUE(Events(workers_[0]->process().output(), "rank.finished", job.id()).empty());
  }
  // Nor does either daemon's log copy it.
  EXPECT_EQ(workers_[0]->process().output().find("failing on purpose"), std::string::npos);
  EXPECT_EQ(coordinator_->process().output().find("failing on purpose"), std::string::npos);

  // A program that does not exist fails at once, whatever the restart policy.
  ASSERT_TRUE(client_->WaitIdle(1, seconds(30)));
  job = client_->Submit(
      "name: cmd-missing\ncommand: [/nonexistent/geofp8-no-such-program, --x]\n"
      "restarts: {max_restarts: 3}\n");
  job = client_->WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_FAILED) << Everything(job);
  EXPECT_NE(job.reason().find("command[0]: cannot run '/nonexistent/geofp8-no-such-program': "
                              "No such file or directory"),
            std::string::npos)
      << job.reason();
  EXPECT_EQ(job.restarts(), 0);
  const auto failed = WaitEvents(*workers_[0], "rank.failed", job.id());
  ASSERT_EQ(failed.size(), 1u) << workers_[0]->process().output();
  EXPECT_EQ(failed[0].at("level"), "error");
}

// A program that never attaches to the hook (issue #29 item 4): the job turns RUNNING when its
// process starts, gets an event and a note naming the rank and the seconds after the worker's
// --hook-attach-timeout, and finishes saying it never attached. One that attaches gets neither.
TEST_F(CommandJobTest, AProgramThatNeverAttachesIsRunningAndNoted) {
  StartWorkers(1, {"--hook-attach-timeout", "1"});
  v1::Job job = client_->Submit("name: cmd-silent\ncommand: [/bin/sleep, '3']\n");
  const auto deadline = std::chrono::steady_clock::now() + seconds(30);
  while (job.note().empty() && job.state() < v1::JOB_SUCCEEDED &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    job = client_->Get(job.id());
  }
  EXPECT_EQ(job.state(), v1::JOB_RUNNING) << Everything(job);
  EXPECT_EQ(job.note().rfind("rank 0 has not attached to the GeoFP8 hook 1 s after its program "
                             "started: a script attaches by constructing geofp8.torch.GeoFP8State",
                             0),
            0u)
      << Everything(job);
  bool running = false, noted = false;
  for (const auto& e : job.events()) {
    running = running || e.message() == "RUNNING: the programs of all 1 ranks started";
    noted = noted || e.message() == job.note();
  }
  EXPECT_TRUE(running && noted) << Everything(job);
  const auto warned = WaitEvents(*workers_[0], "rank.hook_not_attached", job.id());
  ASSERT_EQ(warned.size(), 1u) << workers_[0]->process().output();
  EXPECT_EQ(warned[0].at("level"), "warn");

  job = client_->WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << Everything(job);
  EXPECT_EQ(job.reason(),
            "all ranks finished at step 0; rank 0's program ended without attaching to the "
            "GeoFP8 hook");
  EXPECT_EQ(job.note().rfind("rank 0's program ended without attaching to the GeoFP8 hook: ", 0),
            0u)
      << job.note();

  // hook_script attaches at once.
  ASSERT_TRUE(client_->WaitIdle(1, seconds(30)));
  job = client_->Submit(Spec("cmd-attached", 1, 30, 0));
  job = client_->WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << Everything(job);
  EXPECT_EQ(job.note(), "");
  EXPECT_EQ(job.reason(), "all ranks finished at step 29");
  EXPECT_TRUE(Events(workers_[0]->process().output(), "rank.hook_not_attached", job.id()).empty());
}

TEST_F(CommandJobTest, BadCommandSpecsAreRefusedAtSubmitNamingTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"name: a\ncommand: []\n", "spec.command: must not be empty"},
      {"name: a\ncommand: python3\n", "spec.command: expected a list of strings"},
      {"name: a\ncommand: [python3, [x]]\n", "spec.command[1]: expected a string (a list)"},
      {"name: a\ncommand: ['', x]\n", "spec.command[0]: the program must not be empty"},
      {"name: a\ncommand: [python3]\nmodel: {preset: llama-tiny}\n",
       "spec.model: not allowed with command (python3)"},
      {"name: a\ncommand: [python3]\ntraining: {steps: 5, batch_size: 2}\n",
       "spec.training.batch_size: not allowed with command"},
      {"name: a\ncommand: [python3, " + std::string(5000, 'x') + "]\n",
       "spec.command[1]: at most 4096 bytes"},
  };
  for (const auto& [yaml, want] : cases) {
    try {
      client_->Submit(yaml);
      ADD_FAILURE() << "accepted: " << yaml;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos)
          << "want '" << want << "' in: " << e.what();
    }
  }
}

}  // namespace
}  // namespace geofp8::testing
