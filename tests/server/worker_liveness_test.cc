// Flapping and starved liveness at the coordinator, with a fake clock (#41 items 2 and 3):
// placement prefers workers that have held their session longest and backs off from flapping
// ones; a worker that leaves right after its assignment costs the job no restart (once per
// worker); dead workers are dropped after the retention time; heartbeat deadlines grow by the
// coordinator's own lag; and a mass miss holds fencing off instead of fencing the fleet.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/coordinator/coordinator.h"
#include "tests/server/coordinator_harness.h"

namespace geofp8::coordinator {
namespace {

class WorkerLivenessTest : public CoordinatorHarness {
 protected:
  absl::Status Leave(const Worker& w) {
    v1::LeaveRequest req;
    req.set_worker_id(w.id);
    req.set_generation(w.generation);
    req.set_session_secret(w.secret);
    req.set_reason("flapping");
    return coordinator->Leave(req);
  }
  // A heartbeat the worker sent at `sent_ms` (its own clock), handled now.
  absl::Status BeatSentAt(const Worker& w, int64_t sent_ms) {
    v1::WorkerMessage m;
    m.mutable_heartbeat()->set_unix_ms(sent_ms);
    return Send(w, m);
  }
  v1::Worker Info(const std::string& id) {
    const v1::ListWorkersResponse all = coordinator->ListWorkers();
    for (const auto& w : all.workers()) {
      if (w.id() == id) return w;
    }
    return v1::Worker();
  }
  int DeadCount() {
    int dead = 0;
    const v1::ListWorkersResponse all = coordinator->ListWorkers();
    for (const auto& w : all.workers()) dead += w.state() == v1::WORKER_DEAD;
    return dead;
  }
};

std::string FlapperName(int i) { return "flap-" + std::to_string(100 + i).substr(1); }

// The scenario: 50 workers register and leave in a loop, named before the two healthy
// ones (placement used to take idle workers in name order). A job submitted meanwhile, with no
// restart to spare, runs on a healthy worker and uses none.
TEST_F(WorkerLivenessTest, AJobSubmittedDuringFiftyFlappingWorkersRunsOnAHealthyOne) {
  options.heartbeat_timeout_ms = 1'000'000'000;
  Open("");
  Worker h1 = Join("healthy-1"), h2 = Join("healthy-2");
  clock.now += 120'000;  // they have held their sessions for two minutes
  std::string id;
  for (int round = 0; round < 4; ++round) {
    std::vector<Worker> up;
    for (int i = 0; i < 50; ++i) {
      up.push_back(Join(FlapperName(i)));
      clock.now += 3;
    }
    if (round == 1) id = Submit("name: steady\nworld_size: 1\nrestarts: {max_restarts: 0}\n");
    for (const Worker& w : up) {
      ASSERT_TRUE(Leave(w).ok());
      clock.now += 3;
    }
  }
  const v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_SCHEDULED) << job.reason();
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.attempt(), 0);
  ASSERT_EQ(job.ranks_size(), 1);
  EXPECT_EQ(job.ranks(0).worker_id(), "healthy-1");
}

// Only flapping workers are idle (the healthy one is busy): one that goes right after its
// assignment restarts the job without charging it, once; a flapper with two short sessions in a
// row is not placed on while it backs off.
TEST_F(WorkerLivenessTest, AnEarlyLeaverIsNotChargedOnceAndFlappersBackOff) {
  options.heartbeat_timeout_ms = 1'000'000'000;
  Open("");
  Worker f = Join("f");
  const std::string id = Submit("name: j\nworld_size: 1\nrestarts: {max_restarts: 0}\n");
  ASSERT_EQ(Get(id).ranks(0).worker_id(), "f");
  clock.now += 200;
  ASSERT_TRUE(Leave(f).ok());
  v1::Job job = Get(id);
  ASSERT_EQ(job.state(), v1::JOB_PENDING) << job.reason();
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_NE(job.reason().find("not charged to the job (worker f left within 10 s of its "
                              "assignment; once per worker)"),
            std::string::npos)
      << job.reason();
  EXPECT_EQ(job.consecutive_failures(), 0);

  // f again, second short session in a row when it goes: charged this time, and the job (no
  // restarts) fails.
  f = Join("f");
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  clock.now += 200;
  ASSERT_TRUE(Leave(f).ok());
  job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_FAILED) << job.reason();
  EXPECT_NE(job.reason().find("no restarts left"), std::string::npos) << job.reason();

  // Two short sessions in a row: 1 s of back-off, then 2 s, then 4 s.
  EXPECT_EQ(Info("f").backoff_until_unix_ms(), clock.now + 1000);
  const std::string next = Submit("name: k\nworld_size: 1\n");
  f = Join("f");
  EXPECT_EQ(Get(next).state(), v1::JOB_PENDING);
  EXPECT_EQ(Get(next).scheduling(),
            "waiting for 1 idle workers (0 idle of 1; 1 more backing off after leaving soon after "
            "registering)");
  clock.now += 1000;
  coordinator->Tick();
  EXPECT_EQ(Get(next).state(), v1::JOB_SCHEDULED) << Get(next).scheduling();
  EXPECT_EQ(Get(next).ranks(0).worker_id(), "f");
  clock.now += 100;
  ASSERT_TRUE(Leave(f).ok());
  EXPECT_EQ(Info("f").backoff_until_unix_ms(), clock.now + 2000);
  f = Join("f");
  clock.now += 100;
  ASSERT_TRUE(Leave(f).ok());
  EXPECT_EQ(Info("f").backoff_until_unix_ms(), clock.now + 4000);
  // A generation that held its session for a minute ends the run: no back-off after it.
  f = Join("f");
  clock.now += 60'000;
  ASSERT_TRUE(Heartbeat(f).ok());
  ASSERT_TRUE(Leave(f).ok());
  EXPECT_EQ(Info("f").backoff_until_unix_ms(), 0);
}

