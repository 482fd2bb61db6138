// What the worker daemon runs for one rank of one job attempt: the built-in trainer (JobRunner)
// or a `command:` job's program (CommandRunner). The daemon feeds it the coordinator's messages
// from the session thread; every entry point is thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "geofp8/v1/geofp8.pb.h"
#include "worker/daemon/job_runner.h"

namespace geofp8::worker {

class RankRunner {
 public:
  virtual ~RankRunner() = default;
  virtual void Start() = 0;
  virtual void OfferPolicy(const v1::Policy& policy) = 0;
  virtual void OfferRefresh(const v1::RefreshSchedules& refresh) = 0;
  // `cause`: the coordinator's (Stop.cause); UNSPECIFIED for the worker's own stops.
  virtual void RequestStop(const std::string& reason, v1::StopCause cause) = 0;
  virtual void OnCheckpointAcknowledged(int64_t recovery_step) = 0;
  virtual bool done() const = 0;
  virtual const v1::Assignment& assignment() const = 0;
  // The checkpoint files this rank holds, reported when the worker registers again after a
  // coordinator outage (empty: none the worker manages, as for a command job's program).
  virtual HeldCheckpointsInfo HeldCheckpoints() const { return {}; }
};

// The built-in trainer behind the interface (JobRunner itself stays as it is).
class TrainerRankRunner final : public RankRunner {
 public:
  explicit TrainerRankRunner(std::unique_ptr<JobRunner> runner) : runner_(std::move(runner)) {}
  void Start() override { runner_->Start(); }
  void OfferPolicy(const v1::Policy& p) override { runner_->OfferPolicy(p); }
  void OfferRefresh(const v1::RefreshSchedules& r) override { runner_->OfferRefresh(r); }
  void RequestStop(const std::string& reason, v1::StopCause cause) override {
    runner_->RequestStop(reason, cause);
  }
  void OnCheckpointAcknowledged(int64_t step) override { runner_->OnCheckpointAcknowledged(step); }
  bool done() const override { return runner_->done(); }
  const v1::Assignment& assignment() const override { return runner_->assignment(); }
  HeldCheckpointsInfo HeldCheckpoints() const override { return runner_->HeldCheckpoints(); }

 private:
  std::unique_ptr<JobRunner> runner_;
};

}  // namespace geofp8::worker
