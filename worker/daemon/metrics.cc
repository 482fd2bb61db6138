// Worker metrics (see metrics.h). Names follow Prometheus conventions: base units (seconds,
// bytes), _total for counters, labels for job, layer and format.
#include "worker/daemon/metrics.h"

#include <prometheus/text_serializer.h>

#include <algorithm>

#include "absl/status/status.h"

namespace geofp8::worker {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

namespace {
prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
}
}  // namespace

WorkerMetrics::WorkerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      step_(BuildGauge().Name("geofp8_worker_step").Help("Last completed training step").Register(*registry_)),
      loss_(BuildGauge().Name("geofp8_worker_loss").Help("Training loss (mean over ranks) of the last step").Register(*registry_)),
      tokens_per_second_(BuildGauge().Name("geofp8_worker_tokens_per_second").Help("Tokens per second over all ranks (smoothed)").Register(*registry_)),
      steps_total_(BuildCounter().Name("geofp8_worker_steps_total").Help("Training steps completed by this worker").Register(*registry_)),
      skipped_total_(BuildCounter().Name("geofp8_worker_skipped_steps_total").Help("Steps skipped for a non-finite gradient on some rank").Register(*registry_)),
      step_seconds_(BuildHistogram().Name("geofp8_worker_step_seconds").Help("Wall time of one training step").Register(*registry_)),
      exchange_seconds_(BuildHistogram().Name("geofp8_exchange_seconds").Help("Exchange engine time per step (first submit to finish)").Register(*registry_)),
      bytes_total_(BuildCounter().Name("geofp8_exchange_bytes_total").Help("Bytes this rank put on the wire, attributed to layers by encoded size").Register(*registry_)),
      rel_error_(BuildGauge().Name("geofp8_quantization_rel_error").Help("rel_fro_error of the exchanged average against the exact fp32 average").Register(*registry_)),
      refreshes_total_(BuildCounter().Name("geofp8_geometry_refreshes_total").Help("Geometry refreshes applied").Register(*registry_)),
      drift_(BuildGauge().Name("geofp8_geometry_drift").Help("Subspace drift measured at the layer's last refresh").Register(*registry_)),
      probe_gain_(BuildGauge().Name("geofp8_geometry_probe_gain").Help("Auto-mode probe: error without geometry over error with the basis the layer deploys (basis=deployed) or would deploy while off (basis=shadow); below 1, geometry hurts").Register(*registry_)),
      policy_version_(BuildGauge().Name("geofp8_worker_policy_version").Help("Policy version in force").Register(*registry_)),
      checkpoint_step_(BuildGauge().Name("geofp8_worker_checkpoint_step").Help("Step of the last checkpoint written").Register(*registry_)),
      jobs_total_(BuildCounter().Name("geofp8_worker_jobs_total").Help("Job attempts run to an end, by result").Register(*registry_)),
      errors_total_(BuildCounter().Name("geofp8_worker_errors_total").Help("Errors by kind").Register(*registry_)),
      assigned_(BuildGauge().Name("geofp8_worker_assigned").Help("1 while the worker runs a job rank").Register(*registry_)),
      connected_(BuildGauge().Name("geofp8_worker_session_connected").Help("1 while the Session stream is open").Register(*registry_)),
      generation_(BuildGauge().Name("geofp8_worker_generation").Help("Generation granted at the last Register").Register(*registry_)),
      heartbeats_(BuildCounter().Name("geofp8_worker_heartbeats_total").Help("Heartbeats sent").Register(*registry_)),
      reconnects_(BuildCounter().Name("geofp8_worker_session_reconnects_total").Help("Session streams reopened").Register(*registry_)) {
  assigned_.Add({}).Set(0);
  errors_total_.Add({{"kind", "job_failed"}});
}

absl::StatusOr<int> WorkerMetrics::Serve(const std::string& host, int port) {
  try {
    server_ = std::make_unique<http::MetricsServer>(host, port, [this] { return Render(); });
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError("--metrics-port: cannot listen on " + host + ":" +
                                      std::to_string(port) + ": " + e.what());
  }
  return server_->port();
}