TEST_F(WorkerLivenessTest, AWorkerThatRanItsRankIsChargedEvenIfItWentEarly) {
  options.heartbeat_timeout_ms = 1'000'000'000;
  Open("");
  Worker a = Join("a");
  const std::string id = Submit("name: j\nworld_size: 1\nrestarts: {max_restarts: 1}\n");
  v1::WorkerMessage progress;
  progress.mutable_progress()->set_step(0);
  progress.mutable_progress()->set_policy_version(1);
  ASSERT_TRUE(Send(a, progress).ok());
  ASSERT_TRUE(Leave(a).ok());
  EXPECT_EQ(Get(id).restarts(), 1) << Get(id).reason();
}

TEST_F(WorkerLivenessTest, DeadWorkersAreDroppedAfterTheRetentionTime) {
  options.heartbeat_timeout_ms = 1'000'000'000;
  options.dead_worker_retention_ms = 60'000;
  Open("");
  uint64_t last_generation = 0;
  for (int i = 0; i < 200; ++i) {
    Worker w = Join("gone-" + std::to_string(i));
    last_generation = w.generation;
    ASSERT_TRUE(Leave(w).ok());
  }
  Worker stays = Join("stays");
  EXPECT_EQ(coordinator->ListWorkers().workers_size(), 201);
  clock.now += 60'000;
  coordinator->Tick();
  EXPECT_EQ(coordinator->ListWorkers().workers_size(), 201);  // not before the time
  clock.now += 1;
  ASSERT_TRUE(Heartbeat(stays).ok());
  coordinator->Tick();
  const v1::ListWorkersResponse left = coordinator->ListWorkers();
  ASSERT_EQ(left.workers_size(), 1);
  EXPECT_EQ(left.workers(0).id(), "stays");
  EXPECT_EQ(coordinator->GetCounts().workers_dropped, 200u);
  // A dropped name registers again as a fresh worker; its generations never repeat.
  Worker back = Join("gone-199");
  EXPECT_GT(back.generation, last_generation);
  EXPECT_EQ(Info("gone-199").state(), v1::WORKER_IDLE);
}

// Beats that arrive but wait in the coordinator's queues: their lag (arrival less the send time,
// less the least transit seen from that worker, which absorbs clock skew) extends every deadline.
TEST_F(WorkerLivenessTest, BeatsHandledLateExtendTheDeadlineByTheLag) {
  std::vector<Worker> ws;
  for (int i = 0; i < 5; ++i) ws.push_back(Join("w" + std::to_string(i)));
  Worker quiet = Join("quiet");
  // Worker clocks 7 s ahead of ours: only the differences count.
  const int64_t skew = 7000;
  for (const Worker& w : ws) ASSERT_TRUE(BeatSentAt(w, clock.now + skew).ok());
  ASSERT_TRUE(BeatSentAt(quiet, clock.now + skew).ok());
  const int64_t quiet_since = clock.now;
  // Two seconds of beats handled 3 s after they were sent.
  for (int s = 1; s <= 2; ++s) {
    clock.now += 1000;
    for (const Worker& w : ws) ASSERT_TRUE(BeatSentAt(w, clock.now + skew - 3000).ok());
  }
  EXPECT_EQ(coordinator->GetCounts().heartbeat_lag_ms, 3000);
  clock.now = quiet_since + 2500;  // silent 2.5 s: past the 1 s timeout, within it + the lag
  for (const Worker& w : ws) ASSERT_TRUE(BeatSentAt(w, clock.now + skew - 3000).ok());
  coordinator->Tick();
  EXPECT_EQ(Info("quiet").state(), v1::WORKER_IDLE);
  // Once the lag is gone (beats on time again), the silent worker is found.
  for (int s = 0; s < 3; ++s) {
    clock.now += 1000;
    for (const Worker& w : ws) ASSERT_TRUE(BeatSentAt(w, clock.now + skew).ok());
  }
  EXPECT_EQ(coordinator->GetCounts().heartbeat_lag_ms, 0);
  coordinator->Tick();
  EXPECT_EQ(Info("quiet").state(), v1::WORKER_DEAD);
  EXPECT_NE(Info("w0").state(), v1::WORKER_DEAD);
}

