// Coordinator handlers with fakes (clock, session sinks) and an in-memory or temp-dir SQLite
// store: lifecycle, idempotency, rank assignment, fencing, restarts, policy versions, recovery.
#include "server/coordinator/coordinator.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <thread>

#include "server/coordinator/policy_engine.h"
#include "tests/server/coordinator_harness.h"

namespace geofp8::coordinator {
namespace {

constexpr const char* kSpec2 =
    "name: t\nworld_size: 2\nrestarts: {max_restarts: 1}\npolicy: {margin: 5}\n";

// Adds a probe of `layer` to m: the transform costs 1% of a 0.1 s step.
v1::ProbeResult* AddProbe(v1::WorkerMessage& m, const std::string& layer, double without,
                          double with, v1::ProbeBasis basis) {
  v1::ProbeResult* p = m.mutable_probes()->add_probes();
  p->set_layer(layer);
  p->set_error_without(without);
  p->set_error_with(with);
  p->set_transform_seconds(0.001);
  p->set_step_seconds(0.1);
  p->set_basis(basis);
  return p;
}

// Rank reports a worker resends until acknowledged: a checkpoint at `step`, a successful finish.
v1::WorkerMessage CheckpointReport(const std::string& job, uint64_t seq, int64_t step,
                                   int attempt) {
  v1::WorkerMessage m;
  m.set_seq(seq);
  m.set_want_ack(true);
  m.mutable_checkpoint()->set_step(step);
  m.mutable_checkpoint()->set_job_id(job);
  m.mutable_checkpoint()->set_attempt(attempt);
  return m;
}
v1::WorkerMessage FinishedReport(const std::string& job, uint64_t seq, int attempt, int64_t steps) {
  v1::WorkerMessage m;
  m.set_seq(seq);
  m.set_want_ack(true);
  m.mutable_finished()->set_success(true);
  m.mutable_finished()->set_job_id(job);
  m.mutable_finished()->set_attempt(attempt);
  m.mutable_finished()->set_steps(steps);
  return m;
}

// A command rank's report of its program (CommandStatus) for attempt 0 of `job`.
v1::WorkerMessage CommandReport(const std::string& job, v1::CommandPhase phase, double seconds) {
  v1::WorkerMessage m;
  m.set_want_ack(true);
  m.mutable_command_status()->set_job_id(job);
  m.mutable_command_status()->set_attempt(0);
  m.mutable_command_status()->set_phase(phase);
  m.mutable_command_status()->set_seconds(seconds);
  return m;
}

// A catalog report of 8x8 matrices with these names, of `model_name` (empty: an older hook).
v1::WorkerMessage Catalog(std::initializer_list<const char*> names,
                          const std::string& model_name = "") {
  v1::WorkerMessage m;
  m.mutable_catalog()->set_model_name(model_name);
  for (const char* name : names) {
    auto* l = m.mutable_catalog()->add_layers();
    l->set_name(name);
    l->set_rows(8);
    l->set_cols(8);
  }
  return m;
}

class CoordinatorTest : public CoordinatorHarness {
 protected:
  // A connected worker started with --allow-commands.
  Worker AttachCommandWorker(const std::string& name = "runner") {
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_device("cpu");
    req.set_accepts_commands(true);
    return Attach(req);
  }
  absl::Status Progress(const Worker& w, int64_t step, uint64_t policy_version = 0) {
    v1::WorkerMessage m;
    m.mutable_progress()->set_step(step);
    m.mutable_progress()->set_loss(2.5);
    m.mutable_progress()->set_bytes_sent(100);
    m.mutable_progress()->set_bytes_baseline(400);
    m.mutable_progress()->set_policy_version(policy_version);
    return Send(w, m);
  }
  absl::StatusOr<v1::Policy> Update(const std::string& id, const std::string& layer,
                                    const std::string& format) {
    v1::UpdatePolicyRequest req;
    req.set_job_id(id);
    auto* p = req.add_patches();
    p->set_layer(layer);
    const auto known = ParseFormatName(format);
    p->set_format(known ? ToProto(*known) : v1::Format(99));  // 99: a value no build knows
    auto r = coordinator->UpdatePolicy(req);
    if (!r.ok()) return r.status();
    return r->policy();
  }

  static v1::WorkerMessage PolicyAck(const std::string& id, uint64_t version, int64_t step,
                                     int attempt = 0) {
    v1::WorkerMessage m;
    m.mutable_policy_ack()->set_version(version);
    m.mutable_policy_ack()->set_step(step);
    m.mutable_policy_ack()->set_job_id(id);
    m.mutable_policy_ack()->set_attempt(attempt);
    return m;
  }
  Worker JoinHolding(const std::string& name, const std::string& job_id, int attempt, int rank,
                     std::vector<int64_t> steps,
                     std::vector<std::pair<uint64_t, int64_t>> taken = {}) {
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_device("cpu");
    v1::HeldCheckpoints* h = req.add_checkpoints();
    h->set_job_id(job_id);
    h->set_attempt(attempt);
    h->set_rank(rank);
    for (int64_t s : steps) h->add_steps(s);
    for (const auto& [version, step] : taken) {
      v1::PolicyAck* t = h->add_taken();
      t->set_version(version);
      t->set_step(step);
    }
    return Attach(req);
  }
};

TEST_F(CoordinatorTest, SubmitValidatesAndStartsPending) {
  v1::SubmitJobRequest bad;
  bad.set_spec_yaml("name: x\nworld_size: -1\n");
  auto r = coordinator->SubmitJob(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("line 2: spec.world_size"), std::string::npos);

  std::string id = Submit(kSpec2);
  v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_PENDING);
  EXPECT_EQ(job.world_size(), 2);
  EXPECT_EQ(job.policy_version(), 1u);
  ASSERT_EQ(job.events_size(), 1);
  EXPECT_NE(job.events(0).message().find("waiting for 2 idle workers"), std::string::npos);
}

TEST_F(CoordinatorTest, IdempotencyKeyNeverMakesTwoJobs) {
  std::string a = Submit(kSpec2, "key-1");
  v1::SubmitJobRequest again;
  again.set_spec_yaml(kSpec2);
  again.set_idempotency_key("key-1");
  auto r = coordinator->SubmitJob(again);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->created());
  EXPECT_EQ(r->job().id(), a);
  again.set_spec_yaml("name: other\n");
  r = coordinator->SubmitJob(again);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAlreadyExists);
  auto list = coordinator->ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->jobs_size(), 1);
}

TEST_F(CoordinatorTest, AssignsRanksWhenEnoughIdleWorkersThenRunsAndSucceeds) {
  std::string id = Submit(kSpec2);
  Worker a = Join("a");
  EXPECT_EQ(Get(id).state(), v1::JOB_PENDING);
  Worker b = Join("b");
  v1::Job job = Get(id);
  ASSERT_EQ(job.state(), v1::JOB_SCHEDULED);
  ASSERT_EQ(job.ranks_size(), 2);
  auto as = a.sink->Take(v1::CoordinatorMessage::kAssignment);
  auto bs = b.sink->Take(v1::CoordinatorMessage::kAssignment);
  ASSERT_EQ(as.size(), 1u);
  ASSERT_EQ(bs.size(), 1u);
  EXPECT_EQ(as[0].assignment().rank(), 0);
  EXPECT_EQ(bs[0].assignment().rank(), 1);
  EXPECT_EQ(as[0].assignment().world_size(), 2);
  EXPECT_EQ(as[0].assignment().rendezvous_prefix(), id + "/0/");
  EXPECT_EQ(as[0].assignment().policy().version(), 1u);
  EXPECT_EQ(as[0].assignment().policy_history_size(), 1);

  ASSERT_TRUE(Progress(a, 1).ok());
  EXPECT_EQ(Get(id).state(), v1::JOB_SCHEDULED);  // not every rank has reported yet
  ASSERT_TRUE(Progress(b, 1).ok());
  job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_RUNNING);
  EXPECT_EQ(job.progress().bytes_sent(), 200u);
  EXPECT_EQ(job.progress().bytes_baseline(), 800u);
  EXPECT_FALSE(job.progress().has_val_loss());  // no validation reported yet

  // Rank 0's validation loss is the job's, with the step it was measured after; a later
  // progress report without one keeps it.
  v1::WorkerMessage val;
  val.mutable_progress()->set_step(4);
  val.mutable_progress()->set_loss(2.25);
  val.mutable_progress()->set_val_loss(2.375);
  ASSERT_TRUE(Send(a, val).ok());
  ASSERT_TRUE(Progress(a, 5).ok());
  job = Get(id);
  ASSERT_TRUE(job.progress().has_val_loss());
  EXPECT_EQ(job.progress().val_loss(), 2.375);
  EXPECT_EQ(job.progress().val_step(), 4);
  val.mutable_progress()->set_val_loss(9.0);  // rank 1's is not the job's figure
  ASSERT_TRUE(Send(b, val).ok());
  EXPECT_EQ(Get(id).progress().val_loss(), 2.375);

  // So is its gradient noise scale: rank 0's, kept until it reports another.
  EXPECT_FALSE(Get(id).progress().has_gradient_noise_scale());
  v1::WorkerMessage noise;
  noise.mutable_progress()->set_step(6);
  noise.mutable_progress()->set_gradient_noise_scale(2900.0);
  ASSERT_TRUE(Send(a, noise).ok());
  ASSERT_TRUE(Progress(a, 7).ok());
  noise.mutable_progress()->set_gradient_noise_scale(1.0);
  ASSERT_TRUE(Send(b, noise).ok());
  EXPECT_EQ(Get(id).progress().gradient_noise_scale(), 2900.0);

  v1::WorkerMessage summaries;
  for (int step : {5, 9, 7}) {  // a late, older summary never replaces a newer one
    auto* l = summaries.mutable_summaries()->add_layers();
    l->set_layer("blocks.0.attn.wq");
    l->set_step(step);
    l->set_rel_fro_error(step / 100.0);
  }
  ASSERT_TRUE(Send(a, summaries).ok());
  job = Get(id);
  ASSERT_EQ(job.layers_size(), 1);
  EXPECT_EQ(job.layers(0).step(), 9);

  v1::WorkerMessage done;
  done.mutable_finished()->set_success(true);
  ASSERT_TRUE(Send(a, done).ok());
  EXPECT_EQ(Get(id).state(), v1::JOB_RUNNING);
  ASSERT_TRUE(Send(b, done).ok());
  EXPECT_EQ(Get(id).state(), v1::JOB_SUCCEEDED);
  auto workers = coordinator->ListWorkers();
  for (const auto& w : workers.workers()) EXPECT_EQ(w.state(), v1::WORKER_IDLE) << w.id();
}

