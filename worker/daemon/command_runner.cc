// A `command:` job's rank (see command_runner.h): rendezvous for MASTER_ADDR/MASTER_PORT, the
// hook server, fork and exec into a new process group (as the job's own uid with
// --command-uid-base), then a wait loop that also carries out a
// Stop (SIGTERM to the group, SIGKILL after the grace).
#include "worker/daemon/command_runner.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string_view>
#include <tuple>

#include "kernels/common/check.h"
#include "platform/common/log.h"
#include "platform/common/status_error.h"
#include "platform/policy/job_spec.h"
#include "worker/daemon/grpc_store.h"
#include "worker/daemon/log.h"

extern char** environ;

namespace geofp8::worker {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

// Failures of a command rank are the job's reason as users read it: the message alone, without
// GEOFP8_CHECK's source location.
template <typename... Args>
[[noreturn]] void Fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw std::runtime_error(os.str());
}
template <typename... Args>
void Require(bool ok, const Args&... args) {
  if (!ok) Fail(args...);
}

// How often the wait loop looks at the program and at a pending Stop.
constexpr milliseconds kPollInterval{20};
// The rendezvous key under the attempt's prefix where rank 0 publishes "host:port".
constexpr const char* kMasterKey = "command/master";
// A Unix socket path must fit sockaddr_un.sun_path (108 bytes with its NUL).
constexpr size_t kMaxSocketPath = 107;

// A free TCP port on this host: bound with port 0 and released. Like torchrun's, the program
// binds it again a moment later; another process taking it meanwhile is possible but rare.
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  Require(fd >= 0, "MASTER_PORT: socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  ::close(fd);
  Require(ok, "MASTER_PORT: cannot find a free port: ", std::strerror(err));
  return ntohs(addr.sin_port);
}

std::string SignalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? "SIG" + std::string(abbrev) : "signal " + std::to_string(sig);
}

void WriteTokenFile(const std::string& path, const std::string& token) {
  ::unlink(path.c_str());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  Require(fd >= 0, "token file: cannot create ", path, ": ", std::strerror(errno));
  const std::string text = token + "\n";
  const bool ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size());
  ::close(fd);
  Require(ok, "token file: cannot write ", path);
}

// The result file holds one key=value per line.
std::string OneLine(std::string text) {
  std::replace(text.begin(), text.end(), '\n', '|');
  return text;
}

// The attempt's directory, the program's working directory: only the worker's user may enter it
// (the hook socket and the token file live here).
void CreateJobDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  Require(!ec, "job directory: cannot create ", dir, ": ", ec.message());
  ::chmod(dir.c_str(), 0700);
}

// The job's spec as the coordinator holds it: the hook library reads its exchange and
// geometry_refresh sections (GEOFP8_JOB_SPEC). Returns the file's path.
std::string WriteJobSpec(const std::string& dir, const std::string& spec_yaml) {
  const std::string spec_path = dir + "/job.yaml";
  std::ofstream f(spec_path, std::ios::trunc);
  f << spec_yaml;
  Require(bool(f), "job spec: cannot write ", spec_path);
  return spec_path;
}

// Opens `path` for the program, close-on-exec (posix_spawn duplicates it onto 0, 1 or 2). An
// error names `what` and the file: opened here rather than by posix_spawn, whose failure could not
// tell a file it cannot open from a program it cannot run.
int OpenForProgram(const char* what, const std::string& path, int flags, mode_t mode) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  Require(fd >= 0, what, ": cannot open ", path, ": ", std::strerror(errno));
  return fd;
}

// Closes the descriptors it holds when it goes.
struct Fds {
  std::vector<int> fds;
  ~Fds() {
    for (int fd : fds) ::close(fd);
  }
  int Add(int fd) {
    fds.push_back(fd);
    return fd;
  }
};

// What the child failed at before its program ran, sent to the parent over a pipe.
struct ChildFailure {
  int stage;  // 0 chdir, 1 groups, 2 gid, 3 uid, 4 memory limit, 5 process limit, 6 file limit,
              // 7 exec
  int error;  // errno
};

