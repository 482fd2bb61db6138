// Issue #41 item 4, against the real daemons: with --command-uid-base a command job's program runs
// as its job's own uid and cannot read the worker's token file, its data (results, ready file,
// the data directory's listing) or another job's output, spec and checkpoints: each open fails
// with EACCES. Needs root (the worker switches uids); skipped otherwise.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;

constexpr const char* kToken = "isolation-test-token-0123456789";
constexpr int kUidBase = 200000;

// Opens (or lists) every path argument and prints "PATH ERRNO-NAME" or "PATH ok"; then its uid.
constexpr const char* kProbe =
    "import errno, os, sys\n"
    "for p in sys.argv[1:]:\n"
    "    try:\n"
    "        os.listdir(p) if os.path.isdir(p) else os.close(os.open(p, os.O_RDONLY))\n"
    "        print(p, 'ok')\n"
    "    except OSError as e:\n"
    "        print(p, errno.errorcode[e.errno])\n"
    "print('uid', os.getuid(), os.getgid())\n";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(IsolationFaultTest, ACommandJobReadsNoneOfTheWorkersOrAnotherJobsFiles) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: the worker switches uids";
  TempDir dir("geofp8-isolation");
  // The worker's token where a daemon keeps one: a 0600 file in a folder anyone may pass.
  const std::string secrets = dir.path() + "/secrets";
  std::filesystem::create_directories(secrets);
  ::chmod(dir.path().c_str(), 0755);
  ::chmod(secrets.c_str(), 0755);
  const std::string token_file = secrets + "/token";
  std::ofstream(token_file) << kToken << "\n";
  ::chmod(token_file.c_str(), 0600);
  CoordinatorProcess coordinator({"--token-file", token_file});
  WorkerProcess worker(coordinator.address(), "w0",
                       {"--token-file", token_file, "--allow-commands", "--command-uid-base",
                        std::to_string(kUidBase)});
  Client client(coordinator.address(), kToken);
  ASSERT_TRUE(client.WaitIdle(1, seconds(30))) << worker.process().output();

  // Job A leaves output, a checkpoint and its spec behind.
  v1::Job a = client.Submit(
      "name: iso-a\ncommand: [/bin/sh, -c, 'echo a-secret; echo a-ckpt > "
      "\"$GEOFP8_CHECKPOINT_DIR/ckpt.bin\"; id -u > \"$GEOFP8_CHECKPOINT_DIR/uid\"; "
      "cat /proc/self/limits > \"$GEOFP8_CHECKPOINT_DIR/limits\"']\n");
  a = client.WaitFinal(a.id(), seconds(60));
  ASSERT_EQ(a.state(), v1::JOB_SUCCEEDED) << Describe(a, coordinator, {&worker});
  const std::string data = worker.data_dir();
  const std::string a_dir = data + "/jobs/" + a.id() + "/0";
  const std::string a_ckpt = data + "/jobs/" + a.id() + "/checkpoints";
  // A ran as its own uid, and its files are its own.
  EXPECT_EQ(ReadFile(a_ckpt + "/uid"), std::to_string(kUidBase + 1) + "\n");
  // ... under the job's limits (the worker's defaults; processes counted on its own uid).
  const std::string limits = ReadFile(a_ckpt + "/limits");
  EXPECT_NE(limits.find("Max processes             4096                 4096"), std::string::npos)
      << limits;
  struct stat st {};
  ASSERT_EQ(::stat(a_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, uid_t(kUidBase + 1));
  EXPECT_EQ(st.st_mode & 0777, 0700u);

  // Job B tries to read each of them.
  const std::vector<std::string> targets = {
      token_file,                                     // the worker's token
      data,                                           // the worker's data directory (a listing)
      data + "/ready.json",                           // its ready file
      data + "/results",                              // its result files
      data + "/results/" + a.id() + ".attempt0.txt",  // ... A's
      a_dir,                                          // A's directory
      a_dir + "/rank0.out",                           // A's output
      a_dir + "/job.yaml",                            // A's spec
      a_ckpt + "/ckpt.bin",                           // A's checkpoint
  };
  ASSERT_TRUE(std::filesystem::exists(a_ckpt + "/ckpt.bin"));
  ASSERT_TRUE(std::filesystem::exists(data + "/ready.json"));
  // Its own spec and token file stay readable: the probe opens them too, by the variables.
  std::string spec =
      "name: iso-b\ncommand:\n  - /bin/sh\n  - -c\n"
      "  - exec /usr/bin/python3 -c \"$0\" \"$@\" \"$GEOFP8_JOB_SPEC\" \"$GEOFP8_TOKEN_FILE\"\n"
      "  - |\n";
  std::istringstream probe(kProbe);
  for (std::string line; std::getline(probe, line);) spec += "    " + line + "\n";
  for (const auto& t : targets) spec += "  - " + t + "\n";
  v1::Job b = client.Submit(spec);
  b = client.WaitFinal(b.id(), seconds(60));
  ASSERT_EQ(b.state(), v1::JOB_SUCCEEDED) << Describe(b, coordinator, {&worker});
  const std::string out = ReadFile(data + "/jobs/" + b.id() + "/0/rank0.out");
  std::map<std::string, std::string> result;
  std::istringstream lines(out);
  for (std::string path, verdict; lines >> path >> verdict;) result[path] = verdict;
  for (const auto& t : targets) EXPECT_EQ(result[t], "EACCES") << t << "\n" << out;
  EXPECT_NE(out.find("uid " + std::to_string(kUidBase + 2) + " " + std::to_string(kUidBase + 2)),
            std::string::npos)
      << out;
  // What is its own it reads: its spec and its token file.
  int own_ok = 0;
  for (const auto& [path, verdict] : result)
    own_ok += path.find("/jobs/" + b.id() + "/") != std::string::npos && verdict == "ok";
  EXPECT_EQ(own_ok, 2) << out;
}

}  // namespace
}  // namespace geofp8::testing
