// One rank of a `command:` job (docs/job-spec.md, "Running your own script"): the worker runs
// the user's program in its own process group with the torchrun environment (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the GEOFP8_* variables, keeps its
// stdout/stderr per rank, serves it the hook channel (hook_server.h) and maps its exit to the
// attempt's end: 0 -> Finished success; a non-zero code or a signal -> Finished failure,
// restartable, so the job's restart policy decides. A Stop ends the whole process group: SIGTERM,
// then SIGKILL after kill_grace.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "worker/daemon/connection.h"
#include "worker/daemon/hook_server.h"
#include "worker/daemon/metrics.h"
#include "worker/daemon/rank_runner.h"

namespace geofp8 {
struct JobSpec;
}  // namespace geofp8

namespace geofp8::worker {

// Who a command job's program runs as and what it may use (SpawnCommand).
struct CommandLimits {
  // The uid and gid the program runs as, with no supplementary groups; unset: the worker's own.
  // Only a worker running as root can switch (CommandIdentity).
  std::optional<std::pair<uid_t, gid_t>> run_as;
  uint64_t max_memory_bytes = 0;    // RLIMIT_DATA (heap and private writable mappings); 0: as is
  uint64_t max_processes = 4096;    // RLIMIT_NPROC (per uid: the job's own with run_as); 0: as is
  uint64_t max_open_files = 65536;  // RLIMIT_NOFILE; 0: as is
};

// The identity of `job_id`'s programs under --command-uid-base BASE: uid and gid BASE + the job's
// number modulo 65536 ("job-000012" -> BASE + 12), the same on every worker and attempt, so that
// two jobs' programs never share a uid (until 65536 jobs later) and a job's ranks on one host do.
std::pair<uid_t, gid_t> CommandIdentity(uint32_t base, const std::string& job_id);

struct CommandRunnerOptions {
  JobRunnerOptions job;     // worker_name, data_dir, advertise_host
  std::string coordinator;  // GEOFP8_COORDINATOR: the worker's --coordinator
  // The worker's bearer token, handed to the program as a 0600 file (GEOFP8_TOKEN_FILE), never
  // in its arguments or environment. Empty: no file.
  std::string token;
  // --allow-commands. Off: the rank fails at once, not restartable, without running anything
  // (the coordinator never places a command job on such a worker; this is the second check).
  bool allow_commands = false;
  // --command-env: names of the worker's own variables the program also gets, beyond
  // CommandEnvironment's fixed list.
  std::vector<std::string> pass_env;
  // The worker's GPU (--device cuda:N), or -1: the program gets CUDA_VISIBLE_DEVICES=N (so it
  // sees that one GPU as cuda:0, LOCAL_RANK 0) and GEOFP8_DEVICE=cuda:0. -1 leaves both alone.
  int cuda_device = -1;
  // --command-uid-base: run each job's program as its own uid (CommandIdentity), in files only
  // that uid (and the worker) can read; 0: as the worker's user. Needs a worker run as root.
  uint32_t command_uid_base = 0;
  CommandLimits limits;                                 // rlimits (run_as is set per job)
  std::chrono::milliseconds kill_grace{5000};           // after SIGTERM, before SIGKILL
  std::chrono::milliseconds rendezvous_timeout{60000};  // ranks > 0 wait for rank 0's address
  // How long the program may run without opening the hook channel before the rank reports it
  // (CommandStatus COMMAND_HOOK_NOT_ATTACHED: the job's note and an event). 0: never.
  std::chrono::milliseconds hook_attach_timeout{120000};
  // An attach-only worker's hook socket (--attach): an external job's rank is the program
  // waiting there, not one the worker starts (RunAttached).
  HookServer* gate = nullptr;
};

// How an attached program (an external job's rank) exits when its rank is stopped
// (docs/launchers.md, "Exit codes"): 0 when the job succeeded meanwhile, kExitCancelled when it
// was cancelled, kExitAttemptEnded when the attempt ended otherwise (a rank failed, a worker was
// lost): its launcher restarts it as the job's next attempt.
inline constexpr int kExitCancelled = 3;
inline constexpr int kExitAttemptEnded = 75;  // EX_TEMPFAIL
int AttachedExitCode(v1::StopCause cause);

// Where a rank of (job, attempt) keeps its files: <data_dir>/jobs/<job>/<attempt>/ (mode 0700),
// holding rank<R>.out and rank<R>.err (0600), the hook socket hook<R>.sock and, while the rank
// runs, the token file rank<R>.token. It is the program's working directory.
std::string CommandJobDir(const std::string& data_dir, const std::string& job_id, int attempt);

// The variables of the worker's environment `environ` a command job's program inherits: a fixed
// list a Python/torch program needs (PATH, HOME, USER, LOGNAME, SHELL, LANG, LANGUAGE, TZ,
// TMPDIR, TERM, LD_LIBRARY_PATH, VIRTUAL_ENV, CUDA_VISIBLE_DEVICES, and every LC_*, PYTHON*,
// OMP_*, OPENBLAS_*, MKL_*, NCCL_*, GLOO_* and TORCH_* name), plus the names in `pass`. Nothing
// else of the worker's (its GEOFP8_TOKEN, credentials of its own) reaches the program; the
// caller then adds torchrun's and the GEOFP8_* variables.
std::map<std::string, std::string> CommandEnvironment(char** environ_,
                                                      const std::vector<std::string>& pass);

// Starts `args` (args[0] looked up in PATH) in `dir` with exactly `env`, stdin /dev/null and
// stdout/stderr appended to `out_path`/`err_path` (created 0600), in a process group of its own,
// under `limits` (its uid and gid, then its rlimits). Every path is opened by the caller before
// the program starts, relative to the caller's working directory. Returns the pid. Throws
// std::runtime_error naming the file when `dir`, `out_path` or `err_path` cannot be opened
// ("stdout: cannot open PATH: ..."), the uid or limit it could not set, and command[0] only when
// the program itself cannot be run.
pid_t SpawnCommand(std::vector<std::string> args, const std::map<std::string, std::string>& env,
                   const std::string& dir, const std::string& out_path, const std::string& err_path,
                   const CommandLimits& limits = {});

class CommandRunner final : public RankRunner {
 public:
  using SendFn = std::function<bool(v1::WorkerMessage message, bool reliable)>;

