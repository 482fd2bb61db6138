// Coordinator metrics in prometheus-cpp registries, served by our own /metrics responder. Gauges of
// jobs and workers by state are computed on each scrape, so they never drift from the state.
#include "server/coordinator/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <exception>

#include "platform/common/http_server.h"
#include "platform/common/process_metrics.h"

namespace geofp8::coordinator {
namespace {

prometheus::ClientMetric Value(double v, std::vector<prometheus::ClientMetric::Label> labels) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = v;
  m.counter.value = v;
  return m;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

class Metrics::StateCollector : public prometheus::Collectable {
 public:
  explicit StateCollector(Coordinator* c) : c_(c) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    Coordinator::Counts counts = c_->GetCounts();
    std::vector<prometheus::MetricFamily> out;
    prometheus::MetricFamily jobs{
        "geofp8_jobs", "Jobs by state", prometheus::MetricType::Gauge, {}};
    for (int s = v1::JOB_PENDING; s <= v1::JOB_CANCELLED; ++s) {
      std::string name = Lower(v1::JobState_Name(static_cast<v1::JobState>(s)).substr(4));
      jobs.metric.push_back(Value(static_cast<double>(counts.jobs_by_state[s]), {{"state", name}}));
    }
    out.push_back(std::move(jobs));
    prometheus::MetricFamily workers{
        "geofp8_workers", "Workers by state", prometheus::MetricType::Gauge, {}};
    for (int s = v1::WORKER_IDLE; s <= v1::WORKER_DISCONNECTED; ++s) {
      std::string name = Lower(v1::WorkerState_Name(static_cast<v1::WorkerState>(s)).substr(7));
      workers.metric.push_back(
          Value(static_cast<double>(counts.workers_by_state[s]), {{"state", name}}));
    }
    out.push_back(std::move(workers));
    auto counter = [&](const char* name, const char* help, double v,
                       std::vector<prometheus::ClientMetric::Label> labels = {}) {
      prometheus::MetricFamily f{name, help, prometheus::MetricType::Counter, {}};
      f.metric.push_back(Value(v, std::move(labels)));
      out.push_back(std::move(f));
    };
    // Counted from the job records plus the persisted totals of deleted ones (Store::DeleteJob),
    // so it is monotonic and survives a coordinator restart. Every result is present from the
    // start.
    prometheus::MetricFamily results{
        "geofp8_jobs_total",
        "Job attempts ended, by result: succeeded, failed, cancelled (final states of jobs) or "
        "restarted (an attempt ended by a restartable failure, such as a dead peer, and re-queued)",
        prometheus::MetricType::Counter,
        {}};
    for (auto [state, name] :
         {std::pair{v1::JOB_SUCCEEDED, "succeeded"}, std::pair{v1::JOB_FAILED, "failed"},
          std::pair{v1::JOB_CANCELLED, "cancelled"}}) {
      results.metric.push_back(
          Value(static_cast<double>(counts.jobs_by_state[state] + counts.deleted_by_state[state]),
                {{"result", name}}));
    }
    results.metric.push_back(
        Value(static_cast<double>(counts.job_restarts), {{"result", "restarted"}}));
    out.push_back(std::move(results));
    prometheus::MetricFamily updates{"geofp8_policy_updates_total",
                                     "Policy versions created after the spec's v1, by author",
                                     prometheus::MetricType::Counter,
                                     {}};
    updates.metric.push_back(
        Value(static_cast<double>(counts.policy_updates - counts.auto_policy_updates),
              {{"author", "user"}}));
    updates.metric.push_back(
        Value(static_cast<double>(counts.auto_policy_updates), {{"author", "auto"}}));
    out.push_back(std::move(updates));
    counter("geofp8_fenced_messages_total", "Worker messages rejected for a fenced generation",
            static_cast<double>(counts.fenced_messages));
    counter("geofp8_forged_sessions_total",
            "Worker sessions and Leaves refused for a missing or wrong session secret",
            static_cast<double>(counts.forged_sessions));
    counter("geofp8_foreign_reports_total",
            "Worker reports naming a job the worker is not a rank of (ignored)",
            static_cast<double>(counts.foreign_reports));
    counter("geofp8_refused_log_data_total",
            "Log answers (geofp8ctl logs) for no read sent to that worker's session (dropped)",
            static_cast<double>(counts.refused_log_data));
    counter("geofp8_workers_declared_dead_total",
            "Workers declared dead (heartbeat timeout or re-registration)",
            static_cast<double>(counts.workers_declared_dead));
    counter("geofp8_workers_dropped_total",
            "Dead workers dropped from the registry after --dead-worker-retention-ms",
            static_cast<double>(counts.workers_dropped));
    counter("geofp8_fencing_holds_total",
            "Times the coordinator held off fencing because too many workers missed at once",
            static_cast<double>(counts.fencing_holds));
    auto gauge = [&](const char* name, const char* help, double v) {
      prometheus::MetricFamily f{name, help, prometheus::MetricType::Gauge, {}};
      f.metric.push_back(Value(v, {}));
      out.push_back(std::move(f));
    };
    gauge("geofp8_fencing_held",
          "1 while fencing is held off (too many workers missed their heartbeat deadline at once)",
          counts.fencing_held ? 1 : 0);
    gauge("geofp8_heartbeat_lag_seconds",
          "How late the coordinator handles heartbeats (median over the last second); heartbeat "
          "deadlines grow by it",
          static_cast<double>(counts.heartbeat_lag_ms) / 1000.0);
    return out;
  }

 private:
  Coordinator* c_;
};

Metrics::Metrics(Coordinator* coordinator)
    : coordinator_(coordinator),
      registry_(std::make_shared<prometheus::Registry>()),
      collector_(std::make_shared<StateCollector>(coordinator)) {
  rpcs_ = &prometheus::BuildCounter()
               .Name("geofp8_rpcs_total")
               .Help("RPCs handled, by method and status code")
               .Register(*registry_);
  latency_ = &prometheus::BuildHistogram()
                  .Name("geofp8_rpc_latency_seconds")
                  .Help("RPC handling latency (streams: per message), by method")
                  .Register(*registry_);
}

Metrics::~Metrics() = default;

absl::StatusOr<int> Metrics::Serve(const std::string& listen) {
  std::string host;
  int port = 0;
  if (!http::SplitHostPort(listen, &host, &port)) {
    return absl::InvalidArgumentError("--metrics-listen: expected host:port (" + listen + ")");
  }
  try {
    server_ = std::make_unique<http::MetricsServer>(host, port, [this] { return Render(); });
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError("--metrics-listen: cannot listen on " + listen + ": " +
                                         e.what());
  }
  return server_->port();
}

void Metrics::RecordRpc(const std::string& method, const std::string& code, double seconds) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5};
  rpcs_->Add({{"method", method}, {"code", code}}).Increment();
  latency_->Add({{"method", method}}, kBuckets).Observe(seconds);
}

std::string Metrics::Render() {
  auto families = registry_->Collect();
  auto state = collector_->Collect();
  families.insert(families.end(), state.begin(), state.end());
  auto process = http::ProcessFamilies();
  families.insert(families.end(), process.begin(), process.end());
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace geofp8::coordinator
