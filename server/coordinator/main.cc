// geofp8-coordinator: the control-plane daemon. Serves the geofp8.v1 gRPC API and grpc.health.v1,
// keeps durable state in SQLite under --data-dir, and exposes Prometheus /metrics.
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "platform/common/flag_paths.h"
#include "platform/common/log.h"
#include "platform/common/ready_file.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/grpc_services.h"
#include "server/coordinator/metrics.h"
#include "server/coordinator/store.h"

namespace {

int g_signal_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  const int saved = errno;
  (void)!write(g_signal_pipe[1], &sig, sizeof sig);
  errno = saved;
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "geofp8-coordinator: error: %s\n", message.c_str());
  return 1;
}

// The flags' values, each starting as its default.
struct Flags {
  geofp8::coordinator::ServerOptions server;
  geofp8::coordinator::CoordinatorOptions coord;
  geofp8::coordinator::StoreOptions store_options;
  std::string data_dir = "./geofp8-data";
  std::string metrics_listen = "127.0.0.1:9464";
  std::string ready_file;
  std::string token_file;
  std::string log_format = "text";
  int tick_ms = 200;
  int grace_ms = 5000;
};

void DefineFlags(CLI::App& app, Flags& f) {
  app.add_option("--listen", f.server.listen, "gRPC address host:port (port 0 picks a free one)")
      ->capture_default_str();
  app.add_option("--data-dir", f.data_dir, "Directory of the SQLite state (coordinator.db)")
      ->capture_default_str();
  app.add_option("--ready-file", f.ready_file,
                 "Once serving, write {\"grpc\": \"host:port\", \"metrics\": ..., \"pid\": N} here "
                 "(atomically; removed on a clean shutdown)");
  app.add_option("--metrics-listen", f.metrics_listen,
                 "Prometheus /metrics address host:port; empty disables")
      ->capture_default_str();
  app.add_option("--token-file", f.token_file,
                 "File holding the bearer token every geofp8.v1 call needs, reads included "
                 "(or env GEOFP8_TOKEN); health and /metrics stay open");
  app.add_flag("--accept-store-loss", f.store_options.accept_loss,
               "Start even when coordinator.db does not match its coordinator.seal (truncated, "
               "replaced or rolled back: acknowledged jobs are missing); logged. Job ids still "
               "never repeat");
  app.add_option("--tls-cert", f.server.tls_cert, "PEM server certificate (enables TLS)");
  app.add_option("--tls-key", f.server.tls_key, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", f.server.tls_client_ca,
                 "PEM CA bundle; clients must present a certificate it signed (mTLS)");
  app.add_option("--heartbeat-interval-ms", f.coord.heartbeat_interval_ms,
                 "Heartbeat period told to workers")
      ->capture_default_str()
      ->check(CLI::Range(10, 3600000));
  app.add_option("--heartbeat-timeout-ms", f.coord.heartbeat_timeout_ms,
                 "Silence after which a worker is declared dead and fenced")
      ->capture_default_str()
      ->check(CLI::Range(50, 86400000));
  app.add_option("--restart-backoff-ms", f.coord.restart_backoff_ms,
                 "Crash loops: the second restartable failure of a job in a row waits this long "
                 "before the next attempt, each further one twice as long (0: no back-off)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{86400000}));
  app.add_option("--restart-backoff-max-ms", f.coord.restart_backoff_max_ms,
                 "Cap of the restart back-off; an attempt that ran twice this long starts the "
                 "count of failures over")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{86400000}));
  app.add_option("--dead-worker-retention-ms", f.coord.dead_worker_retention_ms,
                 "A dead worker is dropped from the registry (get workers) this long after its "
                 "death")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{604800000}));
  app.add_option("--fencing-holdoff-share", f.coord.fencing_holdoff_share,
                 "When more than this share of the live workers (10 or more) have not been heard "
                 "for two heartbeat intervals, the coordinator is behind: hold off fencing until "
                 "they are heard again (1: never hold)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--tick-ms", f.tick_ms, "Period of the dead-worker check")
      ->capture_default_str()
      ->check(CLI::Range(5, 60000));
  app.add_flag("--debug-kv-any-job", f.coord.kv_any_job,
               "Tests only: serve the rendezvous KV for any job id, not only live attempts")
      ->group("");
  app.add_option("--shutdown-grace-ms", f.grace_ms, "How long SIGTERM waits for running calls")
      ->capture_default_str()
      ->check(CLI::Range(0, 600000));
  app.add_option("--log-format", f.log_format,
                 "Event lines on stderr: text (logfmt, key=value) or json (one object a line)")
      ->capture_default_str();
}

