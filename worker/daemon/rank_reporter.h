// What one rank tells the coordinator and the worker's metrics: its layer catalog, the policy
// version in force (ack), checkpoints written, per-step progress and metrics, rank 0's error
// summaries and auto-policy probes, and how the attempt ended (Finished, and a result file).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "geofp8/v1/geofp8.pb.h"
#include "kernels/exchange/policy.h"
#include "kernels/model/model.h"
#include "worker/daemon/geometry_probe.h"
#include "worker/daemon/job_runner.h"
#include "worker/daemon/metrics.h"
#include "worker/train/trainer.h"

namespace geofp8::worker {

// A checksum as the result files and logs print it: 16 hex digits.
std::string HexChecksum(uint64_t v);

class RankReporter {
 public:
  // `metrics` may be null (no metrics).
  // Rank 0 logs a job.progress line every `log_progress_every` steps (0: never).
  RankReporter(const v1::Assignment& assignment, const JobRunner::SendFn& send,
               WorkerMetrics* metrics, std::string data_dir, int log_progress_every = 0);

  // Rank 0 sends the model's layers; the coordinator answers with the refresh schedule.
  void Catalog(const std::vector<model::ParamInfo>& params);
  // `p` is in force from `step`. `taken` is the step it was put in force at: `step` for a switch
  // now, earlier for the version a resumed attempt starts under. Rank 0's report is what the
  // coordinator records (reliable: a resumed attempt replays by it).
  void PolicyInForce(const v1::Policy& p, int64_t step, int64_t taken);
  // Every rank reports: rank 0's report moves the job's recovery point, and the Ack to each rank
  // says where that point is, below which the rank deletes its older files.
  void CheckpointWritten(int64_t next_step, const std::string& path);
  // The checkpoint at `next_step` could not be written (`why`): logged and counted, not reported.
  void CheckpointFailed(int64_t next_step, const std::string& why);

  // The step's metrics: loss, throughput, each layer's share of the wire bytes, and the
  // refreshes this rank estimated.
  void StepMetrics(int64_t step, const train::StepRecord& rec, double tokens_per_second,
                   const std::vector<model::ParamInfo>& params,
                   const std::vector<LayerPolicy>& layer_policies,
                   const std::vector<RefreshSchedule>& schedule, const train::Trainer& trainer);
  // `val_loss`: the validation loss measured after `step`, NaN when the step did not validate.
  // `gradient_noise_scale`: B_simple in tokens, sent only when defined (finite and positive).
  void Progress(int64_t step, int64_t steps, double loss, double tokens_per_second,
                uint64_t bytes_sent, uint64_t bytes_baseline, uint64_t policy_version,
                double val_loss, double gradient_noise_scale);
  // Rank 0 sends each layer's rel_fro_error and residual-subspace error from a measured step,
  // with its geometry version and the drift of its last refresh.
  void Summaries(const train::StepRecord& rec, const std::vector<model::ParamInfo>& params,
                 const train::Trainer& trainer);
  // Auto mode: rank 0's probe results of `step` (geometry_probe.h).
  void Probes(int64_t step, const std::vector<LayerProbe>& probes,
              const std::vector<model::ParamInfo>& params, const train::Trainer& trainer,
              double last_step_seconds);

  void Started();
  // Steps this attempt has completed (the last step reported to Progress + 1; the resume step
  // before any): what an attempt that ended by an exception ran, for its outcome.
  int64_t steps_done() const { return steps_done_; }
  // Metrics end, Finished (unless stopped: the coordinator ended it), a log line and
  // <data_dir>/results/<job_id>.attempt<n>.txt.
  void Ended(const JobOutcome& out, double seconds);

 private:
  void Send(v1::WorkerMessage m, bool reliable) { send_(std::move(m), reliable); }

  const v1::Assignment& a_;
  const JobRunner::SendFn& send_;
  WorkerMetrics* metrics_;
  const std::string data_dir_;
  const int log_progress_every_;
  double last_val_loss_ = 0;  // the last validation (for the progress log line)
  int64_t last_val_step_ = -1;
  int64_t steps_done_;
};

}  // namespace geofp8::worker
