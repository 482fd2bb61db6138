// Fencing at the coordinator, with fakes: a generation that was replaced or declared dead can no
// longer act for its worker. Its Leave, session and every report are refused and change nothing,
// so a stale process's shutdown cannot declare the live generation dead (issue #31 item 9).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/coordinator/coordinator.h"
#include "tests/server/coordinator_harness.h"

namespace geofp8::coordinator {
namespace {

class WorkerFencingTest : public CoordinatorHarness {
 protected:
  absl::Status Progress(const Worker& w, int64_t step) {
    v1::WorkerMessage m;
    m.mutable_progress()->set_step(step);
    m.mutable_progress()->set_policy_version(1);
    return Send(w, m);
  }
  absl::Status Leave(const Worker& w) {
    v1::LeaveRequest req;
    req.set_worker_id(w.id);
    req.set_generation(w.generation);
    req.set_session_secret(w.secret);
    req.set_reason("shutdown");
    return coordinator->Leave(req);
  }
  v1::Worker Info(const std::string& id) {
    const v1::ListWorkersResponse all = coordinator->ListWorkers();
    for (const auto& w : all.workers()) {
      if (w.id() == id) return w;
    }
    ADD_FAILURE() << "no worker " << id;
    return v1::Worker();
  }
  // One message of every kind a worker sends, as `job_id`'s rank 0 in `attempt` would.
  static std::vector<std::pair<std::string, v1::WorkerMessage>> EveryReport(
      const std::string& job_id, int attempt) {
    std::vector<std::pair<std::string, v1::WorkerMessage>> out;
    v1::WorkerMessage m;
    m.mutable_heartbeat()->set_unix_ms(1);
    out.emplace_back("heartbeat", m);
    m.Clear();
    m.mutable_progress()->set_step(50);
    m.mutable_progress()->set_policy_version(1);
    out.emplace_back("progress", m);
    m.Clear();
    m.mutable_catalog()->add_layers()->set_name("layers.0.attn.wq");
    out.emplace_back("catalog", m);
    m.Clear();
    m.mutable_summaries()->add_layers()->set_layer("layers.0.attn.wq");
    out.emplace_back("summaries", m);
    m.Clear();
    m.mutable_probes()->add_probes()->set_layer("layers.0.attn.wq");
    out.emplace_back("probes", m);
    m.Clear();
    m.mutable_checkpoint()->set_job_id(job_id);
    m.mutable_checkpoint()->set_attempt(attempt);
    m.mutable_checkpoint()->set_step(40);
    out.emplace_back("checkpoint", m);
    m.Clear();
    m.mutable_policy_ack()->set_job_id(job_id);
    m.mutable_policy_ack()->set_attempt(attempt);
    m.mutable_policy_ack()->set_version(1);
    m.mutable_policy_ack()->set_step(7);
    out.emplace_back("policy_ack", m);
    m.Clear();
    m.mutable_finished()->set_job_id(job_id);
    m.mutable_finished()->set_attempt(attempt);
    m.mutable_finished()->set_success(false);
    m.mutable_finished()->set_restartable(false);
    m.mutable_finished()->set_reason("forged failure");
    out.emplace_back("finished (failed)", m);
    m.mutable_finished()->set_success(true);
    out.emplace_back("finished (succeeded)", m);
    return out;
  }
};

constexpr const char* kSpec = "name: t\nworld_size: 1\nrestarts: {max_restarts: 3}\n";

// A worker process died and its restart registered generation 2, which now runs the job. The old
// process (generation 1, still shutting down) calls Leave and sends its last reports: each is
// refused and the live generation keeps its rank.
TEST_F(WorkerFencingTest, AReplacedGenerationCanNeitherLeaveNorReport) {
  const std::string id = Submit(kSpec);
  Worker a1 = Join("a");
  ASSERT_EQ(a1.sink->Assignments().size(), 1u);
  ASSERT_TRUE(Progress(a1, 3).ok());
  coordinator->CloseSession(a1.id, a1.generation, a1.sink);  // its stream broke
  Worker a2 = Join("a");
  ASSERT_EQ(a2.generation, a1.generation + 1);
  ASSERT_EQ(a2.sink->Assignments().size(), 1u);
  EXPECT_EQ(a2.sink->Assignments()[0].attempt(), 1);
  ASSERT_TRUE(Progress(a2, 3).ok());
  const v1::Job before = Get(id);
  ASSERT_EQ(before.state(), v1::JOB_RUNNING);
  ASSERT_EQ(before.restarts(), 1);
  const uint64_t fenced_before = coordinator->GetCounts().fenced_messages;

  const absl::Status left = Leave(a1);
  EXPECT_EQ(left.code(), absl::StatusCode::kFailedPrecondition) << left;
  EXPECT_NE(left.message().find("worker a generation 1 is fenced (current generation 2"),
            std::string::npos)
      << left;
  for (const auto& [kind, m] : EveryReport(id, 1)) {
    const absl::Status s = Send(a1, m);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << kind << ": " << s;
  }
  EXPECT_EQ(coordinator->OpenSession(a1.id, a1.generation, a1.secret, a1.sink).code(),
            absl::StatusCode::kFailedPrecondition);
  coordinator->CloseSession(a1.id, a1.generation,
                            a1.sink);  // the stale stream ending changes nothing
  EXPECT_EQ(coordinator->GetCounts().fenced_messages - fenced_before, 11u);

  const v1::Job after = Get(id);
  EXPECT_EQ(after.state(), v1::JOB_RUNNING) << after.reason();
  EXPECT_EQ(after.attempt(), 1);
  EXPECT_EQ(after.restarts(), 1);
  EXPECT_EQ(after.progress().step(), 3);
  EXPECT_EQ(after.progress().checkpoint_step(), 0);
  ASSERT_EQ(after.ranks_size(), 1);
  EXPECT_EQ(after.ranks(0).generation(), a2.generation);
  const v1::Worker info = Info("a");
  EXPECT_EQ(info.generation(), a2.generation);
  EXPECT_EQ(info.state(), v1::WORKER_ASSIGNED);
  EXPECT_EQ(info.job_id(), id);
  v1::WorkerMessage hb;
  hb.mutable_heartbeat()->set_unix_ms(clock.now);
  EXPECT_TRUE(Send(a2, hb).ok());

  // The live generation's own Leave is what fails the attempt over.
  ASSERT_TRUE(Leave(a2).ok());
  EXPECT_EQ(Get(id).state(), v1::JOB_PENDING);
  EXPECT_EQ(Get(id).restarts(), 2);
  EXPECT_EQ(Info("a").state(), v1::WORKER_DEAD);
  EXPECT_EQ(Send(a2, hb).code(), absl::StatusCode::kFailedPrecondition);
}

// A generation declared dead (silent past the timeout) is fenced while still the newest: its
// Leave and reports are refused, and the attempt it held fails over once, not twice.
TEST_F(WorkerFencingTest, AGenerationDeclaredDeadCanNeitherLeaveNorReport) {
  const std::string id = Submit(kSpec);
  Worker a = Join("a");
  ASSERT_TRUE(Progress(a, 3).ok());
  clock.now += 1500;
  coordinator->Tick();
  ASSERT_EQ(Info("a").state(), v1::WORKER_DEAD);
  ASSERT_EQ(Get(id).state(), v1::JOB_PENDING);
  ASSERT_EQ(Get(id).restarts(), 1);

  const absl::Status left = Leave(a);
  EXPECT_EQ(left.code(), absl::StatusCode::kFailedPrecondition) << left;
  EXPECT_NE(left.message().find("declared dead: missed heartbeats"), std::string::npos) << left;
  for (const auto& [kind, m] : EveryReport(id, 0)) {
    const absl::Status s = Send(a, m);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << kind << ": " << s;
  }
  EXPECT_EQ(coordinator->OpenSession(a.id, a.generation, a.secret, a.sink).code(),
            absl::StatusCode::kFailedPrecondition);
  const v1::Job after = Get(id);
  EXPECT_EQ(after.state(), v1::JOB_PENDING) << after.reason();
  EXPECT_EQ(after.restarts(), 1);
  EXPECT_EQ(after.progress().checkpoint_step(), 0);

  v1::LeaveRequest unknown;
  unknown.set_worker_id("nobody");
  unknown.set_generation(1);
  EXPECT_EQ(coordinator->Leave(unknown).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace geofp8::coordinator