// The exit code when main must stop here (--help, or 2 for a bad command line), else nullopt.
std::optional<int> ParseFlags(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "geofp8-coordinator: error: %s\n", e.what());
    return 2;
  }
  return std::nullopt;
}

// False, with the error on stderr, for an unknown --log-format.
bool ConfigureLogging(const std::string& log_format) {
  const auto format = geofp8::log::ParseFormat(log_format);
  if (!format) {
    std::fprintf(stderr,
                 "geofp8-coordinator: error: --log-format: unknown value (%s); accepted: text, "
                 "json\n",
                 log_format.c_str());
    return false;
  }
  geofp8::log::Configure(*format);
  return true;
}

// The bearer token from --token-file (trailing newlines and spaces dropped), else from env
// GEOFP8_TOKEN. False, with the error on stderr, when the file cannot be read or is empty.
bool ReadToken(const std::string& token_file, std::string* token) {
  if (!token_file.empty()) {
    auto text = geofp8::coordinator::ReadFileForFlag("--token-file", token_file);
    if (!text.ok()) {
      std::fprintf(stderr, "geofp8-coordinator: error: %s\n",
                   std::string(text.status().message()).c_str());
      return false;
    }
    *token = *text;
    while (!token->empty() &&
           (token->back() == '\n' || token->back() == '\r' || token->back() == ' ')) {
      token->pop_back();
    }
    if (token->empty()) {
      std::fprintf(stderr, "geofp8-coordinator: error: --token-file: %s is empty\n",
                   token_file.c_str());
      return false;
    }
  } else if (const char* env = std::getenv("GEOFP8_TOKEN"); env && *env) {
    *token = env;
  }
  return true;
}

// SIGTERM/SIGINT write to a pipe that main reads, so shutdown runs outside signal context. A
// handler rather than sigwait: libraries (OpenBLAS) start threads before main could mask them.
bool InstallSignalHandlers() {
  if (pipe(g_signal_pipe) != 0) return false;
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  // A write to a socket or pipe whose reader is gone (a reset client, a closed log pipe) must
  // fail with EPIPE, not end the daemon silently.
  signal(SIGPIPE, SIG_IGN);
  return true;
}

// Blocks until a signal handled by OnSignal arrives; returns it.
int WaitForSignal() {
  int sig = 0;
  while (read(g_signal_pipe[0], &sig, sizeof sig) < 0 && errno == EINTR) {
  }
  return sig;
}

// Serves /metrics on `listen` unless it is empty; returns the address host:port, empty when off.
absl::StatusOr<std::string> ServeMetrics(geofp8::coordinator::Metrics& metrics,
                                         const std::string& listen) {
  if (listen.empty()) return std::string();
  auto port = metrics.Serve(listen);
  if (!port.ok()) return port.status();
  std::string address = listen.substr(0, listen.rfind(':')) + ":" + std::to_string(*port);
  std::printf("geofp8-coordinator: metrics on http://%s/metrics\n", address.c_str());
  return address;
}

// Resident bytes of this process (/proc/self/statm); 0 if unreadable.
uint64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t size_pages = 0, resident_pages = 0;
  if (!(statm >> size_pages >> resident_pages)) return 0;
  return resident_pages * uint64_t(sysconf(_SC_PAGESIZE));
}

