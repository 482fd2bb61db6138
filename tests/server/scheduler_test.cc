// Place() directly, without gRPC, a store or a Coordinator: first come, first served among jobs
// that fit the fleet, unplaceable jobs passed over, device and --allow-commands constraints, and
// the interrupted attempt's workers kept on their old ranks.
#include "server/coordinator/scheduler.h"

#include <gtest/gtest.h>

namespace geofp8::coordinator {
namespace {

WorkerSlot Idle(const std::string& id, const std::string& device = "cpu") {
  return {.id = id, .device = device, .connected = true, .idle = true};
}
WorkerSlot Busy(const std::string& id) {
  return {.id = id, .device = "cpu", .connected = true, .idle = false};
}
PendingJob Job(const std::string& id, int world) { return {.id = id, .world_size = world}; }

TEST(SchedulerTest, PlacesInOrderAndTakenWorkersAreNoLongerIdle) {
  const auto p =
      Place({Job("a", 2), Job("b", 1), Job("c", 1)}, {Idle("w1"), Idle("w2"), Idle("w3")});
  ASSERT_EQ(p.size(), 3u);
  EXPECT_TRUE(p[0].placed);
  EXPECT_EQ(p[0].workers, (std::vector<std::string>{"w1", "w2"}));
  EXPECT_EQ(p[1].workers, (std::vector<std::string>{"w3"}));
  EXPECT_FALSE(p[2].placed);
  EXPECT_EQ(p[2].waiting, "waiting for 1 idle workers (0 idle of 3)");
}

TEST(SchedulerTest, AJobWaitingForBusyWorkersHoldsBackLaterJobs) {
  const auto p = Place({Job("big", 2), Job("small", 1)}, {Idle("w1"), Busy("w2")});
  EXPECT_FALSE(p[0].placed);
  EXPECT_EQ(p[0].waiting, "waiting for 2 idle workers (1 idle of 2)");
  EXPECT_FALSE(p[1].placed);
  EXPECT_EQ(p[1].waiting, "queued behind big (first come, first served)");
}

TEST(SchedulerTest, AJobTheFleetCannotHoldIsPassedOver) {
  const auto p = Place({Job("huge", 3), Job("small", 1)}, {Idle("w1"), Busy("w2")});
  EXPECT_FALSE(p[0].placed);
  EXPECT_EQ(p[0].waiting, "cannot be placed: needs 3 workers, 2 connected; later jobs go first");
  EXPECT_EQ(p[1].workers, (std::vector<std::string>{"w1"}));
}

TEST(SchedulerTest, DisconnectedAndFencedWorkersDoNotCount) {
  WorkerSlot gone = Idle("w1");
  gone.connected = false;
  WorkerSlot fenced = Idle("w2");
  fenced.fenced = true;
  const auto p = Place({Job("a", 1)}, {gone, fenced});
  EXPECT_FALSE(p[0].placed);
  EXPECT_EQ(p[0].waiting, "cannot be placed: needs 1 workers, 0 connected; later jobs go first");
}

TEST(SchedulerTest, NcclNeedsACudaDeviceAndCommandJobsNeedAllowCommands) {
  PendingJob nccl = Job("n", 1);
  nccl.needs_gpu = true;
  PendingJob command = Job("c", 1);
  command.needs_commands = true;
  WorkerSlot runner = Idle("r");
  runner.accepts_commands = true;
  const auto p = Place({nccl, command}, {Idle("a-cpu"), Idle("g", "cuda:0"), runner});
  EXPECT_EQ(p[0].workers, (std::vector<std::string>{"g"}));
  EXPECT_EQ(p[1].workers, (std::vector<std::string>{"r"}));
  const auto none = Place({nccl}, {Idle("a-cpu")});
  EXPECT_EQ(none[0].waiting,
            "cannot be placed: needs 1 workers with a CUDA device, 0 connected (backend nccl); "
            "later jobs go first");
}

TEST(SchedulerTest, TheInterruptedAttemptsWorkersKeepTheirRanks) {
  PendingJob job = Job("a", 3);
  job.interrupted_workers = {"w3", "gone", "w1"};
  const auto p = Place({job}, {Idle("w1"), Idle("w2"), Idle("w3"), Idle("w4")});
  ASSERT_TRUE(p[0].placed);
  EXPECT_EQ(p[0].workers, (std::vector<std::string>{"w3", "w2", "w1"}));
}

TEST(SchedulerTest, AnExternalJobGoesWhereItsRanksAttachedAndNowhereElse) {
  WorkerSlot a0 = Idle("a0"), a1 = Idle("a1"), a2 = Idle("a2");
  a0.attach_only = a1.attach_only = a2.attach_only = true;
  PendingJob ext = Job("ext", 2);
  ext.external = true;
  ext.attached = {"a1", ""};
  // One rank attached: it waits, naming the missing rank, and holds back no later job.
  auto p = Place({ext, Job("plain", 1)}, {a0, a1, a2, Idle("w")});
  EXPECT_FALSE(p[0].placed);
  EXPECT_NE(p[0].waiting.find("waiting for its ranks to attach: 1 of 2 attached (missing rank 1)"),
            std::string::npos)
      << p[0].waiting;
  // A plain job never takes an attach-only worker.
  EXPECT_EQ(p[1].workers, (std::vector<std::string>{"w"}));
  p = Place({Job("plain", 1)}, {a0});
  EXPECT_FALSE(p[0].placed);
  // Both attached: placed by rank on the workers they attached to.
  ext.attached = {"a2", "a0"};
  p = Place({ext}, {a0, a1, a2});
  ASSERT_TRUE(p[0].placed) << p[0].waiting;
  EXPECT_EQ(p[0].workers, (std::vector<std::string>{"a2", "a0"}));
  // A claim on a worker that is busy, gone or not attach-only does not count.
  WorkerSlot busy = a0;
  busy.idle = false;
  p = Place({ext}, {busy, a1, a2});
  EXPECT_FALSE(p[0].placed);
  WorkerSlot plain = Idle("a0");
  p = Place({ext}, {plain, a1, a2});
  EXPECT_FALSE(p[0].placed);
}

}  // namespace
}  // namespace geofp8::coordinator
