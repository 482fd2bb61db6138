// Command-line input faults: endless or wrong kinds of files, negative versions, garbage PEM, a
// directory given as --in, and tokens on the command line. Each is a usage error (exit 2) with a
// one-line message naming the flag and the value, and none reaches or harms the server. Also
// every documented exit code of geofp8ctl, a server that never answers among them, and the
// token check at its boundaries (empty, truncated, extended, differently cased).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;

struct Result {
  int code;
  std::string output;
};

Result RunProgram(std::vector<std::string> argv) {
  ChildProcess p(std::move(argv));
  const int code = p.Wait(std::chrono::milliseconds(20000));
  return {code, p.output()};
}

std::string WriteFile(const TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.path() + "/" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TEST(CliInputTest, CtlBoundsAndChecksItsFilesBeforeAnyCall) {
  TempDir dir("geofp8-cli");
  // Port 1: nothing listens, so any call would exit 4; every case here must stop before one.
  const std::vector<std::string> ctl = {GEOFP8CTL_BIN, "-s", "127.0.0.1:1"};
  auto run = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = ctl;
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProgram(argv);
  };
  Result r = run({"submit", "-f", "/dev/zero"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.output, "geofp8ctl: error: -f: larger than 4 MiB (/dev/zero)\n");
  r = run({"submit", "-f", dir.path()});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.output,
            "geofp8ctl: error: -f: is a directory, expected a file (" + dir.path() + ")\n");
  r = run({"policy", "apply", "x", "-f", dir.path()});
  EXPECT_EQ(r.code, 2) << r.output;
  const std::string bad_utf8 = WriteFile(dir, "bad.yaml", "name: a\xff\n");
  r = run({"submit", "-f", bad_utf8});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.output, "geofp8ctl: error: -f: invalid UTF-8 at byte 7 (" + bad_utf8 + ")\n");
  r = run({"policy", "get", "x", "--version", "-1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.output, "geofp8ctl: error: --version: must be >= 0, 0 = latest (-1)\n");
  const std::string garbage = WriteFile(dir, "ca.pem", "not a certificate\n");
  r = run({"--tls-ca", garbage, "get", "jobs"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.output, "geofp8ctl: error: --tls-ca: not a PEM file with a CERTIFICATE block (" +
                          garbage + ")\n");
  r = run({"--token-file", dir.path() + "/absent", "get", "jobs"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("--token-file: cannot read"), std::string::npos) << r.output;
}

TEST(CliInputTest, TokenFileAuthenticatesAndTokenFlagWarns) {
  TempDir dir("geofp8-cli");
  const std::string token = WriteFile(dir, "token", "s3cret\n");
  const std::string wrong = WriteFile(dir, "wrong", "nope\n");
  const std::string spec = WriteFile(dir, "job.yaml", "name: tok\n");
  CoordinatorProcess coordinator({"--token-file", token});
  const std::string s = coordinator.address();
  Result r = RunProgram({GEOFP8CTL_BIN, "-s", s, "--token-file", token, "submit", "-f", spec});
  EXPECT_EQ(r.code, 0) << r.output;
  r = RunProgram({GEOFP8CTL_BIN, "-s", s, "--token-file", wrong, "submit", "-f", spec});
  EXPECT_EQ(r.code, 6) << r.output;
  const std::string spec2 = WriteFile(dir, "job2.yaml", "name: tok2\n");  // tok is still live
  r = RunProgram({GEOFP8CTL_BIN, "-s", s, "--token", "s3cret", "submit", "-f", spec2});
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("geofp8ctl: warning: --token: other users can read it in the process "
                          "list; use --token-file or GEOFP8_TOKEN"),
            std::string::npos)
      << r.output;
  // The worker warns the same way.
  ChildProcess worker({GEOFP8_WORKER_BIN, "--coordinator", s, "--token", "s3cret", "--name", "w",
                       "--metrics-port", "-1", "--data-dir", dir.path() + "/w"});
  EXPECT_TRUE(worker.WaitFor("geofp8-worker: warning: --token: other users can read it",
                             std::chrono::milliseconds(20000)))
      << worker.output();
}

// A TCP port on 127.0.0.1 that accepts connections (the kernel completes the handshake into the
// backlog) and never answers: a server that is up but does not respond.
class SilentListener {
 public:
  SilentListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(fd_, 16) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      throw std::runtime_error("silent listener: cannot listen");
    }
    port_ = ntohs(addr.sin_port);
  }
  ~SilentListener() { ::close(fd_); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Every exit code geofp8ctl documents (docs/job-spec.md, its --help), each from a real cause:
// 0 ok, 1 a watched job cancelled, 2 a usage error, 3 an unknown job, 4 nothing listening and a
// server that never answers within --timeout, 5 a name a live job holds, 6 a wrong token.
// (7, a store that cannot be written: DiskFullFaultTest.)
TEST(CliInputTest, EveryDocumentedExitCode) {
  TempDir dir("geofp8-cli");
  const std::string token = WriteFile(dir, "token", "s3cret\n");
  const std::string wrong = WriteFile(dir, "wrong", "S3CRET\n");
  const std::string spec = WriteFile(dir, "job.yaml", "name: codes\nworld_size: 1\n");
  CoordinatorProcess coordinator({"--token-file", token});
  auto ctl = [&](std::vector<std::string> args, const std::string& server = "") {
    std::vector<std::string> argv = {GEOFP8CTL_BIN, "-s",
                                     server.empty() ? coordinator.address() : server,
                                     "--token-file", token};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProgram(argv);
  };
  Result r = ctl({"get", "jobs"});
  EXPECT_EQ(r.code, 0) << r.output;
  r = ctl({"submit", "-f", spec, "-o", "name"});
  ASSERT_EQ(r.code, 0) << r.output;  // pending: no worker
  r = ctl({"submit", "-f", spec});
  EXPECT_EQ(r.code, 5) << r.output;  // the name is live
  r = ctl({"cancel", "codes"});
  EXPECT_EQ(r.code, 0) << r.output;
  r = ctl({"watch", "codes"});
  EXPECT_EQ(r.code, 1) << r.output;  // the watched job was cancelled
  r = ctl({"describe", "job", "job-999999"});
  EXPECT_EQ(r.code, 3) << r.output;
  r = ctl({"get", "jobs", "--no-such-flag"});
  EXPECT_EQ(r.code, 2) << r.output;
  r = ctl({"logs", "codes", "--rank", "-1"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(r.output,
            "geofp8ctl: error: --rank: must be a whole number >= 0 (-1)\n"
            "run 'geofp8ctl --help' for usage\n");
  r = RunProgram(
      {GEOFP8CTL_BIN, "-s", coordinator.address(), "--token-file", wrong, "get", "jobs"});
  EXPECT_EQ(r.code, 6) << r.output;
  r = ctl({"get", "jobs"}, "127.0.0.1:1");
  EXPECT_EQ(r.code, 4) << r.output;
  // Up but silent: every call, unary or a stream's connect, ends at --timeout with exit 4.
  SilentListener silent;
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--timeout", "1", "get", "jobs"},
                                             {"--timeout", "1", "submit", "-f", spec},
                                             {"--timeout", "1", "watch", "job-000001"}}) {
    const auto start = std::chrono::steady_clock::now();
    r = ctl(args, silent.address());
    const double seconds_taken =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(r.code, 4) << args[2] << ": " << r.output;
    EXPECT_NE(r.output.find("within 1"), std::string::npos) << args[2] << ": " << r.output;
    // 1 s, and never a hang: RunProgram gives up after 20 s (-1).
    EXPECT_LT(seconds_taken, 15.0) << args[2];
  }
}

// The coordinator's bearer-token check compares the whole value: a token that is empty, one
// character short, one character long or differently cased is refused like a wrong one.
TEST(CliInputTest, TheTokenMustMatchExactly) {
  TempDir dir("geofp8-cli");
  CoordinatorProcess coordinator({"--token-file", WriteFile(dir, "token", "s3cret\n")});
  auto stub = v1::JobService::NewStub(
      grpc::CreateChannel(coordinator.address(), grpc::InsecureChannelCredentials()));
  auto list = [&](const std::string& authorization) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    ctx.AddMetadata("authorization", authorization);
    v1::ListJobsResponse resp;
    return stub->ListJobs(&ctx, v1::ListJobsRequest(), &resp);
  };
  for (const std::string bad : {"Bearer ", "Bearer s3cre", "Bearer s3cret1", "Bearer S3CRET",
                                "Bearer s3creT", "Bearer", "", "s3cret"}) {
    const grpc::Status s = list(bad);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "'" << bad << "'";
    EXPECT_EQ(s.error_message(), "authorization: wrong token") << "'" << bad << "'";
  }
  EXPECT_TRUE(list("Bearer s3cret").ok());
}

TEST(CliInputTest, ToolRejectsADirectoryAsInput) {
  TempDir dir("geofp8-cli");
  const Result r = RunProgram({GEOFP8_TOOL_BIN, "encode", "--in", dir.path(), "--out",
                               dir.path() + "/x.bin", "--format", "fp8_e4m3"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.output,
            "geofp8-tool: error: in: is a directory, expected a file (" + dir.path() + ")\n");
}

// #40 item 5: `delete job NAME` twice never deletes an older job of the name. #41 item 1: with
// more than gRPC's 4 MiB of jobs (eight 900 KB specs), listings and name resolution still work.
TEST(CliInputTest, DeleteByNameReachesOnlyTheNewestJobAndListingsPage) {
  TempDir dir("geofp8-cli");
  CoordinatorProcess coordinator;
  const std::vector<std::string> ctl = {GEOFP8CTL_BIN, "-s", coordinator.address()};
  auto run = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = ctl;
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProgram(argv);
  };
  // No worker runs: the jobs stay PENDING until cancelled.
  const std::string spec = WriteFile(dir, "twice.yaml", "name: twice\nworld_size: 1\n");
  for (const char* id : {"job-000001", "job-000002"}) {
    Result r = run({"submit", "-f", spec});
    ASSERT_EQ(r.code, 0) << r.output;
    r = run({"cancel", "twice"});
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(std::string("job/") + id + " CANCELLED"), std::string::npos)
        << r.output;
  }
  Result r = run({"delete", "job", "twice"});
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output, "job/job-000002 deleted\n");
  r = run({"delete", "job", "twice"});  // the newest is gone: refused, the older one stays
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_NE(r.output.find("job twice: the newest job of this name, job-000002, was deleted "
                          "already; an older one, job-000001, is deleted only by its id"),
            std::string::npos)
      << r.output;
  r = run({"get", "job", "job-000001", "-o", "name"});
  EXPECT_EQ(r.code, 0) << r.output;
  r = run({"delete", "job", "job-000001"});  // by its id
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output, "job/job-000001 deleted\n");

  const std::string filler = "# " + std::string(900 * 1000, 'x') + "\n";
  for (int i = 0; i < 8; ++i) {
    const std::string big = WriteFile(dir, "big" + std::to_string(i) + ".yaml",
                                      filler + "name: big" + std::to_string(i) + "\n");
    r = run({"submit", "-f", big});
    ASSERT_EQ(r.code, 0) << r.output;
  }
  r = run({"get", "jobs", "-o", "name"});
  EXPECT_EQ(r.code, 0) << r.output.substr(0, 500);
  EXPECT_EQ(r.output,
            "job/job-000010\njob/job-000009\njob/job-000008\njob/job-000007\njob/job-000006\n"
            "job/job-000005\njob/job-000004\njob/job-000003\n");
  r = run({"get", "jobs", "--limit", "3", "-o", "name"});
  EXPECT_EQ(r.output, "job/job-000010\njob/job-000009\njob/job-000008\n") << r.code;
  r = run({"get", "job", "big0", "-o", "name"});  // the oldest, by its name
  EXPECT_EQ(r.code, 0) << r.output.substr(0, 500);
  EXPECT_EQ(r.output, "job/job-000003\n");
  r = run({"cancel", "big0"});
  EXPECT_EQ(r.code, 0) << r.output.substr(0, 500);
  r = run({"get", "workers"});
  EXPECT_EQ(r.code, 0) << r.output;
}

}  // namespace
}  // namespace geofp8::testing
