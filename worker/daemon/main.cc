// geofp8-worker: registers with the coordinator, runs the ranks it is assigned (trainer +
// exchange engine over Gloo), streams progress, and serves Prometheus /metrics.
#include <signal.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "platform/common/flag_paths.h"
#include "platform/common/log.h"
#include "platform/common/ready_file.h"
#include "worker/daemon/device.h"
#include "worker/daemon/worker.h"

namespace {

int g_signal_pipe[2] = {-1, -1};
void OnSignal(int sig) {
  const int saved = errno;
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &sig, sizeof sig);
  errno = saved;
}

int UsageError(const std::string& message) {
  std::fprintf(stderr, "geofp8-worker: error: %s\n", message.c_str());
  return 2;
}

// "8GiB", "512MiB", "1000000" (bytes). Returns false on anything else.
bool ParseBytes(const std::string& text, uint64_t* out) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    return false;
  }
  const std::string unit = text.substr(used);
  double mult = 1;
  if (unit == "" || unit == "B")
    mult = 1;
  else if (unit == "KiB")
    mult = 1024.0;
  else if (unit == "MiB")
    mult = 1024.0 * 1024;
  else if (unit == "GiB")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "TiB")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else
    return false;
  if (v < 0) return false;
  *out = uint64_t(v * mult);
  return true;
}

// The flags that are not WorkerOptions fields themselves, at their defaults.
struct Flags {
  std::string token_file, capacity, device = "cpu", log_format = "text";
  std::string command_max_memory;  // default: --capacity
  double hook_attach_timeout_s = 120;
  int grace_ms = 10000;
  int step_delay_ms = 0;
  int policy_delay_ms = 0;
  std::string ready_file;
};

// WorkerOptions at the defaults --help shows, and this machine's host name.
geofp8::worker::WorkerOptions DefaultOptions() {
  geofp8::worker::WorkerOptions o;
  o.connection.address = "127.0.0.1:7070";
  o.job.data_dir = "geofp8-worker-data";
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  o.session.host = host;
  return o;
}