TEST_F(CoordinatorTest, NcclJobsOnlyGoToCudaWorkers) {
  std::string id = Submit("name: g\nworld_size: 1\nbackend: nccl\n");
  EXPECT_NE(Get(id).reason().find("with a CUDA device"), std::string::npos);
  Worker cpu = Join("cpu-worker");  // Join registers device "cpu"
  EXPECT_EQ(Get(id).state(), v1::JOB_PENDING);
  v1::RegisterRequest req;
  req.set_name("gpu-worker");
  req.set_device("cuda:0");
  auto r = coordinator->Register(req);
  ASSERT_TRUE(r.ok());
  auto sink = std::make_shared<FakeSink>();
  ASSERT_TRUE(
      coordinator->OpenSession(r->worker_id(), r->generation(), r->session_secret(), sink).ok());
  v1::Job job = Get(id);
  ASSERT_EQ(job.state(), v1::JOB_SCHEDULED);
  EXPECT_EQ(job.ranks(0).worker_id(), "gpu-worker");
}

TEST_F(CoordinatorTest, HeartbeatsAreAcked) {
  Worker a = Join("a");
  ASSERT_TRUE(Heartbeat(a, 42).ok());
  auto acks = a.sink->Take(v1::CoordinatorMessage::kAck);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].ack().seq(), 42u);
}

TEST_F(CoordinatorTest, DeadWorkerIsFencedAndJobRestartsThenFails) {
  std::string id = Submit(kSpec2);  // max_restarts 1
  Worker a = Join("a");
  Worker b = Join("b");
  ASSERT_TRUE(Progress(a, 10).ok());
  ASSERT_TRUE(Progress(b, 10).ok());
  v1::WorkerMessage ckpt;
  ckpt.mutable_checkpoint()->set_step(8);
  ASSERT_TRUE(Send(a, ckpt).ok());

  clock.now += 600;
  ASSERT_TRUE(Heartbeat(a).ok());  // a stays alive, b goes silent
  clock.now += 600;
  coordinator->Tick();
  v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_PENDING);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_NE(job.reason().find("worker b (rank 1, generation 1) missed heartbeats"),
            std::string::npos)
      << job.reason();
  EXPECT_NE(job.reason().find("restart 1/1 from checkpoint step 8"), std::string::npos);
  EXPECT_EQ(a.sink->Take(v1::CoordinatorMessage::kStop).size(), 1u);

  // The fenced generation's late messages are rejected.
  absl::Status late = Heartbeat(b);
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(late.message().find("generation 1 is fenced"), std::string::npos) << late;

  // b comes back as generation 2: the job is reassigned, resuming from the checkpoint.
  Worker b2 = Join("b");
  EXPECT_EQ(b2.generation, 2u);
  job = Get(id);
  ASSERT_EQ(job.state(), v1::JOB_SCHEDULED);
  auto assignments = b2.sink->Take(v1::CoordinatorMessage::kAssignment);
  ASSERT_EQ(assignments.size(), 1u);
  EXPECT_EQ(assignments[0].assignment().resume_step(), 8);
  EXPECT_EQ(assignments[0].assignment().rendezvous_prefix(), id + "/1/");

  // Second death: no restarts left.
  clock.now += 2000;
  coordinator->Tick();
  job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_FAILED);
  EXPECT_NE(job.reason().find("no restarts left (max_restarts 1)"), std::string::npos)
      << job.reason();
}

// A worker resends every reliable report its last stream did not acknowledge, so the handlers
// see repeats: each is acknowledged (with the recovery point for a checkpoint), a repeat changes
// nothing, and a report from an attempt that has ended is ignored.
TEST_F(CoordinatorTest, ReliableReportsAreAckedAndRepeatsAreHarmless) {
  std::string id = Submit(kSpec2);  // max_restarts 1
  Worker a = Join("a");
  Worker b = Join("b");
  ASSERT_TRUE(Progress(a, 25).ok());
  ASSERT_TRUE(Progress(b, 25).ok());
  auto report = [&](const Worker& w, uint64_t seq, int64_t step, int attempt) {
    return Send(w, CheckpointReport(id, seq, step, attempt));
  };
  ASSERT_TRUE(report(a, 7, 20, 0).ok());
  ASSERT_TRUE(report(a, 8, 10, 0).ok());  // an older one, resent late: never moves back
  ASSERT_TRUE(report(b, 3, 20, 0).ok());  // rank 1's report is acknowledged, not kept
  EXPECT_EQ(Get(id).progress().checkpoint_step(), 20);
  auto acks = a.sink->Take(v1::CoordinatorMessage::kAck);
  ASSERT_EQ(acks.size(), 2u);
  EXPECT_EQ(acks[0].ack().seq(), 7u);
  EXPECT_EQ(acks[0].ack().job_id(), id);
  EXPECT_EQ(acks[0].ack().checkpoint_step(), 20);
  EXPECT_EQ(acks[1].ack().seq(), 8u);
  EXPECT_EQ(acks[1].ack().checkpoint_step(), 20);
  acks = b.sink->Take(v1::CoordinatorMessage::kAck);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].ack().checkpoint_step(), 20);

  v1::WorkerMessage done;
  done.set_want_ack(true);
  done.mutable_finished()->set_success(true);
  done.mutable_finished()->set_job_id(id);
  done.mutable_finished()->set_attempt(0);
  done.set_seq(9);
  ASSERT_TRUE(Send(a, done).ok());
  done.set_seq(10);
  ASSERT_TRUE(Send(a, done).ok());  // the same Finished again: rank 1 has still not finished
  EXPECT_EQ(Get(id).state(), v1::JOB_RUNNING);
  EXPECT_EQ(a.sink->Take(v1::CoordinatorMessage::kAck).size(), 4u);

  // b dies; the job restarts (attempt 1) on a and a new b. Attempt 0's reports, resent now,
  // are acknowledged and ignored.
  clock.now += 600;
  ASSERT_TRUE(Heartbeat(a).ok());
  clock.now += 600;
  coordinator->Tick();
  Worker b2 = Join("b");
  ASSERT_EQ(Get(id).attempt(), 1);
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  ASSERT_TRUE(report(a, 11, 30, 0).ok());
  EXPECT_EQ(Get(id).progress().checkpoint_step(), 20);
  done.set_seq(12);
  ASSERT_TRUE(Send(a, done).ok());
  v1::WorkerMessage done_b = done;
  ASSERT_TRUE(Send(b2, done_b).ok());
  EXPECT_EQ(Get(id).state(), v1::JOB_SCHEDULED) << Get(id).reason();
  // The current attempt's reports count.
  ASSERT_TRUE(report(a, 13, 30, 1).ok());
  EXPECT_EQ(Get(id).progress().checkpoint_step(), 30);
  done.mutable_finished()->set_attempt(1);
  ASSERT_TRUE(Send(a, done).ok());
  ASSERT_TRUE(Send(b2, done).ok());
  EXPECT_EQ(Get(id).state(), v1::JOB_SUCCEEDED);
}

