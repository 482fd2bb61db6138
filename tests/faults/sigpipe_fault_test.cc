// A write to a socket or pipe whose reader is gone raises SIGPIPE, which by default ends the
// process without a word. Gloo writes with writev (no MSG_NOSIGNAL), so both daemons ignore it: a
// peer's socket reset inside a collective fails the collective, which the worker logs, and it stays
// up; a daemon whose output pipe is closed keeps serving.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "tests/faults/reference_run.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// The inodes of the TCP sockets `pid` holds open.
std::set<std::string> SocketInodes(pid_t pid) {
  std::set<std::string> out;
  std::error_code ec;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
    if (target.rfind("socket:[", 0) == 0) out.insert(target.substr(8, target.size() - 9));
  }
  return out;
}

// Bytes that arrived on `pid`'s TCP sockets and that it has not read (rx_queue of /proc/net/tcp):
// closing a socket that holds unread bytes sends RST, not FIN.
int64_t UnreadBytes(pid_t pid) {
  const std::set<std::string> inodes = SocketInodes(pid);
  int64_t total = 0;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, st, queues, tr, retrnsmt, uid, timeout, inode;
      f >> sl >> local >> remote >> st >> queues >> tr >> retrnsmt >> uid >> timeout >> inode;
      if (!inodes.count(inode)) continue;
      total += std::stoll(queues.substr(queues.find(':') + 1), nullptr, 16);
    }
  }
  return total;
}

// The `step=` field of the worker's rank.finished/rank.failed line for (job, attempt); -1 if none.
int64_t EndedStep(const std::string& output, const std::string& job, int attempt) {
  std::istringstream lines(output);
  std::string line;
  const std::regex step(" step=([0-9]+)");
  while (std::getline(lines, line)) {
    if (line.find("event=rank.finished") == std::string::npos &&
        line.find("event=rank.failed") == std::string::npos) {
      continue;
    }
    if (line.find("job=" + job) == std::string::npos ||
        line.find(" attempt=" + std::to_string(attempt) + " ") == std::string::npos) {
      continue;
    }
    std::smatch m;
    if (std::regex_search(line, m, step)) return std::stoll(m[1]);
  }
  return -1;
}

TEST(SigpipeFaultTest, APeerResetInsideACollectiveIsLoggedAndTheWorkerStaysUp) {
  // A long heartbeat timeout: the coordinator hears of the peer's death from its closed stream,
  // not from missed beats while the test holds it stopped.
  CoordinatorProcess coordinator({"--heartbeat-timeout-ms", "60000"});
  Client client(coordinator.address());
  const std::vector<std::string> slow = {"--debug-step-delay-ms", "20"};
  WorkerProcess w0(coordinator.address(), "w0", slow), w1(coordinator.address(), "w1", slow),
      spare(coordinator.address(), "spare", slow);
  std::vector<WorkerProcess*> all = {&w0, &w1, &spare};
  ASSERT_TRUE(client.WaitIdle(3, seconds(30)));
  const v1::Job job =
      client.Submit(TinyJobSpec("reset", 80, 5, 10, 2, "exchange: {timeout_s: 60}\n"));
  v1::Job j = client.WaitStep(job.id(), 15, seconds(90));
  ASSERT_EQ(j.state(), v1::JOB_RUNNING) << Describe(j, coordinator, all);
  WorkerProcess *victim = nullptr, *survivor = nullptr;
  for (const auto& w : client.Workers()) {
    if (w.job_id() != job.id()) continue;
    WorkerProcess* p = w.name() == "w0" ? &w0 : w.name() == "w1" ? &w1 : &spare;
    (w.rank() == 1 ? victim : survivor) = p;
  }
  ASSERT_TRUE(victim && survivor) << Describe(j, coordinator, all);

  // Stopped in mid-training, the peer stops reading what the survivor's next collective sends to
  // it; once those bytes wait in its socket, its death resets the connection (RST) under the
  // survivor's collective. If the stop fell where nothing more is sent, its death closes the
  // sockets (FIN) instead, and the survivor's next write meets the reset.
  victim->process().Kill(SIGSTOP);
  const auto deadline = std::chrono::steady_clock::now() + seconds(20);
  int64_t unread = 0;
  while ((unread = UnreadBytes(victim->process().pid())) == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  victim->process().Kill(SIGKILL);
  victim->process().Wait();
  std::printf("peer killed with %lld unread bytes in its sockets (%s)\n", (long long)unread,
              unread > 0 ? "RST" : "FIN");

  // The survivor leaves its collective with the transport's error, logged with the step it had
  // reached, and stays up: attempt 1 runs on it and the spare to the end.
  j = client.WaitFinal(job.id(), seconds(120));
  ASSERT_EQ(j.state(), v1::JOB_SUCCEEDED) << Describe(j, coordinator, all);
  EXPECT_EQ(j.attempt(), 1) << Describe(j, coordinator, all);
  ASSERT_TRUE(survivor->process().running()) << survivor->process().output();
  const std::map<std::string, std::string> left = survivor->Result(job.id(), 0);
  ASSERT_FALSE(left.empty()) << survivor->process().output();
  EXPECT_EQ(left.at("stopped"), "1") << left.at("reason");
  EXPECT_NE(left.at("reason").find("then:"), std::string::npos)
      << "the collective's error is not in the reason: " << left.at("reason");
  // The step it had reached, not 0 (issue #41: a stopped rank's rank.finished said step=0).
  EXPECT_GE(EndedStep(survivor->process().output(), job.id(), 0), 15)
      << survivor->process().output();
  EXPECT_EQ(survivor->Result(job.id(), 1).count("checksum"), 1u) << Describe(j, coordinator, all);
}

// `argv` with stdout and stderr into a pipe that the test closes once the daemon is ready: every
// later log line is a write to a pipe without a reader.
class DeafChild {
 public:
  explicit DeafChild(std::vector<std::string> argv) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::dup2(fds[1], 1);
      ::dup2(fds[1], 2);
      ::close(fds[0]);
      ::close(fds[1]);
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    read_fd_ = fds[0];
  }
  ~DeafChild() {
    if (read_fd_ >= 0) ::close(read_fd_);
    if (status_ < 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  void CloseOutput() {
    ::close(read_fd_);
    read_fd_ = -1;
  }
  // "running", or how it ended ("exit 2", "signal 13").
  std::string State() {
    if (status_ < 0) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) != pid_) return "running";
      status_ = st;
    }
    return WIFEXITED(status_) ? "exit " + std::to_string(WEXITSTATUS(status_))
                              : "signal " + std::to_string(WTERMSIG(status_));
  }

 private:
  pid_t pid_ = -1;
  int read_fd_ = -1;
  int status_ = -1;
};

