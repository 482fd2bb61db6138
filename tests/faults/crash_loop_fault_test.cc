// A command job whose program always crashes (#40 item 3). Before: restarted 3 times in 16 s,
// each at once. Now the restarts back off like Kubernetes' CrashLoopBackOff: the first at once,
// then --restart-backoff-ms (400 ms here), doubling. The gaps are measured from the job's own
// events (failure -> next SCHEDULED), so they hold at any load: a restart is never placed
// early, and load only lengthens a gap. While it backs off, `geofp8ctl describe` says when the
// next try is due.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr int64_t kBaseMs = 400;

TEST(CrashLoopFaultTest, AlwaysCrashingProgramIsRestartedWithGrowingDelays) {
  CoordinatorProcess coordinator({"--restart-backoff-ms", std::to_string(kBaseMs)});
  Client client(coordinator.address());
  WorkerProcess worker(coordinator.address(), "w0", {"--allow-commands"});
  ASSERT_TRUE(client.WaitIdle(1, seconds(30))) << worker.process().output();
  // 5 restarts: waits of 0, 400, 800, 1600 and 3200 ms, then the 6th failure fails the job.
  const v1::Job submitted = client.Submit(
      "name: crasher\nworld_size: 1\ncommand: [/bin/sh, -c, 'echo boom >&2; exit 3']\n"
      "training: {steps: 10}\nrestarts: {max_restarts: 5}\n");

  // Catch the longest wait (3.2 s) and ask describe about it.
  std::string described;
  for (const auto deadline = std::chrono::steady_clock::now() + seconds(120);
       std::chrono::steady_clock::now() < deadline;) {
    const v1::Job j = client.Get(submitted.id());
    if (j.state() == v1::JOB_FAILED) break;
    const int64_t now_ms = std::chrono::duration_cast<milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
    if (j.state() == v1::JOB_PENDING && j.consecutive_failures() == 5 &&
        j.next_attempt_unix_ms() - now_ms > 1500) {
      EXPECT_NE(j.scheduling().find("backing off after 5 failed attempts in a row "
                                    "(CrashLoopBackOff): next try at "),
                std::string::npos)
          << j.scheduling();
#ifdef GEOFP8CTL_BIN
      ChildProcess ctl({GEOFP8CTL_BIN, "-s", coordinator.address(), "describe", "job", j.id()});
      ASSERT_EQ(ctl.Wait(milliseconds(30000)), 0) << ctl.output();
      described = ctl.output();
#endif
      break;
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
#ifdef GEOFP8CTL_BIN
  EXPECT_NE(described.find("Next try:     in "), std::string::npos) << described;
  EXPECT_NE(described.find("backing off after 5 failed attempts in a row"), std::string::npos)
      << described;
#endif

  const v1::Job job = client.WaitFinal(submitted.id(), seconds(120));
  ASSERT_EQ(job.state(), v1::JOB_FAILED) << Describe(job, coordinator, {&worker});
  EXPECT_EQ(job.restarts(), 5);
  EXPECT_NE(job.reason().find("no restarts left"), std::string::npos) << job.reason();

  // Each failure (PENDING) to the next placement (SCHEDULED), from the events' timestamps.
  std::vector<int64_t> gaps;
  int64_t failed_at = -1;
  for (const auto& e : job.events()) {
    if (e.state() == v1::JOB_PENDING && e.message().find("restart ") != std::string::npos) {
      failed_at = e.unix_ms();
    } else if (e.state() == v1::JOB_SCHEDULED && failed_at >= 0) {
      gaps.push_back(e.unix_ms() - failed_at);
      failed_at = -1;
    }
  }
  ASSERT_EQ(gaps.size(), 5u) << Describe(job, coordinator, {&worker});
  std::string text;
  for (int64_t g : gaps) text += std::to_string(g) + " ms ";
  std::printf("gaps from each failure to the next placement: %s\n", text.c_str());
  // Never early: each wait at least base * 2^(k-1) after the second failure in a row.
  for (size_t k = 1; k < gaps.size(); ++k) {
    EXPECT_GE(gaps[k], kBaseMs << (k - 1)) << "gap " << k << ": " << text;
  }
  // And growing: the last wait (3.2 s) longer than the first (0.4 s) whatever the load added.
  EXPECT_GT(gaps[4], gaps[1]) << text;
  EXPECT_GT(gaps[4], gaps[0]) << text;
}

}  // namespace
}  // namespace geofp8::testing