// The flags --help lists, in its order, bound to `o` and `f` (whose values are the defaults
// it shows).
void AddFlags(CLI::App& app, geofp8::worker::WorkerOptions* o, Flags* f) {
  app.add_option("--coordinator", o->connection.address, "Coordinator gRPC address host:port")
      ->capture_default_str();
  app.add_option("--token", o->connection.token,
                 "Bearer token for the coordinator (visible in ps: prefer --token-file or env "
                 "GEOFP8_TOKEN)");
  app.add_option("--token-file", f->token_file, "File holding the bearer token");
  app.add_option("--tls-ca", o->connection.tls_ca, "PEM CA bundle: connect over TLS");
  app.add_option("--tls-cert", o->connection.tls_cert, "PEM client certificate (mutual TLS)");
  app.add_option("--tls-key", o->connection.tls_key, "PEM private key of --tls-cert");
  app.add_option("--name", o->session.name,
                 "Stable worker name; re-registering a name fences its previous process "
                 "(default: host:pid)");
  app.add_option("--metrics-port", o->metrics_port,
                 "Prometheus /metrics port (0: a free one, -1: off)")
      ->capture_default_str();
  app.add_option("--metrics-host", o->metrics_host, "Address /metrics listens on")
      ->capture_default_str();
  app.add_option("--ready-file", f->ready_file,
                 "Once started, write {\"name\": ..., \"metrics\": \"host:port\" or null, "
                 "\"pid\": N} here (atomically; removed on a clean shutdown)");
  app.add_option("--data-dir", o->job.data_dir,
                 "Checkpoints (relative checkpoint.dir of a job) and result files")
      ->capture_default_str();
  app.add_option("--device", f->device,
                 "Compute device: cpu, cuda or cuda:N (a GPU for command: jobs, which get "
                 "CUDA_VISIBLE_DEVICES=N; the built-in trainer runs on CPU)")
      ->capture_default_str();
  app.add_flag("--allow-commands", o->session.accepts_commands,
               "Run `command:` jobs: any program whoever holds the coordinator's token submits, "
               "as this worker's user or, with --command-uid-base, as the job's own "
               "(docs/reliability.md, \"Threat model\"). Off: the "
               "coordinator places no command job here");
  app.add_option("--attach", o->hook_socket,
                 "Attach-only: serve the GeoFP8 hook on this Unix socket to the ranks of external "
                 "jobs that your launcher starts (torchrun, srun, a PyTorchJob), one rank at a "
                 "time (docs/launchers.md); the coordinator places no other job here")
      ->expected(1);
  app.add_option("--command-uid-base", o->command_uid_base,
                 "Run each command job's program as its own uid and gid, BASE + the job's number "
                 "modulo 65536, in files only it and the worker can read (needs a worker run as "
                 "root; docs/reliability.md, \"Threat model\"). 0: as the worker's user")
      ->capture_default_str()
      ->check(CLI::Range(0u, 4294901759u));
  app.add_option("--command-max-memory", f->command_max_memory,
                 "A command job's program's data limit (RLIMIT_DATA), e.g. 8GiB (default: "
                 "--capacity)");
  app.add_option("--command-max-processes", o->command_limits.max_processes,
                 "A command job's processes and threads (RLIMIT_NPROC, counted per uid: set "
                 "only with --command-uid-base, on the job's own uid)")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t(1), uint64_t(1) << 32));
  app.add_option("--command-max-open-files", o->command_limits.max_open_files,
                 "A command job's open files per process (RLIMIT_NOFILE)")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t(16), uint64_t(1) << 30));
  app.add_option("--command-env", o->command_env,
                 "Also pass this variable of the worker's environment to command jobs "
                 "(repeatable; the fixed list is in docs/job-spec.md)");
  app.add_option("--hook-attach-timeout", f->hook_attach_timeout_s,
                 "Seconds a command: job's program may run without attaching to the GeoFP8 hook "
                 "(geofp8.torch.GeoFP8State) before its job gets a note and an event saying so "
                 "(0: no note)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--capacity", f->capacity,
                 "Memory offered to jobs, e.g. 8GiB (default: physical memory)");
  app.add_option("--advertise-host", o->job.advertise_host,
                 "Address peers reach this worker's Gloo connections on")
      ->capture_default_str();
  app.add_option("--blas-threads", o->job.blas_threads, "OpenBLAS threads per rank")
      ->capture_default_str();
  app.add_option("--summary-every", o->job.summary_every,
                 "Steps between per-layer error summaries (0: off)")
      ->capture_default_str();
  app.add_option("--checksum-every", o->job.checksum_every,
                 "Steps between cross-rank parameter checksums (0: end only)")
      ->capture_default_str();
  app.add_option("--shutdown-grace-ms", f->grace_ms, "How long SIGTERM waits for the rank to stop")
      ->capture_default_str();
  app.add_option("--log-format", f->log_format,
                 "Event lines on stderr: text (logfmt, key=value) or json (one object a line)")
      ->capture_default_str();
  app.add_option("--log-progress-every", o->job.log_progress_every,
                 "Steps between rank 0's progress log lines (step, loss); 0: off")
      ->capture_default_str();
}

// Tests' and fault injection's flags: not in --help.
void AddDebugFlags(CLI::App& app, geofp8::worker::WorkerOptions* o, Flags* f) {
  app.add_option("--debug-step-delay-ms", f->step_delay_ms, "Sleep after every step (tests, demos)")
      ->check(CLI::NonNegativeNumber)
      ->group("");
  app.add_option("--debug-policy-delay-ms", f->policy_delay_ms,
                 "Fault injection: hold each policy version this long before applying it")
      ->check(CLI::NonNegativeNumber)
      ->group("");
  app.add_option("--debug-break-stream-on", o->session.debug_break_stream_on,
                 "Fault injection: lose the first reliable message of this kind on the wire and "
                 "break the session stream")
      ->check(CLI::IsMember({"finished", "checkpoint"}))
      ->group("");
}

// --device: the session's device name and the GPU of command: jobs. Returns an error, or "".
std::string ApplyDevice(const std::string& device, geofp8::worker::WorkerOptions* o) {
  // The GPUs are counted from the driver's listing; GEOFP8_NVIDIA_GPUS_DIR replaces the
  // folder (tests give a machine any number of GPUs that way).
  const char* dir = std::getenv("GEOFP8_NVIDIA_GPUS_DIR");
  const std::string where = dir && *dir ? dir : geofp8::worker::kNvidiaGpusDir;
  auto parsed =
      geofp8::worker::ParseWorkerDevice(device, geofp8::worker::CountNvidiaGpus(where), where);
  if (!parsed.ok()) return "--device: " + std::string(parsed.status().message());
  o->session.device = parsed->name;
  o->cuda_device = parsed->cuda_index;
  return "";
}