// Issue #31, item 8: a rank that ends before rank 0's last checkpoint report is persisted (a
// coordinator outage, a full disk) must still learn the job's final recovery point, or it keeps
// every unacknowledged checkpoint it held. The Ack of a Finished report carries the recovery point
// as the Ack of a checkpoint does, and the Stop that ends a succeeded job carries the final one.
TEST_F(CoordinatorTest, AFinishedRankLearnsTheFinalRecoveryPoint) {
  std::string id = Submit(kSpec2);
  Worker a = Join("a");
  Worker b = Join("b");
  ASSERT_TRUE(Progress(a, 25).ok());
  ASSERT_TRUE(Progress(b, 25).ok());
  ASSERT_TRUE(Send(a, CheckpointReport(id, 1, 20, 0)).ok());
  // Rank 1 ends first: its Ack names the recovery point persisted so far.
  ASSERT_TRUE(Send(b, FinishedReport(id, 1, 0, 40)).ok());
  auto acks = b.sink->Take(v1::CoordinatorMessage::kAck);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].ack().job_id(), id);
  EXPECT_EQ(acks[0].ack().checkpoint_step(), 20);
  b.sink->Take(v1::CoordinatorMessage::kStop);
  // Rank 0's final checkpoint, then its finish: the job succeeds, and both ranks are told the
  // final recovery point.
  ASSERT_TRUE(Send(a, CheckpointReport(id, 2, 40, 0)).ok());
  ASSERT_TRUE(Send(a, FinishedReport(id, 3, 0, 40)).ok());
  ASSERT_EQ(Get(id).state(), v1::JOB_SUCCEEDED);
  for (Worker* w : {&a, &b}) {
    auto stops = w->sink->Take(v1::CoordinatorMessage::kStop);
    ASSERT_EQ(stops.size(), 1u) << w->id;
    EXPECT_EQ(stops[0].stop().cause(), v1::STOP_JOB_SUCCEEDED);
    EXPECT_EQ(stops[0].stop().recovery_step(), 40) << w->id;
  }
  acks = a.sink->Take(v1::CoordinatorMessage::kAck);
  ASSERT_FALSE(acks.empty());
  EXPECT_EQ(acks.back().ack().seq(), 3u);  // the Finished report's
  EXPECT_EQ(acks.back().ack().job_id(), id);
  EXPECT_EQ(acks.back().ack().checkpoint_step(), 40);
}

// Issue #31 item 3: a second session for a live worker's (id, generation) needs that
// generation's secret, which only Register's caller saw.
TEST_F(CoordinatorTest, ASessionWithoutTheSecretIsRefusedAndCounted) {
  Worker a = Join("a");
  ASSERT_EQ(a.secret.size(), 32u);
  EXPECT_NE(Join("b").secret, a.secret);
  auto impostor = std::make_shared<FakeSink>();
  const absl::Status none = coordinator->OpenSession(a.id, a.generation, "", impostor);
  EXPECT_EQ(none.code(), absl::StatusCode::kPermissionDenied) << none;
  EXPECT_NE(none.message().find("no session secret"), std::string::npos) << none;
  std::string wrong = a.secret;
  wrong[0] = wrong[0] == '0' ? '1' : '0';
  const absl::Status forged = coordinator->OpenSession(a.id, a.generation, wrong, impostor);
  EXPECT_EQ(forged.code(), absl::StatusCode::kPermissionDenied) << forged;
  EXPECT_EQ(forged.message().find(a.secret), std::string::npos) << "the secret is never echoed";
  EXPECT_EQ(coordinator->GetCounts().forged_sessions, 2u);
  // The impostor's stream ends: the real worker stays connected and takes the next job.
  coordinator->CloseSession(a.id, a.generation, impostor);
  const std::string id = Submit("name: j\nworld_size: 2\n");
  const v1::Job job = Get(id);
  ASSERT_EQ(job.state(), v1::JOB_SCHEDULED) << job.reason();
  EXPECT_EQ(a.sink->Take(v1::CoordinatorMessage::kAssignment).size(), 1u);
  EXPECT_TRUE(impostor->Take(v1::CoordinatorMessage::kAssignment).empty());
}

// Issue #31 item 3, stranding: an impostor's session closing (or any stream that is not the
// worker's current one) never marks the real worker disconnected.
TEST_F(CoordinatorTest, AClosedForeignStreamDoesNotStrandTheWorker) {
  Worker a = Join("a");
  coordinator->CloseSession(a.id, a.generation, std::make_shared<FakeSink>());
  coordinator->CloseSession(a.id, a.generation, nullptr);
  const v1::ListWorkersResponse workers = coordinator->ListWorkers();
  ASSERT_EQ(workers.workers_size(), 1);
  EXPECT_EQ(workers.workers(0).state(), v1::WORKER_IDLE);
  const std::string id = Submit("name: j\nworld_size: 1\n");
  EXPECT_EQ(Get(id).state(), v1::JOB_SCHEDULED) << Get(id).reason();
}

// The same process reconnecting before its old stream was seen to break: the new stream takes
// over, the old one is ended, and the old one's close changes nothing.
TEST_F(CoordinatorTest, AReconnectWithTheSecretReplacesTheOldStream) {
  struct EndCounting : FakeSink {
    void End() override { ++ended; }
    int ended = 0;
  };
  v1::RegisterRequest req;
  req.set_name("a");
  auto r = coordinator->Register(req);
  ASSERT_TRUE(r.ok()) << r.status();
  auto first = std::make_shared<EndCounting>();
  auto second = std::make_shared<FakeSink>();
  ASSERT_TRUE(
      coordinator->OpenSession(r->worker_id(), r->generation(), r->session_secret(), first).ok());
  ASSERT_TRUE(
      coordinator->OpenSession(r->worker_id(), r->generation(), r->session_secret(), second).ok());
  EXPECT_EQ(first->ended, 1);
  coordinator->CloseSession(r->worker_id(), r->generation(), first);
  const std::string id = Submit("name: j\nworld_size: 1\n");
  EXPECT_EQ(Get(id).state(), v1::JOB_SCHEDULED) << Get(id).reason();
  EXPECT_EQ(second->Take(v1::CoordinatorMessage::kAssignment).size(), 1u);
  EXPECT_TRUE(first->Take(v1::CoordinatorMessage::kAssignment).empty());
}

// Issue #31 item 3, forged failure: a report naming a job the worker is not a rank of changes
// nothing and is counted.
TEST_F(CoordinatorTest, AReportForAnotherWorkersJobIsIgnoredAndCounted) {
  Worker a = Join("a");
  const std::string id = Submit("name: j\nworld_size: 1\n");
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  Worker b = Join("b");  // idle: no rank of the job
  v1::WorkerMessage forged;
  forged.mutable_finished()->set_job_id(id);
  forged.mutable_finished()->set_attempt(0);
  forged.mutable_finished()->set_success(false);
  forged.mutable_finished()->set_restartable(false);
  forged.mutable_finished()->set_reason("forged");
  ASSERT_TRUE(Send(b, forged).ok());
  v1::WorkerMessage ckpt;
  ckpt.mutable_checkpoint()->set_job_id(id);
  ckpt.mutable_checkpoint()->set_step(99);
  ASSERT_TRUE(Send(b, ckpt).ok());
  const v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_SCHEDULED) << job.reason();
  EXPECT_EQ(job.progress().checkpoint_step(), 0);
  EXPECT_EQ(coordinator->GetCounts().foreign_reports, 2u);
  // The job's own rank still reports for it.
  v1::WorkerMessage done;
  done.mutable_finished()->set_job_id(id);
  done.mutable_finished()->set_success(true);
  ASSERT_TRUE(Send(a, done).ok());
  EXPECT_EQ(Get(id).state(), v1::JOB_SUCCEEDED);
  EXPECT_EQ(coordinator->GetCounts().foreign_reports, 2u);
}

// Issue #31 item 8: ranks that finish during an outage report their last step only in the
// Finished message; the job ended "all ranks finished at step 309" (really 1199).
TEST_F(CoordinatorTest, TheFinalStepComesFromTheFinishReports) {
  const std::string dir = ::testing::TempDir() + "/final-step-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  Open(dir);
  Worker a = Join("a"), b = Join("b");
  const std::string id = Submit("name: j\nworld_size: 2\ntraining: {steps: 1200}\n");
  ASSERT_TRUE(Progress(a, 309).ok());
  for (const Worker* w : {&a, &b}) {
    v1::WorkerMessage done;
    done.mutable_finished()->set_job_id(id);
    done.mutable_finished()->set_success(true);
    done.mutable_finished()->set_steps(1200);
    ASSERT_TRUE(Send(*w, done).ok());
  }
  v1::Job job = Get(id);
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED);
  EXPECT_EQ(job.progress().step(), 1199);
  EXPECT_EQ(job.reason(), "all ranks finished at step 1199");
  Open(dir);  // and it survives a restart
  EXPECT_EQ(Get(id).progress().step(), 1199);
  std::filesystem::remove_all(dir);
}

