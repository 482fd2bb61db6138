// A flood of policy updates: one update with 100k patches is refused, and after 100 updates of 50
// patches each (cumulatively 250k patches, 7 MB of history before compaction) a restarted rank
// still receives its assignment and the job finishes.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <string>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;

TEST(PolicyFloodFaultTest, HistoryStaysSmallAndAssignmentsStillArrive) {
  CoordinatorProcess coordinator;
  Client client(coordinator.address());
  auto channel = grpc::CreateChannel(coordinator.address(), grpc::InsecureChannelCredentials());
  auto policies = v1::PolicyService::NewStub(channel);
  auto update = [&](int patches, int round) {
    v1::UpdatePolicyRequest req;
    req.set_job_id("job-000001");
    for (int i = 0; i < patches; ++i) {
      v1::LayerPatch* p = req.add_patches();
      // 50 distinct patterns, each matching every layer of the model (a pattern that matches
      // no layer is refused).
      p->set_layer(std::string(1 + i % 50, '*'));
      p->set_format(round % 2 ? v1::FORMAT_BF16 : v1::FORMAT_FP8_E4M3);
    }
    v1::UpdatePolicyResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(20));
    grpc::Status s = policies->UpdatePolicy(&ctx, req, &resp);
    return std::make_pair(s, resp);
  };

  WorkerProcess w0(coordinator.address(), "w0", {"--debug-step-delay-ms", "20"});
  const v1::Job job = client.Submit(
      "name: flood\nmodel: {preset: llama-tiny}\n"
      "training: {steps: 200, batch_size: 2, seq_len: 16}\n"
      "checkpoint: {dir: ckpt, every: 1000}\nrestarts: {max_restarts: 2}\n");
  ASSERT_EQ(job.id(), "job-000001");

  auto [huge, unused] = update(100000, 0);
  EXPECT_EQ(huge.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Refused at the edge by the request bounds (proto/bounds.h), before the handler.
  EXPECT_EQ(huge.error_message(), "patches: at most 256 entries (100000)");

  v1::Policy last;
  for (int round = 1; round <= 100; ++round) {
    auto [s, resp] = update(50, round);
    ASSERT_TRUE(s.ok()) << s.error_message();
    last = resp.policy();
  }
  EXPECT_EQ(last.version(), 101u);
  EXPECT_EQ(last.patches_size(), 50) << "compaction keeps one patch per pattern";

  // The running rank dies; its replacement must receive an assignment that fits gRPC's limit.
  ASSERT_GE(client.WaitStep(job.id(), 1, seconds(60)).progress().step(), 1);
  WorkerProcess w1(coordinator.address(), "w1");
  ASSERT_TRUE(client.WaitIdle(1, seconds(30)));
  w0.process().Kill(SIGKILL);
  const v1::Job done = client.WaitFinal(job.id(), seconds(120));
  EXPECT_EQ(done.state(), v1::JOB_SUCCEEDED) << Describe(done, coordinator, {&w0, &w1});
  EXPECT_EQ(done.restarts(), 1);
}

}  // namespace
}  // namespace geofp8::testing
