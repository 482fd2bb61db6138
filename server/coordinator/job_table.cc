// Jobs, their events and watchers (the ranks' reports are in job_reports.cc).
#include "server/coordinator/job_table.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <set>

#include "platform/common/log.h"
#include "platform/common/status.h"

namespace geofp8::coordinator {
namespace {

// "2026-12-07T04:31:05.250Z".
std::string UtcText(int64_t unix_ms) {
  const time_t secs = static_cast<time_t>(unix_ms / 1000);
  tm t{};
  gmtime_r(&secs, &t);
  char buf[40];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", t.tm_year + 1900,
                t.tm_mon + 1, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec,
                static_cast<int>(unix_ms % 1000));
  return buf;
}

// "0.25 s", "20 s", "5 min".
std::string DurationText(int64_t ms) {
  char buf[32];
  if (ms < 10000) {
    std::snprintf(buf, sizeof buf, "%.2g s", static_cast<double>(ms) / 1000.0);
  } else if (ms < 120000 || ms % 60000 != 0) {
    std::snprintf(buf, sizeof buf, "%lld s", static_cast<long long>(ms / 1000));
  } else {
    std::snprintf(buf, sizeof buf, "%lld min", static_cast<long long>(ms / 60000));
  }
  return buf;
}

}  // namespace

int64_t RestartBackoff::Delay(int failures) const {
  if (base_ms <= 0 || failures <= 1) return 0;
  int64_t delay = base_ms;
  for (int i = 2; i < failures && delay < max_ms; ++i) delay *= 2;
  return std::min(delay, max_ms);
}

std::string StateName(v1::JobState s) {
  std::string n = v1::JobState_Name(s);
  return n.rfind("JOB_", 0) == 0 ? n.substr(4) : n;
}

uint64_t JobNumber(const std::string& id) {
  if (id.size() < 5 || id.size() > 24 || id.compare(0, 4, "job-") != 0) return 0;
  uint64_t n = 0;
  for (size_t i = 4; i < id.size(); ++i) {
    if (id[i] < '0' || id[i] > '9') return 0;
    n = n * 10 + static_cast<uint64_t>(id[i] - '0');
  }
  return n;
}

JobTable::JobTable(Store* store, Clock* clock, RendezvousKv* kv, WorkerRegistry* workers,
                   RestartBackoff backoff)
    : store_(store), clock_(clock), kv_(kv), workers_(workers), backoff_(backoff) {}

bool JobTable::IsFinal(v1::JobState s) {
  return s == v1::JOB_SUCCEEDED || s == v1::JOB_FAILED || s == v1::JOB_CANCELLED;
}

std::map<std::string, std::string> JobTable::Load(Store::Snapshot& snap) {
  std::map<std::string, std::string> invalid_specs;  // job id -> reason
  for (auto& job : snap.jobs) {
    auto rec = std::make_unique<JobRec>();
    // A spec accepted by an older coordinator may fail today's validation (a preset was
    // removed, say). Such a job keeps its history; if it was still live it fails with the reason.
    auto spec = ParseJobSpec(job.spec_yaml());
    std::string invalid;
    if (spec.ok()) {
      rec->spec = *spec;
    } else {
      invalid = "stored spec no longer valid: " + std::string(spec.status().message());
    }
    rec->events.assign(job.events().begin(), job.events().end());
    job.clear_events();
    rec->job = std::move(job);
    if (!invalid.empty()) invalid_specs[rec->job.id()] = invalid;
    if (!rec->job.idempotency_key().empty()) {
      by_idempotency_key_[rec->job.idempotency_key()] = rec->job.id();
    }
    job_order_.push_back(rec.get());
    jobs_[rec->job.id()] = std::move(rec);
  }
  deleted_ = snap.deleted;
  deleted_names_ = snap.deleted_names;
  return invalid_specs;
}

