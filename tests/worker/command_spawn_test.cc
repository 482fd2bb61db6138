// SpawnCommand, the start of a `command:` job's program (issue #40 item 1): its files are opened
// by the worker relative to the worker's own directory, so a relative job directory and output
// paths work, and a file that cannot be opened is named in the error, not the program.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "tests/common/temp_dir.h"
#include "worker/daemon/command_runner.h"

namespace geofp8::worker {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The error SpawnCommand throws, or "" when it started the program (then waited for).
std::string SpawnError(const std::vector<std::string>& args, const std::string& dir,
                       const std::string& out, const std::string& err) {
  try {
    const pid_t pid = SpawnCommand(args, {{"PATH", "/usr/bin:/bin"}}, dir, out, err);
    int status = 0;
    ::waitpid(pid, &status, 0);
    return "";
  } catch (const std::runtime_error& e) {
    return e.what();
  }
}

// Runs in a temporary directory as the daemon's working directory, then goes back.
class CommandSpawnTest : public ::testing::Test {
 protected:
  void SetUp() override {
    previous_ = std::filesystem::current_path();
    std::filesystem::current_path(cwd_.path());
  }
  void TearDown() override { std::filesystem::current_path(previous_); }

  testing::TempDir cwd_{"geofp8-spawn"};
  std::filesystem::path previous_;
};

// The worker's default --data-dir is relative: the program runs in the job's directory, and its
// output files (given relative to the worker's directory) land there, not one level further.
TEST_F(CommandSpawnTest, ARelativeJobDirectoryAndOutputPathsWork) {
  std::filesystem::create_directories("data/jobs/j1/0");
  const std::string dir = "data/jobs/j1/0";
  const pid_t pid = SpawnCommand({"/bin/sh", "-c", "pwd; echo oops >&2"}, {}, dir,
                                 dir + "/rank0.out", dir + "/rank0.err");
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  const std::string abs_dir = (std::filesystem::path(cwd_.path()) / dir).string();
  EXPECT_EQ(ReadFile(dir + "/rank0.out"), std::filesystem::canonical(abs_dir).string() + "\n");
  EXPECT_EQ(ReadFile(dir + "/rank0.err"), "oops\n");
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + dir));
  EXPECT_EQ(std::filesystem::status(dir + "/rank0.out").permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
}

TEST_F(CommandSpawnTest, AFileThatCannotBeOpenedIsNamedNotTheProgram) {
  std::filesystem::create_directories("job");
  // stdout's folder is missing.
  std::string e = SpawnError({"/bin/true"}, "job", "missing/rank0.out", "job/rank0.err");
  EXPECT_EQ(e, "stdout: cannot open missing/rank0.out: No such file or directory");
  // stderr is a directory.
  std::filesystem::create_directories("job/rank0.err");
  e = SpawnError({"/bin/true"}, "job", "job/rank0.out", "job/rank0.err");
  EXPECT_EQ(e, "stderr: cannot open job/rank0.err: Is a directory");
  // The job directory itself is missing.
  e = SpawnError({"/bin/true"}, "gone", "job/rank1.out", "job/rank1.err");
  EXPECT_EQ(e, "job directory: cannot open gone: No such file or directory");
  // Only a program that cannot run is named as the program.
  e = SpawnError({"/nonexistent/prog"}, "job", "job/rank2.out", "job/rank2.err");
  EXPECT_EQ(e, "command[0]: cannot run '/nonexistent/prog': No such file or directory");
  e = SpawnError({"no-such-geofp8-program"}, "job", "job/rank2.out", "job/rank2.err");
  EXPECT_EQ(e,
            "command[0]: cannot run 'no-such-geofp8-program': No such file or directory "
            "(searched PATH)");
}

// --command-uid-base (issue #41 item 4): a job's uid and gid from its number, wrapping at 65536.
TEST(CommandIdentityTest, IsTheBasePlusTheJobsNumber) {
  EXPECT_EQ(CommandIdentity(200000, "job-000012"), std::make_pair(uid_t(200012), gid_t(200012)));
  EXPECT_EQ(CommandIdentity(200000, "job-065541").first, uid_t(200005));
  EXPECT_NE(CommandIdentity(200000, "job-000001"), CommandIdentity(200000, "job-000002"));
}

// The limits reach the program (lowered from the worker's own, never raised).
TEST_F(CommandSpawnTest, TheProgramRunsUnderItsLimits) {
  std::filesystem::create_directories("job");
  CommandLimits limits;
  limits.max_open_files = 100;
  limits.max_processes = 0;  // as is
  limits.max_memory_bytes = uint64_t(1) << 40;
  const pid_t pid = SpawnCommand({"/bin/sh", "-c", "ulimit -n; ulimit -d"}, {}, "job", "job/out",
                                 "job/err", limits);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  // ulimit -d is in KiB.
  EXPECT_EQ(ReadFile("job/out"), "100\n" + std::to_string((uint64_t(1) << 40) / 1024) + "\n");
}

}  // namespace
}  // namespace geofp8::worker