// A burst of large requests (a policy flood, a fuzzing client) is parsed on gRPC's threads, each
// with its own malloc arena, and glibc keeps what they freed for reuse: the resident size stayed
// at the burst's peak (66-87 MB against 22 MB idle). Once a second: when the resident size is more
// than kTrimAbove above the lowest seen, free pages go back to the kernel (malloc_trim). A trim
// that hands nothing back (the burst still allocating, or memory really in use) waits twice as
// long before the next, up to kMaxWait: frees do not shrink the resident size, so a reference
// raised by a trim during a burst would hide what the burst frees after it.
std::thread StartMemoryReturner(const std::atomic<bool>& stopping) {
  return std::thread([&stopping] {
    constexpr uint64_t kTrimAbove = 16ull << 20;
    constexpr auto kMaxWait = std::chrono::seconds(8);
    uint64_t lowest = ResidentBytes();
    auto wait = std::chrono::seconds(1);
    auto next = std::chrono::steady_clock::now();
    while (!stopping.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // shutdown is not held up
      if (std::chrono::steady_clock::now() < next) continue;
      const uint64_t rss = ResidentBytes();
      lowest = std::min(lowest, rss);
      if (rss > lowest + kTrimAbove) {
        malloc_trim(0);
        const uint64_t after = ResidentBytes();
        lowest = std::min(lowest, after);
        if (after < rss) {
          wait = std::chrono::seconds(1);
          geofp8::log::Debug("coordinator.memory_returned")
              .F("rss_before", rss)
              .F("rss_after", after)
              .Msg("freed memory handed back to the kernel");
        } else {
          wait = std::min<std::chrono::seconds>(wait * 2, kMaxWait);
        }
      }
      next = std::chrono::steady_clock::now() + wait;
    }
  });
}

// Writes --ready-file; returns the error, empty on success.
std::string WriteReady(const Flags& f, int grpc_port, const std::string& metrics_address) {
  const std::string grpc_address =
      f.server.listen.substr(0, f.server.listen.rfind(':')) + ":" + std::to_string(grpc_port);
  const std::string json =
      "{\"grpc\": \"" + grpc_address + "\", \"metrics\": " +
      (metrics_address.empty() ? std::string("null") : "\"" + metrics_address + "\"") +
      ", \"pid\": " + std::to_string(getpid()) + "}";
  return geofp8::WriteReadyFile(f.ready_file, json);
}

void AnnounceServing(const Flags& f, int grpc_port, const std::string& metrics_address) {
  const geofp8::coordinator::ServerOptions& server = f.server;
  std::printf("geofp8-coordinator: serving on %s:%d (data %s, auth %s, tls %s)\n",
              server.listen.substr(0, server.listen.rfind(':')).c_str(), grpc_port,
              f.data_dir.c_str(), server.token.empty() ? "off" : "token",
              server.tls_cert.empty() ? "off" : (server.tls_client_ca.empty() ? "on" : "mutual"));
  std::fflush(stdout);
  geofp8::log::Info("coordinator.started")
      .F("grpc_port", grpc_port)
      .F("metrics", metrics_address)
      .F("data_dir", f.data_dir)
      .F("auth", server.token.empty() ? "off" : "token")
      .F("tls", server.tls_cert.empty() ? "off" : (server.tls_client_ca.empty() ? "on" : "mutual"))
      .Msg("serving");
}

// Runs the dead-worker check every tick_ms until `stopping`.
std::thread StartTicker(geofp8::coordinator::Coordinator& coordinator,
                        const std::atomic<bool>& stopping, int tick_ms,
                        int64_t heartbeat_interval_ms) {
  return std::thread([&coordinator, &stopping, tick_ms, heartbeat_interval_ms] {
    // A sleep of tick_ms that took far longer means this process was not running (SIGSTOP,
    // a paused VM): the workers' heartbeats could not be read meanwhile, so their silence is
    // not theirs. A heartbeat interval (at least 1 s) of slack absorbs ordinary delay.
    const int64_t slack_ms = std::max<int64_t>(1000, heartbeat_interval_ms);
    auto before = std::chrono::steady_clock::now();
    while (!stopping.load()) {
      const auto now = std::chrono::steady_clock::now();
      const int64_t slept_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(now - before).count();
      if (slept_ms > tick_ms + slack_ms) coordinator.CreditPause(slept_ms - tick_ms);
      coordinator.Tick();
      before = std::chrono::steady_clock::now();
      std::this_thread::sleep_for(std::chrono::milliseconds(tick_ms));
    }
  });
}