void JobTable::Restart(const std::map<std::string, std::string>& invalid_specs,
                       const std::function<uint64_t(const std::string& job_id)>& latest_policy) {
  for (JobRec* rec : job_order_) {
    if (rec->job.state() == v1::JOB_SCHEDULED || rec->job.state() == v1::JOB_RUNNING) {
      rec->interrupted_attempt = rec->job.attempt();
      for (const auto& r : rec->job.ranks()) {
        if (r.rank() < 0 || r.rank() >= rec->job.world_size()) continue;
        rec->interrupted_workers.resize(rec->job.world_size());
        rec->interrupted_workers[r.rank()] = r.worker_id();
      }
      if (!rec->interrupted_workers.empty()) {
        rec->attempt_workers[rec->job.attempt()] = rec->interrupted_workers;
      }
    }
    rec->job.clear_ranks();
    const uint64_t latest = latest_policy(rec->job.id());
    if (latest == 0) {
      SetState(*rec, v1::JOB_FAILED, "store: job has no policy version");
      continue;
    }
    // The versions are the record: a job row written while a version's write was in flight
    // may carry the one before it.
    rec->job.set_policy_version(latest);
    if (auto it = invalid_specs.find(rec->job.id()); it != invalid_specs.end()) {
      if (!IsFinal(rec->job.state())) SetState(*rec, v1::JOB_FAILED, it->second);
      continue;
    }
    if (rec->job.state() == v1::JOB_SCHEDULED || rec->job.state() == v1::JOB_RUNNING) {
      rec->job.set_attempt(rec->job.attempt() + 1);
      SetState(*rec, v1::JOB_PENDING,
               "coordinator restarted; rescheduling from checkpoint step " +
                   std::to_string(rec->job.progress().checkpoint_step()));
    }
  }
}

v1::Job JobTable::Snapshot(const JobRec& rec, bool with_events) const {
  v1::Job job = rec.job;
  if (with_events) {
    for (const auto& e : rec.events) *job.add_events() = e;
  }
  return job;
}

absl::StatusOr<JobRec*> JobTable::Find(const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: required");
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError("job " + job_id + " not found");
  return it->second.get();
}

JobRec* JobTable::FindOrNull(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second.get();
}

void JobTable::Changed(JobRec& rec) {
  ++rec.change;
  changed_.notify_all();
}

absl::Status JobTable::PersistJob(JobRec& rec) {
  rec.persisted_progress_ms = clock_->NowMs();
  return store_->PutJob(rec.job);
}

bool JobTable::AppendEvent(JobRec& rec, const v1::JobEvent& event) {
  if (!store_->AppendEvent(rec.job.id(), event).ok()) return false;
  rec.events.push_back(event);
  return true;
}

void JobTable::SetState(JobRec& rec, v1::JobState state, const std::string& reason) {
  const int64_t now = clock_->NowMs();
  rec.job.set_state(state);
  rec.job.set_reason(reason);
  if (state != v1::JOB_PENDING) {
    rec.job.clear_scheduling();
    rec.job.clear_next_attempt_unix_ms();
  }
  rec.job.set_updated_unix_ms(now);
  v1::JobEvent event;
  event.set_unix_ms(now);
  event.set_state(state);
  event.set_message(StateName(state) + ": " + reason);
  rec.events.push_back(event);
  absl::Status s = store_->Transaction([&]() -> absl::Status {
    GEOFP8_RETURN_IF_ERROR(PersistJob(rec));
    return store_->AppendEvent(rec.job.id(), event);
  });
  if (!s.ok()) {
    log::Error("store.failed").F("job", rec.job.id()).Msg(s.ToString());
  }
  LogState(rec, state, reason);
  if (IsFinal(state)) kv_->Clear(rec.job.id());
  Changed(rec);
}

