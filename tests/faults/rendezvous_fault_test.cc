// The rendezvous KV of a production coordinator (no --debug-kv-any-job): a client cannot write
// keys for a job that has no running attempt, a real two-rank job still meets over it, and the
// job's keys are refused again once it ends.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <string>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;

grpc::Status KvSet(v1::RendezvousService::Stub& kv, const std::string& job, const std::string& key,
                   const std::string& value) {
  v1::KvSetRequest req;
  req.set_job_id(job);
  req.set_key(key);
  req.set_value(value);
  v1::KvSetResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
  return kv.Set(&ctx, req, &resp);
}

TEST(RendezvousFaultTest, OnlyLiveAttemptsMayUseTheStore) {
  TempDir dir("geofp8-kv");
  ChildProcess coordinator({GEOFP8_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--metrics-listen",
                            "", "--data-dir", dir.path(), "--tick-ms", "50"});
  ASSERT_TRUE(coordinator.WaitFor("serving on", seconds(20))) << coordinator.output();
  const std::string out = coordinator.output();
  const size_t at = out.find("serving on ") + 11;
  const std::string address = out.substr(at, out.find(' ', at) - at);
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto kv = v1::RendezvousService::NewStub(channel);
  Client client(address);

  // Made-up job: refused, and nothing is stored for it.
  grpc::Status s = KvSet(*kv, "no-such-job", "k", std::string(1000, 'x'));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  // A submitted job that has no workers yet (PENDING) is not live either.
  const v1::Job job = client.Submit(
      "name: kv\nworld_size: 2\nmodel: {preset: llama-tiny}\n"
      "training: {steps: 6, batch_size: 2, seq_len: 16}\nexchange: {timeout_s: 20}\n");
  s = KvSet(*kv, job.id(), "k", "v");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();

  // Two real workers meet over the store (Gloo rendezvous) and finish the job.
  WorkerProcess w0(address, "kv0"), w1(address, "kv1");
  const v1::Job done = client.WaitFinal(job.id(), seconds(120));
  ASSERT_EQ(done.state(), v1::JOB_SUCCEEDED) << done.reason() << "\n--- coordinator:\n"
                                             << coordinator.output() << "--- worker 0:\n"
                                             << w0.process().output() << "--- worker 1:\n"
                                             << w1.process().output();
  s = KvSet(*kv, job.id(), "late", "v");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("no running attempt of job " + job.id()), std::string::npos);
}

}  // namespace
}  // namespace geofp8::testing
