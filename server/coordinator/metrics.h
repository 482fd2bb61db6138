// Prometheus metrics of the coordinator: RPC counts and latencies recorded by the adapters, and
// job/worker gauges computed from the coordinator's state at scrape time.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/coordinator/coordinator.h"

namespace geofp8::http {
class MetricsServer;
}

namespace prometheus {
class Registry;
template <typename T>
class Family;
class Counter;
class Histogram;
}  // namespace prometheus

namespace geofp8::coordinator {

class Metrics {
 public:
  explicit Metrics(Coordinator* coordinator);
  ~Metrics();

  // Serves /metrics on host:port (port 0 picks a free one). Returns the bound port.
  absl::StatusOr<int> Serve(const std::string& listen);

  // One finished RPC: method like "JobService/SubmitJob", code like "OK" or "NOT_FOUND".
  void RecordRpc(const std::string& method, const std::string& code, double seconds);

  // The exposition text, as a scrape would return it (for tests and the bench).
  std::string Render();

 private:
  class StateCollector;
  Coordinator* coordinator_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<StateCollector> collector_;
  prometheus::Family<prometheus::Counter>* rpcs_;
  prometheus::Family<prometheus::Histogram>* latency_;
  std::unique_ptr<http::MetricsServer> server_;  // last: stops before what it renders
};

}  // namespace geofp8::coordinator