TEST_F(CoordinatorTest, LeaveNeedsTheSessionSecret) {
  Worker a = Join("a");
  v1::LeaveRequest leave;
  leave.set_worker_id(a.id);
  leave.set_generation(a.generation);
  leave.set_reason("forged");
  EXPECT_EQ(coordinator->Leave(leave).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(Heartbeat(a).ok());
  leave.set_session_secret(a.secret);
  EXPECT_TRUE(coordinator->Leave(leave).ok());
  EXPECT_EQ(Heartbeat(a).code(), absl::StatusCode::kFailedPrecondition);
}

// Command jobs run arbitrary programs: only on workers started with --allow-commands.
TEST_F(CoordinatorTest, CommandJobsOnlyGoToWorkersThatAllowCommands) {
  Worker plain = Join("plain");
  const std::string id = Submit("name: c\nworld_size: 1\ncommand: [/bin/true]\n");
  const v1::Job waiting = Get(id);
  EXPECT_EQ(waiting.state(), v1::JOB_PENDING);
  EXPECT_NE(waiting.scheduling().find("that run command jobs (--allow-commands)"),
            std::string::npos)
      << waiting.scheduling();
  v1::RegisterRequest req;
  req.set_name("runner");
  req.set_accepts_commands(true);
  auto r = coordinator->Register(req);
  ASSERT_TRUE(r.ok());
  auto sink = std::make_shared<FakeSink>();
  ASSERT_TRUE(
      coordinator->OpenSession(r->worker_id(), r->generation(), r->session_secret(), sink).ok());
  const v1::Job job = Get(id);
  ASSERT_EQ(job.state(), v1::JOB_SCHEDULED) << job.scheduling();
  EXPECT_EQ(job.ranks(0).worker_id(), "runner");
  EXPECT_TRUE(plain.sink->Take(v1::CoordinatorMessage::kAssignment).empty());
}

// `policy set` on a command job checks the glob against the program's catalog and names the
// program's script, not a preset it does not have (issue #29: "matches no layer of llama-tiny").
TEST_F(CoordinatorTest, CommandJobGlobsAreCheckedAgainstTheCatalogNamingTheScript) {
  Worker w = AttachCommandWorker();
  const std::string id =
      Submit("name: c\nworld_size: 1\ncommand: [python3, -u, /src/my_train.py, --lr, '1']\n");
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  // Before the catalog, any glob is accepted.
  ASSERT_TRUE(Update(id, "fc3.*", "bf16").ok());
  ASSERT_TRUE(Send(w, Catalog({"fc1.weight", "fc2.weight"})).ok());
  auto typo = Update(id, "fc3.*", "bf16");
  ASSERT_FALSE(typo.ok());
  EXPECT_EQ(typo.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(typo.status().message().find("patches[0].layer: matches no layer of my_train.py "
                                         "(fc3.*); its layers are fc1.weight, fc2.weight"),
            std::string::npos)
      << typo.status();
  EXPECT_EQ(typo.status().message().find("llama-tiny"), std::string::npos) << typo.status();
  EXPECT_TRUE(Update(id, "fc2.*", "bf16").ok());
}

// A command job's spec glob that matches none of the program's layers fails the job when rank 0's
// catalog arrives, with GeoFP8State's message for the same policy (issue #29: it SUCCEEDED).
TEST_F(CoordinatorTest, CommandJobSpecGlobMatchingNoLayerFailsTheJobAtTheCatalog) {
  Worker w = AttachCommandWorker();
  const std::string id = Submit(
      "name: c\nworld_size: 1\ncommand: [python3, train.py]\n"
      "policy:\n  default: {format: fp8_e4m3}\n  layers:\n"
      "    - {match: 'fc1.*', format: bf16}\n    - {match: 'fc3.*', format: bf16}\n");
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  w.sink->Take(v1::CoordinatorMessage::kAssignment);
  ASSERT_TRUE(Send(w, Catalog({"fc1.weight", "fc2.weight"})).ok());
  const v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_FAILED);
  EXPECT_EQ(job.reason(),
            "spec.policy.layers[1].match: matches no layer of train.py (fc3.*); its layers are "
            "fc1.weight, fc2.weight")
      << job.reason();
  EXPECT_EQ(job.restarts(), 0);
  // The rank was told to stop, and no refresh schedule went out.
  EXPECT_EQ(w.sink->Take(v1::CoordinatorMessage::kStop).size(), 1u);
  EXPECT_TRUE(w.sink->Take(v1::CoordinatorMessage::kRefresh).empty());
}

// The catalog's model name (GeoFP8State's model_name, by default the script's file name) is what
// the errors call the model, not the command line's script (issue #29 item 4).
TEST_F(CoordinatorTest, CommandJobGlobErrorsNameTheCatalogsModel) {
  Worker w = AttachCommandWorker();
  const std::string id = Submit("name: c\nworld_size: 1\ncommand: [python3, train.py]\n");
  ASSERT_TRUE(Send(w, Catalog({"fc1.weight"}, "my-gpt")).ok());
  auto typo = Update(id, "fc3.*", "bf16");
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.status().message().find("patches[0].layer: matches no layer of my-gpt (fc3.*)"),
            std::string::npos)
      << typo.status();

  // And the spec's globs, checked when the catalog arrives.
  w.sink->Take(v1::CoordinatorMessage::kAssignment);
  ASSERT_TRUE(coordinator
                  ->CancelJob([&] {
                    v1::CancelJobRequest r;
                    r.set_job_id(id);
                    return r;
                  }())
                  .ok());
  const std::string id2 = Submit(
      "name: c2\nworld_size: 1\ncommand: [python3, train.py]\n"
      "policy:\n  layers:\n    - {match: 'fc3.*', format: bf16}\n");
  ASSERT_EQ(Get(id2).state(), v1::JOB_SCHEDULED) << Get(id2).scheduling();
  ASSERT_TRUE(Send(w, Catalog({"fc1.weight"}, "my-gpt")).ok());
  EXPECT_EQ(Get(id2).reason(),
            "spec.policy.layers[0].match: matches no layer of my-gpt (fc3.*); its layers are "
            "fc1.weight");
}

// A command job turns RUNNING when every rank's program has started, as the built-in trainer's
// does when every rank has reported a step; a script that never reports a step no longer leaves
// it SCHEDULED for its whole run (issue #29 item 4).
TEST_F(CoordinatorTest, CommandJobTurnsRunningWhenEveryRanksProgramStarted) {
  Worker a = AttachCommandWorker("a");
  Worker b = AttachCommandWorker("b");
  const std::string id = Submit("name: c\nworld_size: 2\ncommand: [python3, train.py]\n");
  const v1::Job scheduled = Get(id);
  ASSERT_EQ(scheduled.state(), v1::JOB_SCHEDULED) << scheduled.scheduling();
  const Worker& rank0 = scheduled.ranks(0).worker_id() == a.id ? a : b;
  const Worker& rank1 = &rank0 == &a ? b : a;
  ASSERT_TRUE(Send(rank0, CommandReport(id, v1::COMMAND_PROCESS_STARTED, 0)).ok());
  EXPECT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  // A rank that reports a step counts as running too.
  ASSERT_TRUE(Progress(rank1, 0).ok());
  EXPECT_EQ(Get(id).state(), v1::JOB_RUNNING);
  EXPECT_EQ(Get(id).reason(), "all 2 ranks reported progress");

  const std::string id2 = [&] {
    v1::CancelJobRequest r;
    r.set_job_id(id);
    EXPECT_TRUE(coordinator->CancelJob(r).ok());
    return Submit("name: d\nworld_size: 2\ncommand: [python3, train.py]\n");
  }();
  ASSERT_EQ(Get(id2).state(), v1::JOB_SCHEDULED) << Get(id2).scheduling();
  ASSERT_TRUE(Send(a, CommandReport(id2, v1::COMMAND_PROCESS_STARTED, 0)).ok());
  ASSERT_TRUE(Send(b, CommandReport(id2, v1::COMMAND_PROCESS_STARTED, 0)).ok());
  const v1::Job running = Get(id2);
  EXPECT_EQ(running.state(), v1::JOB_RUNNING);
  EXPECT_EQ(running.reason(), "the programs of all 2 ranks started");
  // A report of another attempt changes nothing.
  v1::WorkerMessage stale = CommandReport(id2, v1::COMMAND_HOOK_NOT_ATTACHED, 120);
  stale.mutable_command_status()->set_attempt(7);
  ASSERT_TRUE(Send(a, stale).ok());
  EXPECT_EQ(Get(id2).note(), "");
}

