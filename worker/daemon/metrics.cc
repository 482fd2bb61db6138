// Worker metrics (see metrics.h). Names follow Prometheus conventions: base units (seconds,
// bytes), _total for counters, labels for job, layer and format.
#include "worker/daemon/metrics.h"

#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "platform/common/process_metrics.h"

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
      step_(BuildGauge()
                .Name("geofp8_worker_step")
                .Help("Last completed training step")
                .Register(*registry_)),
      loss_(BuildGauge()
                .Name("geofp8_worker_loss")
                .Help("Training loss (mean over ranks) of the last step")
                .Register(*registry_)),
      val_loss_(BuildGauge()
                    .Name("geofp8_worker_val_loss")
                    .Help("Validation loss on held-out data (mean over the eval batches), as last "
                          "measured (training.eval_every)")
                    .Register(*registry_)),
      val_step_(BuildGauge()
                    .Name("geofp8_worker_val_step")
                    .Help("Step after which geofp8_worker_val_loss was measured")
                    .Register(*registry_)),
      tokens_per_second_(BuildGauge()
                             .Name("geofp8_worker_tokens_per_second")
                             .Help("Tokens per second over all ranks (smoothed)")
                             .Register(*registry_)),
      steps_total_(BuildCounter()
                       .Name("geofp8_worker_steps_total")
                       .Help("Training steps completed by this worker")
                       .Register(*registry_)),
      skipped_total_(BuildCounter()
                         .Name("geofp8_worker_skipped_steps_total")
                         .Help("Steps skipped for a non-finite gradient on some rank")
                         .Register(*registry_)),
      step_seconds_(BuildHistogram()
                        .Name("geofp8_worker_step_seconds")
                        .Help("Wall time of one training step")
                        .Register(*registry_)),
      exchange_seconds_(BuildHistogram()
                            .Name("geofp8_exchange_seconds")
                            .Help("Exchange engine time per step (first submit to finish)")
                            .Register(*registry_)),
      geometry_seconds_(BuildHistogram()
                            .Name("geofp8_geometry_refresh_seconds")
                            .Help("Geometry estimation (refresh) time per step on this rank, "
                                  "part of the exchange time")
                            .Register(*registry_)),
      bytes_total_(
          BuildCounter()
              .Name("geofp8_exchange_bytes_total")
              .Help("Whole bytes this rank put on the wire, attributed to layers by encoded size")
              .Register(*registry_)),
      rel_error_(BuildGauge()
                     .Name("geofp8_quantization_rel_error")
                     .Help("rel_fro_error of the exchanged average against the exact fp32 average")
                     .Register(*registry_)),
      refreshes_total_(BuildCounter()
                           .Name("geofp8_geometry_refreshes_total")
                           .Help("Geometry refreshes applied")
                           .Register(*registry_)),
      drift_(BuildGauge()
                 .Name("geofp8_geometry_drift")
                 .Help("Subspace drift measured at the layer's last refresh")
                 .Register(*registry_)),
      probe_gain_(BuildGauge()
                      .Name("geofp8_geometry_probe_gain")
                      .Help("Auto-mode probe: error without geometry over error with the basis the "
                            "layer deploys (basis=deployed) or would deploy while off "
                            "(basis=shadow); below 1, geometry hurts")
                      .Register(*registry_)),
      noise_scale_(
          BuildGauge()
              .Name("geofp8_gradient_noise_scale")
              .Help("Gradient noise scale B_simple = tr(Sigma) / |g|^2 in tokens, from each "
                    "rank's gradient and the averaged one, smoothed over steps; absent "
                    "while undefined (one rank, or an estimate not positive)")
              .Register(*registry_)),
      policy_version_(BuildGauge()
                          .Name("geofp8_worker_policy_version")
                          .Help("Policy version in force")
                          .Register(*registry_)),
      checkpoint_step_(BuildGauge()
                           .Name("geofp8_worker_checkpoint_step")
                           .Help("Step of the last checkpoint written")
                           .Register(*registry_)),
      jobs_total_(BuildCounter()
                      .Name("geofp8_worker_jobs_total")
                      .Help("Job attempts run to an end on this worker, by result: succeeded, "
                            "failed, cancelled (stopped by a cancel) or stopped (the coordinator "
                            "ended the attempt: a peer failed, a restart, a shutdown)")
                      .Register(*registry_)),
      errors_total_(BuildCounter()
                        .Name("geofp8_worker_errors_total")
                        .Help("Errors by kind")
                        .Register(*registry_)),
      assigned_(BuildGauge()
                    .Name("geofp8_worker_assigned")
                    .Help("1 while the worker runs a job rank")
                    .Register(*registry_)),
      connected_(BuildGauge()
                     .Name("geofp8_worker_session_connected")
                     .Help("1 while the Session stream is open")
                     .Register(*registry_)),
      generation_(BuildGauge()
                      .Name("geofp8_worker_generation")
                      .Help("Generation granted at the last Register")
                      .Register(*registry_)),
      heartbeats_(BuildCounter()
                      .Name("geofp8_worker_heartbeats_total")
                      .Help("Heartbeats sent")
                      .Register(*registry_)),
      reconnects_(BuildCounter()
                      .Name("geofp8_worker_session_reconnects_total")
                      .Help("Session streams reopened")
                      .Register(*registry_)) {
  // Present from the start, so a panel shows 0 rather than "no data".
  assigned_.Add({}).Set(0);
  connected_.Add({}).Set(0);
  generation_.Add({}).Set(0);
  heartbeats_.Add({});
  reconnects_.Add({});
  steps_total_.Add({});
  skipped_total_.Add({});
  step_seconds_.Add({}, SecondsBuckets());
  exchange_seconds_.Add({}, SecondsBuckets());
  geometry_seconds_.Add({}, SecondsBuckets());
  for (const char* result : {"succeeded", "failed", "cancelled", "stopped"}) {
    jobs_total_.Add({{"result", result}});
  }
  for (const char* kind : {"job_failed", "session_lost", "checkpoint_write"}) {
    errors_total_.Add({{"kind", kind}});
  }
}