  CommandRunner(std::shared_ptr<Connection> connection, v1::Assignment assignment,
                CommandRunnerOptions options, SendFn send, WorkerMetrics* metrics);
  ~CommandRunner() override;  // joins

  void Start() override;
  void OfferPolicy(const v1::Policy& policy) override;
  void OfferRefresh(const v1::RefreshSchedules& refresh) override;
  void RequestStop(const std::string& reason, v1::StopCause cause) override;
  void OnCheckpointAcknowledged(int64_t) override {}  // the program owns its checkpoints
  bool done() const override { return done_.load(); }
  const v1::Assignment& assignment() const override { return assignment_; }
  JobOutcome outcome() const;

 private:
  using Clock = std::chrono::steady_clock;

  // One attempt's state shared by the steps of Run (command_runner.cc).
  struct Attempt;

  // The rank's whole attempt: RunProgram, then EndAttempt, the rank's end event and the result
  // file, whatever RunProgram threw.
  JobOutcome Run();
  void LogStarted();  // rank.started (and the job's metrics)
  // The spec's checks, the attempt's files, the hook channel, the rendezvous, the program's
  // spawn and its wait; fills in `out` from its exit. Throws on a failure on the way.
  void RunProgram(Attempt* at, JobOutcome* out);
  // An external job's rank: the program waiting on the gate is admitted, and its stream's end
  // (with or without its HookFinished) is the attempt's end. A Stop is sent down the stream.
  void RunAttached(const JobSpec& spec, Attempt* at, JobOutcome* out);
  // The job's checkpoint directory, created: the spec's checkpoint.dir or one in the job's.
  std::string CreateCheckpointDir(const JobSpec& spec) const;
  // Starts hook_ on the attempt's socket (a /tmp one when its path is too long). Returns it.
  std::string StartHook(const Attempt& at);
  // What a hook channel gets when it opens: the welcome, and every policy version known (mu_).
  v1::HookWelcome Welcome() const;
  std::vector<v1::Policy> KnownPolicies() const;
  // The program's whole environment (CommandEnvironment, torchrun's and the GEOFP8_* ones).
  std::map<std::string, std::string> ProgramEnvironment(const JobSpec& spec,
                                                        const Attempt& at) const;
  // Waits for `pid` to exit, watching the hook's attach and carrying out a Stop on the way
  // (SIGTERM to its group, SIGKILL after kill_grace). Returns its wait status.
  int WaitForExit(pid_t pid, Clock::time_point spawned, Attempt* at);
  // The outcome of a program that exited with `status`, or of a Stop.
  void JudgeExit(int status, Attempt* at, JobOutcome* out) const;
  // With --command-uid-base: gives the attempt's directory, checkpoint directory, token file,
  // spec and hook socket to the job's uid:gid `id`, and lets it pass (0711) the folders above.
  void GiveToProgram(const Attempt& at, std::pair<uid_t, gid_t> id) const;
  // Removes the token file, closes the hook, completes `out`, and reports the end to the
  // metrics and (without a Stop) the coordinator.
  void EndAttempt(const Attempt& at, JobOutcome* out);
  // Rank 0 publishes host:port in the job's rendezvous store; the others read it.
  std::pair<std::string, int> MasterAddress();
  void Relay(const v1::HookMessage& message);
  bool StopRequested(std::string* reason) const;
  void RememberEffectiveStep(const v1::Policy& policy);
  int64_t EffectiveStep(uint64_t version) const;
  // The built-in trainer's rank events (rank_reporter.cc), for a command job's rank.
  void LogPolicyTaken(const v1::PolicyAck& ack);
  void LogProgress(const v1::StepProgress& p);
  void LogEnded(const JobOutcome& out, double seconds);
  // The program's process and hook channel, reported to the coordinator (CommandStatus): it
  // started (the job turns RUNNING when every rank's has), it has not attached within
  // hook_attach_timeout (the job's note), it attached.
  void SendStatus(v1::CommandPhase phase, double seconds);
  // Called from the wait loop: reports the first attach, or the timeout passing without one.
  // Returns whether the program has attached.
  bool WatchAttach(Clock::time_point spawned, bool* noted);