// A program that has not attached to the hook after the worker's timeout: the job gets a note
// (describe) and an event naming the rank, the seconds and what to do; attaching later clears
// the note with an event of its own.
TEST_F(CoordinatorTest, ACommandRankThatHasNotAttachedGetsANoteAndAnEvent) {
  Worker w = AttachCommandWorker();
  const std::string id = Submit("name: c\nworld_size: 1\ncommand: [python3, train.py]\n");
  ASSERT_TRUE(Send(w, CommandReport(id, v1::COMMAND_PROCESS_STARTED, 0)).ok());
  ASSERT_TRUE(Send(w, CommandReport(id, v1::COMMAND_HOOK_NOT_ATTACHED, 120.2)).ok());
  const std::string said =
      "rank 0 has not attached to the GeoFP8 hook 120 s after its program started: a script "
      "attaches by constructing geofp8.torch.GeoFP8State(process_group, model, policy) and "
      "registering it with ddp_model.register_comm_hook(state, geofp8.torch.geofp8_hook)";
  v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_RUNNING);
  EXPECT_EQ(job.note().rfind(said, 0), 0u) << job.note();
  ASSERT_GT(job.events_size(), 0);
  EXPECT_EQ(job.events(job.events_size() - 1).message(), job.note());
  EXPECT_EQ(job.events(job.events_size() - 1).state(), v1::JOB_RUNNING);
  // A resent report adds nothing.
  const int events = job.events_size();
  ASSERT_TRUE(Send(w, CommandReport(id, v1::COMMAND_HOOK_NOT_ATTACHED, 120.2)).ok());
  EXPECT_EQ(Get(id).events_size(), events);

  ASSERT_TRUE(Send(w, CommandReport(id, v1::COMMAND_HOOK_ATTACHED, 150)).ok());
  job = Get(id);
  EXPECT_EQ(job.note(), "");
  EXPECT_EQ(job.events(job.events_size() - 1).message(),
            "rank 0 attached to the GeoFP8 hook 150 s after its program started");
}

// A program that ends without ever attaching: the final reason says so and the note says what to
// do, whether it exited 0 or failed.
TEST_F(CoordinatorTest, ACommandJobThatEndsWithoutAttachingSaysSo) {
  Worker w = AttachCommandWorker();
  const std::string id = Submit("name: c\nworld_size: 1\ncommand: [python3, train.py]\n");
  ASSERT_TRUE(Send(w, CommandReport(id, v1::COMMAND_PROCESS_STARTED, 0)).ok());
  v1::WorkerMessage done = FinishedReport(id, 1, 0, 0);
  done.mutable_finished()->set_hook_never_attached(true);
  ASSERT_TRUE(Send(w, done).ok());
  v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_SUCCEEDED);
  EXPECT_EQ(job.reason(),
            "all ranks finished at step 0; rank 0's program ended without attaching to the "
            "GeoFP8 hook");
  EXPECT_EQ(job.note().rfind("rank 0's program ended without attaching to the GeoFP8 hook: a "
                             "script attaches by constructing geofp8.torch.GeoFP8State",
                             0),
            0u)
      << job.note();

  const std::string id2 = Submit("name: d\nworld_size: 1\ncommand: [python3, train.py]\n");
  ASSERT_EQ(Get(id2).state(), v1::JOB_SCHEDULED) << Get(id2).scheduling();
  v1::WorkerMessage failed = FinishedReport(id2, 2, 0, 0);
  failed.mutable_finished()->set_success(false);
  failed.mutable_finished()->set_reason("command 'python3' exited with code 1");
  failed.mutable_finished()->set_hook_never_attached(true);
  ASSERT_TRUE(Send(w, failed).ok());
  job = Get(id2);
  EXPECT_EQ(job.state(), v1::JOB_FAILED);
  EXPECT_EQ(job.reason(),
            "rank 0 failed: command 'python3' exited with code 1; its program never attached to "
            "the GeoFP8 hook");
  EXPECT_NE(job.note().find("register_comm_hook"), std::string::npos) << job.note();
  // A program that attached ends with neither.
  const std::string id3 = Submit("name: e\nworld_size: 1\ncommand: [python3, train.py]\n");
  ASSERT_EQ(Get(id3).state(), v1::JOB_SCHEDULED) << Get(id3).scheduling();
  ASSERT_TRUE(Send(w, FinishedReport(id3, 3, 0, 5)).ok());
  EXPECT_EQ(Get(id3).reason(), "all ranks finished at step 4");
  EXPECT_EQ(Get(id3).note(), "");
}

// Globs that all match: the catalog is taken as before.
TEST_F(CoordinatorTest, CommandJobSpecGlobsThatMatchKeepTheJobRunning) {
  Worker w = AttachCommandWorker();
  const std::string id = Submit(
      "name: c\nworld_size: 1\ncommand: [python3, train.py]\n"
      "policy:\n  default: {format: fp8_e4m3}\n  layers:\n    - {match: 'fc*', format: bf16}\n");
  ASSERT_TRUE(Send(w, Catalog({"fc1.weight"})).ok());
  EXPECT_NE(Get(id).state(), v1::JOB_FAILED) << Get(id).reason();
}

