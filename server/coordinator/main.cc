// geofp8-coordinator: the control-plane daemon. Serves the geofp8.v1 gRPC API and grpc.health.v1,
// keeps durable state in SQLite under --data-dir, and exposes Prometheus /metrics.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <thread>

#include "CLI/CLI.hpp"
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"geofp8-coordinator: GeoFP8 control plane (jobs, policies, workers, rendezvous)"};
  geofp8::coordinator::ServerOptions server;
  geofp8::coordinator::CoordinatorOptions coord;
  std::string data_dir = "./geofp8-data";
  std::string metrics_listen = "127.0.0.1:9464";
  std::string ready_file;
  std::string token_file;
  std::string log_format = "text";
  int tick_ms = 200;
  int grace_ms = 5000;
  app.add_option("--listen", server.listen, "gRPC address host:port (port 0 picks a free one)")
      ->capture_default_str();
  app.add_option("--data-dir", data_dir, "Directory of the SQLite state (coordinator.db)")
      ->capture_default_str();
  app.add_option("--ready-file", ready_file,
                 "Once serving, write {\"grpc\": \"host:port\", \"metrics\": ..., \"pid\": N} here "
                 "(atomically; removed on a clean shutdown)");
  app.add_option("--metrics-listen", metrics_listen,
                 "Prometheus /metrics address host:port; empty disables")
      ->capture_default_str();
  app.add_option("--token-file", token_file,
                 "File holding the bearer token every geofp8.v1 call needs, reads included "
                 "(or env GEOFP8_TOKEN); health and /metrics stay open");
  geofp8::coordinator::StoreOptions store_options;
  app.add_flag("--accept-store-loss", store_options.accept_loss,
               "Start even when coordinator.db does not match its coordinator.seal (truncated, "
               "replaced or rolled back: acknowledged jobs are missing); logged. Job ids still "
               "never repeat");
  app.add_option("--tls-cert", server.tls_cert, "PEM server certificate (enables TLS)");
  app.add_option("--tls-key", server.tls_key, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", server.tls_client_ca,
                 "PEM CA bundle; clients must present a certificate it signed (mTLS)");
  app.add_option("--heartbeat-interval-ms", coord.heartbeat_interval_ms,
                 "Heartbeat period told to workers")
      ->capture_default_str()
      ->check(CLI::Range(10, 3600000));
  app.add_option("--heartbeat-timeout-ms", coord.heartbeat_timeout_ms,
                 "Silence after which a worker is declared dead and fenced")
      ->capture_default_str()
      ->check(CLI::Range(50, 86400000));
  app.add_option("--tick-ms", tick_ms, "Period of the dead-worker check")
      ->capture_default_str()
      ->check(CLI::Range(5, 60000));
  app.add_flag("--debug-kv-any-job", coord.kv_any_job,
               "Tests only: serve the rendezvous KV for any job id, not only live attempts")
      ->group("");
  app.add_option("--shutdown-grace-ms", grace_ms, "How long SIGTERM waits for running calls")
      ->capture_default_str()
      ->check(CLI::Range(0, 600000));
  app.add_option("--log-format", log_format,
                 "Event lines on stderr: text (logfmt, key=value) or json (one object a line)")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "geofp8-coordinator: error: %s\n", e.what());
    return 2;
  }
  const auto format = geofp8::log::ParseFormat(log_format);
  if (!format) {
    std::fprintf(stderr,
                 "geofp8-coordinator: error: --log-format: unknown value (%s); accepted: text, "
                 "json\n",
                 log_format.c_str());
    return 2;
  }
  geofp8::log::Configure(*format);
  if (!token_file.empty()) {
    auto token = geofp8::coordinator::ReadFileForFlag("--token-file", token_file);
    if (!token.ok()) {
      std::fprintf(stderr, "geofp8-coordinator: error: %s\n",
                   std::string(token.status().message()).c_str());
      return 2;
    }
    server.token = *token;
    while (!server.token.empty() && (server.token.back() == '\n' || server.token.back() == '\r' ||
                                     server.token.back() == ' ')) {
      server.token.pop_back();
    }
    if (server.token.empty()) {
      std::fprintf(stderr, "geofp8-coordinator: error: --token-file: %s is empty\n",
                   token_file.c_str());
      return 2;
    }
  } else if (const char* env = std::getenv("GEOFP8_TOKEN"); env && *env) {
    server.token = env;
  }

  // SIGTERM/SIGINT write to a pipe that main reads, so shutdown runs outside signal context. A
  // handler rather than sigwait: libraries (OpenBLAS) start threads before main could mask them.
  if (pipe(g_signal_pipe) != 0) return Fail("pipe() failed");
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);

  auto store = geofp8::coordinator::Store::Open(data_dir, store_options);
  if (!store.ok()) return Fail(std::string(store.status().message()));
  geofp8::coordinator::Coordinator coordinator(store->get(), geofp8::coordinator::SystemClock(),
                                               coord);
  if (auto s = coordinator.Recover(); !s.ok()) return Fail(s.ToString());
  geofp8::coordinator::Metrics metrics(&coordinator);
  std::string metrics_address;  // host:port, empty when off
  if (!metrics_listen.empty()) {
    auto port = metrics.Serve(metrics_listen);
    if (!port.ok()) return Fail(std::string(port.status().message()));
    metrics_address =
        metrics_listen.substr(0, metrics_listen.rfind(':')) + ":" + std::to_string(*port);
    std::printf("geofp8-coordinator: metrics on http://%s/metrics\n", metrics_address.c_str());
  }
  auto srv = geofp8::coordinator::CoordinatorServer::Start(&coordinator, &metrics, server);
  if (!srv.ok()) return Fail(std::string(srv.status().message()));
  if (!ready_file.empty()) {
    const std::string grpc_address =
        server.listen.substr(0, server.listen.rfind(':')) + ":" + std::to_string((*srv)->port());
    const std::string json =
        "{\"grpc\": \"" + grpc_address + "\", \"metrics\": " +
        (metrics_address.empty() ? std::string("null") : "\"" + metrics_address + "\"") +
        ", \"pid\": " + std::to_string(getpid()) + "}";
    if (std::string e = geofp8::WriteReadyFile(ready_file, json); !e.empty()) return Fail(e);
  }
  std::printf("geofp8-coordinator: serving on %s:%d (data %s, auth %s, tls %s)\n",
              server.listen.substr(0, server.listen.rfind(':')).c_str(), (*srv)->port(),
              data_dir.c_str(), server.token.empty() ? "off" : "token",
              server.tls_cert.empty() ? "off" : (server.tls_client_ca.empty() ? "on" : "mutual"));
  std::fflush(stdout);
  geofp8::log::Info("coordinator.started")
      .F("grpc_port", (*srv)->port())
      .F("metrics", metrics_address)
      .F("data_dir", data_dir)
      .F("auth", server.token.empty() ? "off" : "token")
      .F("tls", server.tls_cert.empty() ? "off" : (server.tls_client_ca.empty() ? "on" : "mutual"))
      .Msg("serving");

  std::atomic<bool> stopping{false};
  std::thread ticker([&] {
    // A sleep of tick_ms that took far longer means this process was not running (SIGSTOP,
    // a paused VM): the workers' heartbeats could not be read meanwhile, so their silence is
    // not theirs. A heartbeat interval (at least 1 s) of slack absorbs ordinary delay.
    const int64_t slack_ms = std::max<int64_t>(1000, coord.heartbeat_interval_ms);
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
  int sig = 0;
  while (read(g_signal_pipe[0], &sig, sizeof sig) < 0 && errno == EINTR) {
  }
  std::printf("geofp8-coordinator: %s received, shutting down\n",
              sig == SIGTERM ? "SIGTERM" : "SIGINT");
  std::fflush(stdout);
  geofp8::log::Info("coordinator.shutdown")
      .F("signal", sig == SIGTERM ? "SIGTERM" : "SIGINT")
      .Msg("shutting down");
  stopping = true;
  coordinator.Shutdown();  // wakes watchers and rendezvous waiters
  (*srv)->Shutdown(grace_ms);
  ticker.join();
  if (!ready_file.empty()) std::remove(ready_file.c_str());
  std::printf("geofp8-coordinator: stopped\n");
  geofp8::log::Info("coordinator.stopped").Msg("stopped");
  return 0;
}