// One event per state change: job.restarted (PENDING again after an attempt), job.scheduled,
// job.started, job.succeeded, job.failed, job.cancelled.
void JobTable::LogState(const JobRec& rec, v1::JobState state, const std::string& reason) {
  const char* event = "job.pending";
  log::Level level = log::Level::kInfo;
  switch (state) {
    case v1::JOB_PENDING:
      event = "job.restarted";
      level = log::Level::kWarn;
      break;
    case v1::JOB_SCHEDULED:
      event = "job.scheduled";
      break;
    case v1::JOB_RUNNING:
      event = "job.started";
      break;
    case v1::JOB_SUCCEEDED:
      event = "job.succeeded";
      break;
    case v1::JOB_FAILED:
      event = "job.failed";
      level = log::Level::kError;
      break;
    case v1::JOB_CANCELLED:
      event = "job.cancelled";
      break;
    default:
      break;
  }
  log::Event e(level, event);
  e.F("job", rec.job.id())
      .F("name", rec.job.name())
      .F("attempt", rec.job.attempt())
      .F("step", rec.job.progress().step());
  if (state == v1::JOB_PENDING) {
    e.F("restarts", rec.job.restarts()).F("resume_step", rec.job.progress().checkpoint_step());
  }
  if (state == v1::JOB_SCHEDULED) {
    std::string workers;
    for (const auto& r : rec.job.ranks()) workers += (workers.empty() ? "" : ",") + r.worker_id();
    e.F("world_size", rec.job.world_size())
        .F("workers", workers)
        .F("resume_step", rec.job.progress().checkpoint_step());
  }
  if (rec.job.progress().has_val_loss() && IsFinal(state)) {
    e.F("val_loss", rec.job.progress().val_loss());
  }
  e.Msg(reason);
}

absl::StatusOr<JobRec*> JobTable::Submit(
    const v1::SubmitJobRequest& request, const JobSpec& spec,
    const std::function<absl::Status(const v1::Job& job, int64_t now)>& put_policy, bool* created) {
  *created = false;
  if (!request.idempotency_key().empty()) {
    auto it = by_idempotency_key_.find(request.idempotency_key());
    if (it != by_idempotency_key_.end()) {
      JobRec& existing = *jobs_.at(it->second);
      if (existing.job.spec_yaml() != request.spec_yaml()) {
        return absl::AlreadyExistsError("idempotency_key " + request.idempotency_key() +
                                        " was used for job " + existing.job.id() +
                                        " with a different spec");
      }
      return &existing;
    }
  }
  if (const JobRec* live = LiveJobNamed(spec.name)) {
    return absl::AlreadyExistsError("name: job " + live->job.id() + " (" +
                                    StateName(live->job.state()) + ") is already named " +
                                    spec.name +
                                    "; names are unique among unfinished jobs: wait for it to "
                                    "finish, cancel it, or choose another name");
  }
  const int64_t now = clock_->NowMs();
  auto rec = std::make_unique<JobRec>();
  rec->spec = spec;
  v1::Job& job = rec->job;
  job.set_name(spec.name);
  job.set_state(v1::JOB_PENDING);
  job.set_reason(IsExternal(spec)
                     ? "submitted; waiting for its " + std::to_string(spec.world_size) +
                           " ranks to attach (launcher: external)"
                     : "submitted; waiting for " + std::to_string(spec.world_size) +
                           " idle workers" + (spec.backend == "nccl" ? " with a CUDA device" : ""));
  job.set_spec_yaml(request.spec_yaml());
  job.set_world_size(spec.world_size);
  job.set_max_restarts(spec.restarts.max_restarts);
  job.set_policy_version(1);
  job.mutable_progress()->set_total_steps(spec.training.steps);
  job.set_created_unix_ms(now);
  job.set_updated_unix_ms(now);
  job.set_idempotency_key(request.idempotency_key());
  v1::JobEvent event;
  event.set_unix_ms(now);
  event.set_state(v1::JOB_PENDING);
  event.set_message("PENDING: " + job.reason());
  // The job's number, the job, its first event and policy v1 become durable together, before
  // the reply. Numbers come from the store, so an id is never handed out twice.
  GEOFP8_RETURN_IF_ERROR(store_->Transaction([&]() -> absl::Status {
    GEOFP8_ASSIGN_OR_RETURN(const uint64_t number, store_->NextJobNumber());
    char id[32];
    std::snprintf(id, sizeof id, "job-%06llu", static_cast<unsigned long long>(number));
    job.set_id(id);
    GEOFP8_RETURN_IF_ERROR(store_->PutJob(job));
    GEOFP8_RETURN_IF_ERROR(store_->AppendEvent(job.id(), event));
    return put_policy(job, now);
  }));
  rec->events.push_back(event);
  const std::string id = job.id();
  if (!request.idempotency_key().empty()) by_idempotency_key_[request.idempotency_key()] = id;
  JobRec* raw = rec.get();
  job_order_.push_back(raw);
  jobs_[id] = std::move(rec);
  *created = true;
  return raw;
}

