// Reports written into a session stream that then breaks: the worker keeps each reliable message
// until the coordinator acknowledges it and writes it again on the next stream, so a lost
// Finished or Checkpoint neither leaves the job RUNNING for ever nor loses its recovery point.
// The loss is injected in the worker (--debug-break-stream-on): the message is not written and
// the stream is cancelled, as when a connection breaks right after a write.
#include <gtest/gtest.h>

#include <string>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;

std::string Spec(const std::string& name, int steps) {
  return "name: " + name +
         "\nworld_size: 2\nmodel: {preset: llama-tiny}\n"
         "training: {steps: " +
         std::to_string(steps) +
         ", batch_size: 2, seq_len: 16}\n"
         "checkpoint: {dir: ckpt, every: 10}\nrestarts: {max_restarts: 0}\n";
}

int64_t LastEventMs(const v1::Job& job, const std::string& text) {
  int64_t last = 0;
  for (const auto& e : job.events()) {
    if (e.message().find(text) != std::string::npos) last = e.unix_ms();
  }
  return last;
}

TEST(LostReportFaultTest, FinishedLostOnABrokenStreamIsResentAndTheJobSucceeds) {
  CoordinatorProcess coordinator;
  Client client(coordinator.address());
  const std::vector<std::string> lose = {"--debug-break-stream-on", "finished"};
  WorkerProcess w0(coordinator.address(), "w0", lose), w1(coordinator.address(), "w1", lose);
  ASSERT_TRUE(client.WaitIdle(2, seconds(30)));
  const v1::Job job = client.Submit(Spec("finished", 30));
  const v1::Job done = client.WaitFinal(job.id(), seconds(60));
  // Before: both ranks finished 30/30 and the job stayed RUNNING at step 29 for ever.
  ASSERT_EQ(done.state(), v1::JOB_SUCCEEDED) << Describe(done, coordinator, {&w0, &w1});
  EXPECT_EQ(done.restarts(), 0);
  int64_t finished_ms = 0;
  for (WorkerProcess* w : {&w0, &w1}) {
    EXPECT_NE(w->process().output().find("losing this finished message"), std::string::npos)
        << w->process().output();
    EXPECT_NE(w->process().output().find("reliable message(s) not acknowledged"), std::string::npos)
        << w->process().output();
    finished_ms =
        std::max<int64_t>(finished_ms, std::stoll(w->Result(job.id())["finished_unix_ms"]));
  }
  std::printf("lost Finished: job SUCCEEDED %.2f s after the last rank finished\n",
              double(LastEventMs(done, "all ranks finished") - finished_ms) / 1000.0);
}

TEST(LostReportFaultTest, CheckpointLostOnABrokenStreamIsResent) {
  CoordinatorProcess coordinator;
  Client client(coordinator.address());
  const std::vector<std::string> lose = {"--debug-break-stream-on", "checkpoint"};
  WorkerProcess w0(coordinator.address(), "w0", lose), w1(coordinator.address(), "w1", lose);
  ASSERT_TRUE(client.WaitIdle(2, seconds(30)));
  // One checkpoint, at the last step: no later report can stand in for the lost one.
  const v1::Job job = client.Submit(Spec("checkpoint", 10));
  const v1::Job done = client.WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(done.state(), v1::JOB_SUCCEEDED) << Describe(done, coordinator, {&w0, &w1});
  // Rank 0's report is the one the coordinator keeps; resent ahead of Finished, it was taken
  // before the job succeeded. Before: 0, so a restart would have redone every step.
  EXPECT_EQ(done.progress().checkpoint_step(), 10) << Describe(done, coordinator, {&w0, &w1});
  bool lost = false;
  for (WorkerProcess* w : {&w0, &w1}) {
    lost |= w->process().output().find("losing this checkpoint message") != std::string::npos;
  }
  EXPECT_TRUE(lost) << Describe(done, coordinator, {&w0, &w1});
}

}  // namespace
}  // namespace geofp8::testing