// More than half of 20 live workers silent at once: the coordinator, not the fleet, is the likely
// cause; it holds off (counted), and when they are heard again no one was fenced. A few silent
// ones are still fenced, and a hold lasts at most 10 timeouts.
TEST_F(WorkerLivenessTest, AMassMissHoldsFencingOffUntilCaughtUp) {
  std::vector<Worker> ws;
  for (int i = 0; i < 20; ++i) ws.push_back(Join("w" + std::to_string(100 + i)));
  const std::string id = Submit("name: j\nworld_size: 2\n");
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  auto beat = [&](int from, int to) {
    for (int i = from; i < to; ++i) ASSERT_TRUE(Heartbeat(ws[i]).ok());
  };
  clock.now += 1500;
  beat(15, 20);  // 15 of 20 silent past the 1 s timeout
  coordinator->Tick();
  EXPECT_EQ(DeadCount(), 0);
  EXPECT_TRUE(coordinator->GetCounts().fencing_held);
  EXPECT_EQ(coordinator->GetCounts().fencing_holds, 1u);
  clock.now += 2000;
  beat(15, 20);
  coordinator->Tick();
  EXPECT_EQ(DeadCount(), 0);
  // Caught up: all heard again. Fencing resumes, and each gets a fresh timeout.
  clock.now += 100;
  beat(0, 20);
  coordinator->Tick();
  EXPECT_FALSE(coordinator->GetCounts().fencing_held);
  EXPECT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  EXPECT_EQ(Get(id).restarts(), 0);
  // Three really gone (under the share): fenced after the timeout as ever.
  clock.now += 1500;
  beat(3, 20);
  coordinator->Tick();
  EXPECT_EQ(DeadCount(), 3);
  EXPECT_EQ(coordinator->GetCounts().fencing_holds, 1u);
  // Fifteen of the 17 left gone for good: held for 10 timeouts, then fenced.
  clock.now += 1500;
  beat(18, 20);
  coordinator->Tick();
  EXPECT_TRUE(coordinator->GetCounts().fencing_held);
  EXPECT_EQ(coordinator->GetCounts().fencing_holds, 2u);
  const int64_t held_at = clock.now;
  for (int t = 1; t < 10; ++t) {
    clock.now = held_at + t * 1000;
    beat(18, 20);
    coordinator->Tick();
  }
  EXPECT_EQ(DeadCount(), 3);
  EXPECT_TRUE(coordinator->GetCounts().fencing_held);
  clock.now = held_at + 10 * 1000;
  beat(18, 20);
  coordinator->Tick();
  EXPECT_EQ(DeadCount(), 18);
  EXPECT_FALSE(coordinator->GetCounts().fencing_held);
}

// A hold while the beats that do arrive are handled late (the coordinator behind): it lasts as long
// as that lag does, past 10 timeouts, and resumes without a death once all are heard again.
TEST_F(WorkerLivenessTest, AHoldLastsWhileTheCoordinatorIsBehind) {
  std::vector<Worker> ws;
  for (int i = 0; i < 20; ++i) ws.push_back(Join("w" + std::to_string(100 + i)));
  auto beat = [&](int from, int to, int64_t late_ms) {
    for (int i = from; i < to; ++i) {
      v1::WorkerMessage m;
      m.mutable_heartbeat()->set_unix_ms(clock.now - late_ms);
      ASSERT_TRUE(Send(ws[i], m).ok());
    }
  };
  beat(0, 20, 0);                  // the least transit of each
  for (int t = 1; t <= 30; ++t) {  // 30 timeouts: 15 unheard, the others' beats 5 s late
    clock.now += 1000;
    beat(15, 20, 5000);
    coordinator->Tick();
    ASSERT_EQ(DeadCount(), 0) << "after " << t << " s";
  }
  EXPECT_TRUE(coordinator->GetCounts().fencing_held);
  clock.now += 100;
  beat(0, 20, 0);
  coordinator->Tick();
  EXPECT_FALSE(coordinator->GetCounts().fencing_held);
  EXPECT_EQ(DeadCount(), 0);
}

TEST_F(WorkerLivenessTest, ASmallFleetIsFencedAsBefore) {
  // Under kHoldOffMinWorkers live workers, even all of them missing is fenced (a partition of a
  // small cluster restarts its jobs as it always did).
  Worker a = Join("a"), b = Join("b");
  clock.now += 1500;
  coordinator->Tick();
  EXPECT_EQ(DeadCount(), 2);
  EXPECT_EQ(coordinator->GetCounts().fencing_holds, 0u);
}

}  // namespace
}  // namespace geofp8::coordinator