// In the child between fork and exec: only async-signal-safe calls. Sets up and execs; on a
// failure writes it to `report` and exits 127.
[[noreturn]] void ChildExec(const std::vector<const char*>& candidates, char* const* argv,
                            char* const* envp, int dir_fd, int null_fd, int out_fd, int err_fd,
                            const CommandLimits& limits, int report) {
  auto fail = [report](int stage) {
    const ChildFailure f{stage, errno};
    [[maybe_unused]] ssize_t n = ::write(report, &f, sizeof f);
    ::_exit(127);
  };
  ::setpgid(0, 0);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig : {SIGTERM, SIGINT, SIGPIPE, SIGHUP, SIGCHLD, SIGQUIT, SIGUSR1, SIGUSR2}) {
    ::sigaction(sig, &dfl, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::dup2(null_fd, 0);
  ::dup2(out_fd, 1);
  ::dup2(err_fd, 2);
  if (::fchdir(dir_fd) != 0) fail(0);
  if (limits.run_as) {
    if (::setgroups(0, nullptr) != 0) fail(1);
    if (::setgid(limits.run_as->second) != 0) fail(2);
    if (::setuid(limits.run_as->first) != 0) fail(3);
  }
  const std::pair<int, uint64_t> rlimits[] = {{RLIMIT_DATA, limits.max_memory_bytes},
                                              {RLIMIT_NPROC, limits.max_processes},
                                              {RLIMIT_NOFILE, limits.max_open_files}};
  for (int i = 0; i < 3; ++i) {
    if (rlimits[i].second == 0) continue;
    struct rlimit r = {rlimits[i].second, rlimits[i].second};
    // A limit only ever lowers the worker's own hard one (raising it needs CAP_SYS_RESOURCE,
    // which a container's root often lacks).
    struct rlimit now {};
    if (::getrlimit(rlimits[i].first, &now) == 0 && now.rlim_max < r.rlim_max) {
      r.rlim_cur = r.rlim_max = now.rlim_max;
    }
    if (::setrlimit(rlimits[i].first, &r) != 0) fail(4 + i);
  }
  // As execvp: the first candidate that runs; else the most telling error (not ENOENT).
  int error = ENOENT;
  for (const char* path : candidates) {
    ::execve(path, argv, envp);
    if (errno != ENOENT && errno != ENOTDIR) error = errno;
  }
  errno = error;
  fail(7);
  ::_exit(127);  // not reached: fail exits
}

// Where `program` may be: itself when it holds a '/', else each directory of the worker's PATH.
std::vector<std::string> ProgramCandidates(const std::string& program) {
  if (program.find('/') != std::string::npos) return {program};
  const char* path = std::getenv("PATH");
  std::string dirs = path && *path ? path : "/usr/local/bin:/usr/bin:/bin";
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t colon = dirs.find(':', start);
    const std::string dir = dirs.substr(start, colon - start);
    out.push_back((dir.empty() ? "." : dir) + "/" + program);
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  return out;
}

}  // namespace

std::pair<uid_t, gid_t> CommandIdentity(uint32_t base, const std::string& job_id) {
  uint32_t number = 0;
  size_t digits = job_id.size();
  while (digits > 0 && std::isdigit(static_cast<unsigned char>(job_id[digits - 1]))) --digits;
  if (digits < job_id.size()) {
    for (size_t i = digits; i < job_id.size() && i < digits + 9; ++i) {
      number = number * 10 + uint32_t(job_id[i] - '0');
    }
  } else {
    number = uint32_t(std::hash<std::string>()(job_id));  // not a coordinator's id
  }
  const uint32_t id = base + number % 65536;
  return {uid_t(id), gid_t(id)};
}

pid_t SpawnCommand(std::vector<std::string> args, const std::map<std::string, std::string>& env,
                   const std::string& dir, const std::string& out_path, const std::string& err_path,
                   const CommandLimits& limits) {
  Require(!args.empty(), "command: empty");
  const std::string& program = args[0];
  // Every file the program starts with is opened here, relative to the worker's own working
  // directory: the child changes into `dir` only after (by descriptor).
  Fds fds;
  const int dir_fd = fds.Add(OpenForProgram("job directory", dir, O_RDONLY | O_DIRECTORY, 0));
  const int null_fd = fds.Add(OpenForProgram("stdin", "/dev/null", O_RDONLY, 0));
  // Only the worker's user reads a program's output (it may print anything it can read).
  const int out_fd =
      fds.Add(OpenForProgram("stdout", out_path, O_WRONLY | O_CREAT | O_APPEND, 0600));
  const int err_fd =
      fds.Add(OpenForProgram("stderr", err_path, O_WRONLY | O_CREAT | O_APPEND, 0600));

  // Everything the child needs is built before fork: after it, only system calls.
  std::vector<std::string> env_text;
  for (const auto& [k, v] : env) env_text.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& s : env_text) envp.push_back(s.data());
  envp.push_back(nullptr);
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  const std::vector<std::string> candidates = ProgramCandidates(program);
  std::vector<const char*> candidate_ptrs;
  for (const auto& c : candidates) candidate_ptrs.push_back(c.c_str());
  int report[2];
  Require(::pipe2(report, O_CLOEXEC) == 0, "command: pipe: ", std::strerror(errno));
  fds.Add(report[0]);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ChildExec(candidate_ptrs, argv.data(), envp.data(), dir_fd, null_fd, out_fd, err_fd, limits,
              report[1]);
  }
  ::close(report[1]);
  Require(pid > 0, "command: fork: ", std::strerror(errno));
  ::setpgid(pid, pid);  // also here, so a Stop right away reaches the group
  ChildFailure f{};
  ssize_t n;
  while ((n = ::read(report[0], &f, sizeof f)) < 0 && errno == EINTR) {
  }
  if (n <= 0) return pid;  // the pipe closed at exec: the program runs
  int status = 0;
  ::waitpid(pid, &status, 0);
  const std::string error = std::strerror(f.error);
  const std::string who = limits.run_as ? std::to_string(limits.run_as->first) + ":" +
                                              std::to_string(limits.run_as->second)
                                        : std::string();
  switch (f.stage) {
    case 0:
      Fail("job directory: cannot enter ", dir, ": ", error);
    case 1:
    case 2:
    case 3:
      Fail("command: cannot run as uid:gid ", who, " (--command-uid-base needs a worker run as ",
           "root): ", error);
    case 4:
      Fail("command: cannot limit memory to ", limits.max_memory_bytes, " bytes: ", error);
    case 5:
      Fail("command: cannot limit processes to ", limits.max_processes, ": ", error);
    case 6:
      Fail("command: cannot limit open files to ", limits.max_open_files, ": ", error);
    default: {
      std::string where;
      if (program.find('/') == std::string::npos)
        where = " (searched PATH)";
      else if (program[0] != '/')
        where = " (relative to " + dir + ")";
      Fail("command[0]: cannot run '", program, "': ", error, where);
    }
  }
}