std::string WorkerMetrics::Render() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

void WorkerMetrics::JobStarted(const std::string& job_id, int rank, int world_size) {
  std::lock_guard<std::mutex> lock(mu_);
  job_ = job_id;
  assigned_.Add({}).Set(1);
  // "job_id", not "job": Prometheus sets its own `job` label (the scrape job) and would rename
  // ours to exported_job, which breaks the dashboard's `by (job_id)` queries.
  step_.Add({{"job_id", job_}}).Set(-1);
}

void WorkerMetrics::JobEnded(bool success) {
  std::lock_guard<std::mutex> lock(mu_);
  assigned_.Add({}).Set(0);
  jobs_total_.Add({{"result", success ? "succeeded" : "failed"}}).Increment();
  if (!success) errors_total_.Add({{"kind", "job_failed"}}).Increment();
}

void WorkerMetrics::Step(int64_t step, double loss, double tokens_per_second, double step_seconds,
                         double exchange_seconds, bool skipped) {
  std::lock_guard<std::mutex> lock(mu_);
  const prometheus::Labels job = {{"job_id", job_}};
  step_.Add(job).Set(double(step));
  loss_.Add(job).Set(loss);
  tokens_per_second_.Add(job).Set(tokens_per_second);
  steps_total_.Add({}).Increment();
  if (skipped) skipped_total_.Add({}).Increment();
  step_seconds_.Add({}, SecondsBuckets()).Observe(step_seconds);
  exchange_seconds_.Add({}, SecondsBuckets()).Observe(exchange_seconds);
}

void WorkerMetrics::PolicyVersion(uint64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  policy_version_.Add({{"job_id", job_}}).Set(double(version));
}

void WorkerMetrics::LayerBytes(const std::string& layer, const std::string& format, double bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  bytes_total_.Add({{"layer", layer}, {"format", format}}).Increment(bytes);
}

void WorkerMetrics::LayerError(const std::string& layer, double rel_fro_error) {
  std::lock_guard<std::mutex> lock(mu_);
  rel_error_.Add({{"layer", layer}}).Set(rel_fro_error);
}

void WorkerMetrics::Refresh(const std::string& layer, double drift) {
  std::lock_guard<std::mutex> lock(mu_);
  refreshes_total_.Add({{"layer", layer}}).Increment();
  drift_.Add({{"layer", layer}}).Set(drift);
}

void WorkerMetrics::ProbeGain(const std::string& layer, const std::string& basis, double gain) {
  std::lock_guard<std::mutex> lock(mu_);
  // One series per layer: the basis label follows the layer's state, so drop the other one.
  for (const char* other : {"deployed", "shadow"}) {
    const prometheus::Labels labels{{"layer", layer}, {"basis", other}};
    if (basis != other && probe_gain_.Has(labels)) probe_gain_.Remove(&probe_gain_.Add(labels));
  }
  probe_gain_.Add({{"layer", layer}, {"basis", basis}}).Set(gain);
}

void WorkerMetrics::Checkpoint(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  checkpoint_step_.Add({{"job_id", job_}}).Set(double(step));
}

void WorkerMetrics::Error(const std::string& kind) {
  std::lock_guard<std::mutex> lock(mu_);
  errors_total_.Add({{"kind", kind}}).Increment();
}

void WorkerMetrics::Session(bool connected, uint64_t generation, uint64_t heartbeats,
                            uint64_t reconnects) {
  std::lock_guard<std::mutex> lock(mu_);
  connected_.Add({}).Set(connected ? 1 : 0);
  generation_.Add({}).Set(double(generation));
  if (heartbeats > heartbeats_seen_) heartbeats_.Add({}).Increment(double(heartbeats - heartbeats_seen_));
  if (reconnects > reconnects_seen_) reconnects_.Add({}).Increment(double(reconnects - reconnects_seen_));
  heartbeats_seen_ = std::max(heartbeats_seen_, heartbeats);
  reconnects_seen_ = std::max(reconnects_seen_, reconnects);
}

}  // namespace geofp8::worker