TEST_F(CoordinatorTest, ReRegistrationFencesTheOldGeneration) {
  Worker a1 = Join("a");
  // While a1's session is live, a second process under the name is refused (issue #13 item 7:
  // two processes with one name fenced each other for ever).
  v1::RegisterRequest dup;
  dup.set_name("a");
  auto refused = coordinator->Register(dup);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(refused.status().message(),
            "name: a is held by a live session (generation 1, host ); each worker process needs "
            "its own --name");
  EXPECT_TRUE(Heartbeat(a1).ok());
  // Its process died: the session ends, and the name can be registered again.
  coordinator->CloseSession(a1.id, a1.generation, a1.sink);
  Worker a2 = Join("a");
  EXPECT_EQ(a2.generation, a1.generation + 1);
  EXPECT_EQ(Heartbeat(a1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Heartbeat(a2).ok());
  EXPECT_EQ(coordinator->OpenSession(a1.id, a1.generation, a1.secret, a1.sink).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(coordinator->OpenSession("nobody", 1, a1.secret, a1.sink).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(CoordinatorTest, AnUpdateThatChangesNothingMakesNoVersion) {
  std::string id = Submit(kSpec2);
  ASSERT_TRUE(Update(id, "*mlp*", "nvfp4").ok());
  ASSERT_TRUE(Update(id, "*attn*", "bf16").ok());
  v1::GetPolicyRequest g;
  g.set_job_id(id);
  const v1::Policy v3 = *coordinator->GetPolicy(g);
  ASSERT_EQ(v3.version(), 3u);
  // The version's own default and patches, sent back (what `policy get -o yaml | policy apply
  // -f -` sends): unchanged, no v4.
  auto file = PatchFileOf(v3);
  ASSERT_TRUE(file.ok()) << file.status();
  v1::UpdatePolicyRequest req;
  req.set_job_id(id);
  *req.mutable_default_policy() = ToProto(*file->defaults);
  for (const auto& p : file->layers) *req.add_patches() = ToProto(p);
  auto r = coordinator->UpdatePolicy(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->unchanged());
  EXPECT_EQ(r->policy().version(), 3u);
  EXPECT_EQ(coordinator->GetPolicy(g)->version(), 3u);
  // Re-sending only the last patch is a no-op too; re-sending the first is not (it moves it
  // behind the second, which could change a layer both patterns match).
  v1::UpdatePolicyRequest last;
  last.set_job_id(id);
  *last.add_patches() = v3.patches(1);
  EXPECT_TRUE(coordinator->UpdatePolicy(last)->unchanged());
  v1::UpdatePolicyRequest first;
  first.set_job_id(id);
  *first.add_patches() = v3.patches(0);
  auto moved = coordinator->UpdatePolicy(first);
  ASSERT_TRUE(moved.ok());
  EXPECT_FALSE(moved->unchanged());
  EXPECT_EQ(moved->policy().version(), 4u);
  // A pattern that names no layer of the job's model (llama-tiny) is refused.
  auto typo = Update(id, "*embed*", "bf16");
  ASSERT_FALSE(typo.ok());
  EXPECT_EQ(typo.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(typo.status().message().find("patches[0].layer: matches no layer of llama-tiny "
                                         "(*embed*); its layers are tok_emb,"),
            std::string::npos)
      << typo.status();
  // A new default is a change; a bad one is refused naming the field.
  v1::UpdatePolicyRequest d;
  d.set_job_id(id);
  LayerPolicy e5 = *file->defaults;
  e5.format = Format::kFp8E5M2;
  *d.mutable_default_policy() = ToProto(e5);
  auto changed = coordinator->UpdatePolicy(d);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_FALSE(changed->unchanged());
  EXPECT_EQ(changed->policy().default_policy().format(), v1::FORMAT_FP8_E5M2);
  d.mutable_default_policy()->set_format(v1::Format(99));
  EXPECT_NE(std::string(coordinator->UpdatePolicy(d).status().message())
                .find("default_policy.format: unknown value (99)"),
            std::string::npos);
  d.mutable_default_policy()->set_format(v1::FORMAT_FP8_E4M3);
  d.mutable_default_policy()->set_rank(5000);
  EXPECT_NE(std::string(coordinator->UpdatePolicy(d).status().message())
                .find("default_policy.rank: must be in [1, 4096] (5000)"),
            std::string::npos);
}

TEST_F(CoordinatorTest, PolicyTakesEffectAtLargestReportedStepPlusMargin) {
  std::string id = Submit(kSpec2);
  Worker a = Join("a");
  Worker b = Join("b");
  ASSERT_TRUE(Progress(a, 40).ok());
  ASSERT_TRUE(Progress(b, 37).ok());
  auto p = Update(id, "*attn*", "nvfp4");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->version(), 2u);
  EXPECT_EQ(p->effective_step(), 45);
  ASSERT_EQ(p->patches_size(), 1);
  // Both ranks receive it.
  EXPECT_EQ(a.sink->Take(v1::CoordinatorMessage::kPolicy).size(), 1u);
  EXPECT_EQ(b.sink->Take(v1::CoordinatorMessage::kPolicy).size(), 1u);

  auto bad = Update(id, "*attn*", "fp7");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("patches[0].format: unknown value (99)"),
            std::string::npos);
  EXPECT_EQ(Update("job-999999", "x", "bf16").status().code(), absl::StatusCode::kNotFound);

  v1::ListPolicyVersionsRequest lr;
  lr.set_job_id(id);
  auto versions = coordinator->ListPolicyVersions(lr);
  ASSERT_TRUE(versions.ok());
  ASSERT_EQ(versions->policies_size(), 2);
  EXPECT_EQ(versions->policies(0).author(), "spec");
  EXPECT_EQ(versions->policies(1).author(), "user");

  // The effective step is a lower bound: running it under v1 is fine while the ranks have not
  // taken v2 (they take it once every rank holds it).
  ASSERT_TRUE(Progress(a, 45, /*policy_version=*/1).ok());
  ASSERT_TRUE(Progress(b, 46, /*policy_version=*/1).ok());
  EXPECT_EQ(Get(id).state(), v1::JOB_RUNNING);
  // Rank 0 took it at step 47; a rank that runs step 47 under v1 has diverged: the job fails.
  ASSERT_TRUE(Send(a, PolicyAck(id, 2, 47)).ok());
  ASSERT_TRUE(Progress(b, 47, /*policy_version=*/1).ok());
  v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_FAILED);
  EXPECT_NE(job.reason().find("ran step 47 under policy v1 but v2 took effect at step 47"),
            std::string::npos)
      << job.reason();
  EXPECT_EQ(Update(id, "*", "bf16").status().code(), absl::StatusCode::kFailedPrecondition);
}

// Rank 0 reports the step at which the ranks took each version; a restarted attempt gets the
// version in force at its resume step, the taken ones after it (to replay at their steps) and
// the untaken tail, without versions that were overtaken.
TEST_F(CoordinatorTest, TakenStepsAreRecordedAndPickTheResumedAttemptsVersions) {
  std::string id = Submit(kSpec2);  // margin 5, max_restarts 1
  Worker a = Join("a");
  Worker b = Join("b");
  ASSERT_TRUE(Progress(a, 10).ok());
  ASSERT_TRUE(Progress(b, 10).ok());
  ASSERT_EQ(Update(id, "*", "bf16")->effective_step(), 15);        // v2
  ASSERT_TRUE(Send(b, PolicyAck(id, 2, 99)).ok());                 // rank 1's report: not recorded
  ASSERT_TRUE(Send(a, PolicyAck(id, 2, 18, /*attempt=*/7)).ok());  // another attempt's: neither
  v1::GetPolicyRequest g;
  g.set_job_id(id);
  g.set_version(2);
  EXPECT_FALSE(coordinator->GetPolicy(g)->has_taken_step());
  ASSERT_TRUE(Send(a, PolicyAck(id, 2, 18)).ok());
  EXPECT_EQ(coordinator->GetPolicy(g)->taken_step(), 18);
  ASSERT_TRUE(Progress(a, 20, 2).ok());
  ASSERT_TRUE(Progress(b, 20, 2).ok());
  ASSERT_EQ(Update(id, "*", "fp8_e4m3")->effective_step(), 25);  // v3, overtaken by v4
  ASSERT_EQ(Update(id, "*", "bf16")->effective_step(), 25);      // v4
  ASSERT_TRUE(Send(a, PolicyAck(id, 4, 26)).ok());
  ASSERT_TRUE(Progress(a, 26, 4).ok());
  ASSERT_TRUE(Progress(b, 26, 4).ok());
  ASSERT_EQ(Update(id, "*", "fp8_e4m3")->effective_step(), 31);  // v5, same step as v6
  ASSERT_EQ(Update(id, "*", "bf16")->effective_step(), 31);      // v6
  v1::WorkerMessage ckpt;
  ckpt.mutable_checkpoint()->set_step(20);
  ASSERT_TRUE(Send(a, ckpt).ok());
  EXPECT_EQ(Get(id).state(), v1::JOB_RUNNING);

  clock.now += 600;
  ASSERT_TRUE(Heartbeat(a).ok());  // b goes silent: attempt 1 resumes at step 20
  clock.now += 600;
  coordinator->Tick();
  a.sink->Take(v1::CoordinatorMessage::kAssignment);
  Worker b2 = Join("b");
  auto as = b2.sink->Take(v1::CoordinatorMessage::kAssignment);
  ASSERT_EQ(as.size(), 1u);
  const v1::Assignment& asg = as[0].assignment();
  EXPECT_EQ(asg.resume_step(), 20);
  std::vector<uint64_t> versions;
  for (const auto& p : asg.policy_history()) versions.push_back(p.version());
  EXPECT_EQ(versions, (std::vector<uint64_t>{2, 4, 6}));
  EXPECT_EQ(asg.policy_history(0).taken_step(), 18);
  EXPECT_EQ(asg.policy_history(1).taken_step(), 26);
  EXPECT_FALSE(asg.policy_history(2).has_taken_step());
}

// After a coordinator restart, the workers of the interrupted attempt report the checkpoints
// they hold; the job resumes from the newest step all of them hold, not the persisted point.
TEST_F(CoordinatorTest, AfterARestartTheJobResumesFromTheNewestStepEveryRankHolds) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("geofp8-coordinator-held-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  for (const bool all_report : {true, false}) {
    Open(dir.string());  // no workers registered
    std::string id = Submit(kSpec2);
    Worker a = Join(all_report ? "a" : "c");
    Worker b = Join(all_report ? "b" : "d");
    ASSERT_TRUE(Progress(a, 12).ok());
    ASSERT_TRUE(Progress(b, 12).ok());
    v1::WorkerMessage ckpt;
    ckpt.mutable_checkpoint()->set_step(10);
    ASSERT_TRUE(Send(a, ckpt).ok());
    Open(dir.string());  // the coordinator restarts; the ranks trained on meanwhile
    ASSERT_EQ(Get(id).state(), v1::JOB_PENDING);
    Worker a2 = JoinHolding(all_report ? "a" : "c", id, 0, 0, {10, 25, 30, 35});
    // Without b's report (say it held files of another attempt) the persisted point stays.
    Worker b2 = JoinHolding(all_report ? "b" : "d", id, all_report ? 0 : 3, 1, {10, 25, 30});
    v1::Job job = Get(id);
    ASSERT_EQ(job.state(), v1::JOB_SCHEDULED) << job.reason();
    auto as = a2.sink->Take(v1::CoordinatorMessage::kAssignment);
    ASSERT_EQ(as.size(), 1u);
    EXPECT_EQ(as[0].assignment().resume_step(), all_report ? 30 : 10);
    EXPECT_EQ(as[0].assignment().rank(), 0);
    EXPECT_EQ(job.progress().checkpoint_step(), all_report ? 30 : 10);
    bool event = false;
    for (const auto& e : job.events()) {
      event |=
          e.message().find(
              "resuming from checkpoint step 30, the newest every rank of "
              "attempt 0 holds (the persisted recovery point was step 10)") != std::string::npos;
    }
    EXPECT_EQ(event, all_report);
    v1::CancelJobRequest cancel;
    cancel.set_job_id(id);
    ASSERT_TRUE(coordinator->CancelJob(cancel).ok());
  }
  coordinator.reset();
  store.reset();
  std::filesystem::remove_all(dir);
}

// Issue #13, #6: two updates in one step (the same effective_step), the first taken just before
// a coordinator outage. Rank 0's report of it was lost with the coordinator, and the newer one
// was still untaken, so the assignment's history left the first out (only the newest of untaken
// versions sharing a step is sent) and the resumed ranks started under v1 instead of the version
// their checkpoint was written under: a geometry restart, another checksum. Now the ranks report
// the versions they took when they register again, and the coordinator records them first.
TEST_F(CoordinatorTest, AVersionTakenJustBeforeAnOutageIsRecordedFromTheReRegistration) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("geofp8-coordinator-taken-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  for (const bool report_taken : {true, false}) {
    Open(dir.string());
    std::string id = Submit(kSpec2);  // margin 5
    Worker a = Join(report_taken ? "a" : "c");
    Worker b = Join(report_taken ? "b" : "d");
    ASSERT_TRUE(Send(a, PolicyAck(id, 1, 0)).ok());
    ASSERT_TRUE(Progress(a, 10).ok());
    ASSERT_TRUE(Progress(b, 10).ok());
    ASSERT_EQ(Update(id, "*", "bf16")->effective_step(), 15);      // v2
    ASSERT_EQ(Update(id, "*", "fp8_e4m3")->effective_step(), 15);  // v3: the same step
    v1::WorkerMessage ckpt;
    ckpt.mutable_checkpoint()->set_step(10);
    ASSERT_TRUE(Send(a, ckpt).ok());
    // The ranks take v2 at step 16 (v3 has not reached both yet) and write checkpoints 20 and 25
    // under it; the coordinator dies before rank 0's PolicyAck arrives.
    Open(dir.string());
    ASSERT_EQ(Get(id).state(), v1::JOB_PENDING);
    std::vector<std::pair<uint64_t, int64_t>> taken;
    if (report_taken) taken = {{1, 0}, {2, 16}};
    Worker a2 = JoinHolding(report_taken ? "a" : "c", id, 0, 0, {10, 20, 25}, taken);
    Worker b2 = JoinHolding(report_taken ? "b" : "d", id, 0, 1, {10, 20, 25}, taken);
    const v1::Job job = Get(id);
    ASSERT_EQ(job.state(), v1::JOB_SCHEDULED) << job.reason();
    auto as = a2.sink->Take(v1::CoordinatorMessage::kAssignment);
    ASSERT_EQ(as.size(), 1u);
    const v1::Assignment& asg = as[0].assignment();
    EXPECT_EQ(asg.resume_step(), 25);
    std::vector<uint64_t> versions;
    for (const auto& p : asg.policy_history()) versions.push_back(p.version());
    if (report_taken) {
      // The resumed ranks start under v2 (taken at 16, before the resume step), then take v3.
      EXPECT_EQ(versions, (std::vector<uint64_t>{2, 3}));
      EXPECT_EQ(asg.policy_history(0).taken_step(), 16);
      EXPECT_FALSE(asg.policy_history(1).has_taken_step());
      v1::GetPolicyRequest g;
      g.set_job_id(id);
      g.set_version(2);
      EXPECT_EQ(coordinator->GetPolicy(g)->taken_step(), 16);  // persisted with the job
      bool event = false;
      for (const auto& e : job.events()) {
        event |=
            e.message().find("policy v2 was taken at step 16 in attempt 0") != std::string::npos;
      }
      EXPECT_TRUE(event);
    } else {
      // Without the report (an older worker): the corner as it was, v2 is left out.
      EXPECT_EQ(versions, (std::vector<uint64_t>{1, 3}));
    }
    v1::CancelJobRequest cancel;
    cancel.set_job_id(id);
    ASSERT_TRUE(coordinator->CancelJob(cancel).ok());
  }
  coordinator.reset();
  store.reset();
  std::filesystem::remove_all(dir);
}