namespace {

// <data_dir>/results/<job>.attempt<N>.txt: the attempt's end, one key=value a line.
void WriteResultFile(const std::string& data_dir, const v1::Assignment& a, const std::string& dir,
                     const JobOutcome& out) {
  std::error_code ec;
  const std::filesystem::path results = std::filesystem::path(data_dir) / "results";
  std::filesystem::create_directories(results, ec);
  ::chmod(results.c_str(), 0700);  // the worker's alone, even where jobs run as other uids
  std::ofstream f(results / (a.job_id() + ".attempt" + std::to_string(a.attempt()) + ".txt"));
  f << "job=" << a.job_id() << "\nattempt=" << a.attempt() << "\nrank=" << a.rank()
    << "\nsuccess=" << (out.success ? 1 : 0) << "\nstopped=" << (out.stopped ? 1 : 0)
    << "\nsteps=" << out.steps << "\npolicy_version=" << out.policy_version
    << "\ncommand_dir=" << dir << "\nreason=" << OneLine(out.reason) << "\n";
}

}  // namespace

std::string CommandJobDir(const std::string& data_dir, const std::string& job_id, int attempt) {
  return (std::filesystem::path(data_dir) / "jobs" / job_id / std::to_string(attempt)).string();
}

std::map<std::string, std::string> CommandEnvironment(char** environ_,
                                                      const std::vector<std::string>& pass) {
  static const std::set<std::string_view> kNames = {"PATH",
                                                    "HOME",
                                                    "USER",
                                                    "LOGNAME",
                                                    "SHELL",
                                                    "LANG",
                                                    "LANGUAGE",
                                                    "TZ",
                                                    "TMPDIR",
                                                    "TERM",
                                                    "LD_LIBRARY_PATH",
                                                    "VIRTUAL_ENV",
                                                    "CUDA_VISIBLE_DEVICES"};
  static const std::string_view kPrefixes[] = {"LC_",  "PYTHON", "OMP_",  "OPENBLAS_",
                                               "MKL_", "NCCL_",  "GLOO_", "TORCH_"};
  const std::set<std::string> extra(pass.begin(), pass.end());
  std::map<std::string, std::string> env;
  for (char** e = environ_; e && *e; ++e) {
    const std::string_view kv = *e;
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    const std::string_view name = kv.substr(0, eq);
    bool keep = kNames.count(name) > 0 || extra.count(std::string(name)) > 0;
    for (std::string_view p : kPrefixes) keep = keep || name.substr(0, p.size()) == p;
    if (keep) env[std::string(name)] = std::string(kv.substr(eq + 1));
  }
  return env;
}

CommandRunner::CommandRunner(std::shared_ptr<Connection> connection, v1::Assignment assignment,
                             CommandRunnerOptions options, SendFn send, WorkerMetrics* metrics)
    : connection_(std::move(connection)),
      assignment_(std::move(assignment)),
      options_(std::move(options)),
      send_(std::move(send)),
      metrics_(metrics) {
  // The program runs in a directory of its own and gets these paths: relative ones would name
  // other files from there (the daemon resolves --data-dir; this holds for any caller).
  std::error_code ec;
  const auto data_dir = std::filesystem::absolute(options_.job.data_dir, ec);
  if (!ec) options_.job.data_dir = data_dir.lexically_normal().string();
  for (const auto& p : assignment_.policy_history()) policies_.emplace(p.version(), p);
  policies_.emplace(assignment_.policy().version(), assignment_.policy());
  for (const auto& [v, p] : policies_) RememberEffectiveStep(p);
}

void CommandRunner::RememberEffectiveStep(const v1::Policy& policy) {
  std::lock_guard<std::mutex> lock(effective_mu_);
  effective_steps_.emplace(policy.version(), policy.effective_step());
}

int64_t CommandRunner::EffectiveStep(uint64_t version) const {
  std::lock_guard<std::mutex> lock(effective_mu_);
  const auto it = effective_steps_.find(version);
  return it == effective_steps_.end() ? -1 : it->second;
}

void CommandRunner::LogPolicyTaken(const v1::PolicyAck& ack) {
  const v1::Assignment& a = assignment_;
  const int64_t step = ack.has_step() ? ack.step() : last_step_.load() + 1;
  log::Info("policy.taken")
      .F("job", a.job_id())
      .F("attempt", a.attempt())
      .F("rank", a.rank())
      .F("version", ack.version())
      .F("step", step)
      .F("effective_step", EffectiveStep(ack.version()))
      .Msg("policy v" + std::to_string(ack.version()) + " in force from step " +
           std::to_string(step) + " (the program's hook)");
}

