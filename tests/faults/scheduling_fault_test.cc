// Head-of-line blocking: jobs that no connected worker set can run (backend nccl on CPU workers,
// more ranks than workers) are passed over, say why, and later jobs run.
#include <gtest/gtest.h>

#include <string>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;

std::string Spec(const std::string& name, int world, const std::string& backend) {
  return "name: " + name + "\nworld_size: " + std::to_string(world) + "\nbackend: " + backend +
         "\nmodel: {preset: llama-tiny}\ntraining: {steps: 4, batch_size: 2, seq_len: 16}\n";
}

TEST(SchedulingFaultTest, UnplaceableJobsDoNotBlockLaterOnes) {
  CoordinatorProcess coordinator;
  Client client(coordinator.address());
  WorkerProcess worker(coordinator.address(), "cpu0");
  ASSERT_TRUE(client.WaitIdle(1, seconds(30))) << worker.process().output();

  const v1::Job gpu = client.Submit(Spec("needs-gpu", 1, "nccl"));
  const v1::Job wide = client.Submit(Spec("too-wide", 3, "gloo"));
  const v1::Job small = client.Submit(Spec("small", 1, "gloo"));
  const v1::Job done = client.WaitFinal(small.id(), seconds(60));
  ASSERT_EQ(done.state(), v1::JOB_SUCCEEDED) << Describe(done, coordinator, {&worker});

  v1::Job j = client.Get(gpu.id());
  EXPECT_EQ(j.state(), v1::JOB_PENDING);
  EXPECT_EQ(j.scheduling(),
            "cannot be placed: needs 1 workers with a CUDA device, 0 connected (backend nccl); "
            "later jobs go first");
  EXPECT_EQ(j.reason().rfind("submitted; waiting for 1 idle workers with a CUDA device", 0), 0u)
      << j.reason();
  j = client.Get(wide.id());
  EXPECT_EQ(j.state(), v1::JOB_PENDING);
  EXPECT_EQ(j.scheduling(), "cannot be placed: needs 3 workers, 1 connected; later jobs go first");
  EXPECT_TRUE(client.Get(small.id()).scheduling().empty());
}

TEST(SchedulingFaultTest, AJobWaitingForBusyWorkersStillGoesFirst) {
  // First come, first served still holds for jobs the fleet can run: a 2-rank job that waits
  // for a busy worker is not overtaken by a 1-rank job submitted after it.
  CoordinatorProcess coordinator;
  Client client(coordinator.address());
  // Slow steps (30 x 100 ms) keep the first job busy while the next two are submitted.
  const std::vector<std::string> slow = {"--debug-step-delay-ms", "100"};
  WorkerProcess w0(coordinator.address(), "a", slow), w1(coordinator.address(), "b", slow);
  ASSERT_TRUE(client.WaitIdle(2, seconds(30)));
  const v1::Job first = client.Submit(
      "name: busy\nmodel: {preset: llama-tiny}\ntraining: {steps: 30, batch_size: 2, seq_len: "
      "16}\n");
  ASSERT_GE(client.WaitStep(first.id(), 0, seconds(30)).progress().step(), 0);
  const v1::Job wide = client.Submit(Spec("wide", 2, "gloo"));
  const v1::Job late = client.Submit(Spec("late", 1, "gloo"));
  v1::Job j = client.Get(late.id());
  EXPECT_EQ(j.state(), v1::JOB_PENDING);
  EXPECT_EQ(j.scheduling(), "queued behind " + wide.id() + " (first come, first served)");
  EXPECT_EQ(client.WaitFinal(wide.id(), seconds(90)).state(), v1::JOB_SUCCEEDED);
  EXPECT_EQ(client.WaitFinal(late.id(), seconds(60)).state(), v1::JOB_SUCCEEDED);
}

}  // namespace
}  // namespace geofp8::testing
