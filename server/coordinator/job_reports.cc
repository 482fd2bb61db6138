// JobTable's handling of the ranks' reports: progress, a command job's program status,
// checkpoints and finishes (job_table.h).
#include <algorithm>
#include <string>
#include <vector>

#include "platform/common/log.h"
#include "platform/common/status.h"
#include "server/coordinator/job_table.h"

namespace geofp8::coordinator {
namespace {

// Progress is persisted at most this often per job; state changes and checkpoints always are.
constexpr int64_t kProgressPersistMs = 1000;

// What a command job's program that has not attached to the hook must do (the job's note).
constexpr const char* kHookAdvice =
    "a script attaches by constructing geofp8.torch.GeoFP8State(process_group, model, policy) "
    "and registering it with ddp_model.register_comm_hook(state, geofp8.torch.geofp8_hook) "
    "(docs/pytorch.md); until then its steps, layers and checkpoints do not reach the job and "
    "the job's policy does not apply to it";

// "rank 1" or "ranks 0, 1, 2", at most 8 named ("ranks 0, ..., 7 and 5 more").
std::string RankList(const std::vector<int>& ranks) {
  constexpr size_t kNamed = 8;
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < kNamed; ++i) {
    text += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  if (ranks.size() > kNamed) text += " and " + std::to_string(ranks.size() - kNamed) + " more";
  return text;
}

// "rank 1 has not attached to the GeoFP8 hook 120 s after its program started".
std::string NotAttachedText(const std::vector<int>& ranks, double seconds) {
  char s[32];
  std::snprintf(s, sizeof s, "%.0f", seconds);
  return RankList(ranks) + (ranks.size() == 1 ? " has" : " have") +
         " not attached to the GeoFP8 hook " + s + " s after " +
         (ranks.size() == 1 ? "its program" : "their programs") + " started";
}

// "rank 0's program ended without attaching to the GeoFP8 hook".
std::string EndedUnattachedText(const std::vector<int>& ranks) {
  return RankList(ranks) + (ranks.size() == 1 ? "'s program" : "' programs") + " ended without " +
         "attaching to the GeoFP8 hook";
}

// Job.note: the ranks of this attempt still waiting past the timeout, and those that ended
// without attaching, with what to do; "" when there are none.
std::string HookNote(const std::vector<RankState>& ranks) {
  std::vector<int> waiting, ended;
  double wait_s = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r].hook_never_attached) {
      ended.push_back(static_cast<int>(r));
    } else if (ranks[r].hook_wait_s >= 0 && !ranks[r].finished) {
      wait_s = waiting.empty() ? ranks[r].hook_wait_s : std::min(wait_s, ranks[r].hook_wait_s);
      waiting.push_back(static_cast<int>(r));
    }
  }
  std::string note;
  if (!waiting.empty()) note = NotAttachedText(waiting, wait_s);
  if (!ended.empty()) note += (note.empty() ? "" : "; ") + EndedUnattachedText(ended);
  return note.empty() ? note : note + ": " + kHookAdvice;
}

}  // namespace

void JobTable::OnProgress(JobRec& rec, int rank, const v1::StepProgress& p,
                          const std::vector<v1::Policy>& policies, Outbox& out) {
  RankState& rs = rec.ranks[rank];
  rs.step = std::max(rs.step, p.step());
  rs.bytes_sent = p.bytes_sent();
  rs.bytes_baseline = p.bytes_baseline();
  // A rank that ran a step under an older policy than one taken at or before it has diverged.
  // A version's effective_step is only a lower bound: taking it later is no divergence.
  if (p.policy_version() != 0) {
    for (const auto& policy : policies) {
      if (policy.version() > p.policy_version() && policy.has_taken_step() &&
          p.step() >= policy.taken_step()) {
        FailAttempt(rec,
                    "rank " + std::to_string(rank) + " ran step " + std::to_string(p.step()) +
                        " under policy v" + std::to_string(p.policy_version()) + " but v" +
                        std::to_string(policy.version()) + " took effect at step " +
                        std::to_string(policy.taken_step()),
                    /*restartable=*/false, out);
        return;
      }
    }
  }
  v1::JobProgress* prog = rec.job.mutable_progress();
  prog->set_step(std::max(prog->step(), p.step()));
  if (rank == 0) {
    prog->set_loss(p.loss());
    prog->set_tokens_per_second(p.tokens_per_second());
    if (p.has_gradient_noise_scale()) prog->set_gradient_noise_scale(p.gradient_noise_scale());
    if (p.has_val_loss()) {
      prog->set_val_loss(p.val_loss());
      prog->set_val_step(p.step());
    }
  }
  uint64_t sent = 0, base = 0;
  for (const auto& r : rec.ranks) {
    sent += r.bytes_sent;
    base += r.bytes_baseline;
  }
  prog->set_bytes_sent(sent);
  prog->set_bytes_baseline(base);
  const int64_t now = clock_->NowMs();
  prog->set_updated_unix_ms(now);
  if (rec.job.state() == v1::JOB_SCHEDULED) {
    RunningIfAllRanksRun(rec,
                         "all " + std::to_string(rec.ranks.size()) + " ranks reported progress");
    if (rec.job.state() == v1::JOB_RUNNING) return;
  }
  if (now - rec.persisted_progress_ms >= kProgressPersistMs) {
    if (auto s = PersistJob(rec); !s.ok()) {
      log::Error("store.failed").F("job", rec.job.id()).Msg(s.ToString());
    }
  }
  Changed(rec);
}