void CommandRunner::LogProgress(const v1::StepProgress& p) {
  double val_loss = 0;
  int64_t val_step = -1;
  {
    std::lock_guard<std::mutex> lock(effective_mu_);
    if (p.has_val_loss()) {
      last_val_loss_ = p.val_loss();
      last_val_step_ = p.step();
    }
    val_loss = last_val_loss_;
    val_step = last_val_step_;
  }
  const int every = options_.job.log_progress_every;
  if (assignment_.rank() != 0 || every <= 0 || (p.step() + 1) % every != 0) return;
  log::Event e(log::Level::kInfo, "job.progress");
  e.F("job", assignment_.job_id())
      .F("attempt", assignment_.attempt())
      .F("rank", assignment_.rank())
      .F("step", p.step())
      .F("loss", p.loss())
      .F("tokens_per_second", p.tokens_per_second())
      .F("policy_version", p.policy_version());
  if (val_step >= 0) e.F("val_loss", val_loss).F("val_step", val_step);
  const int64_t total = total_steps_.load();
  e.Msg("step " + std::to_string(p.step() + 1) +
        (total > 0 ? "/" + std::to_string(total) : std::string()));
}

void CommandRunner::LogEnded(const JobOutcome& out, double seconds) {
  const bool failed = !out.success && !out.stopped;
  log::Event e(failed ? log::Level::kError : log::Level::kInfo,
               failed ? "rank.failed" : "rank.finished");
  e.F("job", assignment_.job_id())
      .F("attempt", assignment_.attempt())
      .F("rank", assignment_.rank())
      .F("step", out.steps);
  if (!failed) e.F("result", out.success ? "succeeded" : out.cancelled ? "cancelled" : "stopped");
  e.F("seconds", seconds).Msg(out.reason);
}

void CommandRunner::SendStatus(v1::CommandPhase phase, double seconds) {
  v1::WorkerMessage m;
  m.mutable_command_status()->set_job_id(assignment_.job_id());
  m.mutable_command_status()->set_attempt(assignment_.attempt());
  m.mutable_command_status()->set_phase(phase);
  m.mutable_command_status()->set_seconds(seconds);
  send_(std::move(m), true);
}

bool CommandRunner::WatchAttach(Clock::time_point spawned, bool* noted) {
  const double seconds = std::chrono::duration<double>(Clock::now() - spawned).count();
  if (channel_->attaches() > 0) {
    SendStatus(v1::COMMAND_HOOK_ATTACHED, seconds);
    return true;
  }
  if (!*noted && options_.hook_attach_timeout.count() > 0 &&
      Clock::now() - spawned >= options_.hook_attach_timeout) {
    *noted = true;
    log::Warn("rank.hook_not_attached")
        .F("job", assignment_.job_id())
        .F("attempt", assignment_.attempt())
        .F("rank", assignment_.rank())
        .F("seconds", seconds)
        .Msg("the program has not attached to the GeoFP8 hook (" + channel_->address() + ")");
    SendStatus(v1::COMMAND_HOOK_NOT_ATTACHED, seconds);
  }
  return false;
}

CommandRunner::~CommandRunner() {
  if (thread_.joinable()) thread_.join();
}

void CommandRunner::Start() {
  thread_ = std::thread([this] {
    JobOutcome o = Run();
    {
      std::lock_guard<std::mutex> lock(mu_);
      outcome_ = o;
      done_ = true;
    }
    cv_.notify_all();
  });
}

JobOutcome CommandRunner::outcome() const {
  std::lock_guard<std::mutex> lock(mu_);
  return outcome_;
}

void CommandRunner::OfferPolicy(const v1::Policy& policy) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!policies_.emplace(policy.version(), policy).second) return;
  RememberEffectiveStep(policy);
  if (channel_) channel_->OfferPolicy(policy);
}

void CommandRunner::OfferRefresh(const v1::RefreshSchedules& refresh) {
  std::lock_guard<std::mutex> lock(mu_);
  refresh_ = refresh;
  if (channel_) channel_->OfferRefresh(refresh);
}

void CommandRunner::RequestStop(const std::string& reason, v1::StopCause cause) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.Record(reason, cause);
  }
  cv_.notify_all();
}

bool CommandRunner::StopRequested(std::string* reason) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (reason) *reason = stop_.reason;
  return !stop_.reason.empty();
}

std::pair<std::string, int> CommandRunner::MasterAddress() {
  GrpcStore store(connection_, assignment_.job_id(), assignment_.rendezvous_prefix());
  if (assignment_.rank() == 0) {
    const int port = FreePort();
    const std::string value = options_.job.advertise_host + ":" + std::to_string(port);
    store.Set(kMasterKey, std::vector<uint8_t>(value.begin(), value.end()));
    return {options_.job.advertise_host, port};
  }
  // In short waits, so that a Stop (rank 0 never came) ends the wait promptly.
  const auto deadline = Clock::now() + options_.rendezvous_timeout;
  for (;;) {
    std::string reason;
    Require(!StopRequested(&reason), "stopped waiting for rank 0's MASTER_ADDR: ", reason);
    try {
      const std::vector<uint8_t> v = store.Get(kMasterKey, milliseconds(1000));
      const std::string text(v.begin(), v.end());
      const size_t colon = text.rfind(':');
      Require(colon != std::string::npos, "rank 0 published a bad address '", text, "'");
      return {text.substr(0, colon), std::stoi(text.substr(colon + 1))};
    } catch (const Error& e) {
      if (Clock::now() >= deadline) {
        Fail("rank 0 did not publish MASTER_ADDR/MASTER_PORT within ",
             options_.rendezvous_timeout.count(), " ms (", e.what(), ")");
      }
      if (dynamic_cast<const StoreTimeoutError*>(&e) == nullptr) {
        std::this_thread::sleep_for(milliseconds(200));  // not a wait that ran out: back off
      }
    }
  }
}

