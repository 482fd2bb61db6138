// A small HTTP/1.1 responder that serves one text document at /metrics for Prometheus scrapes.
// It replaces prometheus-cpp's Exposer, whose civetweb crashed on any request for another path.
//
// Why it lives in platform/common: both daemons (server/coordinator and worker/daemon) serve
// /metrics, and neither may depend on the other, so the responder sits below both. It knows only
// POSIX sockets and a render callback; it has no gRPC, no Prometheus types and no daemon state.
// The daemons render their registries in the callback.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace geofp8::http {

struct MetricsServerOptions {
  // The request head must arrive within this, and the response must be taken within this again;
  // a slow client (slowloris) is dropped when its time is up.
  int io_timeout_ms = 5000;
  // Connections held at once. When all are taken, a new connection takes the slot of the oldest
  // one still reading its request head, which gets a 408 and is closed: a scraper sends its head
  // within a round trip, so slow clients that reconnect as fast as they are dropped cannot hold
  // every slot. When every slot is a response in flight, the new one gets a short 503 and is
  // closed at once.
  int max_connections = 64;
  // A request head (request line and headers) longer than this gets 431.
  size_t max_head_bytes = 8192;
  // After the response, unread request bytes are drained for at most this long before close, so
  // that closing does not reset the connection under a response the client has not read yet.
  int linger_ms = 1000;
};

// Counters for tests and logs; all monotonic.
struct MetricsServerStats {
  std::atomic<uint64_t> accepted{0};
  std::atomic<uint64_t> rejected_busy{0};  // answered 503 because max_connections were open
  std::atomic<uint64_t> timed_out{0};      // dropped at io_timeout_ms
  std::atomic<uint64_t> evicted{0};        // unfinished heads closed to make room (408)
  std::atomic<uint64_t> responses{0};      // responses fully written
};

// Serves GET and HEAD /metrics (200, text/plain; version=0.0.4). Any other path is 404, another
// method on /metrics 405 with Allow, a malformed request 400, an oversized head 431. Every
// response closes the connection. One thread runs a poll loop over all connections, so a slow
// client never delays another; the render callback runs on that thread, once per scrape.
class MetricsServer {
 public:
  using Render = std::function<std::string()>;

  // Binds host:port (port 0 picks a free one; host may be a name, an IPv4 or an IPv6 literal,
  // with or without brackets) and starts serving. Throws geofp8::Error naming the address and
  // the system error when it cannot listen.
  MetricsServer(const std::string& host, int port, Render render,
                MetricsServerOptions options = {});
  // Stops accepting, closes every connection and joins the loop thread.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The bound port.
  int port() const { return port_; }
  const MetricsServerStats& stats() const { return stats_; }

 private:
  struct Connection;
  void Loop();

  Render render_;
  MetricsServerOptions options_;
  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};  // a pipe: the destructor writes to stop the loop
  int port_ = 0;
  MetricsServerStats stats_;
  std::thread thread_;
};

// "host:port" -> host and port, for flags such as --metrics-listen. Accepts "[v6]:port". Returns
// false when there is no port or it is not in [0, 65535].
bool SplitHostPort(const std::string& listen, std::string* host, int* port);

}  // namespace geofp8::http
