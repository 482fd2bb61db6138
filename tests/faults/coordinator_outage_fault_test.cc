// A coordinator outage many checkpoint intervals long (kill -9, then a restart on the same port
// and data directory). The ranks keep training while it is away, keeping the acknowledged
// recovery point and their newest few checkpoints. When they register again they report the
// checkpoints they hold, and the restarted coordinator resumes the job from the newest step
// every rank holds: at most one checkpoint interval is redone.
// Before: each rank kept one <name>.ckpt, overwritten during the outage, and the job failed for
// good with "resume: no rank holds a checkpoint at step N"; then every step trained during the
// outage was redone from the persisted recovery point, and the files had no bound.
//
// GEOFP8_OUTAGE_SECONDS (default 3) sets the outage, for a longer run by hand
// (docs/reliability.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/faults/reference_run.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr int kEvery = 5;  // checkpoint interval, steps
// The worker's default (JobRunnerOptions::keep_unacknowledged).
constexpr int kKeepUnacknowledged = 3;

int OutageSeconds() {
  const char* s = std::getenv("GEOFP8_OUTAGE_SECONDS");
  return s && std::atoi(s) > 0 ? std::atoi(s) : 3;
}

// Long enough that the job is still running when the coordinator comes back: at 20+ ms a step,
// an outage of S seconds covers at most 50 S steps.
std::string Spec(const std::string& name) {
  return TinyJobSpec(name, 150 + 50 * OutageSeconds(), 9, kEvery, 0);
}

std::vector<int64_t> Checkpoints(const WorkerProcess& w, const std::string& job) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(w.data_dir() + "/ckpt/" + job, ec)) {
    if (e.path().extension() != ".ckpt") continue;
    const std::string stem = e.path().stem().string();  // <name>.<step>
    steps.push_back(std::stoll(stem.substr(stem.rfind('.') + 1)));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}
int CountCheckpoints(const WorkerProcess& w, const std::string& job) {
  return int(Checkpoints(w, job).size());
}