void CommandRunner::Relay(const v1::HookMessage& h) {
  if (!relay_open_.load()) return;  // a straggler after the attempt ended
  const bool rank0 = assignment_.rank() == 0;
  v1::WorkerMessage m;
  bool reliable = false;
  switch (h.body_case()) {
    case v1::HookMessage::kCatalog:
      if (!rank0) return;  // the schedule follows rank 0's catalog, as for the trainer
      *m.mutable_catalog() = h.catalog();
      reliable = true;
      break;
    case v1::HookMessage::kProgress: {
      const v1::StepProgress& p = h.progress();
      int64_t prev = last_step_.load();
      while (p.step() > prev && !last_step_.compare_exchange_weak(prev, p.step())) {
      }
      if (metrics_) {
        // A program that reports no step time (StepProgress.step_seconds 0): the time between
        // its reports stands in for it, and the exchange's share is unknown (0).
        const auto now = Clock::now();
        const double between =
            std::chrono::duration<double>(now - last_progress_at_.exchange(now)).count();
        metrics_->Step(
            p.step(), p.loss(), p.tokens_per_second(),
            {p.step_seconds() > 0 ? p.step_seconds() : between, p.exchange_seconds(), 0.0}, false);
        if (p.has_val_loss()) metrics_->ValidationLoss(p.step(), p.val_loss());
      }
      LogProgress(p);
      *m.mutable_progress() = p;
      break;
    }
    case v1::HookMessage::kSummaries:
      if (!rank0) return;
      if (metrics_) {
        for (const auto& l : h.summaries().layers()) {
          metrics_->LayerError(l.layer(), l.rel_fro_error());
        }
      }
      *m.mutable_summaries() = h.summaries();
      break;
    case v1::HookMessage::kProbes:
      if (!rank0) return;
      *m.mutable_probes() = h.probes();
      break;
    case v1::HookMessage::kCheckpoint:
      *m.mutable_checkpoint() = h.checkpoint();
      m.mutable_checkpoint()->set_job_id(assignment_.job_id());
      m.mutable_checkpoint()->set_attempt(assignment_.attempt());
      if (metrics_) metrics_->Checkpoint(h.checkpoint().step());
      reliable = true;
      break;
    case v1::HookMessage::kFinished: {
      std::lock_guard<std::mutex> lock(effective_mu_);
      finished_ = h.finished();
      return;
    }
    case v1::HookMessage::kPolicyAck:
      version_in_force_ = h.policy_ack().version();
      if (metrics_) metrics_->PolicyVersion(h.policy_ack().version());
      LogPolicyTaken(h.policy_ack());
      *m.mutable_policy_ack() = h.policy_ack();
      m.mutable_policy_ack()->set_job_id(assignment_.job_id());
      m.mutable_policy_ack()->set_attempt(assignment_.attempt());
      // Rank 0's ack with its step is what the coordinator records as the version's taken_step
      // (a resumed attempt replays by it): reliable, as the built-in trainer sends it.
      reliable = rank0 && h.policy_ack().has_step();
      break;
    default:
      return;
  }
  send_(std::move(m), reliable);
}

// What the steps of Run share about one attempt: where its files are and how far it got.
struct CommandRunner::Attempt {
  std::string rank;            // the rank, as text
  std::string dir;             // CommandJobDir: the program's working directory
  std::string program;         // spec.command[0]
  std::string token_file;      // written while the program runs; empty: none
  std::string checkpoint_dir;  // GEOFP8_CHECKPOINT_DIR
  std::string spec_path;       // GEOFP8_JOB_SPEC
  std::string socket;          // the hook channel's Unix socket
  std::string master_addr;
  int master_port = 0;
  std::string out_path;  // the program's stdout
  std::string err_path;  // ... and stderr
  bool restartable = false;
  bool ran = false;       // the program's process started
  bool attached = false;  // ... and opened the hook channel
};

void CommandRunner::LogStarted() {
  const v1::Assignment& a = assignment_;
  const std::string rank = std::to_string(a.rank());
  if (metrics_) metrics_->JobStarted(a.job_id(), a.rank(), a.world_size());
  log::Info("rank.started")
      .F("job", a.job_id())
      .F("attempt", a.attempt())
      .F("rank", a.rank())
      .F("world_size", a.world_size())
      .F("step", a.resume_step())
      .Msg("starting rank " + rank + " of " + std::to_string(a.world_size()) + " as a command" +
           (a.resume_step() > 0 ? " from checkpoint step " + std::to_string(a.resume_step())
                                : std::string()));
}

std::string CommandRunner::CreateCheckpointDir(const JobSpec& spec) const {
  const v1::Assignment& a = assignment_;
  // Checkpoints: the spec's directory (inside --data-dir) per job, else one in the job's.
  std::filesystem::path ckpt =
      std::filesystem::path(options_.job.data_dir) / "jobs" / a.job_id() / "checkpoints";
  if (!spec.checkpoint.dir.empty()) {
    const auto inside = ResolveInDataDir(options_.job.data_dir, spec.checkpoint.dir);
    Require(inside.has_value(), "checkpoint.dir: must stay inside the data directory ",
            options_.job.data_dir, " (", spec.checkpoint.dir, ")");
    ckpt = std::filesystem::path(*inside) / a.job_id();
  }
  std::error_code ec;
  std::filesystem::create_directories(ckpt, ec);
  Require(!ec, "checkpoint directory: cannot create ", ckpt.string(), ": ", ec.message());
  return ckpt.string();
}