absl::StatusOr<v1::ListJobsResponse> JobTable::List(const v1::ListJobsRequest& request,
                                                    size_t page_size) const {
  for (int i = 0; i < request.states_size(); ++i) {
    if (request.states(i) == v1::JOB_STATE_UNSPECIFIED) {
      return absl::InvalidArgumentError("states[" + std::to_string(i) +
                                        "]: JOB_STATE_UNSPECIFIED is no state");
    }
  }
  // The token is the number of the last job of the previous page: this page starts below it.
  // Numbers only grow, so it keeps its meaning while jobs are submitted or deleted.
  uint64_t below = UINT64_MAX;
  if (!request.page_token().empty()) {
    below = JobNumber("job-" + request.page_token());
    if (below == 0) {
      const std::string& t = request.page_token();
      return absl::InvalidArgumentError("page_token: not a token ListJobs issued (" +
                                        (t.size() <= 64 ? t : t.substr(0, 64) + "...") + ")");
    }
  }
  v1::ListJobsResponse response;
  size_t bytes = 0;
  for (auto it = job_order_.rbegin(); it != job_order_.rend(); ++it) {
    const JobRec& rec = **it;
    const uint64_t number = JobNumber(rec.job.id());
    if (number >= below) continue;
    if (request.states_size() > 0 && std::find(request.states().begin(), request.states().end(),
                                               rec.job.state()) == request.states().end()) {
      continue;
    }
    if (!request.name().empty() && rec.job.name() != request.name()) continue;
    // Tag, length and body of the job as an element of `jobs`.
    const size_t add = rec.job.ByteSizeLong() + 6;
    if (response.jobs_size() > 0 && (static_cast<size_t>(response.jobs_size()) >= page_size ||
                                     bytes + add > kMaxJobsPageBytes)) {
      response.set_next_page_token(std::to_string(JobNumber(response.jobs().rbegin()->id())));
      break;
    }
    *response.add_jobs() = Snapshot(rec, false);
    bytes += add;
  }
  return response;
}

absl::Status JobTable::Cancel(JobRec& rec, const std::string& request_reason, Outbox& out) {
  if (IsFinal(rec.job.state())) {
    return absl::FailedPreconditionError("job " + rec.job.id() + " is already " +
                                         StateName(rec.job.state()));
  }
  const std::string reason =
      "cancelled" + (request_reason.empty() ? std::string() : ": " + request_reason);
  ReleaseRanks(rec, reason, v1::STOP_CANCELLED, out);
  SetState(rec, v1::JOB_CANCELLED, reason);
  return absl::OkStatus();
}

absl::StatusOr<std::optional<v1::WatchJobResponse>> JobTable::WatchNext(
    std::unique_lock<std::mutex>& lock, const std::string& job_id, WatchCursor* cursor,
    int timeout_ms, const bool& shutdown) {
  GEOFP8_ASSIGN_OR_RETURN(JobRec * rec, Find(job_id));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (rec->change <= cursor->change && !shutdown) {
    const bool timed_out = changed_.wait_until(lock, deadline) == std::cv_status::timeout;
    // The job may have been deleted while the lock was released (DeleteJob wakes watchers).
    GEOFP8_ASSIGN_OR_RETURN(rec, Find(job_id));
    if (timed_out) break;
  }
  if (shutdown) return absl::UnavailableError("coordinator shutting down");
  if (rec->change <= cursor->change) return std::optional<v1::WatchJobResponse>();
  v1::WatchJobResponse response;
  *response.mutable_job() = Snapshot(*rec, false);
  for (size_t i = cursor->events; i < rec->events.size(); ++i) {
    *response.add_events() = rec->events[i];
  }
  cursor->change = rec->change;
  cursor->events = rec->events.size();
  return std::optional<v1::WatchJobResponse>(std::move(response));
}

