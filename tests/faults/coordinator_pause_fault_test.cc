// The coordinator SIGSTOPped for 12 s, longer than its 6 s heartbeat timeout, then SIGCONT
// (issue #13, #2). Before: its first tick after SIGCONT found every worker silent for 12 s and
// declared them all dead (a false death), failing the running attempt. Now the daemon's timer
// sees that its own sleep took 12 s, the silence is the coordinator's, and every live worker gets
// a fresh heartbeat timeout. The ranks never needed the coordinator meanwhile: the job goes on
// in attempt 0, no worker is declared dead, nothing is redone, and it ends SUCCEEDED with the
// checksum of a fault-free run.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "tests/faults/reference_run.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr int kPauseSeconds = 12;  // > the default 6 s heartbeat timeout
constexpr int kStepDelayMs = 50;
// The ranks keep training while the coordinator is stopped (at most 240 steps in 12 s at 50+ ms a
// step), so the job is still running at SIGCONT.
constexpr int kSteps = 40 + kPauseSeconds * 1000 / kStepDelayMs + 40;

std::string Spec(const std::string& name) { return TinyJobSpec(name, kSteps, 13, 5, 2); }

TEST(CoordinatorPauseFaultTest, SigstopPastTheHeartbeatTimeoutIsNoDeath) {
  // The coordinator's default heartbeat timeout (6 s) and interval (1 s).
  CoordinatorProcess coordinator;
  Client client(coordinator.address());
  const std::vector<std::string> slow = {"--debug-step-delay-ms", std::to_string(kStepDelayMs)};
  WorkerProcess w0(coordinator.address(), "w0", slow), w1(coordinator.address(), "w1", slow);
  ASSERT_TRUE(client.WaitIdle(2, seconds(30)));
  const v1::Job job = client.Submit(Spec("pause"));
  const v1::Job before = client.WaitStep(job.id(), 20, seconds(60));
  ASSERT_EQ(before.state(), v1::JOB_RUNNING) << Describe(before, coordinator, {&w0, &w1});

  std::map<std::string, uint64_t> generations;
  for (const auto& w : client.Workers()) generations[w.name()] = w.generation();
  coordinator.process().Kill(SIGSTOP);
  std::this_thread::sleep_for(seconds(kPauseSeconds));
  coordinator.process().Kill(SIGCONT);
  const auto resumed = std::chrono::steady_clock::now();
  // Serving again: the step the coordinator records moves past where it was stopped.
  const int64_t at_stop = client.Get(job.id()).progress().step();
  double serving_s = -1;
  for (const auto deadline = resumed + seconds(10); std::chrono::steady_clock::now() < deadline;) {
    const v1::Job j = client.Get(job.id());
    if (j.progress().step() > at_stop) {
      serving_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - resumed).count();
      break;
    }
    std::this_thread::sleep_for(milliseconds(20));
  }

  const v1::Job done = client.WaitFinal(job.id(), seconds(90));
  ASSERT_EQ(done.state(), v1::JOB_SUCCEEDED) << done.reason() << "\n"
                                             << Describe(done, coordinator, {&w0, &w1});
  std::printf(
      "coordinator SIGSTOP for %d s at step %lld: attempt %d at the end, %d restarts; progress "
      "recorded again %.2f s after SIGCONT\n",
      kPauseSeconds, static_cast<long long>(before.progress().step()), done.attempt(),
      done.restarts(), serving_s);
  // No false death: the same attempt ran to the end, and no worker was fenced.
  EXPECT_EQ(done.attempt(), 0) << Describe(done, coordinator, {&w0, &w1});
  EXPECT_EQ(done.restarts(), 0);
  for (const auto& e : done.events()) {
    EXPECT_EQ(e.message().find("missed heartbeats"), std::string::npos) << e.message();
  }
  EXPECT_NE(coordinator.process().output().find("did not run for"), std::string::npos)
      << coordinator.process().output();
  for (const auto& w : client.Workers())
    EXPECT_EQ(w.generation(), generations[w.name()]) << w.name();
  // Running again within 5 s of the coordinator's return (it never stopped on the workers).
  EXPECT_GE(serving_s, 0) << Describe(done, coordinator, {&w0, &w1});
  EXPECT_LT(serving_s, 5.0);

  // The checksum of the same job without the pause, from a fresh coordinator and workers
  // without the step delay (the checksum does not depend on timing).
  const std::string checksum = w0.Result(job.id())["checksum"];
  EXPECT_EQ(checksum, w1.Result(job.id())["checksum"]);
  EXPECT_EQ(FaultFreeChecksum(Spec("straight")), checksum);
}

}  // namespace
}  // namespace geofp8::testing