// The numeric flags' ranges and --data-dir. Returns an error, or "".
std::string CheckLimits(const geofp8::worker::WorkerOptions& o) {
  if (o.metrics_port < -1 || o.metrics_port > 65535) {
    return "--metrics-port: must be in [-1, 65535] (" + std::to_string(o.metrics_port) + ")";
  }
  if (o.job.blas_threads < 1) {
    return "--blas-threads: must be >= 1 (" + std::to_string(o.job.blas_threads) + ")";
  }
  if (o.job.summary_every < 0 || o.job.checksum_every < 0) {
    return "--summary-every/--checksum-every: must be >= 0";
  }
  if (o.job.data_dir.empty()) return "--data-dir: must not be empty";
  return "";
}

// The token: --token-file's first line (trailing CR and spaces cut) over --token, else env
// GEOFP8_TOKEN. Warns about --token on stderr. Returns an error, or "".
std::string ApplyToken(const CLI::App& app, const std::string& token_file, std::string* token) {
  if (app.count("--token") > 0) {
    std::fprintf(stderr,
                 "geofp8-worker: warning: --token: other users can read it in the process list; "
                 "use --token-file or GEOFP8_TOKEN\n");
  }
  if (!token_file.empty()) {
    std::ifstream in(token_file);
    if (!in) return "--token-file: cannot read " + token_file;
    std::getline(in, *token);
    while (!token->empty() && (token->back() == '\r' || token->back() == ' ')) token->pop_back();
  }
  if (token->empty()) {
    if (const char* t = std::getenv("GEOFP8_TOKEN")) *token = t;
  }
  return "";
}

// Checks the parsed flags, makes every path flag absolute and completes `o` from them (and
// `format` from --log-format). Returns the usage error, or "".
std::string ApplyFlags(const CLI::App& app, Flags* f, geofp8::worker::WorkerOptions* o,
                       geofp8::log::Format* format) {
  const auto parsed = geofp8::log::ParseFormat(f->log_format);
  if (!parsed) return "--log-format: unknown value (" + f->log_format + "); accepted: text, json";
  *format = *parsed;
  if (o->job.log_progress_every < 0) {
    return "--log-progress-every: must be >= 0 (" + std::to_string(o->job.log_progress_every) + ")";
  }
  if (std::string e = ApplyDevice(f->device, o); !e.empty()) return e;
  o->hook_attach_timeout = std::chrono::milliseconds(
      static_cast<int64_t>(std::llround(f->hook_attach_timeout_s * 1000)));
  if (std::string e = CheckLimits(*o); !e.empty()) return e;
  // Every path flag, against the directory the worker started in: command jobs run in
  // directories of their own and get paths under --data-dir.
  if (!o->hook_socket.empty() && o->session.accepts_commands) {
    return "--attach: an attach-only worker runs no command: job (drop --allow-commands)";
  }
  o->session.attach_only = !o->hook_socket.empty();
  if (std::string e = geofp8::MakeFlagPathsAbsolute({{"--data-dir", &o->job.data_dir},
                                                     {"--attach", &o->hook_socket},
                                                     {"--token-file", &f->token_file},
                                                     {"--tls-ca", &o->connection.tls_ca},
                                                     {"--tls-cert", &o->connection.tls_cert},
                                                     {"--tls-key", &o->connection.tls_key},
                                                     {"--ready-file", &f->ready_file}});
      !e.empty()) {
    return e;
  }
  if (std::string e = ApplyToken(app, f->token_file, &o->connection.token); !e.empty()) return e;
  if (f->capacity.empty()) {
    struct sysinfo si {};
    if (sysinfo(&si) == 0) o->session.memory_bytes = uint64_t(si.totalram) * si.mem_unit;
  } else if (!ParseBytes(f->capacity, &o->session.memory_bytes)) {
    return "--capacity: expected bytes with an optional KiB/MiB/GiB/TiB suffix (" + f->capacity +
           ")";
  }
  o->command_limits.max_memory_bytes = o->session.memory_bytes;
  if (!f->command_max_memory.empty() &&
      !ParseBytes(f->command_max_memory, &o->command_limits.max_memory_bytes)) {
    return "--command-max-memory: expected bytes with an optional KiB/MiB/GiB/TiB suffix (" +
           f->command_max_memory + ")";
  }
  if (o->command_uid_base > 0 && ::geteuid() != 0) {
    return "--command-uid-base: the worker must run as root to run jobs as other uids (it runs "
           "as uid " +
           std::to_string(::geteuid()) + ")";
  }
  if (o->session.name.empty()) o->session.name = o->session.host + ":" + std::to_string(getpid());
  o->job.worker_name = o->session.name;
  o->job.debug_step_delay = std::chrono::milliseconds(f->step_delay_ms);
  o->job.debug_policy_delay = std::chrono::milliseconds(f->policy_delay_ms);
  return "";
}