const JobRec* JobTable::LiveJobNamed(const std::string& name) const {
  for (const JobRec* rec : job_order_) {
    if (rec->job.name() == name && !IsFinal(rec->job.state())) return rec;
  }
  return nullptr;
}

absl::StatusOr<JobRec*> JobTable::NewestNamed(const std::string& name) {
  JobRec* newest = nullptr;
  for (auto it = job_order_.rbegin(); it != job_order_.rend() && !newest; ++it) {
    if ((*it)->job.name() == name) newest = *it;
  }
  auto deleted = deleted_names_.find(name);
  if (deleted != deleted_names_.end() &&
      (!newest || JobNumber(deleted->second) > JobNumber(newest->job.id()))) {
    return absl::NotFoundError(
        "job " + name + ": the newest job of this name, " + deleted->second +
        ", was deleted already" +
        (newest ? "; an older one, " + newest->job.id() + ", is deleted only by its id" : ""));
  }
  if (!newest) return absl::NotFoundError("job " + name + " not found (no job has this name)");
  return newest;
}

std::vector<JobRec*> JobTable::Pending() const {
  std::vector<JobRec*> pending;
  for (JobRec* rec : job_order_) {
    if (rec->job.state() == v1::JOB_PENDING) pending.push_back(rec);
  }
  return pending;
}

absl::StatusOr<v1::DeleteJobResponse> JobTable::Delete(JobRec* rec) {
  if (!IsFinal(rec->job.state())) {
    return absl::FailedPreconditionError(
        "job " + rec->job.id() + " (" + rec->job.name() + ") is " + StateName(rec->job.state()) +
        "; only a finished job (SUCCEEDED, FAILED, CANCELLED) can be deleted: cancel it first");
  }
  // The store first: if it cannot be written, nothing changes and the caller may retry.
  auto named = deleted_names_.find(rec->job.name());
  const bool newest_deleted_of_name =
      named == deleted_names_.end() || JobNumber(named->second) < JobNumber(rec->job.id());
  GEOFP8_RETURN_IF_ERROR(store_->DeleteJob(rec->job, newest_deleted_of_name));
  if (newest_deleted_of_name) deleted_names_[rec->job.name()] = rec->job.id();
  v1::DeleteJobResponse response;
  *response.mutable_job() = Snapshot(*rec, false);
  ++deleted_.by_state[rec->job.state()];
  deleted_.restarts += rec->job.restarts();
  if (!rec->job.idempotency_key().empty()) by_idempotency_key_.erase(rec->job.idempotency_key());
  job_order_.erase(std::find(job_order_.begin(), job_order_.end(), rec));
  kv_->Clear(rec->job.id());
  log::Info("job.deleted")
      .F("job", rec->job.id())
      .F("name", rec->job.name())
      .F("state", StateName(rec->job.state()))
      .Msg("deleted with its events and policy versions");
  const std::string id = rec->job.id();
  jobs_.erase(id);
  changed_.notify_all();
  return response;
}

void JobTable::ReleaseRanks(JobRec& rec, const std::string& stop_reason, v1::StopCause cause,
                            Outbox& out) {
  v1::CoordinatorMessage m;
  m.mutable_stop()->set_job_id(rec.job.id());
  m.mutable_stop()->set_reason(stop_reason);
  m.mutable_stop()->set_cause(cause);
  if (cause == v1::STOP_JOB_SUCCEEDED) {
    m.mutable_stop()->set_recovery_step(rec.job.progress().checkpoint_step());
  }
  workers_->SendToRanks(rec.ranks, m, out);
  workers_->ReleaseRanks(rec.ranks);
  rec.ranks.clear();
  rec.job.clear_ranks();
}

