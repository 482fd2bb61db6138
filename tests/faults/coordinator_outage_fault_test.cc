// A coordinator outage many checkpoint intervals long (kill -9, then a restart on the same port
// and data directory). The ranks keep training while it is away; the restarted coordinator
// resumes the job from the recovery point it had persisted, which every rank still holds because
// a rank deletes a checkpoint only below a recovery point the coordinator has acknowledged.
// Before: each rank kept one <name>.ckpt, overwritten during the outage, and the job failed for
// good with "resume: no rank holds a checkpoint at step N".
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

std::string Spec(const std::string& name) {
  return "name: " + name +
         "\nworld_size: 2\nmodel: {preset: llama-tiny}\n"
         "training: {steps: 100, batch_size: 2, seq_len: 16, seed: 9}\n"
         "checkpoint: {dir: ckpt, every: 5}\nrestarts: {max_restarts: 0}\n";
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int CountCheckpoints(const WorkerProcess& w, const std::string& job) {
  int n = 0;
  std::error_code ec;
  for (const auto& e :
       std::filesystem::directory_iterator(w.data_dir() + "/ckpt/" + job, ec)) {
    n += e.path().extension() == ".ckpt";
  }
  return n;
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
  std::this_thread::sleep_for(seconds(3));
  const int kept_during_outage = CountCheckpoints(w0, job.id());
  ChildProcess again({GEOFP8_COORDINATOR_BIN, "--listen", "127.0.0.1:" + port,
                      "--metrics-listen", "", "--data-dir", coordinator.data_dir(), "--tick-ms",
                      "50"});
  ASSERT_TRUE(again.WaitFor("serving on", seconds(20))) << again.output();
  const int64_t restarted_ms = NowUnixMs();  // back (serving), give or take the 20 ms poll
  Client client2(address);
  // The first calls may meet the connection the kill broke.
  v1::Job done;
  for (const auto deadline = std::chrono::steady_clock::now() + seconds(90);
       std::chrono::steady_clock::now() < deadline;) {
    try {
      done = client2.WaitFinal(job.id(), seconds(90));
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

  int64_t running_ms = 0, resumed_at = -1;
  for (const auto& e : done.events()) {
    if (e.message().find("all 2 ranks reported progress") != std::string::npos) {
      running_ms = e.unix_ms();
    }
    const std::string key = "rescheduling from checkpoint step ";
    const size_t at = e.message().find(key);
    if (at != std::string::npos) resumed_at = std::stoll(e.message().substr(at + key.size()));
  }
  // The resume step is the one persisted before the outage, or a later one whose report got
  // through before the kill.
  EXPECT_GE(resumed_at, recovery_point) << describe();
  std::printf(
      "coordinator kill -9 for 3 s: ranks kept %d checkpoints meanwhile; resumed from step %lld "
      "(progress was %lld when killed); running again %.2f s after the restart\n",
      kept_during_outage, static_cast<long long>(resumed_at),
      static_cast<long long>(before.progress().step()),
      double(running_ms - restarted_ms) / 1000.0);
  EXPECT_GT(kept_during_outage, 2) << "the outage did not outlast a checkpoint interval";
  // The recovery target (issue #13): running again within 5 s of the coordinator's return.
  // Measured 0.5 s: the sessions wait for the channel, which retries at most 2 s apart.
  EXPECT_LT(double(running_ms - restarted_ms) / 1000.0, 5.0) << describe();

  // The same final state as a run without the outage; and after the job, each rank keeps only
  // checkpoints at or past the acknowledged recovery point.
  const std::string checksum = w0.Result(job.id(), done.attempt())["checksum"];
  EXPECT_EQ(checksum, w1.Result(job.id(), done.attempt())["checksum"]);
  const v1::Job straight = client2.WaitFinal(client2.Submit(Spec("straight")).id(), seconds(90));
  ASSERT_EQ(straight.state(), v1::JOB_SUCCEEDED) << describe();
  EXPECT_EQ(w0.Result(straight.id())["checksum"], checksum);
  EXPECT_LE(CountCheckpoints(w0, straight.id()), 2);
}

}  // namespace
}  // namespace geofp8::testing