// SIGTERM and SIGINT write their number to g_signal_pipe. False if the pipe cannot be made.
bool CatchSignals() {
  if (pipe(g_signal_pipe) != 0) return false;
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  // Gloo writes with writev, without MSG_NOSIGNAL: a write to a peer's reset socket would end the
  // worker silently. Ignored, it fails with EPIPE and the collective reports it. Command jobs get
  // the default back (command_runner.cc).
  signal(SIGPIPE, SIG_IGN);
  return true;
}

// The --ready-file's JSON, written atomically. Returns an error, or "".
std::string WriteReady(const std::string& ready_file, const geofp8::worker::WorkerOptions& o,
                       int metrics_port) {
  const std::string metrics =
      metrics_port >= 0 ? "\"" + o.metrics_host + ":" + std::to_string(metrics_port) + "\""
                        : std::string("null");
  return geofp8::WriteReadyFile(ready_file, "{\"name\": " + geofp8::JsonString(o.session.name) +
                                                ", \"metrics\": " + metrics +
                                                ", \"pid\": " + std::to_string(getpid()) + "}");
}

// Runs the worker until SIGTERM or SIGINT, then shuts it down. Returns the exit code.
int Serve(const geofp8::worker::WorkerOptions& o, const Flags& f) {
  geofp8::worker::Worker worker(o);
  if (auto s = worker.Start(); !s.ok()) {
    std::fprintf(stderr, "geofp8-worker: error: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (worker.metrics_port() >= 0) {
    std::printf("geofp8-worker: metrics on http://%s:%d/metrics\n", o.metrics_host.c_str(),
                worker.metrics_port());
  }
  std::printf("geofp8-worker: %s connecting to %s (device %s, data %s)\n", o.session.name.c_str(),
              o.connection.address.c_str(), o.session.device.c_str(), o.job.data_dir.c_str());
  std::fflush(stdout);
  if (!f.ready_file.empty()) {
    if (std::string e = WriteReady(f.ready_file, o, worker.metrics_port()); !e.empty()) {
      return UsageError(e);
    }
  }
  int sig = 0;
  while (read(g_signal_pipe[0], &sig, sizeof sig) < 0 && errno == EINTR) {
  }
  const char* signal_name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
  geofp8::log::Info("worker.shutdown")
      .F("signal", signal_name)
      .F("grace_ms", f.grace_ms)
      .Msg(std::string(signal_name) + " received, shutting down");
  if (!worker.Shutdown(std::chrono::milliseconds(f.grace_ms), signal_name)) {
    std::fflush(stdout);
    std::_Exit(0);
  }
  if (!f.ready_file.empty()) std::remove(f.ready_file.c_str());
  geofp8::log::Info("worker.stopped").Msg("stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"geofp8-worker: a GeoFP8 training worker driven by geofp8-coordinator"};
  geofp8::worker::WorkerOptions o = DefaultOptions();
  Flags f;
  AddFlags(app, &o, &f);
  AddDebugFlags(app, &o, &f);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    return UsageError(e.what());
  }
  geofp8::log::Format format = geofp8::log::Format::kText;
  if (std::string e = ApplyFlags(app, &f, &o, &format); !e.empty()) return UsageError(e);
  geofp8::log::Configure(format, {{"worker", o.session.name}});
  // Jobs run as other uids pass through the data directory: whatever the worker writes there
  // (ready file, results, the built-in trainer's checkpoints) is its own alone.
  if (o.command_uid_base > 0) ::umask(077);
  if (!CatchSignals()) return UsageError("pipe() failed");
  return Serve(o, f);
}