TEST(CoordinatorOutageFaultTest, KillNineLongerThanACheckpointIntervalStillSucceeds) {
  CoordinatorProcess coordinator;
  const std::string address = coordinator.address();
  const std::string port = address.substr(address.rfind(':') + 1);
  Client client(address);
  const std::vector<std::string> slow = {"--debug-step-delay-ms", "20"};
  WorkerProcess w0(address, "w0", slow), w1(address, "w1", slow);
  ASSERT_TRUE(client.WaitIdle(2, seconds(30)));
  const v1::Job job = client.Submit(Spec("outage"));
  const v1::Job before = client.WaitStep(job.id(), 20, seconds(60));
  ASSERT_EQ(before.state(), v1::JOB_RUNNING) << Describe(before, coordinator, {&w0, &w1});
  const int64_t recovery_point = before.progress().checkpoint_step();
  ASSERT_GE(recovery_point, 5);

  coordinator.process().Kill(SIGKILL);
  coordinator.process().Wait();
  // 3 s away: at 20+ ms a step, many checkpoint intervals of 5 steps pass meanwhile.
  std::this_thread::sleep_for(seconds(OutageSeconds()));
  // A rank writes each new file before it prunes, so a listing that falls between the two sees
  // one file more than the bound; the fewest over a few listings is what the rank keeps.
  std::vector<int64_t> kept = Checkpoints(w0, job.id());
  for (int i = 0; i < 10; ++i) {
    std::this_thread::sleep_for(milliseconds(7));
    std::vector<int64_t> again = Checkpoints(w0, job.id());
    if (again.size() < kept.size()) kept = std::move(again);
  }
  const int kept_during_outage = int(kept.size());
  ChildProcess again({GEOFP8_COORDINATOR_BIN, "--listen", "127.0.0.1:" + port, "--metrics-listen",
                      "", "--data-dir", coordinator.data_dir(), "--tick-ms", "50"});
  ASSERT_TRUE(again.WaitFor("serving on", seconds(20))) << again.output();
  const int64_t restarted_ms = NowUnixMs();  // back (serving), give or take the 20 ms poll
  Client client2(address);
  // The first calls may meet the connection the kill broke.
  v1::Job done;
  for (const auto deadline = std::chrono::steady_clock::now() + seconds(90 + 5 * OutageSeconds());
       std::chrono::steady_clock::now() < deadline;) {
    try {
      done = client2.WaitFinal(job.id(), seconds(90 + 5 * OutageSeconds()));
      break;
    } catch (const std::exception&) {
      std::this_thread::sleep_for(milliseconds(100));
    }
  }
  auto describe = [&] {
    return again.output() + "\n--- w0:\n" + w0.process().output() + "\n--- w1:\n" +
           w1.process().output();
  };
  ASSERT_EQ(done.state(), v1::JOB_SUCCEEDED) << done.reason() << "\n" << describe();

  int64_t running_ms = 0, resumed_at = -1, persisted_at = -1;
  for (const auto& e : done.events()) {
    if (e.message().find("all 2 ranks reported progress") != std::string::npos) {
      running_ms = e.unix_ms();
    }
    // The persisted point at the restart, then the newest step every rank reported holding.
    for (const std::string key :
         {"rescheduling from checkpoint step ", "resuming from checkpoint step "}) {
      const size_t at = e.message().find(key);
      if (at == std::string::npos) continue;
      resumed_at = std::stoll(e.message().substr(at + key.size()));
      if (key.rfind("rescheduling", 0) == 0) persisted_at = resumed_at;
    }
  }
  EXPECT_GE(resumed_at, recovery_point) << describe();
  // Where the cut-off attempt stopped (its ranks stop together once they lose their session).
  const int64_t stopped_at = std::stoll(w0.Result(job.id(), 0)["steps"]);
  EXPECT_EQ(w1.Result(job.id(), 0)["steps"], std::to_string(stopped_at));
  const int64_t redone = stopped_at - resumed_at;
  std::printf(
      "coordinator kill -9 for %d s: progress %lld when killed, recovery point %lld; the ranks "
      "held %d checkpoint files (steps %lld..%lld) after the outage; attempt 0 stopped at step "
      "%lld; resumed from step %lld (%lld steps redone); running again %.2f s after the "
      "restart\n",
      OutageSeconds(), static_cast<long long>(before.progress().step()),
      static_cast<long long>(recovery_point), kept_during_outage,
      static_cast<long long>(kept.empty() ? -1 : kept.front()),
      static_cast<long long>(kept.empty() ? -1 : kept.back()), static_cast<long long>(stopped_at),
      static_cast<long long>(resumed_at), static_cast<long long>(redone),
      double(running_ms - restarted_ms) / 1000.0);
  ASSERT_FALSE(kept.empty());
  EXPECT_GE(kept.back() - recovery_point, 3 * kEvery)
      << "the outage did not outlast several checkpoint intervals";
  // The disk bound: the acknowledged recovery point, the first file after it (its report may
  // have been persisted with the Ack lost in the kill) and the newest few; not one per interval.
  EXPECT_LE(kept_during_outage, 2 + kKeepUnacknowledged) << describe();
  // Where the coordinator would have resumed without the ranks' reports is still on disk.
  EXPECT_TRUE(std::count(kept.begin(), kept.end(), persisted_at)) << persisted_at;
  // The recovery target (issue #13): no more than one checkpoint interval redone.
  EXPECT_GE(redone, 0);
  EXPECT_LE(redone, kEvery) << describe();
  // The recovery target (issue #13): running again within 5 s of the coordinator's return.
  // Measured 0.5 s: the sessions wait for the channel, which retries at most 2 s apart.
  EXPECT_LT(double(running_ms - restarted_ms) / 1000.0, 5.0) << describe();

  // After the job each rank keeps only what is at or past the final recovery point (issue #31,
  // item 8: a rank whose last Ack came before rank 0's final report kept 2 + keep_unacknowledged
  // files). The Stop that ends the job carries that point; give it a moment to arrive.
  const int64_t final_point = done.progress().checkpoint_step();
  for (const WorkerProcess* w : {&w0, &w1}) {
    std::vector<int64_t> left = Checkpoints(*w, job.id());
    for (auto deadline = std::chrono::steady_clock::now() + seconds(10);
         !left.empty() && left.front() < final_point && std::chrono::steady_clock::now() < deadline;
         left = Checkpoints(*w, job.id())) {
      std::this_thread::sleep_for(milliseconds(50));
    }
    ASSERT_FALSE(left.empty()) << "the final checkpoint is the job's output";
    EXPECT_GE(left.front(), final_point)
        << left.size() << " files left, the oldest at step " << left.front() << "\n"
        << describe();
  }

  // The same final state as a run without the outage; and after the job, each rank keeps only
  // checkpoints at or past the acknowledged recovery point.
  const std::string checksum = w0.Result(job.id(), done.attempt())["checksum"];
  EXPECT_EQ(checksum, w1.Result(job.id(), done.attempt())["checksum"]);
  const v1::Job straight =
      client2.WaitFinal(client2.Submit(Spec("straight")).id(), seconds(90 + 5 * OutageSeconds()));
  ASSERT_EQ(straight.state(), v1::JOB_SUCCEEDED) << describe();
  EXPECT_EQ(w0.Result(straight.id())["checksum"], checksum);
  EXPECT_LE(CountCheckpoints(w0, straight.id()), 2);
}

}  // namespace
}  // namespace geofp8::testing
