// The runner of one rank's attempt (see job_runner.h): the session thread's entry points, the
// attempt's thread (RankAttempt), the stop watchdog, and how the attempt's end is classified
// and reported.

#include "worker/daemon/job_runner.h"

#include <algorithm>
#include <optional>

#include "kernels/common/check.h"
#include "platform/common/status_error.h"
#include "proto/bounds.h"
#include "worker/daemon/log.h"
#include "worker/daemon/rank_attempt.h"
#include "worker/daemon/rank_reporter.h"

namespace geofp8::worker {

using Clock = std::chrono::steady_clock;

absl::StatusOr<model::ModelConfig> ModelConfigFor(const JobSpec& spec) {
  std::optional<model::ModelConfig> mc = model::PresetConfig(spec.model.preset);
  if (!mc) {
    return absl::InvalidArgumentError("model.preset: unknown preset '" + spec.model.preset +
                                      "' (accepted: " + std::string(model::AcceptedPresets()) +
                                      ")");
  }
  // The preset's context length is a default; the job's sequence length wins when longer.
  mc->seq = std::max(mc->seq, spec.training.seq_len);
  if (std::string err = model::ValidateModelConfig(*mc); !err.empty()) {
    return absl::InvalidArgumentError(err);
  }
  return *mc;
}

v1::WorkerMessage FinishedMessage(const v1::Assignment& assignment, const JobOutcome& out) {
  v1::WorkerMessage m;
  m.mutable_finished()->set_success(out.success);
  // Within the coordinator's bound, or it would refuse the report (and end the session) for it.
  m.mutable_finished()->set_reason(bounds::Fit(out.reason, "JobFinished", "reason"));
  m.mutable_finished()->set_job_id(assignment.job_id());
  m.mutable_finished()->set_attempt(assignment.attempt());
  m.mutable_finished()->set_steps(out.steps);
  return m;
}

JobRunner::JobRunner(std::shared_ptr<Connection> connection, v1::Assignment assignment,
                     JobRunnerOptions options, SendFn send, WorkerMetrics* metrics)
    : connection_(std::move(connection)),
      assignment_(std::move(assignment)),
      options_(std::move(options)),
      send_(std::move(send)),
      metrics_(metrics),
      inbox_(assignment_),
      checkpoints_(options_.worker_name, options_.keep_unacknowledged) {}

JobRunner::~JobRunner() { Join(); }

void JobRunner::Start() {
  thread_ = std::thread([this] {
    JobOutcome o = Run();
    {
      std::lock_guard<std::mutex> lock(mu_);
      outcome_ = o;
    }
    stop_.MarkDone();
  });
  watchdog_ = std::thread([this] {
    stop_.Watchdog(options_.stop_abort_after, assignment_.job_id(), assignment_.rank());
  });
}

void JobRunner::Join() {
  if (thread_.joinable()) thread_.join();
  if (watchdog_.joinable()) watchdog_.join();
}

JobOutcome JobRunner::outcome() const {
  std::lock_guard<std::mutex> lock(mu_);
  return outcome_;
}

void JobRunner::OfferPolicy(const v1::Policy& policy) {
  if (options_.debug_policy_delay.count() > 0)
    std::this_thread::sleep_for(options_.debug_policy_delay);
  inbox_.Offer(policy);
}

void JobRunner::OfferRefresh(const v1::RefreshSchedules& refresh) { inbox_.OfferRefresh(refresh); }

void JobRunner::OnCheckpointAcknowledged(int64_t recovery_step) {
  checkpoints_.OnAcknowledged(recovery_step);
}

HeldCheckpointsInfo JobRunner::HeldCheckpoints() const {
  HeldCheckpointsInfo h;
  h.job_id = assignment_.job_id();
  h.attempt = assignment_.attempt();
  h.rank = assignment_.rank();
  h.steps = checkpoints_.Held();
  h.taken = inbox_.Taken();
  return h;
}

void JobRunner::RequestStop(const std::string& reason, v1::StopCause cause) {
  stop_.Request(reason, cause);
  inbox_.Interrupt();  // a rank waiting for the catalog's schedule stops waiting
}

JobOutcome JobRunner::Run() {
  const auto start = Clock::now();
  RankReporter reporter(assignment_, send_, metrics_, options_.data_dir,
                        options_.log_progress_every);
  reporter.Started();
  JobOutcome out;
  bool transport = false;
  try {
    try {
      RankAttempt attempt(
          {assignment_, options_, connection_, inbox_, stop_, checkpoints_, reporter});
      out = attempt.Run();
    } catch (const TransportError&) {
      transport = true;
      throw;
    }
  } catch (const std::exception& e) {
    out.success = false;
    out.reason = e.what();
    // Left inside a step (a collective that a stop or a lost peer ended): the steps it did run.
    out.steps = reporter.steps_done();
    // The reason is the user's (no source location); where the core raised it, for debugging.
    // A failed Status raised on the way (StatusError) adds its code: classified by type.
    if (const auto* core = dynamic_cast<const geofp8::Error*>(&e); core && !core->where().empty()) {
      log::Event event = log::Debug("rank.error_location");
      event.F("job", assignment_.job_id()).F("rank", assignment_.rank()).F("where", core->where());
      if (const auto* status = dynamic_cast<const StatusError*>(core)) {
        event.F("code", absl::StatusCodeToString(status->status().code()));
      }
      event.Msg(out.reason);
    }
    // A collective that failed because a peer vanished is the coordinator's to judge: it
    // declares the peer dead and restarts the attempt from its checkpoint (a Stop reaches us).
    // Reporting the failure ourselves would make it final.
    if (transport && !stop_.requested()) {
      Log("job " + assignment_.job_id() + ": collective failed (" + out.reason +
          "); waiting up to " + std::to_string(options_.peer_failure_grace.count()) +
          " ms for the coordinator's verdict");
      stop_.WaitFor(options_.peer_failure_grace);
    }
    // A failure while a stop was pending is the stop's consequence (peers left), not news.
    if (const std::string stop_reason = stop_.reason(); !stop_reason.empty()) {
      out.stopped = true;
      out.reason = "stopped (" + stop_reason + "); then: " + out.reason;
    }
  }
  out.cancelled = out.stopped && stop_.cause() == v1::STOP_CANCELLED;
  out.policy_version = inbox_.in_force();
  reporter.Ended(out, std::chrono::duration<double>(Clock::now() - start).count());
  return out;
}

}  // namespace geofp8::worker