void JobTable::RunningIfAllRanksRun(JobRec& rec, const std::string& reason) {
  if (rec.job.state() == v1::JOB_SCHEDULED &&
      std::all_of(rec.ranks.begin(), rec.ranks.end(),
                  [](const RankState& r) { return r.step >= 0 || r.process_started; })) {
    SetState(rec, v1::JOB_RUNNING, reason);
  }
}

void JobTable::OnCommandStatus(JobRec& rec, int rank, const v1::CommandStatus& status) {
  if (!SameAttempt(rec, status.job_id(), status.attempt())) return;
  RankState& rs = rec.ranks[rank];
  switch (status.phase()) {
    case v1::COMMAND_PROCESS_STARTED:
      rs.process_started = true;
      RunningIfAllRanksRun(
          rec, "the programs of all " + std::to_string(rec.ranks.size()) + " ranks started");
      return;
    case v1::COMMAND_HOOK_NOT_ATTACHED: {
      if (rs.hook_wait_s >= 0) return;  // resent
      rs.hook_wait_s = status.seconds();
      rec.job.set_note(HookNote(rec.ranks));
      log::Warn("job.hook_not_attached")
          .F("job", rec.job.id())
          .F("attempt", rec.job.attempt())
          .F("rank", rank)
          .F("seconds", status.seconds())
          .Msg(NotAttachedText({rank}, status.seconds()));
      PersistWithEvent(rec, NotAttachedText({rank}, status.seconds()) + ": " + kHookAdvice);
      break;
    }
    case v1::COMMAND_HOOK_ATTACHED: {
      if (rs.hook_wait_s < 0) return;  // in time (or resent): nothing was said
      rs.hook_wait_s = -1;
      rec.job.set_note(HookNote(rec.ranks));
      char s[32];
      std::snprintf(s, sizeof s, "%.0f", status.seconds());
      PersistWithEvent(rec, RankList({rank}) + " attached to the GeoFP8 hook " + s +
                                " s after its program started");
      break;
    }
    default:
      return;
  }
  Changed(rec);
}

absl::Status JobTable::OnCheckpoint(JobRec& rec, int rank, const v1::Checkpoint& checkpoint) {
  // A report resent after a broken stream may repeat one already taken: the recovery
  // point only moves forward, and only within the attempt that wrote it.
  if (rank == 0 && SameAttempt(rec, checkpoint.job_id(), checkpoint.attempt()) &&
      checkpoint.step() > rec.job.progress().checkpoint_step()) {
    rec.job.mutable_progress()->set_checkpoint_step(checkpoint.step());
    GEOFP8_RETURN_IF_ERROR(PersistJob(rec));
    log::Info("checkpoint.recorded")
        .F("job", rec.job.id())
        .F("attempt", rec.job.attempt())
        .F("rank", rank)
        .F("step", checkpoint.step())
        .Msg("recovery point is now step " + std::to_string(checkpoint.step()));
    Changed(rec);
  }
  return absl::OkStatus();
}

bool JobTable::OnFinished(JobRec& rec, int rank, const v1::JobFinished& finished, Outbox& out) {
  // Resent after a broken stream: a second success changes nothing; a report of an
  // attempt that has since ended is ignored.
  if (!SameAttempt(rec, finished.job_id(), finished.attempt())) return false;
  RankState& rs = rec.ranks[rank];
  rs.hook_never_attached = finished.hook_never_attached();
  if (rs.hook_never_attached) rec.job.set_note(HookNote(rec.ranks));
  if (!finished.success()) {
    // A command job's program that crashed is restartable (JobFinished.restartable):
    // the job's restart policy decides, as for a dead worker.
    FailAttempt(
        rec,
        "rank " + std::to_string(rank) + " failed: " + finished.reason() +
            (rs.hook_never_attached ? "; its program never attached to the GeoFP8 hook" : ""),
        finished.restartable(), out);
    return true;
  }
  rs.finished = true;
  // Progress sent while the coordinator was away may have been lost; the report of
  // the finish says how far the rank got.
  if (finished.steps() - 1 > rec.job.progress().step()) {
    rec.job.mutable_progress()->set_step(finished.steps() - 1);
  }
  if (std::all_of(rec.ranks.begin(), rec.ranks.end(),
                  [](const RankState& r) { return r.finished; })) {
    std::vector<int> unattached;
    for (size_t r = 0; r < rec.ranks.size(); ++r) {
      if (rec.ranks[r].hook_never_attached) unattached.push_back(static_cast<int>(r));
    }
    ReleaseRanks(rec, "job succeeded", v1::STOP_JOB_SUCCEEDED, out);
    SetState(rec, v1::JOB_SUCCEEDED,
             "all ranks finished at step " + std::to_string(rec.job.progress().step()) +
                 (unattached.empty() ? "" : "; " + EndedUnattachedText(unattached)));
  }
  return true;
}

}  // namespace geofp8::coordinator