TEST_F(CoordinatorTest, WorkerReportedFailureFailsTheJobWithItsReason) {
  std::string id = Submit(kSpec2);
  Worker a = Join("a");
  Worker b = Join("b");
  v1::WorkerMessage m;
  m.mutable_finished()->set_success(false);
  m.mutable_finished()->set_reason("policy v3 effective at step 40 arrived at step 42");
  ASSERT_TRUE(Send(b, m).ok());
  v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_FAILED);
  EXPECT_EQ(job.reason(), "rank 1 failed: policy v3 effective at step 40 arrived at step 42");
  auto stops = a.sink->Take(v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_EQ(stops[0].stop().cause(), v1::STOP_ATTEMPT_ENDED);
}

TEST_F(CoordinatorTest, CancelStopsRanksAndIsFinal) {
  std::string id = Submit(kSpec2);
  Worker a = Join("a");
  Worker b = Join("b");
  v1::CancelJobRequest req;
  req.set_job_id(id);
  req.set_reason("user asked");
  auto r = coordinator->CancelJob(req);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->state(), v1::JOB_CANCELLED);
  EXPECT_EQ(r->reason(), "cancelled: user asked");
  // The Stop says why by its cause, which the worker's metrics count (never by the text).
  auto stops = b.sink->Take(v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_EQ(stops[0].stop().cause(), v1::STOP_CANCELLED);
  EXPECT_EQ(coordinator->CancelJob(req).status().code(), absl::StatusCode::kFailedPrecondition);
  req.set_job_id("job-404");
  EXPECT_EQ(coordinator->CancelJob(req).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, CatalogProducesStaggeredRefreshSchedules) {
  std::string id = Submit("name: t\nworld_size: 2\ngeometry_refresh: {interval: 100}\n");
  Worker a = Join("a");
  Worker b = Join("b");
  v1::WorkerMessage m;
  for (const char* name : {"l0", "l1", "bias", "l2", "l3"}) {
    auto* l = m.mutable_catalog()->add_layers();
    l->set_name(name);
    l->set_rows(64);
    l->set_cols(std::string(name) == "bias" ? 1 : 64);
  }
  ASSERT_TRUE(Send(a, m).ok());
  auto got = b.sink->Take(v1::CoordinatorMessage::kRefresh);
  ASSERT_EQ(got.size(), 1u);
  const auto& s = got[0].refresh().schedules();
  ASSERT_EQ(s.size(), 4);  // the 1-D bias has no geometry
  EXPECT_EQ(s[0].layer(), "l0");
  EXPECT_EQ(s[0].owner(), 0);
  EXPECT_EQ(s[1].owner(), 1);
  EXPECT_EQ(s[2].owner(), 0);
  EXPECT_EQ(s[0].offset(), 0);
  EXPECT_EQ(s[1].offset(), 25);
  EXPECT_EQ(s[2].offset(), 50);
  EXPECT_EQ(s[3].offset(), 75);
  for (const auto& r : s) EXPECT_EQ(r.interval(), 100);
  // Later policy versions carry the schedule.
  auto p = Update(id, "l1", "bf16");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->refresh_size(), 4);
}