v1::HookWelcome CommandRunner::Welcome() const {
  const v1::Assignment& a = assignment_;
  v1::HookWelcome w;
  w.set_job_id(a.job_id());
  w.set_attempt(a.attempt());
  w.set_rank(a.rank());
  w.set_world_size(a.world_size());
  w.set_resume_step(a.resume_step());
  return w;
}

std::vector<v1::Policy> CommandRunner::KnownPolicies() const {
  std::vector<v1::Policy> policies;
  for (const auto& [v, p] : policies_) policies.push_back(p);
  return policies;
}

std::string CommandRunner::StartHook(const Attempt& at) {
  const v1::Assignment& a = assignment_;
  std::string socket = at.dir + "/hook" + at.rank + ".sock";
  if (socket.size() > kMaxSocketPath) {
    socket = "/tmp/geofp8-hook-" + std::to_string(::getpid()) + "-" + a.job_id() + "-" +
             std::to_string(a.attempt()) + "-" + at.rank + ".sock";
  }
  std::lock_guard<std::mutex> lock(mu_);
  hook_ = ValueOrThrow(HookServer::Start(socket, Welcome(), KnownPolicies(),
                                         [this](const v1::HookMessage& m) { Relay(m); }));
  channel_ = hook_.get();
  if (refresh_) hook_->OfferRefresh(*refresh_);
  return socket;
}

std::map<std::string, std::string> CommandRunner::ProgramEnvironment(const JobSpec& spec,
                                                                     const Attempt& at) const {
  const v1::Assignment& a = assignment_;
  // The environment: the documented part of the worker's own, plus torchrun's and GeoFP8's.
  std::map<std::string, std::string> env = CommandEnvironment(environ, options_.pass_env);
  env["RANK"] = at.rank;
  env["WORLD_SIZE"] = std::to_string(a.world_size());
  env["LOCAL_RANK"] = "0";  // one rank per worker
  env["LOCAL_WORLD_SIZE"] = "1";
  if (options_.cuda_device >= 0) {
    env["CUDA_VISIBLE_DEVICES"] = std::to_string(options_.cuda_device);
    env["GEOFP8_DEVICE"] = "cuda:0";  // the one visible GPU, at index LOCAL_RANK
  }
  env["MASTER_ADDR"] = at.master_addr;
  env["MASTER_PORT"] = std::to_string(at.master_port);
  env["GEOFP8_COORDINATOR"] = options_.coordinator;
  env["GEOFP8_JOB_ID"] = a.job_id();
  env["GEOFP8_ATTEMPT"] = std::to_string(a.attempt());
  env["GEOFP8_HOOK_ADDRESS"] = "unix:" + at.socket;
  env["GEOFP8_RESUME_STEP"] = std::to_string(a.resume_step());
  env["GEOFP8_CHECKPOINT_DIR"] = at.checkpoint_dir;
  env["GEOFP8_JOB_SPEC"] = at.spec_path;
  // The spec's collective timeout, which GeoFP8State takes unless given timeout_s itself.
  env["GEOFP8_EXCHANGE_TIMEOUT_S"] = std::to_string(spec.exchange.timeout_s);
  if (!at.token_file.empty()) env["GEOFP8_TOKEN_FILE"] = at.token_file;
  return env;
}

int CommandRunner::WaitForExit(pid_t pid, Clock::time_point spawned, Attempt* at) {
  const v1::Assignment& a = assignment_;
  bool noted = false;
  int status = 0;
  std::optional<Clock::time_point> termed;
  bool killed = false;
  for (;;) {
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (!at->attached) at->attached = WatchAttach(spawned, &noted);
    if (w == pid) break;
    Require(w == 0 || errno == EINTR, "waitpid(", pid, "): ", std::strerror(errno));
    std::string reason;
    if (StopRequested(&reason)) {
      if (!termed) {
        Log("job " + a.job_id() + " rank " + at->rank + ": stop (" + reason +
            "): SIGTERM to process group " + std::to_string(pid));
        ::kill(-pid, SIGTERM);
        termed = Clock::now();
      } else if (!killed && Clock::now() - *termed >= options_.kill_grace) {
        Log("job " + a.job_id() + " rank " + at->rank + ": still running " +
            std::to_string(options_.kill_grace.count()) + " ms after SIGTERM: SIGKILL");
        ::kill(-pid, SIGKILL);
        killed = true;
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, kPollInterval);
  }
  return status;
}

void CommandRunner::JudgeExit(int status, Attempt* at, JobOutcome* out) const {
  const std::string& program = at->program;
  std::string stop;
  out->steps = last_step_.load() + 1;
  if (StopRequested(&stop)) {
    out->stopped = true;
    out->reason = "stopped (" + stop + ")";
  } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    out->success = true;
    out->reason = "command '" + program + "' exited with code 0 after " +
                  std::to_string(out->steps) + " steps";
  } else {
    at->restartable = true;
    // The status, where the output is and the command that shows it, never the output itself:
    // the reason is shown to every reader of the job, and the program may print anything it can
    // read (`logs` needs the token). The job's id and the attempt, since a name may be reused and
    // a restart makes another attempt the newest.
    out->reason =
        (WIFEXITED(status)
             ? "command '" + program + "' exited with code " + std::to_string(WEXITSTATUS(status))
             : "command '" + program + "' was killed by " + SignalName(WTERMSIG(status))) +
        "; its output stays on worker " + options_.job.worker_name + " (" + at->err_path + ", " +
        at->out_path + "): geofp8ctl logs " + assignment_.job_id() + " --rank " + at->rank +
        " --attempt " + std::to_string(assignment_.attempt()) + " --stderr";
  }
}

