// One rank of one job attempt, as the coordinator assigned it: the Llama trainer over the
// exchange engine with Gloo rendezvoused through the coordinator, policy versions applied at
// their effective step, progress/summaries/checkpoints reported over the session.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "geofp8/v1/geofp8.pb.h"
#include "kernels/exchange/communicator.h"
#include "kernels/exchange/policy.h"
#include "kernels/model/model.h"
#include "platform/policy/job_spec.h"
#include "worker/daemon/connection.h"
#include "worker/daemon/metrics.h"
#include "worker/daemon/policy_inbox.h"
#include "worker/daemon/rank_checkpoints.h"
#include "worker/daemon/stop_control.h"

namespace geofp8::worker {

struct JobRunnerOptions {
  std::string worker_name;  // names this worker's checkpoint file
  std::string data_dir;     // checkpoints (relative checkpoint.dir) and results live here
  std::string advertise_host = "127.0.0.1";  // address peers reach this rank's Gloo pairs on
  int summary_every = 10;                    // per-layer error summaries (rank 0), steps; 0: never
  int checksum_every = 10;  // cross-rank parameter checksum, steps; 0: only at the end
  int blas_threads = 1;
  // Steps between rank 0's job.progress log lines (step, loss); 0: never.
  int log_progress_every = 50;
  std::chrono::milliseconds schedule_wait{30000};  // wait for the refresh schedule at start
  // After a transport failure (a peer vanished), how long to wait for the coordinator's Stop
  // before reporting the failure: a dead peer makes the attempt restartable, and only the
  // coordinator can tell (heartbeat timeout). The daemon sets it from the heartbeat timeout.
  std::chrono::milliseconds peer_failure_grace{15000};
  // After a Stop, how long the rank may take to reach its next step boundary, where all ranks
  // stop together, before its communicator is aborted: a peer that hangs (stopped, partitioned)
  // would otherwise hold it in a collective until exchange.timeout_s.
  std::chrono::milliseconds stop_abort_after{1000};
  // While no Ack comes (a coordinator outage), a rank keeps the acknowledged recovery point, the
  // first checkpoint after it and the newest keep_unacknowledged (at least 2) checkpoints; it
  // deletes the ones in between (RankCheckpoints::BoundUnacknowledged).
  int keep_unacknowledged = 3;
  // Tests: sleep this long after every step (to make a live policy change land mid-run).
  std::chrono::milliseconds debug_step_delay{0};
  // Fault injection: hold each policy version this long before the rank sees it, as a slow
  // network would. Tests use it to make a policy arrive after its effective step for certain.
  std::chrono::milliseconds debug_policy_delay{0};
};

// What one attempt ended with, also written to <data_dir>/results/<job_id>.<attempt>.txt.
struct JobOutcome {
  bool success = false;
  bool stopped = false;    // ended by a coordinator Stop (no Finished sent)
  bool cancelled = false;  // stopped because the job was cancelled (Stop.cause)
  std::string reason;
  int64_t steps = 0;            // steps completed (the last step index + 1)
  uint64_t checksum = 0;        // FNV-1a of final weights and moments (train::Checksum)
  uint64_t policy_version = 0;  // in force at the end
};

// The Finished report of an attempt that ended without a coordinator Stop.
v1::WorkerMessage FinishedMessage(const v1::Assignment& assignment, const JobOutcome& out);

// The checkpoint files a rank holds (see v1::HeldCheckpoints), reported when the worker registers
// again after losing its session.
struct HeldCheckpointsInfo {
  std::string job_id;
  int32_t attempt = 0;
  int32_t rank = 0;
  std::vector<int64_t> steps;  // ascending
  // (version, step it took effect at) for every version this attempt put in force, in order.
  std::vector<std::pair<uint64_t, int64_t>> taken;
};

// Everything the daemon feeds a runner from the session thread is thread-safe; the attempt
// (RankAttempt) runs on the runner's own thread. The runner owns what both threads share, each
// behind its own lock: the policy inbox, the stop control and the checkpoint files; it
// classifies how the attempt ended and reports it (RankReporter).
class JobRunner {
 public:
  using SendFn = std::function<bool(v1::WorkerMessage message, bool reliable)>;

  JobRunner(std::shared_ptr<Connection> connection, v1::Assignment assignment,
            JobRunnerOptions options, SendFn send, WorkerMetrics* metrics);
  ~JobRunner();  // joins

  void Start();
  // Thread-safe notifications from the session.
  void OfferPolicy(const v1::Policy& policy);
  void OfferRefresh(const v1::RefreshSchedules& refresh);
  void RequestStop(const std::string& reason, v1::StopCause cause);
  // The coordinator has persisted `recovery_step` as the job's recovery point (the Ack of a
  // checkpoint report): no restart resumes before it, so older checkpoints are deleted. Also
  // after the rank has ended.
  void OnCheckpointAcknowledged(int64_t recovery_step);
  // The files this rank holds now (none when checkpoints are off). Also after the rank ended.
  HeldCheckpointsInfo HeldCheckpoints() const;

  bool done() const { return stop_.done(); }
  void Join();
  const v1::Assignment& assignment() const { return assignment_; }
  JobOutcome outcome() const;

 private:
  JobOutcome Run();

  std::shared_ptr<Connection> connection_;
  v1::Assignment assignment_;
  JobRunnerOptions options_;
  SendFn send_;
  WorkerMetrics* metrics_;

  PolicyInbox inbox_;            // versions not yet in force, the catalog's schedule
  StopControl stop_;             // the coordinator's Stop, the abort watchdog, done
  RankCheckpoints checkpoints_;  // this rank's checkpoint files

  mutable std::mutex mu_;
  JobOutcome outcome_;
  std::thread thread_;
  std::thread watchdog_;  // aborts the communicator once a Stop has waited stop_abort_after
};

// Converts the job spec to the model's shape (preset, with seq widened to training.seq_len);
// errors name the spec field.
absl::StatusOr<model::ModelConfig> ModelConfigFor(const JobSpec& spec);

}  // namespace geofp8::worker
