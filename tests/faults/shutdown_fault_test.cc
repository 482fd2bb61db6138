// Orderly shutdowns: a worker's SIGTERM tells the coordinator, so its job restarts at once
// instead of after the heartbeat timeout; the coordinator's SIGTERM ends worker sessions instead
// of waiting out the whole grace period.
#include <gtest/gtest.h>

#include <string>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

TEST(ShutdownFaultTest, WorkerSigtermRestartsItsJobWithoutTheHeartbeatTimeout) {
  // A 30 s heartbeat timeout: a restart sooner than that can only come from the worker's word.
  CoordinatorProcess coordinator({"--heartbeat-timeout-ms", "30000"});
  Client client(coordinator.address());
  const std::vector<std::string> slow = {"--debug-step-delay-ms", "20"};
  WorkerProcess w0(coordinator.address(), "w0", slow), w1(coordinator.address(), "w1", slow),
      spare(coordinator.address(), "spare", slow);
  ASSERT_TRUE(client.WaitIdle(3, seconds(30)));
  const v1::Job job = client.Submit(
      "name: sigterm\nworld_size: 2\nmodel: {preset: llama-tiny}\n"
      "training: {steps: 150, batch_size: 2, seq_len: 16}\nexchange: {timeout_s: 60}\n"
      "checkpoint: {dir: ckpt, every: 10}\nrestarts: {max_restarts: 2}\n");
  v1::Job j = client.WaitStep(job.id(), 20, seconds(60));
  ASSERT_EQ(j.state(), v1::JOB_RUNNING) << Describe(j, coordinator, {&w0, &w1, &spare});
  std::string leaving;
  for (const auto& w : client.Workers()) {
    if (w.job_id() == job.id() && w.rank() == 1) leaving = w.name();
  }
  ASSERT_FALSE(leaving.empty()) << Describe(j, coordinator, {&w0, &w1, &spare});
  WorkerProcess* victim = leaving == "w0" ? &w0 : leaving == "w1" ? &w1 : &spare;

  const auto start = Clock::now();
  victim->process().Kill(SIGTERM);
  do {
    std::this_thread::sleep_for(milliseconds(20));
    j = client.Get(job.id());
  } while (j.attempt() == 0 && Clock::now() - start < seconds(25));
  const double detect_s = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(j.attempt(), 1) << Describe(j, coordinator, {&w0, &w1, &spare});
  EXPECT_LT(detect_s, 10.0) << "restart waited for the heartbeat timeout";
  std::printf("worker SIGTERM: job restarted after %.2f s (heartbeat timeout 30 s)\n", detect_s);
  EXPECT_EQ(victim->process().Wait(seconds(20)), 0) << victim->process().output();
  EXPECT_NE(victim->process().output().find("left the coordinator (SIGTERM)"), std::string::npos)
      << victim->process().output();
  bool named = false;
  const v1::Job after = client.Get(job.id());
  for (const auto& e : after.events()) {
    named |= e.message().find("(rank 1, generation 1) left (SIGTERM)") != std::string::npos;
  }
  EXPECT_TRUE(named) << Describe(j, coordinator, {&w0, &w1, &spare});

  const v1::Job done = client.WaitFinal(job.id(), seconds(120));
  EXPECT_EQ(done.state(), v1::JOB_SUCCEEDED) << Describe(done, coordinator, {&w0, &w1, &spare});
}

TEST(ShutdownFaultTest, CoordinatorSigtermDoesNotWaitOutTheGraceWithWorkersConnected) {
  CoordinatorProcess coordinator({"--shutdown-grace-ms", "30000"});
  WorkerProcess w0(coordinator.address(), "w0"), w1(coordinator.address(), "w1");
  {
    Client client(coordinator.address());
    ASSERT_TRUE(client.WaitIdle(2, seconds(30)));
  }
  const auto start = Clock::now();
  coordinator.process().Kill(SIGTERM);
  EXPECT_EQ(coordinator.process().Wait(seconds(25)), 0) << coordinator.process().output();
  const double stop_s = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(stop_s, 10.0) << coordinator.process().output();
  std::printf("coordinator SIGTERM with 2 workers connected: exited after %.2f s (grace 30 s)\n",
              stop_s);
  // The workers stay up and keep trying to reconnect.
  EXPECT_TRUE(w0.process().running());
  EXPECT_TRUE(w1.process().running());
}

}  // namespace
}  // namespace geofp8::testing
