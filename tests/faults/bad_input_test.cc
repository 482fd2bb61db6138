// Bad input over the real wire: requests the coordinator used to answer with INTERNAL and no
// message, or with a message too long for a gRPC trailer. Each gets INVALID_ARGUMENT naming the
// field, and the coordinator keeps serving.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <string>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "tests/worker/coordinator_process.h"

namespace geofp8::testing {
namespace {

class BadInputTest : public ::testing::Test {
 protected:
  BadInputTest()
      : channel_(grpc::CreateChannel(coordinator_.address(), grpc::InsecureChannelCredentials())),
        jobs_(v1::JobService::NewStub(channel_)) {}

  grpc::Status Submit(const std::string& yaml, v1::SubmitJobResponse* resp = nullptr) {
    v1::SubmitJobRequest req;
    req.set_spec_yaml(yaml);
    v1::SubmitJobResponse ignored;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return jobs_->SubmitJob(&ctx, req, resp ? resp : &ignored);
  }
  // The server still accepts a good spec.
  void ExpectServing() {
    v1::SubmitJobResponse resp;
    const grpc::Status s = Submit("name: still-serving\n", &resp);
    EXPECT_TRUE(s.ok()) << s.error_message() << coordinator_.process().output();
    EXPECT_EQ(resp.job().name(), "still-serving");
  }

  CoordinatorProcess coordinator_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
};

TEST_F(BadInputTest, InvalidUtf8IsInvalidArgumentNamingTheField) {
  // C++ protobuf sends the bytes (with a logged complaint); the server cannot parse them.
  const grpc::Status s = Submit("name: a\xff\xfe\n");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(s.error_message(),
            "SubmitJobRequest.spec_yaml: invalid UTF-8 (string fields must be UTF-8)");
  ExpectServing();
}

TEST_F(BadInputTest, LongErrorListArrivesCutInsteadOfATransportError) {
  std::string yaml = "name: a\ntraining:\n";
  // Non-ASCII keys: percent-encoding triples them in the trailer.
  for (int i = 0; i < 2000; ++i) yaml += "  \xc3\xa9t\xc3\xa9_" + std::to_string(i) + ": 1\n";
  const grpc::Status s = Submit(yaml);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("line 3: spec.training.\xc3\xa9t\xc3\xa9_0: unknown field"),
            std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find(" more errors"), std::string::npos) << s.error_message();
  ExpectServing();
}

TEST_F(BadInputTest, HugeValuesAndLimitsAreNamed) {
  grpc::Status s = Submit("name: a\ntraining: {steps: 1099511627776}\n");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(),
            "line 2: spec.training.steps: must be in [1, 1000000000] (1099511627776)");
  s = Submit("name: a\nname: b\n");
  EXPECT_EQ(s.error_message(), "line 2: spec.name: duplicate key (first at line 1)");
  s = Submit("name: a\n---\nname: b\n");
  EXPECT_EQ(s.error_message(),
            "line 3: spec: a second YAML document (--- starts one); a spec is one document");
  s = Submit("name: a\nbackend: " + std::string(1 << 20, 'x') + "\n");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(s.error_message().size(), 300u);
  ExpectServing();
}

TEST_F(BadInputTest, PathsOutsideTheWorkersDataDirectoryAreRefused) {
  grpc::Status s = Submit("name: a\ncheckpoint: {dir: ../../outside, every: 5}\n");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(),
            "line 2: spec.checkpoint.dir: must stay inside the worker's data directory (no ..) "
            "(../../outside)");
  s = Submit("name: a\ndata: {source: file, path: /etc/shadow}\n");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(
      s.error_message(),
      "line 2: spec.data.path: must be relative to the worker's data directory (/etc/shadow)");
  ExpectServing();
}

}  // namespace
}  // namespace geofp8::testing
