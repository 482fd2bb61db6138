// Large hostile specs (issue #31 item 7): 20 submits of a 3 MB spec and 20 of a 1 MB one, each a
// flow list (a million entries, a third of that). Before: each cost 0.5-10 s of the
// coordinator's CPU in the YAML parser, and ten took its RSS from 21 MB to about 560 MB, where it
// stayed. Now a spec over 1 MiB is refused by its size and the other by its shape, both before
// parsing; the memory is given back, and the coordinator keeps serving.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;

// Resident set of `pid` in KiB, from /proc.
long RssKib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

TEST(SpecFloodFaultTest, FortyRefusedLargeSpecsCostNeitherTimeNorMemory) {
  CoordinatorProcess coordinator;
  Client client(coordinator.address());
  auto channel = grpc::CreateChannel(coordinator.address(), grpc::InsecureChannelCredentials());
  auto jobs = v1::JobService::NewStub(channel);
  auto submit = [&](const std::string& yaml) {
    v1::SubmitJobRequest req;
    req.set_spec_yaml(yaml);
    v1::SubmitJobResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
    return jobs->SubmitJob(&ctx, req, &resp);
  };
  std::string hostile = "name: flood\nx: [";
  while (hostile.size() < 3'000'000) hostile += "1, ";
  hostile += "1]\n";
  const std::string expected =
      "spec_yaml: at most 1048576 bytes (" + std::to_string(hostile.size()) + ")";
  // Under the size bound, a million entries by shape: parsed, half a second and 160 MB each.
  std::string dense = "name: flood\nx: [";
  while (dense.size() < 1'000'000) dense += "1, ";
  dense += "1]\n";
  const std::string dense_expected =
      "line 2: spec: more than 50000 entries (lines and flow items) by this line";

  // Warm up the server's buffers with one refusal, then measure.
  ASSERT_EQ(submit(hostile).error_message(), expected);
  const long before = RssKib(coordinator.process().pid());
  ASSERT_GT(before, 0);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) {
    grpc::Status s = submit(hostile);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << i;
    ASSERT_EQ(s.error_message(), expected) << i;
    s = submit(dense);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << i;
    ASSERT_EQ(s.error_message(), dense_expected) << i;
  }
  const double seconds_taken =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const long after = RssKib(coordinator.process().pid());
  std::printf(
      "20 refused %zu-byte and 20 %zu-byte specs in %.2f s; coordinator RSS %ld KiB -> "
      "%ld KiB\n",
      hostile.size(), dense.size(), seconds_taken, before, after);
  // 80 MB of requests went through; what stays is at most a few of them (gRPC's buffers), far
  // from the 540 MB that ten parsed specs kept before.
  EXPECT_LT(after - before, 32 * 1024) << "RSS " << before << " KiB -> " << after << " KiB";
  // Before: 3-10 s each. Now mostly the transfer: 20 s leaves room for a loaded 2-core machine.
  EXPECT_LT(seconds_taken, 20.0);
  // Still serving.
  const v1::Job job = client.Submit("name: after\ntraining: {steps: 5}\n");
  EXPECT_EQ(job.state(), v1::JOB_PENDING);
}

}  // namespace
}  // namespace geofp8::testing
