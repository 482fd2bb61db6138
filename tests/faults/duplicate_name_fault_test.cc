// Two worker processes started with the same --name: the second is refused while the first
// holds its session (they used to fence each other for ever), and takes the name over once the
// first dies.
#include <gtest/gtest.h>

#include <string>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;

v1::Worker Find(Client& client, const std::string& name) {
  for (const auto& w : client.Workers()) {
    if (w.name() == name) return w;
  }
  return {};
}

TEST(DuplicateNameFaultTest, SecondProcessIsRefusedUntilTheFirstDies) {
  CoordinatorProcess coordinator;
  Client client(coordinator.address());
  WorkerProcess first(coordinator.address(), "twin");
  ASSERT_TRUE(client.WaitIdle(1, seconds(30))) << first.process().output();
  const uint64_t generation = Find(client, "twin").generation();

  WorkerProcess second(coordinator.address(), "twin");
  // It is told why, and retries (with backoff) rather than fencing the first.
  const std::string refusal =
      "name: twin is held by a live session (generation " + std::to_string(generation) + ", host ";
  ASSERT_TRUE(second.process().WaitFor(refusal, std::chrono::milliseconds(20000)))
      << second.process().output();
  ASSERT_TRUE(second.process().WaitFor("retrying in 200 ms", std::chrono::milliseconds(20000)))
      << second.process().output();
  // The first still holds its generation and runs a job.
  EXPECT_EQ(Find(client, "twin").generation(), generation);
  EXPECT_EQ(first.process().output().find("session rejected"), std::string::npos)
      << first.process().output();
  const v1::Job job = client.Submit(
      "name: twin-job\nmodel: {preset: llama-tiny}\ntraining: {steps: 4, batch_size: 2, "
      "seq_len: 16}\n");
  EXPECT_EQ(client.WaitFinal(job.id(), seconds(60)).state(), v1::JOB_SUCCEEDED)
      << first.process().output();

  // The first dies: the second registers under the next generation.
  first.process().Kill(SIGKILL);
  first.process().Wait();
  const auto deadline = std::chrono::steady_clock::now() + seconds(30);
  v1::Worker w;
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    w = Find(client, "twin");
  } while ((w.generation() == generation || w.state() != v1::WORKER_IDLE) &&
           std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(w.generation(), generation + 1) << second.process().output();
  EXPECT_EQ(w.state(), v1::WORKER_IDLE);
}

}  // namespace
}  // namespace geofp8::testing
