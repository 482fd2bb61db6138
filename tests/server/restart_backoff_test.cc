// Crash loops (#40 item 3), at the coordinator with a fake clock: restartable failures in a row
// back off exponentially up to the cap (the first restart is at once), a job backing off says
// until when and holds back no other job, and an attempt that ran for the reset window starts
// the count over.
#include <gtest/gtest.h>

#include <string>

#include "server/coordinator/coordinator.h"
#include "tests/server/coordinator_harness.h"

namespace geofp8::coordinator {
namespace {

class RestartBackoffTest : public CoordinatorHarness {
 protected:
  void SetUp() override {
    options.heartbeat_timeout_ms = 1'000'000'000;  // liveness is not under test here
    options.restart_backoff_ms = 1000;
    options.restart_backoff_max_ms = 4000;
    Open("");
  }
  // w's rank of `attempt` failed as a crashed program does (restartable).
  void Crash(const Worker& w, const std::string& job_id, int attempt) {
    v1::WorkerMessage m;
    m.mutable_finished()->set_job_id(job_id);
    m.mutable_finished()->set_attempt(attempt);
    m.mutable_finished()->set_success(false);
    m.mutable_finished()->set_restartable(true);
    m.mutable_finished()->set_reason("command 'train.py' exited with code 1");
    ASSERT_TRUE(Send(w, m).ok());
  }
};

constexpr const char* kSpec = "name: crashy\nworld_size: 1\nrestarts: {max_restarts: 10}\n";

TEST_F(RestartBackoffTest, FailuresInARowWaitTwiceAsLongEachUpToTheCap) {
  const std::string id = Submit(kSpec);
  Worker a = Join("a");
  ASSERT_EQ(a.sink->Assignments().size(), 1u);
  // The wait before attempt k+1, after the k-th failure in a row: at once, then 1, 2, 4 s, and
  // the 4 s cap from then on.
  const int64_t waits[] = {0, 1000, 2000, 4000, 4000};
  for (int k = 0; k < 5; ++k) {
    Crash(a, id, k);
    v1::Job job = Get(id);
    EXPECT_EQ(job.consecutive_failures(), k + 1);
    EXPECT_EQ(job.restarts(), k + 1);
    if (waits[k] == 0) {
      EXPECT_EQ(job.state(), v1::JOB_SCHEDULED) << job.reason();
      EXPECT_EQ(job.next_attempt_unix_ms(), 0);
    } else {
      ASSERT_EQ(job.state(), v1::JOB_PENDING) << job.reason();
      EXPECT_EQ(job.next_attempt_unix_ms(), clock.now + waits[k]);
      EXPECT_NE(job.reason().find("backing off"), std::string::npos) << job.reason();
      EXPECT_NE(job.events(job.events_size() - 1).message().find("failed attempts in a row"),
                std::string::npos);
      // Not a moment early: one tick before it is due, still waiting, and saying until when.
      clock.now += waits[k] - 1;
      coordinator->Tick();
      job = Get(id);
      EXPECT_EQ(job.state(), v1::JOB_PENDING);
      EXPECT_EQ(job.scheduling().rfind("backing off after " + std::to_string(k + 1) +
                                           " failed attempts in a row (CrashLoopBackOff): next "
                                           "try at ",
                                       0),
                0u)
          << job.scheduling();
      EXPECT_EQ(a.sink->Assignments().size(), size_t(k + 1));
      clock.now += 1;
      coordinator->Tick();
      job = Get(id);
      EXPECT_EQ(job.state(), v1::JOB_SCHEDULED) << job.reason();
      EXPECT_EQ(job.next_attempt_unix_ms(), 0);
    }
    ASSERT_EQ(a.sink->Assignments().size(), size_t(k + 2));
    EXPECT_EQ(a.sink->Assignments().back().attempt(), k + 1);
  }
}

TEST_F(RestartBackoffTest, AJobBackingOffHoldsBackNoOtherJob) {
  const std::string crashy = Submit(kSpec);
  Worker a = Join("a");
  Crash(a, crashy, 0);
  Crash(a, crashy, 1);
  ASSERT_EQ(Get(crashy).state(), v1::JOB_PENDING);
  ASSERT_GT(Get(crashy).next_attempt_unix_ms(), clock.now);
  // Submitted later, placed at once on the worker the backing-off job leaves idle.
  const std::string other = Submit("name: other\nworld_size: 1\n");
  EXPECT_EQ(Get(other).state(), v1::JOB_SCHEDULED);
  EXPECT_EQ(Get(other).ranks(0).worker_id(), "a");
}

TEST_F(RestartBackoffTest, AnAttemptThatRanForTheResetWindowStartsTheCountOver) {
  const std::string id = Submit(kSpec);
  Worker a = Join("a");
  Crash(a, id, 0);
  Crash(a, id, 1);
  clock.now += 1000;
  coordinator->Tick();
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  // Attempt 2 runs for twice the cap, then fails: a failure on its own, restarted at once.
  clock.now += 2 * 4000;
  Crash(a, id, 2);
  const v1::Job job = Get(id);
  EXPECT_EQ(job.consecutive_failures(), 1);
  EXPECT_EQ(job.state(), v1::JOB_SCHEDULED) << job.reason();
  EXPECT_EQ(job.restarts(), 3);
}

TEST_F(RestartBackoffTest, ZeroTurnsTheBackOffOff) {
  options.restart_backoff_ms = 0;
  Open("");
  const std::string id = Submit(kSpec);
  Worker a = Join("a");
  for (int k = 0; k < 4; ++k) {
    Crash(a, id, k);
    EXPECT_EQ(Get(id).state(), v1::JOB_SCHEDULED) << Get(id).reason();
  }
}

TEST(RestartBackoffDelay, DoublesFromTheSecondFailureAndStopsAtTheCap) {
  const RestartBackoff b{.base_ms = 10000, .max_ms = 300000};
  EXPECT_EQ(b.Delay(0), 0);
  EXPECT_EQ(b.Delay(1), 0);
  EXPECT_EQ(b.Delay(2), 10000);
  EXPECT_EQ(b.Delay(3), 20000);
  EXPECT_EQ(b.Delay(6), 160000);
  EXPECT_EQ(b.Delay(7), 300000);
  EXPECT_EQ(b.Delay(1000), 300000);  // no overflow far past the cap
}

}  // namespace
}  // namespace geofp8::coordinator