int AttachedExitCode(v1::StopCause cause) {
  switch (cause) {
    case v1::STOP_JOB_SUCCEEDED:
      return 0;
    case v1::STOP_CANCELLED:
      return kExitCancelled;
    default:
      return kExitAttemptEnded;
  }
}

void CommandRunner::RunAttached(const JobSpec& spec, Attempt* at, JobOutcome* out) {
  const v1::Assignment& a = assignment_;
  Require(options_.gate != nullptr, "worker ", options_.job.worker_name,
          " has no hook socket for external jobs (start geofp8-worker with --attach)");
  total_steps_ = spec.training.steps;
  at->program = "rank " + at->rank + "'s program";
  {
    std::lock_guard<std::mutex> lock(mu_);
    at->restartable = true;
    Require(options_.gate->Open(Welcome(), KnownPolicies(),
                                [this](const v1::HookMessage& m) { Relay(m); }),
            "rank ", at->rank, "'s program left before its attempt was placed");
    channel_ = options_.gate;
    if (refresh_) channel_->OfferRefresh(*refresh_);
  }
  Log("job " + a.job_id() + " rank " + at->rank + ": attached program admitted (attempt " +
      std::to_string(a.attempt()) + ")");
  at->ran = true;
  SendStatus(v1::COMMAND_PROCESS_STARTED, 0);
  const auto opened = Clock::now();
  std::optional<Clock::time_point> stopped_at;
  for (;;) {
    const int64_t attaches = channel_->attaches();
    if (attaches > 0 && !at->attached) {
      at->attached = true;
      SendStatus(v1::COMMAND_HOOK_ATTACHED, 0);
    }
    // Ended: its stream closed, or never reopened after the admission (it left meanwhile).
    if ((attaches > 0 && channel_->attached() == 0) ||
        (attaches == 0 && Clock::now() - opened > std::chrono::seconds(10))) {
      break;
    }
    std::string reason;
    if (StopRequested(&reason)) {
      if (!stopped_at) {
        v1::HookStop stop;
        stop.set_reason(reason);
        {
          std::lock_guard<std::mutex> lock(mu_);
          stop.set_cause(stop_.cause);
        }
        stop.set_exit_code(AttachedExitCode(stop.cause()));
        Log("job " + a.job_id() + " rank " + at->rank + ": stop (" + reason +
            "): the attached program is told to exit with code " +
            std::to_string(stop.exit_code()));
        channel_->Stop(stop);
        stopped_at = Clock::now();
      } else if (Clock::now() - *stopped_at >= options_.kill_grace) {
        break;  // EndAttempt cancels its stream
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, kPollInterval);
  }
  out->steps = last_step_.load() + 1;
  std::optional<v1::HookFinished> finished;
  {
    std::lock_guard<std::mutex> lock(effective_mu_);
    finished = finished_;
  }
  std::string stop;
  if (StopRequested(&stop)) {
    out->stopped = true;
    out->reason = "stopped (" + stop + ")";
  } else if (finished && finished->success()) {
    out->success = true;
    out->reason =
        "rank " + at->rank + "'s program finished after " + std::to_string(out->steps) + " steps";
  } else if (finished) {
    out->reason = "rank " + at->rank + "'s program failed: " + finished->reason() +
                  "; its output is with its launcher";
  } else {
    out->reason = "rank " + at->rank + "'s program left without finishing: its hook channel to " +
                  "worker " + options_.job.worker_name +
                  " closed (a crash, a kill or a lost worker); its output is with its launcher";
  }
}

void CommandRunner::RunProgram(Attempt* at, JobOutcome* out) {
  const v1::Assignment& a = assignment_;
  const JobSpec spec = ValueOrThrow(ParseJobSpec(a.spec_yaml()), "spec: ");
  if (IsExternal(spec)) {
    RunAttached(spec, at, out);
    return;
  }
  Require(options_.allow_commands, "worker ", options_.job.worker_name,
          " does not run command: jobs (start geofp8-worker with --allow-commands)");
  Require(!spec.command.empty(), "spec.command: missing");
  at->program = spec.command[0];
  total_steps_ = spec.training.steps;

  CreateJobDir(at->dir);
  at->checkpoint_dir = CreateCheckpointDir(spec);
  if (!options_.token.empty()) {
    at->token_file = at->dir + "/rank" + at->rank + ".token";
    WriteTokenFile(at->token_file, options_.token);
  }
  at->spec_path = WriteJobSpec(at->dir, a.spec_yaml());
  // The hook channel, before the program can look for it.
  at->socket = StartHook(*at);
  std::tie(at->master_addr, at->master_port) = MasterAddress();

  at->out_path = at->dir + "/rank" + at->rank + ".out";
  at->err_path = at->dir + "/rank" + at->rank + ".err";
  CommandLimits limits = options_.limits;
  auto env = ProgramEnvironment(spec, *at);
  // RLIMIT_NPROC counts a uid's processes host-wide: under the worker's own uid it would count
  // the worker's threads and every other process of that user, so it applies to a job's own uid.
  limits.max_processes = 0;
  if (options_.command_uid_base > 0) {
    limits.max_processes = options_.limits.max_processes;
    limits.run_as = CommandIdentity(options_.command_uid_base, a.job_id());
    GiveToProgram(*at, *limits.run_as);
    env["HOME"] = at->dir;  // the worker's own is not the job's to write
  }
  const pid_t pid = SpawnCommand(spec.command, env, at->dir, at->out_path, at->err_path, limits);
  Log("job " + a.job_id() + " rank " + at->rank + ": started '" + at->program + "' as pid " +
      std::to_string(pid) + " (MASTER_ADDR " + at->master_addr + ":" +
      std::to_string(at->master_port) + "; output in " + at->dir + ")");

  // The job turns RUNNING when every rank's program runs; whether it attaches is watched
  // while waiting (hook_ stays until after the wait).
  const auto spawned = Clock::now();
  at->ran = true;
  SendStatus(v1::COMMAND_PROCESS_STARTED, 0);
  // Wait, carrying out a Stop on the way.
  const int status = WaitForExit(pid, spawned, at);
  // Whatever the program left behind in its group goes with it.
  ::kill(-pid, SIGKILL);
  JudgeExit(status, at, out);
}

void CommandRunner::GiveToProgram(const Attempt& at, std::pair<uid_t, gid_t> id) const {
  const auto [uid, gid] = id;
  const std::filesystem::path data = options_.job.data_dir;
  // The folders on the way may be passed through, never listed: the data directory, jobs/ and
  // the job's, and those above the checkpoint directory.
  std::vector<std::filesystem::path> passed = {data, data / "jobs",
                                               data / "jobs" / assignment_.job_id()};
  for (auto p = std::filesystem::path(at.checkpoint_dir).parent_path();
       p.string().size() > data.string().size() && p != p.parent_path(); p = p.parent_path()) {
    passed.push_back(p);
  }
  for (const auto& p : passed) {
    Require(::chmod(p.c_str(), 0711) == 0, "job directory: cannot chmod ", p.string(), ": ",
            std::strerror(errno));
  }
  // What the program may use: its directories (0700), its token, its spec and the hook socket.
  for (const std::string& p : {at.dir, at.checkpoint_dir, at.token_file, at.spec_path, at.socket}) {
    if (p.empty()) continue;
    Require(::chown(p.c_str(), uid, gid) == 0, "command: cannot give ", p, " to uid ",
            std::to_string(uid),
            " (--command-uid-base needs a worker run as root): ", std::strerror(errno));
  }
  ::chmod(at.dir.c_str(), 0700);
  ::chmod(at.checkpoint_dir.c_str(), 0700);
}

void CommandRunner::EndAttempt(const Attempt& at, JobOutcome* out) {
  // The token was the running program's; nothing keeps a copy once it has ended.
  if (!at.token_file.empty()) ::unlink(at.token_file.c_str());
  relay_open_ = false;
  {
    std::unique_ptr<HookServer> hook;
    HookServer* gate = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      hook = std::move(hook_);
      if (channel_ == options_.gate) gate = options_.gate;
      channel_ = nullptr;
    }
    hook.reset();  // outside mu_: shutting down waits for Relay calls in flight
    if (gate) gate->EndAttempt(std::chrono::milliseconds(200));
  }
  out->policy_version = version_in_force_.load();
  // Before the coordinator hears of the end: a scrape after it sees the job's gauges gone.
  {
    std::lock_guard<std::mutex> lock(mu_);
    out->cancelled = out->stopped && stop_.cause == v1::STOP_CANCELLED;
  }
  if (metrics_) metrics_->JobEnded(out->success, out->stopped, out->cancelled);
  if (!out->stopped) {
    v1::WorkerMessage m = FinishedMessage(assignment_, *out);
    m.mutable_finished()->set_restartable(at.restartable);
    m.mutable_finished()->set_hook_never_attached(at.ran && !at.attached);
    send_(std::move(m), true);
  }
}

JobOutcome CommandRunner::Run() {
  const auto started = Clock::now();
  const v1::Assignment& a = assignment_;
  LogStarted();
  Attempt at;
  at.rank = std::to_string(a.rank());
  at.dir = CommandJobDir(options_.job.data_dir, a.job_id(), a.attempt());
  JobOutcome out;
  try {
    RunProgram(&at, &out);
  } catch (const std::exception& e) {
    out.success = false;
    out.reason = e.what();
    std::string stop;
    if (StopRequested(&stop)) {
      out.stopped = true;
      out.reason = "stopped (" + stop + "); then: " + out.reason;
    }
  }
  EndAttempt(at, &out);
  LogEnded(out, std::chrono::duration<double>(Clock::now() - started).count());
  WriteResultFile(options_.job.data_dir, a, at.dir, out);
  return out;
}

}  // namespace geofp8::worker
