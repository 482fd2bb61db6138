// One attempt of one rank, on the runner's thread (the former JobRunner::Impl): parses the spec,
// rendezvouses over Gloo, resumes from a checkpoint, puts each policy version in force at its
// step and runs the training loop. Per step:
//   control consensus (stop / abort) -> policy version due at this step (Trainer::SetPolicies)
//   -> Trainer::Step (batch, forward+backward with buckets into the exchange engine, average,
//   clip, AdamW, loss all-reduce) -> progress, metrics, summaries, probes, checksum, checkpoint.
// What it shares with the session thread it reaches through the narrow objects in
// AttemptContext; it throws (TransportError for a failed collective) on failure.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "geofp8/v1/geofp8.pb.h"
#include "kernels/exchange/communicator.h"
#include "kernels/exchange/policy.h"
#include "kernels/model/model.h"
#include "platform/policy/exchange_policy.h"
#include "platform/policy/job_spec.h"
#include "worker/daemon/connection.h"
#include "worker/daemon/geometry_probe.h"
#include "worker/daemon/grpc_store.h"
#include "worker/daemon/job_runner.h"
#include "worker/daemon/policy_inbox.h"
#include "worker/daemon/rank_checkpoints.h"
#include "worker/daemon/rank_reporter.h"
#include "worker/daemon/stop_control.h"
#include "worker/train/checkpoint.h"
#include "worker/train/trainer.h"

namespace geofp8::worker {

struct AttemptContext {
  const v1::Assignment& assignment;
  const JobRunnerOptions& options;
  std::shared_ptr<Connection> connection;  // rendezvous and policy listing
  PolicyInbox& inbox;
  StopControl& stop;
  RankCheckpoints& checkpoints;
  RankReporter& reporter;
};

// The trainer's options for the job spec on this worker; throws geofp8::Error naming the spec
// field for a spec this worker cannot run.
train::TrainOptions TrainOptionsFor(const JobSpec& spec, int world,
                                    const JobRunnerOptions& options);

class RankAttempt {
 public:
  explicit RankAttempt(AttemptContext ctx);
  ~RankAttempt();  // detaches the communicator from the stop watchdog first

  JobOutcome Run();

 private:
  // The decisions every rank takes at a step boundary, agreed by one max-reduction: the most
  // severe wish of any rank wins; and the newest policy version every rank holds (the minimum
  // over ranks, as the maximum of the complements), which PolicyInbox::TakeDue may put in force.
  enum ControlWord : uint32_t { kRun = 0, kStop = 1, kAbort = 2 /* a rank failed */ };
  struct Agreed {
    ControlWord control;
    uint64_t policy_version;
  };
  Agreed Control();

  void Connect(const train::TrainOptions& to);
  // Creates the trainer under the version in force at `start` (resuming its checkpoint).
  void Begin(const train::TrainOptions& to, int64_t start);
  // One step of the loop; false: the ranks agreed to stop (`out` says why).
  bool Step(int64_t step, int64_t steps, double baseline_per_step, JobOutcome& out);

  // The plan of `p` and its refresh schedule (empty when no layer uses geometry), waiting for
  // the coordinator's schedule where it has not arrived; its layers and schedule are kept as the
  // ones in force: Apply hands them to the trainer for the step about to run.
  VersionPlan Resolve(const v1::Policy& p);
  // Puts `p` in force from `step`: the trainer switches its exchange at that step boundary,
  // keeping the geometry of layers whose mode and rank stay (Trainer::SetPolicies).
  void Apply(const v1::Policy& p, int64_t step);
  void Announce(const v1::Policy& p, int64_t step, int64_t taken);

  std::string ResolveCheckpointDir() const;
  std::string Fingerprint() const;
  void SaveCheckpoint(int64_t next_step);
  // The checkpoint to resume at the assignment's resume step from: any rank whose own
  // checkpoint is at that step broadcasts it (every rank's is identical), so a restart may land
  // on different workers. Fetched before the trainer exists: the policy version it was written
  // under can decide the version the attempt starts with (PolicyInbox::TakeStart). Its geometry,
  // written under an older version, is kept where the version in force now would have kept it
  // (Trainer::Restore).
  train::Checkpoint FetchCheckpoint(int64_t resume_step);

  AttemptContext ctx_;
  const v1::Assignment& a_;
  JobSpec spec_;
  model::ModelConfig model_config_;
  std::vector<model::ParamInfo> params_;  // the model's parameters, in exchange layer order
  std::unique_ptr<GrpcStore> store_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<train::Trainer> trainer_;  // model, optimizer, data, exchange engine
  std::unique_ptr<GeometryProbe> prober_;    // rank 0 of an auto_policy job
  std::vector<LayerPolicy> layer_policies_;  // of the version in force (for metrics and probes)
  std::vector<RefreshSchedule> schedule_;    // of the version in force; empty: no geometry
  v1::Policy policy_;                        // in force
  std::string checkpoint_dir_;               // <checkpoint.dir>/<job id>; empty: checkpoints off
  double last_step_seconds_ = 0;
  int rank_ = 0, world_ = 1;
  double tokens_per_second_ = 0;
};

}  // namespace geofp8::worker