prometheus::Gauge& WorkerMetrics::JobGauge(prometheus::Family<prometheus::Gauge>& family,
                                           prometheus::Labels labels) {
  labels["job_id"] = job_;
  prometheus::Gauge& g = family.Add(labels);
  job_gauges_.insert({&family, &g});
  return g;
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
  auto families = registry_->Collect();
  auto process = http::ProcessFamilies();
  families.insert(families.end(), process.begin(), process.end());
  return prometheus::TextSerializer().Serialize(families);
}

void WorkerMetrics::JobStarted(const std::string& job_id, int rank, int world_size) {
  std::lock_guard<std::mutex> lock(mu_);
  job_ = job_id;
  // A restarted attempt of a job that ended here continues its counters.
  ended_jobs_.erase(std::remove(ended_jobs_.begin(), ended_jobs_.end(), job_id), ended_jobs_.end());
  assigned_.Add({}).Set(1);
  // "job_id", not "job": Prometheus sets its own `job` label (the scrape job) and would rename
  // ours to exported_job, which breaks the dashboard's `by (job_id)` queries.
  JobGauge(step_, {}).Set(-1);
}

void WorkerMetrics::JobEnded(bool success, bool stopped, bool cancelled) {
  std::lock_guard<std::mutex> lock(mu_);
  assigned_.Add({}).Set(0);
  const char* result = success                ? "succeeded"
                       : stopped && cancelled ? "cancelled"
                       : stopped              ? "stopped"
                                              : "failed";
  jobs_total_.Add({{"result", result}}).Increment();
  if (!success && !stopped) errors_total_.Add({{"kind", "job_failed"}}).Increment();
  for (auto [family, gauge] : job_gauges_) family->Remove(gauge);
  job_gauges_.clear();
  if (!job_.empty()) ended_jobs_.push_back(job_);
  while (ended_jobs_.size() > kKeptJobs) {
    for (auto [family, counter] : job_counters_[ended_jobs_.front()]) {
      exact_bytes_.erase(counter);
      family->Remove(counter);
    }
    job_counters_.erase(ended_jobs_.front());
    ended_jobs_.pop_front();
  }
  job_.clear();
}