void JobTable::FailAttempt(JobRec& rec, const std::string& reason, bool restartable, Outbox& out,
                           const std::string& early_leaver) {
  if (IsFinal(rec.job.state())) return;
  if (restartable) {
    // The ranks of this attempt may keep training while cut off (a partition longer than the
    // heartbeat timeout): when their workers register again they report the checkpoints they
    // hold, and the restart resumes from the newest one every rank holds, as after a
    // coordinator restart (ResumeAfterOutage). A rank that really died reports nothing, and the
    // restart uses the persisted recovery point.
    rec.interrupted_attempt = rec.job.attempt();
    rec.interrupted_workers.assign(rec.job.world_size(), std::string());
    for (size_t r = 0; r < rec.ranks.size() && r < rec.interrupted_workers.size(); ++r) {
      rec.interrupted_workers[r] = rec.ranks[r].worker_id;
    }
  }
  // A worker that went before its rank ran anything (no progress, no program started) soon
  // after its assignment: the job never ran there.
  bool early = false;
  if (restartable && !early_leaver.empty()) {
    early = std::any_of(rec.ranks.begin(), rec.ranks.end(), [&](const RankState& r) {
      return r.worker_id == early_leaver && r.step < 0 && !r.process_started;
    });
  }
  ReleaseRanks(rec, reason, v1::STOP_ATTEMPT_ENDED, out);
  kv_->Clear(rec.job.id());
  const std::string from =
      " from checkpoint step " + std::to_string(rec.job.progress().checkpoint_step());
  if (early && rec.uncharged_workers.insert(early_leaver).second) {
    // The worker's fault, not the job's (a flapping worker): the job keeps its restarts, and
    // the failure does not count towards the back-off. Once per worker, so a job that itself
    // brings its workers down still runs out of restarts.
    rec.job.set_attempt(rec.job.attempt() + 1);
    SetState(rec, v1::JOB_PENDING,
             reason + "; not charged to the job (worker " + early_leaver + " left within " +
                 DurationText(kUnchargedLossWindowMs) +
                 " of its assignment; once per worker): restarts used " +
                 std::to_string(rec.job.restarts()) + "/" + std::to_string(rec.job.max_restarts()) +
                 "; restarting" + from);
  } else if (restartable && rec.job.restarts() < rec.job.max_restarts()) {
    const int64_t now = clock_->NowMs();
    rec.job.set_restarts(rec.job.restarts() + 1);
    rec.job.set_attempt(rec.job.attempt() + 1);
    // An attempt that ran for the reset window failed on its own; one that did not continues
    // the run of failures, and each one in a row doubles the wait (CrashLoopBackOff).
    const bool ran_clean = now - rec.attempt_started_ms >= 2 * backoff_.max_ms;
    const int failures = ran_clean ? 1 : rec.job.consecutive_failures() + 1;
    rec.job.set_consecutive_failures(failures);
    std::string text = reason + "; restart " + std::to_string(rec.job.restarts()) + "/" +
                       std::to_string(rec.job.max_restarts()) + from;
    if (const int64_t delay = backoff_.Delay(failures); delay > 0) {
      rec.job.set_next_attempt_unix_ms(now + delay);
      text += "; backing off " + DurationText(delay) + " after " + std::to_string(failures) +
              " failed attempts in a row: next try at " + UtcText(now + delay);
    }
    SetState(rec, v1::JOB_PENDING, text);
  } else if (restartable) {
    SetState(rec, v1::JOB_FAILED,
             reason + "; no restarts left (max_restarts " + std::to_string(rec.job.max_restarts()) +
                 ")");
  } else {
    SetState(rec, v1::JOB_FAILED, reason);
  }
}

int64_t JobTable::ResumeAfterOutage(const JobRec& rec,
                                    const std::vector<std::string>& chosen) const {
  std::optional<std::set<int64_t>> common;
  for (size_t r = 0; r < rec.interrupted_workers.size(); ++r) {
    const WorkerRec* w = workers_->Find(rec.interrupted_workers[r]);
    if (!w) return -1;
    std::set<int64_t> steps;
    for (const auto& h : w->held) {
      if (h.job_id() == rec.job.id() && h.attempt() == rec.interrupted_attempt &&
          h.rank() == static_cast<int32_t>(r)) {
        steps.insert(h.steps().begin(), h.steps().end());
      }
    }
    if (common) {
      std::erase_if(*common, [&](int64_t s) { return !steps.count(s); });
    } else {
      common = std::move(steps);
    }
  }
  if (!common || common->empty()) return -1;
  const bool holder_chosen = std::any_of(chosen.begin(), chosen.end(), [&](const std::string& w) {
    return std::find(rec.interrupted_workers.begin(), rec.interrupted_workers.end(), w) !=
           rec.interrupted_workers.end();
  });
  if (!holder_chosen) return -1;
  const int64_t newest = *common->rbegin();
  return newest <= rec.spec.training.steps ? newest : -1;
}

