// Issue #31 items 1 and 4, against the real daemons: a `command:` job that prints secrets to
// stderr cannot get them to a reader (a job's reason carries no program output, reads need the
// token, neither daemon's log copies it); a worker without --allow-commands is never given one;
// and a coordinator whose database was truncated refuses to start instead of serving an empty
// store, and never hands out a job id twice.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;

constexpr const char* kToken = "exfil-test-token-0123456789";

// The reproducer: a program that prints what it can read (a root-only file when the
// worker runs as root, and the token file the worker hands it) to stderr, then fails.
std::string ExfilSpec(const std::string& secret_file) {
  return "name: exfil\ncommand: [/bin/sh, -c, 'head -3 " + secret_file +
         " >&2; echo TOKEN=$(cat $GEOFP8_TOKEN_FILE) >&2; exit 3']\n";
}

TEST(ExfiltrationFaultTest, ACommandJobsOutputNeverReachesAReader) {
  TempDir dir("geofp8-exfil");
  const std::string token_file = dir.path() + "/token";
  std::ofstream(token_file) << kToken << "\n";
  const std::string secret = dir.path() + "/shadow";
  std::ofstream(secret) << "root:$y$j9T$not-a-real-hash:19000:0:99999:7:::\n";
  CoordinatorProcess coordinator({"--token-file", token_file});
  WorkerProcess worker(coordinator.address(), "w0",
                       {"--token-file", token_file, "--allow-commands"});
  Client client(coordinator.address(), kToken);
  ASSERT_TRUE(client.WaitIdle(1, seconds(30))) << worker.process().output();
  v1::Job job = client.Submit(ExfilSpec(secret));
  job = client.WaitFinal(job.id(), seconds(60));
  ASSERT_EQ(job.state(), v1::JOB_FAILED) << job.reason();

  // With the token: the exit status and where the output is, nothing of the output.
  EXPECT_NE(job.reason().find("exited with code 3; its output stays on worker w0"),
            std::string::npos)
      << job.reason();
  std::string everything = job.reason();
  for (const auto& e : job.events()) everything += "\n" + e.message();
  for (const std::string& leak : {std::string(kToken), std::string("not-a-real-hash")}) {
    EXPECT_EQ(everything.find(leak), std::string::npos) << everything;
    EXPECT_EQ(coordinator.process().output().find(leak), std::string::npos) << leak;
    EXPECT_EQ(worker.process().output().find(leak), std::string::npos) << leak;
  }
  // The output itself is on the worker, readable only by its user; the token file is gone.
  const std::string job_dir = worker.data_dir() + "/jobs/" + job.id() + "/0";
  std::ifstream err(job_dir + "/rank0.err");
  const std::string err_text((std::istreambuf_iterator<char>(err)), {});
  EXPECT_NE(err_text.find("TOKEN=" + std::string(kToken)), std::string::npos) << err_text;
  EXPECT_EQ(
      std::filesystem::status(job_dir + "/rank0.err").permissions() & std::filesystem::perms::all,
      std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  EXPECT_FALSE(std::filesystem::exists(job_dir + "/rank0.token"));

  // Without the token: no read answers.
  auto channel = grpc::CreateChannel(coordinator.address(), grpc::InsecureChannelCredentials());
  auto jobs = v1::JobService::NewStub(channel);
  auto workers = v1::WorkerService::NewStub(channel);
  auto policies = v1::PolicyService::NewStub(channel);
  auto ctx = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + seconds(10));
    return c;
  };
  v1::GetJobRequest get;
  get.set_job_id(job.id());
  v1::Job got;
  EXPECT_EQ(jobs->GetJob(ctx().get(), get, &got).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  v1::ListJobsResponse list;
  EXPECT_EQ(jobs->ListJobs(ctx().get(), v1::ListJobsRequest(), &list).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::ListWorkersResponse ws;
  EXPECT_EQ(workers->ListWorkers(ctx().get(), v1::ListWorkersRequest(), &ws).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::ListPolicyVersionsRequest versions;
  versions.set_job_id(job.id());
  v1::ListPolicyVersionsResponse vs;
  EXPECT_EQ(policies->ListPolicyVersions(ctx().get(), versions, &vs).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::WatchJobRequest watch;
  watch.set_job_id(job.id());
  auto wctx = ctx();
  auto reader = jobs->WatchJob(wctx.get(), watch);
  v1::WatchJobResponse w;
  EXPECT_FALSE(reader->Read(&w));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST(ExfiltrationFaultTest, AWorkerWithoutAllowCommandsIsNeverGivenACommandJob) {
  CoordinatorProcess coordinator;
  WorkerProcess plain(coordinator.address(), "plain");
  Client client(coordinator.address());
  ASSERT_TRUE(client.WaitIdle(1, seconds(30))) << plain.process().output();
  v1::Job job = client.Submit("name: cmd\ncommand: [/bin/true]\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  job = client.Get(job.id());
  EXPECT_EQ(job.state(), v1::JOB_PENDING);
  EXPECT_NE(job.scheduling().find("that run command jobs (--allow-commands), 0 connected"),
            std::string::npos)
      << job.scheduling();
  for (const auto& w : client.Workers()) EXPECT_FALSE(w.accepts_commands()) << w.name();
  // A worker that allows them takes it.
  WorkerProcess runner(coordinator.address(), "runner", {"--allow-commands"});
  job = client.WaitFinal(job.id(), seconds(60));
  EXPECT_EQ(job.state(), v1::JOB_SUCCEEDED) << job.reason();
  EXPECT_EQ(runner.Result(job.id())["success"], "1");
  EXPECT_TRUE(plain.Result(job.id()).empty());
}

// Issue #31 item 4 (`truncate -s 0` on coordinator.db): refused at start, with what is missing;
// --accept-store-loss serves what is left, and the next id is not job-000001 again.
TEST(ExfiltrationFaultTest, ATruncatedStoreIsRefusedAtStartAndIdsNeverRepeat) {
  TempDir dir("geofp8-store-loss");
  const std::string data = dir.path();
  auto start = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {
        GEOFP8_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--metrics-listen", "",
        "--data-dir",           data};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<ChildProcess>(argv);
  };
  auto address_of = [](ChildProcess& p) {
    const std::string out = p.output();
    const size_t at = out.find("serving on ") + 11;
    return out.substr(at, out.find(' ', at) - at);
  };
  {
    auto first = start({});
    ASSERT_TRUE(first->WaitFor("serving on", seconds(20))) << first->output();
    Client client(address_of(*first));
    EXPECT_EQ(client.Submit("name: a\n").id(), "job-000001");
    EXPECT_EQ(client.Submit("name: b\n").id(), "job-000002");
    first->Kill(SIGKILL);
    first->Wait();
  }
  for (const char* f : {"coordinator.db-wal", "coordinator.db-shm"}) {
    std::filesystem::remove(std::filesystem::path(data) / f);
  }
  std::filesystem::resize_file(std::filesystem::path(data) / "coordinator.db", 0);
  {
    auto refused = start({});
    EXPECT_NE(refused->Wait(), 0);
    EXPECT_NE(refused->output().find("has no store identity, but coordinator.seal says store"),
              std::string::npos)
        << refused->output();
    EXPECT_NE(refused->output().find("issued 2 job ids"), std::string::npos) << refused->output();
  }
  auto accepted = start({"--accept-store-loss"});
  ASSERT_TRUE(accepted->WaitFor("serving on", seconds(20))) << accepted->output();
  EXPECT_NE(accepted->output().find("store.loss_accepted"), std::string::npos)
      << accepted->output();
  Client client(address_of(*accepted));
  EXPECT_EQ(client.Submit("name: c\n").id(), "job-000003");
}

}  // namespace
}  // namespace geofp8::testing