void WorkerMetrics::Step(int64_t step, double loss, double tokens_per_second,
                         const StepTimes& times, bool skipped) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!job_.empty()) {
    JobGauge(step_, {}).Set(double(step));
    JobGauge(loss_, {}).Set(loss);
    JobGauge(tokens_per_second_, {}).Set(tokens_per_second);
  }
  steps_total_.Add({}).Increment();
  if (skipped) skipped_total_.Add({}).Increment();
  step_seconds_.Add({}, SecondsBuckets()).Observe(times.step_seconds);
  exchange_seconds_.Add({}, SecondsBuckets()).Observe(times.exchange_seconds);
  geometry_seconds_.Add({}, SecondsBuckets()).Observe(times.geometry_seconds);
}

void WorkerMetrics::ValidationLoss(int64_t step, double loss) {
  std::lock_guard<std::mutex> lock(mu_);
  if (job_.empty()) return;
  JobGauge(val_loss_, {}).Set(loss);
  JobGauge(val_step_, {}).Set(double(step));
}

void WorkerMetrics::PolicyVersion(uint64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!job_.empty()) JobGauge(policy_version_, {}).Set(double(version));
}

void WorkerMetrics::LayerBytes(const std::string& layer, const std::string& format, double bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (job_.empty() || !(bytes > 0)) return;
  prometheus::Counter& c =
      bytes_total_.Add({{"job_id", job_}, {"layer", layer}, {"format", format}});
  job_counters_[job_].insert({&bytes_total_, &c});
  double& exact = exact_bytes_[&c];
  exact += bytes;
  const double whole = std::floor(exact);
  if (whole > c.Value()) c.Increment(whole - c.Value());
}

void WorkerMetrics::LayerError(const std::string& layer, double rel_fro_error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!job_.empty()) JobGauge(rel_error_, {{"layer", layer}}).Set(rel_fro_error);
}

void WorkerMetrics::Refresh(const std::string& layer, double drift) {
  std::lock_guard<std::mutex> lock(mu_);
  if (job_.empty()) return;
  prometheus::Counter& c = refreshes_total_.Add({{"job_id", job_}, {"layer", layer}});
  job_counters_[job_].insert({&refreshes_total_, &c});
  c.Increment();
  JobGauge(drift_, {{"layer", layer}}).Set(drift);
}

void WorkerMetrics::ProbeGain(const std::string& layer, const std::string& basis, double gain) {
  std::lock_guard<std::mutex> lock(mu_);
  if (job_.empty()) return;
  // One series per layer: the basis label follows the layer's state, so drop the other one.
  for (const char* other : {"deployed", "shadow"}) {
    const prometheus::Labels labels{{"job_id", job_}, {"layer", layer}, {"basis", other}};
    if (basis != other && probe_gain_.Has(labels)) {
      prometheus::Gauge* g = &probe_gain_.Add(labels);
      job_gauges_.erase({&probe_gain_, g});
      probe_gain_.Remove(g);
    }
  }
  JobGauge(probe_gain_, {{"layer", layer}, {"basis", basis}}).Set(gain);
}

void WorkerMetrics::GradientNoiseScale(double tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  if (job_.empty()) return;
  const prometheus::Labels labels{{"job_id", job_}};
  if (std::isfinite(tokens) && tokens > 0) {
    JobGauge(noise_scale_, {}).Set(tokens);
  } else if (noise_scale_.Has(labels)) {
    prometheus::Gauge* g = &noise_scale_.Add(labels);
    job_gauges_.erase({&noise_scale_, g});
    noise_scale_.Remove(g);
  }
}

void WorkerMetrics::Checkpoint(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!job_.empty()) JobGauge(checkpoint_step_, {}).Set(double(step));
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
  if (heartbeats > heartbeats_seen_)
    heartbeats_.Add({}).Increment(double(heartbeats - heartbeats_seen_));
  if (reconnects > reconnects_seen_)
    reconnects_.Add({}).Increment(double(reconnects - reconnects_seen_));
  heartbeats_seen_ = std::max(heartbeats_seen_, heartbeats);
  reconnects_seen_ = std::max(reconnects_seen_, reconnects);
}

}  // namespace geofp8::worker
