// Test helper: the real geofp8-coordinator as a child process on a free 127.0.0.1 port with a
// temporary data directory, its output kept for failure messages.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/temp_dir.h"

namespace geofp8::testing {

// Runs `argv` with stdout+stderr into a pipe read by a thread; lines are kept. `cwd`: the
// directory it starts in (empty: this process's).
class ChildProcess {
 public:
  explicit ChildProcess(std::vector<std::string> argv, const std::string& cwd = "") {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::dup2(fds[1], 1);
      ::dup2(fds[1], 2);
      ::close(fds[0]);
      ::close(fds[1]);
      if (!cwd.empty() && ::chdir(cwd.c_str()) != 0) {
        std::fprintf(stderr, "chdir %s failed\n", cwd.c_str());
        ::_exit(127);
      }
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      std::fprintf(stderr, "exec %s failed\n", args[0]);
      ::_exit(127);
    }
    ::close(fds[1]);
    reader_ = std::thread([this, fd = fds[0]] {
      FILE* f = ::fdopen(fd, "r");
      char buf[4096];
      while (std::fgets(buf, sizeof buf, f)) {
        std::lock_guard<std::mutex> lock(mu_);
        output_ += buf;
      }
      std::fclose(f);
    });
  }
  ~ChildProcess() {
    Kill(SIGKILL);
    Wait();
    if (reader_.joinable()) reader_.join();
  }
  std::string output() {
    std::lock_guard<std::mutex> lock(mu_);
    return output_;
  }
  pid_t pid() const { return pid_; }
  void Kill(int sig) {
    if (pid_ > 0 && !exited_) ::kill(pid_, sig);
  }
  // Exit status (or 128 + signal); waits at most `timeout`, then returns -1.
  int Wait(std::chrono::milliseconds timeout = std::chrono::milliseconds(30000)) {
    if (exited_) return status_;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      int st = 0;
      const pid_t r = ::waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        // The pipe reaches EOF now that the child is gone: collect the rest of its output.
        if (reader_.joinable()) reader_.join();
        return status_;
      }
      if (std::chrono::steady_clock::now() > deadline) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  bool running() { return Wait(std::chrono::milliseconds(0)) == -1; }
  // Waits until the output contains `text`; returns false on timeout or exit.
  bool WaitFor(const std::string& text, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (output().find(text) != std::string::npos) return true;
      if (!running()) return output().find(text) != std::string::npos;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = -1;
  std::thread reader_;
  std::mutex mu_;
  std::string output_;
};

// geofp8-coordinator on 127.0.0.1:0; address() is host:port once it serves.
class CoordinatorProcess {
 public:
  explicit CoordinatorProcess(std::vector<std::string> extra = {}) : dir_("geofp8-coord") {
    // --debug-kv-any-job: grpc_store_test drives the rendezvous KV with made-up job ids. Drop it
    // once that test runs real jobs; tests/faults/kv_limits_test checks the production default.
    std::vector<std::string> argv = {GEOFP8_COORDINATOR_BIN,
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--metrics-listen",
                                     "",
                                     "--data-dir",
                                     dir_.path(),
                                     "--tick-ms",
                                     "50",
                                     "--debug-kv-any-job"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    proc_ = std::make_unique<ChildProcess>(argv);
    if (!proc_->WaitFor("serving on", std::chrono::seconds(20))) {
      throw std::runtime_error("coordinator did not start: " + proc_->output());
    }
    const std::string out = proc_->output();
    const size_t at = out.find("serving on ") + 11;
    const std::string hostport = out.substr(at, out.find(' ', at) - at);
    address_ = hostport;
  }
  const std::string& address() const { return address_; }
  const std::string& data_dir() const { return dir_.path(); }
  ChildProcess& process() { return *proc_; }

 private:
  TempDir dir_;
  std::unique_ptr<ChildProcess> proc_;
  std::string address_;
};

}  // namespace geofp8::testing