// Opens the store, serves until SIGTERM or SIGINT, then shuts down; returns the exit code.
int Serve(const Flags& f) {
  auto store = geofp8::coordinator::Store::Open(f.data_dir, f.store_options);
  if (!store.ok()) return Fail(std::string(store.status().message()));
  geofp8::coordinator::Coordinator coordinator(store->get(), geofp8::coordinator::SystemClock(),
                                               f.coord);
  if (auto s = coordinator.Recover(); !s.ok()) return Fail(s.ToString());
  geofp8::coordinator::Metrics metrics(&coordinator);
  auto metrics_address = ServeMetrics(metrics, f.metrics_listen);
  if (!metrics_address.ok()) return Fail(std::string(metrics_address.status().message()));
  auto srv = geofp8::coordinator::CoordinatorServer::Start(&coordinator, &metrics, f.server);
  if (!srv.ok()) return Fail(std::string(srv.status().message()));
  if (!f.ready_file.empty()) {
    if (std::string e = WriteReady(f, (*srv)->port(), *metrics_address); !e.empty()) {
      return Fail(e);
    }
  }
  AnnounceServing(f, (*srv)->port(), *metrics_address);

  std::atomic<bool> stopping{false};
  std::thread ticker = StartTicker(coordinator, stopping, f.tick_ms, f.coord.heartbeat_interval_ms);
  std::thread memory_returner = StartMemoryReturner(stopping);
  const int sig = WaitForSignal();
  std::printf("geofp8-coordinator: %s received, shutting down\n",
              sig == SIGTERM ? "SIGTERM" : "SIGINT");
  std::fflush(stdout);
  geofp8::log::Info("coordinator.shutdown")
      .F("signal", sig == SIGTERM ? "SIGTERM" : "SIGINT")
      .Msg("shutting down");
  stopping = true;
  coordinator.Shutdown();  // wakes watchers and rendezvous waiters
  (*srv)->Shutdown(f.grace_ms);
  ticker.join();
  memory_returner.join();
  if (!f.ready_file.empty()) std::remove(f.ready_file.c_str());
  std::printf("geofp8-coordinator: stopped\n");
  geofp8::log::Info("coordinator.stopped").Msg("stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"geofp8-coordinator: GeoFP8 control plane (jobs, policies, workers, rendezvous)"};
  Flags flags;
  DefineFlags(app, flags);
  if (std::optional<int> exit_code = ParseFlags(app, argc, argv)) return *exit_code;
  if (!ConfigureLogging(flags.log_format)) return 2;
  // Every path flag against the directory the coordinator started in, once: the logs and the
  // ready file then name each file unambiguously.
  if (std::string e =
          geofp8::MakeFlagPathsAbsolute({{"--data-dir", &flags.data_dir},
                                         {"--ready-file", &flags.ready_file},
                                         {"--token-file", &flags.token_file},
                                         {"--tls-cert", &flags.server.tls_cert},
                                         {"--tls-key", &flags.server.tls_key},
                                         {"--tls-client-ca", &flags.server.tls_client_ca}});
      !e.empty()) {
    std::fprintf(stderr, "geofp8-coordinator: error: %s\n", e.c_str());
    return 2;
  }
  if (!ReadToken(flags.token_file, &flags.server.token)) return 2;
  if (!InstallSignalHandlers()) return Fail("pipe() failed");
  return Serve(flags);
}