TEST_F(CoordinatorTest, AutoEngineTurnsGeometryOnAndLogsAVersionWithReason) {
  std::string id = Submit(
      "name: t\nworld_size: 1\nauto_policy: {enabled: true, min_gain: 1.5, off_gain: 1.1,"
      " max_cost_fraction: 0.1, min_interval: 25, max_interval: 400}\n"
      "geometry_refresh: {estimator: instant, interval: 100}\n");
  Worker a = Join("a");
  ASSERT_TRUE(Progress(a, 50).ok());
  v1::WorkerMessage m;
  auto* good = AddProbe(m, "blocks.0.attn.wq", 0.3, 0.1, v1::PROBE_BASIS_SHADOW);
  AddProbe(m, "blocks.0.mlp.up", 0.1, 0.09, v1::PROBE_BASIS_UNSPECIFIED);
  ASSERT_TRUE(Send(a, m).ok());
  v1::GetPolicyRequest g;
  g.set_job_id(id);
  auto p = coordinator->GetPolicy(g);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->version(), 2u);
  EXPECT_EQ(p->author(), "auto");
  EXPECT_EQ(p->effective_step(), 55);
  EXPECT_NE(p->reason().find("blocks.0.attn.wq: geometry lowrank on: gain 3 >= 1.5 (shadow basis)"),
            std::string::npos)
      << p->reason();
  EXPECT_EQ(ResolveLayer(*p, "blocks.0.attn.wq").policy.geometry(), v1::GEOMETRY_LOWRANK);
  EXPECT_EQ(ResolveLayer(*p, "blocks.0.mlp.up").policy.geometry(), v1::GEOMETRY_NONE);

  // Low drift on the now-geometric layer doubles its interval; high drift halves it.
  v1::WorkerMessage d;
  auto* probe = d.mutable_probes()->add_probes();
  *probe = *good;
  probe->set_drift(0.01);
  ASSERT_TRUE(Send(a, d).ok());
  p = coordinator->GetPolicy(g);
  EXPECT_EQ(p->version(), 3u);
  EXPECT_EQ(ResolveLayer(*p, "blocks.0.attn.wq").refresh_interval, 200);
  probe->set_drift(0.9);
  ASSERT_TRUE(Send(a, d).ok());
  p = coordinator->GetPolicy(g);
  EXPECT_EQ(p->version(), 4u);
  EXPECT_EQ(ResolveLayer(*p, "blocks.0.attn.wq").refresh_interval, 100);
  // A probe with an unchanged verdict makes no version.
  probe->set_drift(0.1);
  ASSERT_TRUE(Send(a, d).ok());
  EXPECT_EQ(coordinator->GetPolicy(g)->version(), 4u);
  // The deployed basis does not beat Euclidean: geometry off.
  probe->set_error_with(0.31);
  probe->set_basis(v1::PROBE_BASIS_DEPLOYED);
  ASSERT_TRUE(Send(a, d).ok());
  p = coordinator->GetPolicy(g);
  EXPECT_EQ(p->version(), 5u);
  EXPECT_EQ(ResolveLayer(*p, "blocks.0.attn.wq").policy.geometry(), v1::GEOMETRY_NONE);
  EXPECT_NE(p->reason().find("geometry off: gain 0.968 < 1.1 (deployed basis)"), std::string::npos)
      << p->reason();
  // `describe` shows the engine's last judgement of each probed layer and the state it left.
  v1::GetJobRequest gj;
  gj.set_job_id(id);
  auto job = coordinator->GetJob(gj);
  ASSERT_TRUE(job.ok());
  std::map<std::string, v1::LayerSummary> layers;
  for (const auto& l : job->layers()) layers[l.layer()] = l;
  ASSERT_TRUE(layers.contains("blocks.0.attn.wq"));
  EXPECT_NEAR(layers["blocks.0.attn.wq"].probe_gain(), 0.3 / 0.31, 1e-12);
  EXPECT_EQ(layers["blocks.0.attn.wq"].probe_basis(), v1::PROBE_BASIS_DEPLOYED);
  EXPECT_FALSE(layers["blocks.0.attn.wq"].geometry_on());
  ASSERT_TRUE(layers.contains("blocks.0.mlp.up"));
  EXPECT_NEAR(layers["blocks.0.mlp.up"].probe_gain(), 0.1 / 0.09, 1e-12);
  EXPECT_FALSE(layers["blocks.0.mlp.up"].geometry_on());
  // A probe without a basis (error_with 0) is no evidence: nothing changes.
  probe->set_error_with(0);
  ASSERT_TRUE(Send(a, d).ok());
  EXPECT_EQ(coordinator->GetPolicy(g)->version(), 5u);
}

TEST_F(CoordinatorTest, AutoEngineLeavesTheEmaFeedingCadenceAlone) {
  // The default estimator is ema, fed every step: the engine switches geometry but never
  // re-times the sketch (its drift is small by construction and says nothing about staleness).
  std::string id = Submit(
      "name: t\nworld_size: 1\nauto_policy: {enabled: true, min_gain: 1.5, off_gain: 1.1}\n");
  Worker a = Join("a");
  ASSERT_TRUE(Progress(a, 50).ok());
  v1::WorkerMessage m;
  AddProbe(m, "blocks.0.attn.wq", 0.3, 0.1, v1::PROBE_BASIS_SHADOW)->set_drift(0.001);
  ASSERT_TRUE(Send(a, m).ok());
  ASSERT_TRUE(Send(a, m).ok());  // the same evidence again: no second version
  v1::GetPolicyRequest g;
  g.set_job_id(id);
  auto p = coordinator->GetPolicy(g);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->version(), 2u);
  EXPECT_EQ(ResolveLayer(*p, "blocks.0.attn.wq").policy.geometry(), v1::GEOMETRY_LOWRANK);
  EXPECT_EQ(ResolveLayer(*p, "blocks.0.attn.wq").refresh_interval, 0);
}

TEST_F(CoordinatorTest, IntervalStaysWithinBounds) {
  AutoPolicySpec bounds;
  bounds.min_interval = 50;
  bounds.max_interval = 150;
  v1::Policy policy;
  policy.mutable_default_policy()->set_geometry(v1::GEOMETRY_LOWRANK);
  v1::ProbeResult probe;
  probe.set_layer("x");
  probe.set_error_without(1);
  probe.set_error_with(0.5);
  probe.set_drift(0.001);
  RefreshSpec refresh;
  refresh.estimator = GeometryEstimator::kInstant;
  refresh.interval = 100;
  auto d = DecideAuto(bounds, refresh, policy, {probe});
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].patch.refresh_interval(), 150);
  probe.set_drift(0.99);
  refresh.interval = 60;
  d = DecideAuto(bounds, refresh, policy, {probe});
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].patch.refresh_interval(), 50);
}

TEST_F(CoordinatorTest, WatchSeesChangesAndEvents) {
  std::string id = Submit(kSpec2);
  WatchCursor cursor;
  auto first = coordinator->WatchNext(id, &cursor, 10);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(first->has_value());
  EXPECT_EQ((*first)->events_size(), 1);
  auto none = coordinator->WatchNext(id, &cursor, 10);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  std::thread t([&] {
    Join("a");
    Join("b");
  });
  auto next = coordinator->WatchNext(id, &cursor, 5000);
  t.join();
  ASSERT_TRUE(next.ok());
  ASSERT_TRUE(next->has_value());
  EXPECT_EQ((*next)->job().state(), v1::JOB_SCHEDULED);
  EXPECT_EQ(coordinator->WatchNext("job-404", &cursor, 1).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, StateSurvivesReopeningTheStore) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("geofp8-coordinator-test-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  Open(dir.string());
  std::string id = Submit(kSpec2, "k");
  Worker a = Join("a");
  Worker b = Join("b");
  ASSERT_TRUE(Progress(a, 12).ok());
  ASSERT_TRUE(Progress(b, 12).ok());
  ASSERT_TRUE(Update(id, "*", "bf16").ok());
  Open(dir.string());  // a new coordinator over the same directory
  v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_PENDING);  // its workers belong to the old process
  EXPECT_NE(job.reason().find("coordinator restarted"), std::string::npos);
  EXPECT_EQ(job.policy_version(), 2u);
  EXPECT_EQ(job.attempt(), 1);
  v1::GetPolicyRequest g;
  g.set_job_id(id);
  g.set_version(2);
  auto p = coordinator->GetPolicy(g);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->effective_step(), 17);
  // Idempotency survives too, and generations keep growing.
  v1::SubmitJobRequest again;
  again.set_spec_yaml(kSpec2);
  again.set_idempotency_key("k");
  auto r = coordinator->SubmitJob(again);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->created());
  EXPECT_EQ(r->job().id(), id);
  EXPECT_EQ(Join("a").generation, 2u);
  coordinator.reset();
  store.reset();
  std::filesystem::remove_all(dir);
}

TEST_F(CoordinatorTest, RecoveryFailsLiveJobsWhoseStoredSpecNoLongerValidates) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("geofp8-coordinator-spec-test-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  Open(dir.string());
  std::string id = Submit(kSpec2);
  v1::Job job = Get(id);
  job.clear_events();
  job.set_spec_yaml("name: t\nmodel: {preset: retired-model}\n");
  ASSERT_TRUE(store->PutJob(job).ok());
  Open(dir.string());
  job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_FAILED);
  EXPECT_NE(job.reason().find("stored spec no longer valid: line 2: spec.model.preset"),
            std::string::npos)
      << job.reason();
  coordinator.reset();
  store.reset();
  std::filesystem::remove_all(dir);
}

TEST(RendezvousKv, SetGetWaitAdd) {
  RendezvousKv kv;
  EXPECT_EQ(kv.Get("j", "k", 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(kv.Get("j", "k", 20).status().code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(kv.Set("j", "k", std::string("v\0x", 3)).ok());
  auto v = kv.Get("j", "k", 0);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, std::string("v\0x", 3));
  EXPECT_EQ(kv.Get("other-job", "k", 0).status().code(), absl::StatusCode::kNotFound);
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    kv.Set("j", "late", "x").IgnoreError();
  });
  EXPECT_TRUE(kv.Wait("j", {"k", "late"}, 5000).ok());
  setter.join();
  auto timeout = kv.Wait("j", {"k", "never"}, 20);
  EXPECT_EQ(timeout.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(timeout.message().find("key never"), std::string::npos);
  EXPECT_EQ(*kv.Add("j", "n", 5), 5);
  EXPECT_EQ(*kv.Add("j", "n", -2), 3);
  EXPECT_EQ(*kv.Get("j", "n", 0), "3");
  EXPECT_EQ(kv.Add("j", "k", 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kv.Set("", "k", "v").code(), absl::StatusCode::kInvalidArgument);
  kv.Clear("j");
  EXPECT_EQ(kv.Get("j", "n", 0).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace geofp8::coordinator