  std::shared_ptr<Connection> connection_;
  v1::Assignment assignment_;
  CommandRunnerOptions options_;
  SendFn send_;
  WorkerMetrics* metrics_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, v1::Policy> policies_;  // every version known, by version
  std::optional<v1::RefreshSchedules> refresh_;
  std::unique_ptr<HookServer> hook_;
  HookServer* channel_ = nullptr;       // hook_, or the gate of an external job's rank; under mu_
  StopRequest stop_;                    // under mu_
  std::atomic<bool> relay_open_{true};  // false once the attempt has ended
  std::atomic<int64_t> last_step_{-1};
  // When the program last reported a step (at first: when the rank started).
  std::atomic<std::chrono::steady_clock::time_point> last_progress_at_{
      std::chrono::steady_clock::now()};
  std::atomic<uint64_t> version_in_force_{0};
  // For the rank events (docs/operations.md): each known version's effective step, under its own
  // mutex (Relay runs on the hook server's thread and never takes mu_), and training.steps.
  mutable std::mutex effective_mu_;
  std::map<uint64_t, int64_t> effective_steps_;
  std::atomic<int64_t> total_steps_{0};
  // The job.progress line's last validation loss (rank 0), under effective_mu_.
  double last_val_loss_ = 0;
  int64_t last_val_step_ = -1;
  std::optional<v1::HookFinished> finished_;  // an attached program's end, under effective_mu_
  std::atomic<bool> done_{false};
  JobOutcome outcome_;
  std::thread thread_;
};

}  // namespace geofp8::worker
