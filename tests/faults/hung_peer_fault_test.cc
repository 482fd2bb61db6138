// A rank whose peer hangs (SIGSTOP: its sockets stay open, nothing arrives) is inside a Gloo
// collective. The coordinator's Stop must get it out within a second or two, not after
// exchange.timeout_s, so the job restarts on the spare worker at once and ends with the checksum
// of a fault-free run.
#include <gtest/gtest.h>

#include <string>

#include "tests/faults/reference_run.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

std::string Spec(const std::string& name) {
  return TinyJobSpec(name, 80, 5, 10, 2, "exchange: {timeout_s: 60}\n");
}

// Unix ms of the job's first (last) event whose message contains `text`; 0 if none.
int64_t EventMs(const v1::Job& job, const std::string& text) {
  for (const auto& e : job.events()) {
    if (e.message().find(text) != std::string::npos) return e.unix_ms();
  }
  return 0;
}
int64_t LastEventMs(const v1::Job& job, const std::string& text) {
  int64_t last = 0;
  for (const auto& e : job.events()) {
    if (e.message().find(text) != std::string::npos) last = e.unix_ms();
  }
  return last;
}

TEST(HungPeerFaultTest, StopAbortsTheCollectiveAndTheJobRestartsOnTheSpare) {
  CoordinatorProcess coordinator({"--heartbeat-timeout-ms", "3000"});
  Client client(coordinator.address());
  const std::vector<std::string> slow = {"--debug-step-delay-ms", "20"};
  WorkerProcess w0(coordinator.address(), "w0", slow), w1(coordinator.address(), "w1", slow),
      spare(coordinator.address(), "spare", slow);
  std::vector<WorkerProcess*> all = {&w0, &w1, &spare};
  auto by_name = [&](const std::string& name) {
    return name == "w0" ? &w0 : name == "w1" ? &w1 : &spare;
  };
  ASSERT_TRUE(client.WaitIdle(3, seconds(30)));
  const v1::Job job = client.Submit(Spec("hung"));
  v1::Job j = client.WaitStep(job.id(), 20, seconds(60));
  ASSERT_EQ(j.state(), v1::JOB_RUNNING) << Describe(j, coordinator, all);
  ASSERT_GE(j.progress().checkpoint_step(), 10) << Describe(j, coordinator, all);
  std::string hung_name, rank0_name;
  for (const auto& w : client.Workers()) {
    if (w.job_id() != job.id()) continue;
    (w.rank() == 1 ? hung_name : rank0_name) = w.name();
  }
  ASSERT_FALSE(hung_name.empty() || rank0_name.empty()) << Describe(j, coordinator, all);
  WorkerProcess* hung = by_name(hung_name);
  WorkerProcess* rank0 = by_name(rank0_name);

  const int64_t sigstop_ms =
      std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  hung->process().Kill(SIGSTOP);
  // The coordinator declares the hung worker dead after its heartbeat timeout and stops rank 0,
  // which sits in a collective waiting for it.
  const auto deadline = std::chrono::steady_clock::now() + seconds(30);
  std::map<std::string, std::string> left;
  while (left.empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(50));
    left = rank0->Result(job.id(), 0);
  }
  ASSERT_FALSE(left.empty()) << "rank 0 still in attempt 0\n" << Describe(j, coordinator, all);
  EXPECT_EQ(left["stopped"], "1") << left["reason"];
  j = client.WaitFinal(job.id(), seconds(90));
  hung->process().Kill(SIGCONT);
  ASSERT_EQ(j.state(), v1::JOB_SUCCEEDED) << Describe(j, coordinator, all);
  EXPECT_EQ(j.attempt(), 1);

  // Timed on the coordinator's and the worker's own clocks (one host): the Stop went out with the
  // failure event; rank 0 wrote its result when it left the collective.
  const int64_t declared_ms = EventMs(j, "missed heartbeats");
  const int64_t running_ms = LastEventMs(j, "all 2 ranks reported progress");
  ASSERT_GT(declared_ms, 0) << Describe(j, coordinator, all);
  const double left_s = double(std::stoll(left["finished_unix_ms"]) - declared_ms) / 1000.0;
  const double running_s = double(running_ms - declared_ms) / 1000.0;
  std::printf(
      "hung peer: declared dead %.2f s after SIGSTOP (heartbeat timeout 3 s); rank 0 left its "
      "collective %.2f s after the stop (exchange.timeout_s 60); attempt 1 running %.2f s after "
      "the stop\n",
      double(declared_ms - sigstop_ms) / 1000.0, left_s, running_s);
  // The abort fires 1 s after the stop; the rest is slack for a loaded 2-core machine.
  EXPECT_LT(left_s, 5.0) << left["reason"];
  EXPECT_LT(running_s, 10.0) << Describe(j, coordinator, all);
  // The recovery target (issue #13): running again within 10 s of the worker's death.
  EXPECT_LT(double(running_ms - sigstop_ms) / 1000.0, 10.0) << Describe(j, coordinator, all);

  // Both ranks of attempt 1 end equal, and equal to the same job run without a fault.
  WorkerProcess* other = nullptr;
  for (WorkerProcess* w : all) {
    if (w != hung && w != rank0) other = w;
  }
  const auto a = rank0->Result(job.id(), 1), b = other->Result(job.id(), 1);
  ASSERT_EQ(a.count("checksum"), 1u) << Describe(j, coordinator, all);
  EXPECT_EQ(a.at("checksum"), b.count("checksum") ? b.at("checksum") : "")
      << Describe(j, coordinator, all);
  hung->process().Kill(SIGKILL);
  const v1::Job straight = client.WaitFinal(client.Submit(Spec("straight")).id(), seconds(90));
  ASSERT_EQ(straight.state(), v1::JOB_SUCCEEDED) << Describe(straight, coordinator, all);
  EXPECT_EQ(rank0->Result(straight.id(), 0)["checksum"], a.at("checksum"));
}

}  // namespace
}  // namespace geofp8::testing