std::string WaitForFile(const std::string& path, seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    if (text.str().find('}') != std::string::npos) return text.str();
    std::this_thread::sleep_for(milliseconds(20));
  }
  return "";
}

TEST(SigpipeFaultTest, DaemonsKeepServingWhenTheirOutputPipeIsClosed) {
  TempDir dir("geofp8-sigpipe");
  DeafChild coordinator({GEOFP8_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--metrics-listen", "",
                         "--data-dir", dir.path() + "/coord", "--tick-ms", "50", "--ready-file",
                         dir.path() + "/coord.json"});
  const std::string ready = WaitForFile(dir.path() + "/coord.json", seconds(30));
  ASSERT_FALSE(ready.empty()) << "coordinator not ready: " << coordinator.State();
  const std::smatch m = [&] {
    std::smatch out;
    std::regex_search(ready, out, std::regex("\"grpc\": \"([^\"]+)\""));
    return out;
  }();
  ASSERT_EQ(m.size(), 2u) << ready;
  const std::string address = m[1];
  coordinator.CloseOutput();

  DeafChild worker({GEOFP8_WORKER_BIN, "--coordinator", address, "--name", "deaf", "--metrics-port",
                    "0", "--data-dir", dir.path() + "/worker", "--ready-file",
                    dir.path() + "/worker.json"});
  ASSERT_FALSE(WaitForFile(dir.path() + "/worker.json", seconds(30)).empty())
      << "worker not ready: " << worker.State();
  worker.CloseOutput();

  // Registration, the job's placement and its end are logged by both: writes to closed pipes.
  Client client(address);
  ASSERT_TRUE(client.WaitIdle(1, seconds(30)))
      << "coordinator " << coordinator.State() << ", worker " << worker.State();
  const v1::Job done =
      client.WaitFinal(client
                           .Submit("name: deaf\nworld_size: 1\nmodel: {preset: llama-tiny}\n"
                                   "training: {steps: 3, batch_size: 1, seq_len: 8}\n")
                           .id(),
                       seconds(90));
  EXPECT_EQ(done.state(), v1::JOB_SUCCEEDED)
      << done.reason() << "; coordinator " << coordinator.State() << ", worker " << worker.State();
  EXPECT_EQ(coordinator.State(), "running");
  EXPECT_EQ(worker.State(), "running");
  EXPECT_EQ(client.Workers().size(), 1u);
}

}  // namespace
}  // namespace geofp8::testing