void JobTable::ResumeInterrupted(JobRec& rec, const std::vector<std::string>& chosen) {
  const int64_t held = ResumeAfterOutage(rec, chosen);
  const int64_t persisted = rec.job.progress().checkpoint_step();
  if (held > persisted) {
    rec.job.mutable_progress()->set_checkpoint_step(held);
    if (!PersistWithEvent(rec, "resuming from checkpoint step " + std::to_string(held) +
                                   ", the newest every rank of attempt " +
                                   std::to_string(rec.interrupted_attempt) +
                                   " holds (the persisted recovery point was step " +
                                   std::to_string(persisted) + ")")) {
      rec.job.mutable_progress()->set_checkpoint_step(persisted);
    }
  }
  rec.interrupted_workers.clear();
  rec.interrupted_attempt = -1;
}

bool JobTable::PersistWithEvent(JobRec& rec, const std::string& message) {
  v1::JobEvent event;
  event.set_unix_ms(clock_->NowMs());
  event.set_state(rec.job.state());
  event.set_message(message);
  if (auto st = store_->Transaction([&]() -> absl::Status {
        GEOFP8_RETURN_IF_ERROR(PersistJob(rec));
        return store_->AppendEvent(rec.job.id(), event);
      });
      !st.ok()) {
    log::Error("store.failed").F("job", rec.job.id()).Msg(st.ToString());
    return false;
  }
  rec.events.push_back(event);
  return true;
}

void JobTable::BindRanks(JobRec& rec, const std::vector<std::string>& workers) {
  rec.ranks.clear();
  rec.job.clear_ranks();
  rec.job.clear_note();  // the previous attempt's
  for (size_t r = 0; r < workers.size(); ++r) {
    const WorkerRec& w = *workers_->Find(workers[r]);
    workers_->Assign(w.info.id(), rec.job.id(), static_cast<int>(r));
    RankState rs;
    rs.worker_id = w.info.id();
    rs.generation = w.info.generation();
    rec.ranks.push_back(rs);
    auto* ra = rec.job.add_ranks();
    ra->set_rank(static_cast<int>(r));
    ra->set_worker_id(w.info.id());
    ra->set_generation(w.info.generation());
  }
  rec.attempt_workers[rec.job.attempt()] = workers;
  rec.attempt_started_ms = clock_->NowMs();
}

bool JobTable::BackingOff(JobRec& rec, int64_t now_ms) const {
  const int64_t next = rec.job.next_attempt_unix_ms();
  if (rec.job.state() != v1::JOB_PENDING || next <= now_ms) return false;
  rec.job.set_scheduling("backing off after " + std::to_string(rec.job.consecutive_failures()) +
                         " failed attempts in a row (CrashLoopBackOff): next try at " +
                         UtcText(next));
  return true;
}

bool JobTable::SameAttempt(const JobRec& rec, const std::string& job_id, int32_t attempt) {
  return job_id.empty() || (job_id == rec.job.id() && attempt == rec.job.attempt());
}

void JobTable::Count(std::map<int, int64_t>* by_state, std::map<int, int64_t>* deleted_by_state,
                     uint64_t* restarts) const {
  for (const JobRec* rec : job_order_) {
    ++(*by_state)[rec->job.state()];
    *restarts += rec->job.restarts();
  }
  *deleted_by_state = deleted_.by_state;
  *restarts += static_cast<uint64_t>(deleted_.restarts);
}

}  // namespace geofp8::coordinator
