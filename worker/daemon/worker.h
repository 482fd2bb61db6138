// The worker daemon: a session with the coordinator, at most one job rank at a time, and the
// /metrics endpoint. Routes coordinator messages (assignment, policy, refresh, stop) to the rank.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "worker/daemon/command_runner.h"
#include "worker/daemon/connection.h"
#include "worker/daemon/job_runner.h"
#include "worker/daemon/metrics.h"
#include "worker/daemon/rank_runner.h"
#include "worker/daemon/session.h"

namespace geofp8::worker {

struct WorkerOptions {
  ConnectionOptions connection;
  SessionOptions session;
  JobRunnerOptions job;
  // --command-env: more of the worker's variables for command jobs (CommandEnvironment).
  // Whether it runs command jobs at all is session.accepts_commands (--allow-commands).
  std::vector<std::string> command_env;
  // --hook-attach-timeout: how long a command job's program may run without attaching to the
  // GeoFP8 hook before its job gets a note and an event saying so (CommandRunnerOptions).
  std::chrono::milliseconds hook_attach_timeout{120000};
  // --device cuda:N: the GPU a `command:` job's program gets (CUDA_VISIBLE_DEVICES=N); -1: cpu.
  // The built-in trainer runs on CPU whatever the device.
  int cuda_device = -1;
  // --command-uid-base and the command jobs' rlimits (CommandRunnerOptions).
  uint32_t command_uid_base = 0;
  CommandLimits command_limits;
  // --attach PATH: an attach-only worker's hook socket (HookServer::StartGate); empty: none.
  std::string hook_socket;
  std::string metrics_host = "127.0.0.1";
  int metrics_port = 9465;  // 0: a free port; -1: no /metrics
};

class Worker {
 public:
  explicit Worker(WorkerOptions options);
  ~Worker();

  // Opens /metrics, connects and registers (in the background, with backoff). Errors name the
  // flag (--metrics-port, --coordinator, --tls-ca).
  absl::Status Start();
  // Tells the coordinator this worker leaves (`reason`: "SIGTERM", ...), which fences it and
  // restarts its job from the checkpoint on other workers at once; then stops the running rank
  // and closes the session. Returns
  // false if the rank was still inside a collective after `grace`: the caller must then end the
  // process without destroying the Worker.
  bool Shutdown(std::chrono::milliseconds grace, const std::string& reason = "shutdown");

  int metrics_port() const { return metrics_port_; }
  SessionClient* session() { return session_.get(); }

 private:
  void OnMessage(const v1::CoordinatorMessage& message);
  void OnGenerationLost(const std::string& reason);
  // The gate's callbacks: a program's attach (or its withdrawal) to the coordinator, after the
  // token check. Returns why the attach is refused, or "".
  std::string ForwardAttach(const v1::HookAttach& attach, bool withdraw);
  void StartRunner(const v1::Assignment& assignment);  // mu_ held
  void Supervise();

  WorkerOptions options_;
  std::shared_ptr<Connection> connection_;
  std::unique_ptr<WorkerMetrics> metrics_;
  std::unique_ptr<SessionClient> session_;
  int metrics_port_ = -1;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::unique_ptr<HookServer> gate_;       // --attach: the hook socket ranks attach to
  std::unique_ptr<RankRunner> runner_;     // the trainer or a command job's program
  std::optional<v1::Assignment> pending_;  // arrived while the previous rank was winding down
  std::thread supervisor_;
};

}  // namespace geofp8::worker
