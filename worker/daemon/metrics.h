// The worker's Prometheus metrics (prometheus-cpp registry, served by platform/common/http_server):
// training progress, exchange bytes and time, per-layer quantization error, session health.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "platform/common/http_server.h"

namespace geofp8::worker {

class WorkerMetrics {
 public:
  WorkerMetrics();
  // Serves GET /metrics on host:port (port 0 picks a free one); returns the bound port.
  absl::StatusOr<int> Serve(const std::string& host, int port);
  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }
  // The exposition text, as a scrape returns it.
  std::string Render() const;

  // A job (attempt) starts on this worker: labels step/loss gauges and resets per-job gauges.
  // Every series labelled job_id belongs to the job that runs now. When the attempt ends its
  // gauges (step, loss, validation loss and step, tokens/s, policy version, checkpoint step,
  // per-layer error, drift, probe gain, noise scale) are removed; its counters (exchange bytes,
  // refreshes) stay for the last kKeptJobs jobs that ended here, so their final values remain
  // scrapeable without growing without bound.
  static constexpr size_t kKeptJobs = 4;
  void JobStarted(const std::string& job_id, int rank, int world_size);
  // result: succeeded; stopped by the coordinator with a reason that says "cancelled"
  // (cancelled); stopped otherwise (stopped: a peer's failure, a restart, a shutdown); failed.
  void JobEnded(bool success, bool stopped, bool cancelled);
  // Where one step's wall time went on this rank: the whole step, the exchange engine (first
  // submit to finish, overlapping the backward pass) and the geometry estimation within it.
  struct StepTimes {
    double step_seconds = 0;
    double exchange_seconds = 0;
    double geometry_seconds = 0;
  };
  void Step(int64_t step, double loss, double tokens_per_second, const StepTimes& times,
            bool skipped);
  // Validation loss on held-out data measured after `step` (training.eval_every).
  void ValidationLoss(int64_t step, double loss);
  void PolicyVersion(uint64_t version);
  // Bytes attributed to a layer may be fractional; the counter holds whole bytes (the fractions
  // are carried, so the total is the floor of the exact sum).
  void LayerBytes(const std::string& layer, const std::string& format, double bytes);
  void LayerError(const std::string& layer, double rel_fro_error);
  void Refresh(const std::string& layer, double drift);
  // An auto-mode probe's gain (error without geometry / error with it) and the basis judged:
  // "deployed" (the layer uses geometry) or "shadow" (what it would deploy while off).
  void ProbeGain(const std::string& layer, const std::string& basis, double gain);
  // The gradient noise scale B_simple in tokens (train::StepRecord::gradient_noise_scale). An
  // undefined (non-finite or non-positive) value removes the sample rather than showing a number.
  void GradientNoiseScale(double tokens);
  void Checkpoint(int64_t step);
  void Error(const std::string& kind);  // job_failed, session_lost, ...
  // Session counters are sampled at scrape time by the daemon.
  void Session(bool connected, uint64_t generation, uint64_t heartbeats, uint64_t reconnects);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::mutex mu_;
  prometheus::Family<prometheus::Gauge>& step_;
  prometheus::Family<prometheus::Gauge>& loss_;
  prometheus::Family<prometheus::Gauge>& val_loss_;
  prometheus::Family<prometheus::Gauge>& val_step_;
  prometheus::Family<prometheus::Gauge>& tokens_per_second_;
  prometheus::Family<prometheus::Counter>& steps_total_;
  prometheus::Family<prometheus::Counter>& skipped_total_;
  prometheus::Family<prometheus::Histogram>& step_seconds_;
  prometheus::Family<prometheus::Histogram>& exchange_seconds_;
  prometheus::Family<prometheus::Histogram>& geometry_seconds_;
  prometheus::Family<prometheus::Counter>& bytes_total_;
  prometheus::Family<prometheus::Gauge>& rel_error_;
  prometheus::Family<prometheus::Counter>& refreshes_total_;
  prometheus::Family<prometheus::Gauge>& drift_;
  prometheus::Family<prometheus::Gauge>& probe_gain_;
  prometheus::Family<prometheus::Gauge>& noise_scale_;
  prometheus::Family<prometheus::Gauge>& policy_version_;
  prometheus::Family<prometheus::Gauge>& checkpoint_step_;
  prometheus::Family<prometheus::Counter>& jobs_total_;
  prometheus::Family<prometheus::Counter>& errors_total_;
  prometheus::Family<prometheus::Gauge>& assigned_;
  prometheus::Family<prometheus::Gauge>& connected_;
  prometheus::Family<prometheus::Gauge>& generation_;
  prometheus::Family<prometheus::Counter>& heartbeats_;
  prometheus::Family<prometheus::Counter>& reconnects_;
  uint64_t heartbeats_seen_ = 0, reconnects_seen_ = 0;  // session totals already counted
  std::string job_;  // label of the current job; empty between jobs (job updates are dropped)
  // Removed when the job ends: the current job's gauges, by family.
  prometheus::Gauge& JobGauge(prometheus::Family<prometheus::Gauge>& family,
                              prometheus::Labels labels);
  std::set<std::pair<prometheus::Family<prometheus::Gauge>*, prometheus::Gauge*>> job_gauges_;
  // Per-job counters and the exact (fractional) byte sums behind the whole-byte counters.
  std::map<std::string,
           std::set<std::pair<prometheus::Family<prometheus::Counter>*, prometheus::Counter*>>>
      job_counters_;
  std::map<prometheus::Counter*, double> exact_bytes_;
  std::deque<std::string> ended_jobs_;           // oldest first, at most kKeptJobs
  std::unique_ptr<http::MetricsServer> server_;  // last: stops before the families it renders
};

}  // namespace geofp8::worker
