// Coordinator handlers. One mutex guards all state; store writes happen under it (they are the
// durability point of each RPC), stream writes happen after it is released (Outbox).
#include "server/coordinator/coordinator.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/util/message_differencer.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <set>

#include "platform/common/log.h"
#include "platform/common/status.h"
#include "server/coordinator/policy_engine.h"
#include "server/coordinator/secrets.h"

namespace geofp8::coordinator {
namespace {

class RealClock : public Clock {
 public:
  int64_t NowMs() override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

std::string StateName(v1::JobState s) {
  std::string n = v1::JobState_Name(s);
  return n.rfind("JOB_", 0) == 0 ? n.substr(4) : n;
}

// Progress is persisted at most this often per job; state changes and checkpoints always are.
constexpr int64_t kProgressPersistMs = 1000;

// A refused spec at least this large is followed by malloc_trim: the trim costs about a
// millisecond, small next to receiving such a request.
constexpr size_t kTrimAfterRefusedBytes = size_t{64} << 10;

// A version's patches are applied in order, field by field, so a field that a later patch with
// the same `layer` pattern sets again can never show: drop it, and drop patches left empty.
// Exact, needs no layer catalog, and keeps 1000 updates of one pattern at one patch.
void CompactPatches(google::protobuf::RepeatedPtrField<v1::LayerPatch>* patches) {
  std::map<std::string, std::set<int>> set_later;  // pattern -> field numbers set further on
  std::vector<v1::LayerPatch> kept;
  for (int i = patches->size() - 1; i >= 0; --i) {
    v1::LayerPatch p = patches->Get(i);
    const auto* reflection = p.GetReflection();
    std::vector<const google::protobuf::FieldDescriptor*> fields;
    reflection->ListFields(p, &fields);
    std::set<int>& later = set_later[p.layer()];
    bool any = false;
    for (const auto* f : fields) {
      if (f->number() == v1::LayerPatch::kLayerFieldNumber) continue;
      if (later.count(f->number())) {
        reflection->ClearField(&p, f);
      } else {
        later.insert(f->number());
        any = true;
      }
    }
    if (any) kept.push_back(std::move(p));
  }
  patches->Clear();
  for (auto it = kept.rbegin(); it != kept.rend(); ++it) *patches->Add() = std::move(*it);
}

// The name an unmatched glob's error gives a job's model: the preset, or for a command job the
// program's script as its command line names it (issue #29: a command job has no preset).
// `python3 -u train.py --lr 1` -> "train.py", `python3 -m pkg.train` -> "pkg.train",
// `/opt/bin/trainer --x` -> "trainer".
std::string ModelNameForGlobs(const JobSpec& spec) {
  if (spec.command.empty()) return spec.model.preset;
  const auto base = [](const std::string& path) {
    const size_t slash = path.rfind('/');
    return slash == std::string::npos ? path : path.substr(slash + 1);
  };
  const std::string program = base(spec.command[0]);
  if (program.rfind("python", 0) == 0) {
    for (size_t i = 1; i < spec.command.size(); ++i) {
      const std::string& a = spec.command[i];
      if (a == "-m" && i + 1 < spec.command.size()) return spec.command[i + 1];
      if (a == "-c") break;  // inline code: no script to name
      if (!a.empty() && a[0] != '-') return base(a);
    }
  }
  return program.empty() ? "the program" : program;
}

// "" unless `spec` is a command job's and one of its policy.layers globs matches no layer of
// `catalog`: then "spec.policy.layers[I].match: matches no layer of SCRIPT (GLOB); ...", the
// message GeoFP8State gives for the same policy.
std::string CommandSpecGlobProblem(const JobSpec& spec, const v1::LayerCatalog& catalog) {
  if (spec.command.empty() || catalog.layers().empty()) return "";
  std::vector<model::ParamInfo> layers;
  for (const auto& l : catalog.layers()) layers.push_back({.name = l.name()});
  for (size_t i = 0; i < spec.policy.layers.size(); ++i) {
    const std::string& glob = spec.policy.layers[i].match;
    if (glob.empty()) continue;
    if (std::string problem = UnmatchedGlobProblem(glob, layers, ModelNameForGlobs(spec));
        !problem.empty()) {
      return "spec.policy.layers[" + std::to_string(i) + "].match: " + problem;
    }
  }
  return "";
}

}  // namespace

Clock* SystemClock() {
  static RealClock clock;
  return &clock;
}

Coordinator::Coordinator(Store* store, Clock* clock, CoordinatorOptions options)
    : store_(store), clock_(clock), options_(options) {
  // Rendezvous is for the ranks of a live attempt only (opened when scheduled, cleared when the
  // attempt ends), so keys of unknown or finished jobs cannot pile up.
  if (!options_.kv_any_job) kv_.RequireOpenJobs();
}

Coordinator::~Coordinator() { Shutdown(); }

namespace {

// Index of the policy version in force at `step`: the newest taken at or before it; for a job
// from an older coordinator, whose versions carry no taken_step, the newest effective by then.
size_t InForceAt(const std::vector<v1::Policy>& policies, int64_t step) {
  std::optional<size_t> taken;
  size_t legacy = 0;
  for (size_t v = 0; v < policies.size(); ++v) {
    if (policies[v].has_taken_step() && policies[v].taken_step() <= step) taken = v;
    if (!policies[v].has_taken_step() && policies[v].effective_step() <= step) legacy = v;
  }
  return taken ? *taken : legacy;
}

// The versions an attempt resuming at `resume` can need, oldest first: the one in force there;
// the taken ones after it (replayed at their taken_step); and those after the newest taken one
// (the ranks take them when all hold them). A version older than a taken one that was never
// taken was overtaken and never in force. Of untaken versions sharing an effective step only the
// newest can be taken (a stalled job gives every update the same step), so only it is sent.
std::vector<size_t> PolicyHistory(const std::vector<v1::Policy>& policies, int64_t resume) {
  const size_t first = InForceAt(policies, resume);
  size_t newest_taken = first;
  for (size_t v = first; v < policies.size(); ++v) {
    if (policies[v].has_taken_step()) newest_taken = v;
  }
  std::vector<size_t> out = {first};
  for (size_t v = first + 1; v < policies.size(); ++v) {
    if (policies[v].has_taken_step()) {
      out.push_back(v);
      continue;
    }
    if (v < newest_taken) continue;
    if (v + 1 < policies.size() && !policies[v + 1].has_taken_step() &&
        policies[v + 1].effective_step() == policies[v].effective_step()) {
      continue;
    }
    out.push_back(v);
  }
  return out;
}

// The bytes `p` takes as one element of a repeated or singular message field: tag, length, body.
size_t FieldBytes(const v1::Policy& p) {
  const size_t body = p.ByteSizeLong();
  return 1 + google::protobuf::io::CodedOutputStream::VarintSize64(body) + body;
}

// Bytes of policy versions the Assignments of an attempt resuming at `resume` can carry until
// the recovery point moves on: the latest version (`policy`), and every version from the one in
// force at `resume` (`policy_history`). That is PolicyHistory's versions and those it leaves out
// now but sends once the ranks take them, so taking versions never makes it grow.
size_t AssignmentPolicyBytes(const std::vector<v1::Policy>& policies, int64_t resume) {
  if (policies.empty()) return 0;
  size_t bytes = FieldBytes(policies.back());
  for (size_t v = InForceAt(policies, resume); v < policies.size(); ++v) {
    bytes += FieldBytes(policies[v]);
  }
  return bytes;
}

}  // namespace

bool Coordinator::IsFinal(v1::JobState s) {
  return s == v1::JOB_SUCCEEDED || s == v1::JOB_FAILED || s == v1::JOB_CANCELLED;
}

void Coordinator::Flush(Outbox& out) {
  for (auto& [sink, message] : out) sink->Send(message);
  out.clear();
}

absl::Status Coordinator::Recover() {
  auto snap = store_->Load();
  if (!snap.ok()) return snap.status();
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, std::string> invalid_specs;  // job id -> reason
  for (auto& job : snap->jobs) {
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
  deleted_ = snap->deleted;
  for (auto& p : snap->policies) {
    auto it = jobs_.find(p.job_id());
    if (it == jobs_.end()) continue;
    it->second->policies.push_back(std::move(p));
  }
  for (JobRec* rec : job_order_) {
    if (rec->job.state() == v1::JOB_SCHEDULED || rec->job.state() == v1::JOB_RUNNING) {
      rec->interrupted_attempt = rec->job.attempt();
      for (const auto& r : rec->job.ranks()) {
        if (r.rank() < 0 || r.rank() >= rec->job.world_size()) continue;
        rec->interrupted_workers.resize(rec->job.world_size());
        rec->interrupted_workers[r.rank()] = r.worker_id();
      }
    }
    rec->job.clear_ranks();
    if (rec->policies.empty()) {
      SetState(*rec, v1::JOB_FAILED, "store: job has no policy version");
      continue;
    }
    // The versions are the record: a job row written while a version's write was in flight
    // may carry the one before it.
    rec->job.set_policy_version(rec->policies.back().version());
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
  return absl::OkStatus();
}

// ------------------------------------------------------------------------------------------
// Jobs

v1::Job Coordinator::Snapshot(const JobRec& rec, bool with_events) const {
  v1::Job job = rec.job;
  if (with_events) {
    for (const auto& e : rec.events) *job.add_events() = e;
    for (const auto& [name, summary] : rec.layers) *job.add_layers() = summary;
  }
  return job;
}

absl::StatusOr<Coordinator::JobRec*> Coordinator::FindJob(const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: required");
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError("job " + job_id + " not found");
  return it->second.get();
}

void Coordinator::Changed(JobRec& rec) {
  ++rec.change;
  changed_.notify_all();
}

absl::Status Coordinator::PersistJob(JobRec& rec) {
  rec.persisted_progress_ms = clock_->NowMs();
  return store_->PutJob(rec.job);
}

void Coordinator::SetState(JobRec& rec, v1::JobState state, const std::string& reason) {
  const int64_t now = clock_->NowMs();
  rec.job.set_state(state);
  rec.job.set_reason(reason);
  if (state != v1::JOB_PENDING) rec.job.clear_scheduling();
  rec.job.set_updated_unix_ms(now);
  v1::JobEvent event;
  event.set_unix_ms(now);
  event.set_state(state);
  event.set_message(StateName(state) + ": " + reason);
  rec.events.push_back(event);
  absl::Status s = store_->Transaction([&]() -> absl::Status {
    if (auto st = PersistJob(rec); !st.ok()) return st;
    return store_->AppendEvent(rec.job.id(), event);
  });
  if (!s.ok()) {
    log::Error("store.failed").F("job", rec.job.id()).Msg(s.ToString());
  }
  LogState(rec, state, reason);
  if (IsFinal(state)) kv_.Clear(rec.job.id());
  Changed(rec);
}

// One event per state change: job.restarted (PENDING again after an attempt), job.scheduled,
// job.started, job.succeeded, job.failed, job.cancelled.
void Coordinator::LogState(const JobRec& rec, v1::JobState state, const std::string& reason) {
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

absl::StatusOr<v1::SubmitJobResponse> Coordinator::SubmitJob(const v1::SubmitJobRequest& request) {
  auto response = SubmitJobUnlogged(request);
  if (!response.ok()) {
    log::Warn("job.refused")
        .F("code", absl::StatusCodeToString(response.status().code()))
        .F("idempotency_key", request.idempotency_key())
        .Msg(std::string(response.status().message()));
    // A large refused request leaves its buffers in malloc's free lists, where glibc keeps them
    // (issue #31 item 7: ten refused 3 MB specs kept 540 MB): give the free memory back.
    if (request.spec_yaml().size() >= kTrimAfterRefusedBytes) malloc_trim(0);
  } else if (response->created()) {
    const v1::Job& job = response->job();
    log::Info("job.submitted")
        .F("job", job.id())
        .F("name", job.name())
        .F("world_size", job.world_size())
        .F("steps", job.progress().total_steps())
        .F("state", StateName(job.state()))
        .Msg("accepted");
  } else {
    log::Info("job.submitted")
        .F("job", response->job().id())
        .F("name", response->job().name())
        .F("idempotency_key", request.idempotency_key())
        .Msg("repeat of an accepted submission (same idempotency key and spec)");
  }
  return response;
}

absl::StatusOr<v1::SubmitJobResponse> Coordinator::SubmitJobUnlogged(
    const v1::SubmitJobRequest& request) {
  auto spec = ParseJobSpec(request.spec_yaml());
  if (!spec.ok()) return spec.status();
  Outbox out;
  v1::SubmitJobResponse response;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!request.idempotency_key().empty()) {
      auto it = by_idempotency_key_.find(request.idempotency_key());
      if (it != by_idempotency_key_.end()) {
        JobRec& existing = *jobs_.at(it->second);
        if (existing.job.spec_yaml() != request.spec_yaml()) {
          return absl::AlreadyExistsError("idempotency_key " + request.idempotency_key() +
                                          " was used for job " + existing.job.id() +
                                          " with a different spec");
        }
        *response.mutable_job() = Snapshot(existing, false);
        response.set_created(false);
        return response;
      }
    }
    if (const JobRec* live = LiveJobNamed(spec->name)) {
      return absl::AlreadyExistsError("name: job " + live->job.id() + " (" +
                                      StateName(live->job.state()) + ") is already named " +
                                      spec->name +
                                      "; names are unique among unfinished jobs: wait for it to "
                                      "finish, cancel it, or choose another name");
    }
    const int64_t now = clock_->NowMs();
    auto rec = std::make_unique<JobRec>();
    rec->spec = *spec;
    v1::Job& job = rec->job;
    job.set_name(spec->name);
    job.set_state(v1::JOB_PENDING);
    job.set_reason("submitted; waiting for " + std::to_string(spec->world_size) + " idle workers" +
                   (spec->backend == "nccl" ? " with a CUDA device" : ""));
    job.set_spec_yaml(request.spec_yaml());
    job.set_world_size(spec->world_size);
    job.set_max_restarts(spec->restarts.max_restarts);
    job.set_policy_version(1);
    job.mutable_progress()->set_total_steps(spec->training.steps);
    job.set_created_unix_ms(now);
    job.set_updated_unix_ms(now);
    job.set_idempotency_key(request.idempotency_key());
    v1::JobEvent event;
    event.set_unix_ms(now);
    event.set_state(v1::JOB_PENDING);
    event.set_message("PENDING: " + job.reason());
    v1::Policy policy;
    // The job's number, the job, its first event and policy v1 become durable together, before
    // the reply. Numbers come from the store, so an id is never handed out twice.
    absl::Status s = store_->Transaction([&]() -> absl::Status {
      auto number = store_->NextJobNumber();
      if (!number.ok()) return number.status();
      char id[32];
      std::snprintf(id, sizeof id, "job-%06llu", static_cast<unsigned long long>(*number));
      job.set_id(id);
      policy = InitialPolicy(job.id(), *spec, now);
      if (auto st = store_->PutJob(job); !st.ok()) return st;
      if (auto st = store_->AppendEvent(job.id(), event); !st.ok()) return st;
      return store_->PutPolicy(policy);
    });
    if (!s.ok()) return s;
    rec->events.push_back(event);
    rec->policies.push_back(policy);
    const std::string id = job.id();
    if (!request.idempotency_key().empty()) by_idempotency_key_[request.idempotency_key()] = id;
    JobRec* raw = rec.get();
    job_order_.push_back(raw);
    jobs_[id] = std::move(rec);
    TrySchedule(out);
    *response.mutable_job() = Snapshot(*raw, false);
    response.set_created(true);
    changed_.notify_all();
  }
  Flush(out);
  return response;
}

absl::StatusOr<v1::Job> Coordinator::GetJob(const v1::GetJobRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  auto rec = FindJob(request.job_id());
  if (!rec.ok()) return rec.status();
  return Snapshot(**rec, true);
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const v1::ListJobsRequest& request) {
  if (request.limit() < 0) {
    return absl::InvalidArgumentError("limit: must be >= 0 (" + std::to_string(request.limit()) +
                                      ")");
  }
  std::lock_guard<std::mutex> lock(mu_);
  v1::ListJobsResponse response;
  for (auto it = job_order_.rbegin(); it != job_order_.rend(); ++it) {
    const JobRec& rec = **it;
    if (request.states_size() > 0 && std::find(request.states().begin(), request.states().end(),
                                               rec.job.state()) == request.states().end()) {
      continue;
    }
    *response.add_jobs() = Snapshot(rec, false);
    if (request.limit() > 0 && response.jobs_size() >= request.limit()) break;
  }
  return response;
}

absl::StatusOr<v1::Job> Coordinator::CancelJob(const v1::CancelJobRequest& request) {
  Outbox out;
  v1::Job result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = FindJob(request.job_id());
    if (!found.ok()) return found.status();
    JobRec& rec = **found;
    if (IsFinal(rec.job.state())) {
      return absl::FailedPreconditionError("job " + rec.job.id() + " is already " +
                                           StateName(rec.job.state()));
    }
    const std::string reason =
        "cancelled" + (request.reason().empty() ? std::string() : ": " + request.reason());
    ReleaseRanks(rec, reason, v1::STOP_CANCELLED, out);
    SetState(rec, v1::JOB_CANCELLED, reason);
    TrySchedule(out);
    result = Snapshot(rec, true);
  }
  Flush(out);
  return result;
}

absl::StatusOr<std::optional<v1::WatchJobResponse>> Coordinator::WatchNext(
    const std::string& job_id, WatchCursor* cursor, int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  auto found = FindJob(job_id);
  if (!found.ok()) return found.status();
  JobRec* rec = *found;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (rec->change <= cursor->change && !shutdown_) {
    const bool timed_out = changed_.wait_until(lock, deadline) == std::cv_status::timeout;
    // The job may have been deleted while the lock was released (DeleteJob wakes watchers).
    found = FindJob(job_id);
    if (!found.ok()) return found.status();
    rec = *found;
    if (timed_out) break;
  }
  if (shutdown_) return absl::UnavailableError("coordinator shutting down");
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

const Coordinator::JobRec* Coordinator::LiveJobNamed(const std::string& name) const {
  for (const JobRec* rec : job_order_) {
    if (rec->job.name() == name && !IsFinal(rec->job.state())) return rec;
  }
  return nullptr;
}

absl::StatusOr<v1::DeleteJobResponse> Coordinator::DeleteJob(const v1::DeleteJobRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = FindJob(request.job_id());
  if (!found.ok()) return found.status();
  JobRec* rec = *found;
  if (!IsFinal(rec->job.state())) {
    return absl::FailedPreconditionError(
        "job " + rec->job.id() + " (" + rec->job.name() + ") is " + StateName(rec->job.state()) +
        "; only a finished job (SUCCEEDED, FAILED, CANCELLED) can be deleted: cancel it first");
  }
  // The store first: if it cannot be written, nothing changes and the caller may retry.
  if (auto s = store_->DeleteJob(rec->job); !s.ok()) return s;
  v1::DeleteJobResponse response;
  *response.mutable_job() = Snapshot(*rec, false);
  ++deleted_.by_state[rec->job.state()];
  deleted_.restarts += rec->job.restarts();
  if (!rec->job.idempotency_key().empty()) by_idempotency_key_.erase(rec->job.idempotency_key());
  job_order_.erase(std::find(job_order_.begin(), job_order_.end(), rec));
  kv_.Clear(rec->job.id());
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

// ------------------------------------------------------------------------------------------
// Policies

absl::StatusOr<v1::Policy> Coordinator::GetPolicy(const v1::GetPolicyRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = FindJob(request.job_id());
  if (!found.ok()) return found.status();
  const JobRec& rec = **found;
  if (rec.policies.empty()) return absl::InternalError("job " + rec.job.id() + " has no policy");
  if (request.version() == 0) return rec.policies.back();
  if (request.version() > rec.policies.size()) {
    return absl::NotFoundError("policy version " + std::to_string(request.version()) + " of job " +
                               rec.job.id() + " not found (latest is " +
                               std::to_string(rec.policies.size()) + ")");
  }
  return rec.policies[request.version() - 1];
}

absl::StatusOr<v1::ListPolicyVersionsResponse> Coordinator::ListPolicyVersions(
    const v1::ListPolicyVersionsRequest& request) {
  if (request.page_size() < 0 || request.page_size() > kMaxPolicyPageSize) {
    return absl::InvalidArgumentError("page_size: must be in [0, " +
                                      std::to_string(kMaxPolicyPageSize) +
                                      "], 0 = " + std::to_string(kDefaultPolicyPageSize) + " (" +
                                      std::to_string(request.page_size()) + ")");
  }
  const size_t page_size = request.page_size() == 0 ? kDefaultPolicyPageSize : request.page_size();
  std::lock_guard<std::mutex> lock(mu_);
  auto found = FindJob(request.job_id());
  if (!found.ok()) return found.status();
  const std::vector<v1::Policy>& policies = (*found)->policies;
  // The token is the number of the first version of the page, which never changes meaning:
  // versions are immutable and only ever appended.
  uint64_t first = 1;
  if (!request.page_token().empty()) {
    const std::string& t = request.page_token();
    const bool digits = t.size() <= 19 && std::all_of(t.begin(), t.end(),
                                                      [](char c) { return c >= '0' && c <= '9'; });
    first = digits ? std::stoull(t) : 0;
    if (first < 2 || first > policies.size()) {
      return absl::InvalidArgumentError("page_token: not a token this job's history issued (" +
                                        (t.size() <= 64 ? t : t.substr(0, 64) + "...") + ")");
    }
  }
  v1::ListPolicyVersionsResponse response;
  size_t bytes = 0;
  for (size_t v = first - 1; v < policies.size(); ++v) {
    const size_t add = FieldBytes(policies[v]);
    if (response.policies_size() > 0 && (response.policies_size() >= static_cast<int>(page_size) ||
                                         bytes + add > kMaxPolicyPageBytes)) {
      response.set_next_page_token(std::to_string(v + 1));
      break;
    }
    *response.add_policies() = policies[v];
    bytes += add;
  }
  return response;
}

absl::StatusOr<v1::Policy> Coordinator::StagePolicyVersion(
    JobRec& rec, const std::vector<v1::LayerPatch>& patches, const std::string& reason,
    const std::string& author, Store::WriteHandle* write, const v1::LayerPolicy* default_policy,
    bool* unchanged) {
  // Made from the newest version, durable or staged: versions are numbered and submitted in
  // order, and each is written only after the one it was made from (Store::PutNextPolicy).
  const v1::Policy& latest =
      rec.staged_policies.empty() ? rec.policies.back() : rec.staged_policies.back().policy;
  v1::Policy next = latest;
  next.set_version(latest.version() + 1);
  next.clear_taken_step();  // not taken until rank 0 says so
  // Ranks that already passed the effective step would diverge, so it lies beyond the largest
  // step any rank has reported, by the job's margin.
  next.set_effective_step(rec.job.progress().step() + rec.spec.policy.margin);
  if (default_policy) *next.mutable_default_policy() = *default_policy;
  for (const auto& p : patches) *next.add_patches() = p;
  CompactPatches(next.mutable_patches());
  if (unchanged) {
    // Compaction keeps the last setting of every field per pattern, so re-appending patches the
    // version already ends with gives back the same list.
    *unchanged = google::protobuf::util::MessageDifferencer::Equals(next.default_policy(),
                                                                    latest.default_policy()) &&
                 next.patches_size() == latest.patches_size();
    for (int i = 0; *unchanged && i < next.patches_size(); ++i) {
      *unchanged =
          google::protobuf::util::MessageDifferencer::Equals(next.patches(i), latest.patches(i));
    }
    if (*unchanged) {
      // A staged latest is answered once it is durable (or with its failure).
      if (!rec.staged_policies.empty()) *write = rec.staged_policies.back().write;
      return latest;
    }
  }
  if (next.patches_size() > kMaxPatchesPerVersion) {
    return absl::ResourceExhaustedError(
        "patches: policy v" + std::to_string(next.version()) + " would hold " +
        std::to_string(next.patches_size()) + " patches after compaction, at most " +
        std::to_string(kMaxPatchesPerVersion) + "; patch broader globs or fewer distinct layers");
  }
  next.set_reason(reason);
  next.set_author(author);
  next.set_created_unix_ms(clock_->NowMs());
  next.clear_refresh();
  std::vector<v1::RefreshSchedule> schedules;
  if (!rec.catalog.empty()) {
    schedules =
        ComputeSchedules(rec.catalog, next, rec.job.world_size(), rec.spec.geometry_refresh);
    for (const auto& s : schedules) *next.add_refresh() = s;
  }
  // Every version a resumed rank may need travels in its Assignment; refuse the one that would
  // make that undeliverable (issue #31: 200 updates of 20 new globs made an 8 MB Assignment,
  // and every worker looped on gRPC's 4 MiB limit).
  const int64_t resume = rec.job.progress().checkpoint_step();
  const size_t durable = rec.policies.size();
  for (const StagedPolicy& staged : rec.staged_policies) rec.policies.push_back(staged.policy);
  rec.policies.push_back(next);
  const size_t bytes = AssignmentPolicyBytes(rec.policies, resume);
  const uint64_t oldest = rec.policies[InForceAt(rec.policies, resume)].version();
  rec.policies.resize(durable);
  if (bytes > kMaxPolicyHistoryBytes) {
    return absl::ResourceExhaustedError(
        "policy history: v" + std::to_string(next.version()) +
        " would bring the policy versions a resumed rank can need (v" + std::to_string(oldest) +
        " to v" + std::to_string(next.version()) + ", from the recovery point at step " +
        std::to_string(resume) + ") to " + std::to_string(bytes) + " bytes, over the bound of " +
        std::to_string(kMaxPolicyHistoryBytes) +
        " bytes; versions before the one in force at the next checkpoint drop out, or patch "
        "broader globs");
  }
  v1::JobEvent event;
  event.set_unix_ms(next.created_unix_ms());
  event.set_state(rec.job.state());
  event.set_message("policy v" + std::to_string(next.version()) + " effective at step " +
                    std::to_string(next.effective_step()) + " (" + author + "): " + reason);
  // The closure runs on whichever thread leads the batch, perhaps after mu_ was released: it
  // holds copies only.
  v1::Job row = rec.job;
  row.set_policy_version(next.version());
  row.set_updated_unix_ms(next.created_unix_ms());
  *write = store_->Submit([store = store_, next, row = std::move(row), event]() -> absl::Status {
    GEOFP8_RETURN_IF_ERROR(store->PutNextPolicy(next));
    GEOFP8_RETURN_IF_ERROR(store->PutJob(row));
    return store->AppendEvent(row.id(), event);
  });
  rec.staged_policies.push_back({next, event, std::move(schedules), *write});
  return next;
}

void Coordinator::PublishPolicies(JobRec& rec, Outbox& out) {
  while (!rec.staged_policies.empty()) {
    std::optional<absl::Status> result = store_->Result(rec.staged_policies.front().write);
    if (!result) return;  // not yet durable, nor are the ones staged after it
    if (!result->ok()) {
      // The ones staged after it were made from it: their writes fail too (PutNextPolicy), and
      // the next version made takes its number.
      rec.staged_policies.clear();
      return;
    }
    StagedPolicy staged = std::move(rec.staged_policies.front());
    rec.staged_policies.pop_front();
    const v1::Policy& next = staged.policy;
    if (!rec.catalog.empty()) rec.schedules = std::move(staged.schedules);
    rec.job.set_policy_version(next.version());
    rec.job.set_updated_unix_ms(next.created_unix_ms());
    rec.events.push_back(staged.event);
    rec.policies.push_back(next);
    log::Info("policy.changed")
        .F("job", rec.job.id())
        .F("version", next.version())
        .F("author", next.author())
        .F("effective_step", next.effective_step())
        .F("step", rec.job.progress().step())
        .F("patches", next.patches_size())
        .Msg(next.reason());
    ++counters_.policy_updates;
    if (next.author() == "auto") ++counters_.auto_policy_updates;
    v1::CoordinatorMessage m;
    *m.mutable_policy() = next;
    SendToRanks(rec, m, out);
    Changed(rec);
  }
}

absl::StatusOr<v1::Policy> Coordinator::AddPolicyVersion(JobRec& rec,
                                                         const std::vector<v1::LayerPatch>& patches,
                                                         const std::string& reason,
                                                         const std::string& author, Outbox& out) {
  Store::WriteHandle write;
  auto policy = StagePolicyVersion(rec, patches, reason, author, &write);
  if (!policy.ok() || !write) return policy;
  // Waits under mu_ (the caller's state may be observed once this returns), sharing a commit
  // with whatever is queued.
  if (absl::Status s = store_->Wait(write); !s.ok()) {
    // The versions staged before it are durable and published by their own callers (into the
    // outboxes they flush); this one and those made from it are dropped.
    std::deque<StagedPolicy>& staged = rec.staged_policies;
    staged.erase(std::find_if(staged.begin(), staged.end(),
                              [&](const StagedPolicy& p) { return p.write == write; }),
                 staged.end());
    return s;
  }
  PublishPolicies(rec, out);
  return policy;
}

absl::StatusOr<v1::UpdatePolicyResponse> Coordinator::UpdatePolicy(
    const v1::UpdatePolicyRequest& request) {
  if (request.patches_size() == 0 && !request.has_default_policy()) {
    return absl::InvalidArgumentError(
        "patches: at least one layer patch (or a default_policy) is required");
  }
  std::optional<v1::LayerPolicy> default_policy;
  if (request.has_default_policy()) {
    auto typed = FromProto(request.default_policy(), "default_policy");
    if (!typed.ok()) return typed.status();
    LayerPatchSpec ranges;
    ranges.match = "*";
    ranges.block = typed->block;
    ranges.rank = typed->rank;
    ranges.alpha = typed->alpha;
    if (std::string e = ValidateLayerPatch(ranges, "default_policy"); !e.empty()) {
      return absl::InvalidArgumentError(e);
    }
    default_policy = ToProto(*typed);  // canonical form: every field set
  }
  if (request.patches_size() > kMaxPatchesPerUpdate) {
    return absl::InvalidArgumentError("patches: at most " + std::to_string(kMaxPatchesPerUpdate) +
                                      " per update (" + std::to_string(request.patches_size()) +
                                      ")");
  }
  std::vector<v1::LayerPatch> patches;
  for (int i = 0; i < request.patches_size(); ++i) {
    auto spec = FromProto(request.patches(i), "patches[" + std::to_string(i) + "]");
    if (!spec.ok()) return spec.status();
    patches.push_back(ToProto(*spec));  // canonical form: only the fields that were set
  }
  Outbox out;
  v1::UpdatePolicyResponse response;
  Store::WriteHandle write;
  absl::Status written;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto found = FindJob(request.job_id());
    if (!found.ok()) return found.status();
    JobRec& rec = **found;
    if (IsFinal(rec.job.state())) {
      return absl::FailedPreconditionError("job " + rec.job.id() + " is " +
                                           StateName(rec.job.state()) +
                                           "; its policy can no longer change");
    }
    // A pattern that names no layer is a typo that would do nothing. The layers are the ones
    // rank 0 reported, or before that the spec's model.
    std::vector<model::ParamInfo> layers;
    for (const auto& l : rec.catalog) layers.push_back({.name = l.name()});
    // A command job's layers are known only from its script's catalog.
    if (layers.empty() && rec.spec.command.empty()) {
      if (auto mc = model::PresetConfig(rec.spec.model.preset)) layers = model::ParamLayout(*mc);
    }
    for (size_t i = 0; i < patches.size() && !layers.empty(); ++i) {
      if (std::string problem =
              UnmatchedGlobProblem(patches[i].layer(), layers, ModelNameForGlobs(rec.spec));
          !problem.empty()) {
        return absl::InvalidArgumentError("patches[" + std::to_string(i) + "].layer: " + problem);
      }
    }
    bool unchanged = false;
    auto policy = StagePolicyVersion(
        rec, patches, request.reason().empty() ? "user update" : request.reason(), "user", &write,
        default_policy ? &*default_policy : nullptr, &unchanged);
    if (!policy.ok()) return policy.status();
    *response.mutable_policy() = *policy;
    response.set_unchanged(unchanged);
    if (write) {
      // Not under mu_, so that updates arriving together share one commit. Readers and ranks
      // see the version only once PublishPolicies finds it durable.
      lock.unlock();
      written = store_->Wait(write);
      lock.lock();
      // The job may have been deleted meanwhile (cancelled, then DeleteJob): after this version
      // was durable, since the delete was written after it. Versions published here (this one
      // and any durable before it) go out even when this one failed.
      if (auto again = jobs_.find(request.job_id()); again != jobs_.end()) {
        PublishPolicies(*again->second, out);
      }
    }
  }
  Flush(out);
  if (!written.ok()) return written;
  return response;
}

// ------------------------------------------------------------------------------------------
// Workers

absl::StatusOr<v1::RegisterResponse> Coordinator::Register(const v1::RegisterRequest& request) {
  if (request.name().empty()) return absl::InvalidArgumentError("name: required");
  if (request.name().size() > 200) {
    return absl::InvalidArgumentError("name: longer than 200 characters");
  }
  // A name held by a live session belongs to a running process: a second process under the
  // same name would fence it, be fenced in turn when it re-registers, and so on for ever. A
  // restarted process gets the name once the old session ends (its stream breaks when the
  // process dies) or is declared dead. Checked before the write and again at install (mu_).
  auto refusal = [&]() -> absl::Status {
    if (shutdown_) return absl::UnavailableError("coordinator shutting down");
    auto it = workers_.find(request.name());
    if (it == workers_.end() || !it->second.fenced_reason.empty() || !it->second.sink) {
      return absl::OkStatus();
    }
    const v1::Worker& held = it->second.info;
    return absl::AlreadyExistsError("name: " + request.name() +
                                    " is held by a live session (generation " +
                                    std::to_string(held.generation()) + ", host " + held.host() +
                                    "); each worker process needs its own --name");
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    GEOFP8_RETURN_IF_ERROR(refusal());
  }
  // Durable before anything uses it, and written without mu_ so that registrations arriving
  // together share one commit (see "Durability" in coordinator.h).
  GEOFP8_ASSIGN_OR_RETURN(const uint64_t gen, store_->NextGeneration(request.name()));
  Outbox out;
  v1::RegisterResponse response;
  {
    std::lock_guard<std::mutex> lock(mu_);
    GEOFP8_RETURN_IF_ERROR(refusal());
    auto it = workers_.find(request.name());
    if (it != workers_.end() && it->second.info.generation() > gen) {
      // A racing registration of the name committed after this one and is installed: this
      // generation was replaced before it was ever current, so it is answered fenced (its
      // session is refused) and the process registers again.
      log::Warn("worker.superseded")
          .F("worker", request.name())
          .F("generation", gen)
          .F("current", it->second.info.generation())
          .Msg("registered concurrently with a later generation of the same name");
      response.set_worker_id(request.name());
      response.set_generation(gen);
      response.set_session_secret(RandomSecret());
      response.set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
      response.set_heartbeat_timeout_ms(options_.heartbeat_timeout_ms);
      return response;
    }
    if (it != workers_.end() && it->second.fenced_reason.empty()) {
      // A new generation replaces the old one, which is fenced from now on.
      DeclareDead(it->second, "re-registered as generation " + std::to_string(gen), out);
    }
    WorkerRec& w = workers_[request.name()];
    w.info.set_id(request.name());
    w.info.set_name(request.name());
    w.info.set_host(request.host());
    w.info.set_device(request.device());
    w.info.set_memory_bytes(request.memory_bytes());
    w.info.set_accepts_commands(request.accepts_commands());
    w.info.set_generation(gen);
    w.info.set_state(v1::WORKER_DISCONNECTED);
    w.info.clear_job_id();
    w.info.set_rank(-1);
    w.info.set_last_step(-1);
    w.sink.reset();
    w.fenced_reason.clear();
    w.held.assign(request.checkpoints().begin(), request.checkpoints().end());
    w.session_secret = RandomSecret();
    SyncLive(w, /*touch=*/true);
    response.set_worker_id(w.info.id());
    response.set_generation(gen);
    response.set_session_secret(w.session_secret);
    log::Info("worker.registered")
        .F("worker", w.info.id())
        .F("generation", gen)
        .F("host", w.info.host())
        .F("device", w.info.device())
        .F("accepts_commands", w.info.accepts_commands() ? "true" : "false")
        .F("held_checkpoints", w.held.size())
        .Msg("registered");
    response.set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
    response.set_heartbeat_timeout_ms(options_.heartbeat_timeout_ms);
  }
  Flush(out);
  return response;
}

absl::Status Coordinator::Leave(const v1::LeaveRequest& request) {
  Outbox out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) return absl::UnavailableError("coordinator shutting down");
    auto it = workers_.find(request.worker_id());
    if (it == workers_.end()) {
      return absl::NotFoundError("worker_id: not registered (" + request.worker_id() + ")");
    }
    WorkerRec& w = it->second;
    if (request.generation() != w.info.generation() || !w.fenced_reason.empty()) {
      return FencedError(request.worker_id(), request.generation(), w.info.generation(),
                         w.fenced_reason);
    }
    if (auto s = CheckSecret(w, request.session_secret(), "leave"); !s.ok()) return s;
    DeclareDead(w, "left (" + (request.reason().empty() ? "shutdown" : request.reason()) + ")",
                out);
    TrySchedule(out);
  }
  Flush(out);
  return absl::OkStatus();
}

absl::Status Coordinator::CheckSecret(const WorkerRec& w, const std::string& secret,
                                      const char* what) {
  if (SecretEquals(w.session_secret, secret)) return absl::OkStatus();
  ++counters_.forged_sessions;
  return absl::PermissionDeniedError(
      std::string(what) + ": worker " + w.info.id() + " generation " +
      std::to_string(w.info.generation()) +
      (secret.empty() ? ": no session secret (RegisterResponse.session_secret)"
                      : ": wrong session secret") +
      "; only the process that registered this generation may open its session");
}

absl::Status Coordinator::OpenSession(const std::string& worker_id, uint64_t generation,
                                      const std::string& session_secret,
                                      std::shared_ptr<SessionSink> sink) {
  Outbox out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) return absl::UnavailableError("coordinator shutting down");
    auto it = workers_.find(worker_id);
    if (it == workers_.end()) {
      return absl::FailedPreconditionError("worker " + worker_id +
                                           " is not registered; call Register first");
    }
    WorkerRec& w = it->second;
    if (generation != w.info.generation() || !w.fenced_reason.empty()) {
      return FencedError(worker_id, generation, w.info.generation(), w.fenced_reason);
    }
    if (auto s = CheckSecret(w, session_secret, "session"); !s.ok()) return s;
    // The same process again (it holds the secret) before its old stream was seen to break:
    // the new stream takes over, and the old one ends.
    if (w.sink && w.sink != sink) w.sink->End();
    w.sink = std::move(sink);
    SyncLive(w, /*touch=*/true);
    // A rank whose stream broke may have missed policy versions sent meanwhile. The ranks only
    // agree on versions every one of them holds, so resend those not yet taken, in order
    // (a rank ignores the ones it has).
    if (auto j = jobs_.find(w.info.job_id()); !w.info.job_id().empty() && j != jobs_.end()) {
      const std::vector<v1::Policy>& ps = j->second->policies;
      size_t from = 0;
      for (size_t v = 0; v < ps.size(); ++v) {
        if (ps[v].has_taken_step()) from = v + 1;
      }
      for (size_t v = from; v < ps.size(); ++v) {
        v1::CoordinatorMessage m;
        *m.mutable_policy() = ps[v];
        out.emplace_back(w.sink, std::move(m));
      }
    }
    if (w.info.state() == v1::WORKER_DISCONNECTED) {
      w.info.set_state(w.info.job_id().empty() ? v1::WORKER_IDLE : v1::WORKER_ASSIGNED);
    }
    TrySchedule(out);
  }
  Flush(out);
  return absl::OkStatus();
}

void Coordinator::CloseSession(const std::string& worker_id, uint64_t generation,
                               const std::shared_ptr<SessionSink>& sink) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.info.generation() != generation) return;
  WorkerRec& w = it->second;
  if (!sink || w.sink != sink) return;  // replaced, or never this worker's session
  w.sink.reset();
  SyncLive(w, /*touch=*/false);
  // An assigned worker keeps its rank until its heartbeats time out: a short reconnect is fine.
  if (w.info.state() == v1::WORKER_IDLE) w.info.set_state(v1::WORKER_DISCONNECTED);
}

v1::ListWorkersResponse Coordinator::ListWorkers() {
  std::lock_guard<std::mutex> lock(mu_);
  v1::ListWorkersResponse response;
  for (const auto& [id, w] : workers_) {
    v1::Worker* out = response.add_workers();
    *out = w.info;
    out->set_last_heartbeat_unix_ms(LastSeen(id));
  }
  return response;
}

void Coordinator::SendToRanks(const JobRec& rec, const v1::CoordinatorMessage& m, Outbox& out) {
  for (const auto& r : rec.ranks) {
    auto it = workers_.find(r.worker_id);
    if (it == workers_.end() || it->second.info.generation() != r.generation) continue;
    if (it->second.sink) out.emplace_back(it->second.sink, m);
  }
}

void Coordinator::ReleaseRanks(JobRec& rec, const std::string& stop_reason, v1::StopCause cause,
                               Outbox& out) {
  v1::CoordinatorMessage m;
  m.mutable_stop()->set_job_id(rec.job.id());
  m.mutable_stop()->set_reason(stop_reason);
  m.mutable_stop()->set_cause(cause);
  if (cause == v1::STOP_JOB_SUCCEEDED) {
    m.mutable_stop()->set_recovery_step(rec.job.progress().checkpoint_step());
  }
  SendToRanks(rec, m, out);
  for (const auto& r : rec.ranks) {
    auto it = workers_.find(r.worker_id);
    if (it == workers_.end() || it->second.info.generation() != r.generation) continue;
    v1::Worker& info = it->second.info;
    info.clear_job_id();
    info.set_rank(-1);
    if (info.state() == v1::WORKER_ASSIGNED) {
      info.set_state(it->second.sink ? v1::WORKER_IDLE : v1::WORKER_DISCONNECTED);
    }
  }
  rec.ranks.clear();
  rec.job.clear_ranks();
}

void Coordinator::FailAttempt(JobRec& rec, const std::string& reason, bool restartable,
                              Outbox& out) {
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
  ReleaseRanks(rec, reason, v1::STOP_ATTEMPT_ENDED, out);
  kv_.Clear(rec.job.id());
  if (restartable && rec.job.restarts() < rec.job.max_restarts()) {
    rec.job.set_restarts(rec.job.restarts() + 1);
    rec.job.set_attempt(rec.job.attempt() + 1);
    SetState(rec, v1::JOB_PENDING,
             reason + "; restart " + std::to_string(rec.job.restarts()) + "/" +
                 std::to_string(rec.job.max_restarts()) + " from checkpoint step " +
                 std::to_string(rec.job.progress().checkpoint_step()));
  } else if (restartable) {
    SetState(rec, v1::JOB_FAILED,
             reason + "; no restarts left (max_restarts " + std::to_string(rec.job.max_restarts()) +
                 ")");
  } else {
    SetState(rec, v1::JOB_FAILED, reason);
  }
}

int64_t Coordinator::ResumeAfterOutage(const JobRec& rec,
                                       const std::vector<WorkerRec*>& chosen) const {
  std::optional<std::set<int64_t>> common;
  for (size_t r = 0; r < rec.interrupted_workers.size(); ++r) {
    auto it = workers_.find(rec.interrupted_workers[r]);
    if (it == workers_.end()) return -1;
    std::set<int64_t> steps;
    for (const auto& h : it->second.held) {
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
  const bool holder_chosen = std::any_of(chosen.begin(), chosen.end(), [&](const WorkerRec* w) {
    return std::find(rec.interrupted_workers.begin(), rec.interrupted_workers.end(),
                     w->info.id()) != rec.interrupted_workers.end();
  });
  if (!holder_chosen) return -1;
  const int64_t newest = *common->rbegin();
  return newest <= rec.spec.training.steps ? newest : -1;
}

void Coordinator::RecordReportedTaken(JobRec& rec) {
  if (rec.interrupted_workers.empty()) return;
  auto it = workers_.find(rec.interrupted_workers[0]);
  if (it == workers_.end()) return;
  for (const auto& h : it->second.held) {
    if (h.job_id() != rec.job.id() || h.attempt() != rec.interrupted_attempt || h.rank() != 0) {
      continue;
    }
    for (const auto& t : h.taken()) {
      if (!t.has_step() || t.version() < 1 || t.version() > rec.policies.size()) continue;
      v1::Policy& p = rec.policies[t.version() - 1];
      if (p.has_taken_step()) continue;  // rank 0's own report arrived: it is the record
      p.set_taken_step(t.step());
      if (auto s = store_->PutPolicy(p); !s.ok()) {
        p.clear_taken_step();
        std::fprintf(stderr, "geofp8-coordinator: %s\n", s.ToString().c_str());
        continue;
      }
      v1::JobEvent event;
      event.set_unix_ms(clock_->NowMs());
      event.set_state(rec.job.state());
      event.set_message("policy v" + std::to_string(t.version()) + " was taken at step " +
                        std::to_string(t.step()) + " in attempt " +
                        std::to_string(rec.interrupted_attempt) +
                        " (rank 0's report was lost; recorded from its re-registration)");
      if (store_->AppendEvent(rec.job.id(), event).ok()) rec.events.push_back(event);
      Changed(rec);
    }
  }
}

void Coordinator::TrySchedule(Outbox& out) {
  std::string blocked_by;  // the first job that fits the fleet but waits for busy workers
  for (JobRec* rec : job_order_) {
    if (rec->job.state() != v1::JOB_PENDING) continue;
    // NCCL ranks need a GPU; Gloo ranks run anywhere.
    const bool needs_gpu = rec->spec.backend == "nccl";
    // A `command:` job runs an arbitrary program: only on workers started with --allow-commands.
    const bool needs_commands = !rec->spec.command.empty();
    std::vector<WorkerRec*> idle;
    int able = 0;  // connected workers that could run a rank of this job, idle or busy
    for (auto& [id, w] : workers_) {
      if (!w.sink || !w.fenced_reason.empty() ||
          (needs_gpu && w.info.device().rfind("cuda", 0) != 0) ||
          (needs_commands && !w.info.accepts_commands())) {
        continue;
      }
      ++able;
      if (w.info.state() == v1::WORKER_IDLE) idle.push_back(&w);
    }
    const int world = rec->job.world_size();
    std::string kind = needs_gpu ? " with a CUDA device" : "";
    if (needs_commands) kind += " that run command jobs (--allow-commands)";
    if (able < world) {
      // No finishing job can make room for this one: waiting for it would stall every later
      // job (head-of-line blocking), so it is passed over until enough workers connect.
      rec->job.set_scheduling("cannot be placed: needs " + std::to_string(world) + " workers" +
                              kind + ", " + std::to_string(able) + " connected" +
                              (needs_gpu ? " (backend nccl)" : "") + "; later jobs go first");
      continue;
    }
    // First come, first served among jobs that fit the fleet: one that waits for busy workers
    // blocks later ones, so large jobs are never starved by a stream of small ones.
    if (!blocked_by.empty()) {
      rec->job.set_scheduling("queued behind " + blocked_by + " (first come, first served)");
      continue;
    }
    if (static_cast<int>(idle.size()) < world) {
      rec->job.set_scheduling("waiting for " + std::to_string(world) + " idle workers" + kind +
                              " (" + std::to_string(idle.size()) + " idle of " +
                              std::to_string(able) + ")");
      blocked_by = rec->job.id();
      continue;
    }
    rec->job.clear_scheduling();
    if (!rec->interrupted_workers.empty()) {
      // After a coordinator restart, or an attempt failed for a lost worker (a partition, say),
      // the interrupted attempt's workers go first, each to its old rank where it can: they may
      // hold checkpoints written while cut off from the coordinator.
      std::vector<WorkerRec*> ordered(world, nullptr);
      for (size_t r = 0; r < rec->interrupted_workers.size() && r < size_t(world); ++r) {
        const std::string& id = rec->interrupted_workers[r];
        auto it = std::find_if(idle.begin(), idle.end(),
                               [&](WorkerRec* w) { return w && w->info.id() == id; });
        if (it != idle.end()) {
          ordered[r] = *it;
          *it = nullptr;
        }
      }
      // The other ranks (their old worker is gone) take the remaining idle workers in order.
      auto next = idle.begin();
      for (auto& slot : ordered) {
        while (!slot && next != idle.end()) slot = *next++;
      }
      for (; next != idle.end(); ++next) {
        if (*next) ordered.push_back(*next);
      }
      idle = std::move(ordered);
      std::vector<WorkerRec*> chosen(idle.begin(), idle.begin() + world);
      RecordReportedTaken(*rec);
      const int64_t held = ResumeAfterOutage(*rec, chosen);
      const int64_t persisted = rec->job.progress().checkpoint_step();
      if (held > persisted) {
        rec->job.mutable_progress()->set_checkpoint_step(held);
        v1::JobEvent event;
        event.set_unix_ms(clock_->NowMs());
        event.set_state(rec->job.state());
        event.set_message(
            "resuming from checkpoint step " + std::to_string(held) +
            ", the newest every rank of attempt " + std::to_string(rec->interrupted_attempt) +
            " holds (the persisted recovery point was step " + std::to_string(persisted) + ")");
        if (auto st = store_->Transaction([&]() -> absl::Status {
              if (auto s2 = PersistJob(*rec); !s2.ok()) return s2;
              return store_->AppendEvent(rec->job.id(), event);
            });
            st.ok()) {
          rec->events.push_back(event);
        } else {
          rec->job.mutable_progress()->set_checkpoint_step(persisted);
          log::Error("store.failed").F("job", rec->job.id()).Msg(st.ToString());
        }
      }
      rec->interrupted_workers.clear();
      rec->interrupted_attempt = -1;
    }
    // What every rank's Assignment shares. Only what the rank can still need (issue #4: every
    // version since v1 grew without bound and past gRPC's message limit): see PolicyHistory.
    v1::Assignment base;
    base.set_job_id(rec->job.id());
    base.set_attempt(rec->job.attempt());
    base.set_world_size(world);
    base.set_spec_yaml(rec->job.spec_yaml());
    base.set_rendezvous_prefix(rec->job.id() + "/" + std::to_string(rec->job.attempt()) + "/");
    base.set_resume_step(rec->job.progress().checkpoint_step());
    base.set_checkpoint_path(rec->spec.checkpoint.dir);
    *base.mutable_policy() = rec->policies.back();
    for (size_t v : PolicyHistory(rec->policies, rec->job.progress().checkpoint_step())) {
      *base.add_policy_history() = rec->policies[v];
    }
    // UpdatePolicy keeps the versions under kMaxPolicyHistoryBytes; a store written before that
    // bound may hold more. Such an Assignment could never arrive: fail the job with the reason
    // rather than have every worker loop on it. A peer entry is at most 256 bytes (a 200-byte
    // worker id, its rank and generation).
    const size_t assignment_bytes = base.ByteSizeLong() + 6 + size_t{256} * world;
    if (assignment_bytes > kMaxAssignmentBytes) {
      SetState(
          *rec, v1::JOB_FAILED,
          "policy history: an assignment resuming at step " + std::to_string(base.resume_step()) +
              " would carry " + std::to_string(base.policy_history_size()) +
              " policy versions in " + std::to_string(assignment_bytes) + " bytes, over the " +
              std::to_string(kMaxAssignmentBytes) + "-byte bound on what a worker can receive");
      continue;
    }
    rec->ranks.clear();
    rec->job.clear_ranks();
    for (int r = 0; r < world; ++r) {
      WorkerRec& w = *idle[r];
      w.info.set_state(v1::WORKER_ASSIGNED);
      w.info.set_job_id(rec->job.id());
      w.info.set_rank(r);
      w.info.set_last_step(-1);
      RankState rs;
      rs.worker_id = w.info.id();
      rs.generation = w.info.generation();
      rec->ranks.push_back(rs);
      auto* ra = rec->job.add_ranks();
      ra->set_rank(r);
      ra->set_worker_id(w.info.id());
      ra->set_generation(w.info.generation());
    }
    for (int r = 0; r < world; ++r) {
      v1::CoordinatorMessage m;
      v1::Assignment* a = m.mutable_assignment();
      *a = base;
      a->set_rank(r);
      *a->mutable_peers() = rec->job.ranks();
      out.emplace_back(idle[r]->sink, std::move(m));
      log::Info("job.assigned")
          .F("job", rec->job.id())
          .F("attempt", rec->job.attempt())
          .F("rank", r)
          .F("worker", idle[r]->info.id())
          .F("generation", idle[r]->info.generation())
          .F("step", a->resume_step())
          .Msg("rank " + std::to_string(r) + " of " + std::to_string(world) + " to worker " +
               idle[r]->info.id());
    }
    std::string workers;
    for (int r = 0; r < world; ++r) workers += (r ? ", " : "") + idle[r]->info.id();
    kv_.Open(rec->job.id());  // before the assignments leave (the Outbox is sent after this)
    SetState(*rec, v1::JOB_SCHEDULED,
             "assigned ranks 0.." + std::to_string(world - 1) + " to " + workers);
  }
}

void Coordinator::DeclareDead(WorkerRec& w, const std::string& reason, Outbox& out) {
  {
    log::Event e(log::Level::kWarn, "worker.dead");
    e.F("worker", w.info.id()).F("generation", w.info.generation());
    if (!w.info.job_id().empty()) e.F("job", w.info.job_id()).F("rank", w.info.rank());
    e.Msg(reason);
  }
  w.fenced_reason = "declared dead: " + reason;
  w.info.set_state(v1::WORKER_DEAD);
  if (w.sink) {
    v1::CoordinatorMessage m;
    m.mutable_stop()->set_reason("generation " + std::to_string(w.info.generation()) +
                                 " fenced: " + reason);
    m.mutable_stop()->set_cause(v1::STOP_FENCED);
    if (!w.info.job_id().empty()) m.mutable_stop()->set_job_id(w.info.job_id());
    out.emplace_back(w.sink, std::move(m));
  }
  w.sink.reset();
  SyncLive(w, /*touch=*/false);
  ++counters_.workers_declared_dead;
  if (!w.info.job_id().empty()) {
    auto it = jobs_.find(w.info.job_id());
    const int rank = w.info.rank();
    w.info.clear_job_id();
    w.info.set_rank(-1);
    if (it != jobs_.end()) {
      FailAttempt(*it->second,
                  "worker " + w.info.id() + " (rank " + std::to_string(rank) + ", generation " +
                      std::to_string(w.info.generation()) + ") " + reason,
                  /*restartable=*/true, out);
    }
  }
}

void Coordinator::CreditPause(int64_t paused_ms) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::lock_guard<std::mutex> live_lock(live_mu_);
    const int64_t now = clock_->NowMs();
    int credited = 0;
    for (auto& [id, l] : live_) {
      if (!l.fenced_reason.empty()) continue;
      // A full timeout from now: heartbeats sent while we were stopped are still in the socket
      // buffers, and a worker that really died meanwhile is found one timeout later.
      l.last_ms = std::max(l.last_ms, now);
      ++credited;
    }
    std::fprintf(stderr,
                 "geofp8-coordinator: the coordinator itself did not run for %lld ms (stopped or "
                 "starved); %d worker(s) get a fresh heartbeat timeout instead of being declared "
                 "dead\n",
                 static_cast<long long>(paused_ms), credited);
  }
}

void Coordinator::Tick() {
  Outbox out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t now = clock_->NowMs();
    for (auto& [id, w] : workers_) {
      if (!w.fenced_reason.empty()) continue;
      const int64_t silent = now - LastSeen(id);
      if (silent > options_.heartbeat_timeout_ms) {
        DeclareDead(w,
                    "missed heartbeats for " + std::to_string(silent) + " ms (timeout " +
                        std::to_string(options_.heartbeat_timeout_ms) + " ms)",
                    out);
      }
    }
    TrySchedule(out);
  }
  Flush(out);
}

void Coordinator::OnProgress(JobRec& rec, int rank, const v1::StepProgress& p, Outbox& out) {
  RankState& rs = rec.ranks[rank];
  rs.step = std::max(rs.step, p.step());
  rs.bytes_sent = p.bytes_sent();
  rs.bytes_baseline = p.bytes_baseline();
  // A rank that ran a step under an older policy than one taken at or before it has diverged.
  // A version's effective_step is only a lower bound: taking it later is no divergence.
  if (p.policy_version() != 0) {
    for (const auto& policy : rec.policies) {
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
  if (rec.job.state() == v1::JOB_SCHEDULED &&
      std::all_of(rec.ranks.begin(), rec.ranks.end(),
                  [](const RankState& r) { return r.step >= 0; })) {
    SetState(rec, v1::JOB_RUNNING,
             "all " + std::to_string(rec.ranks.size()) + " ranks reported progress");
    return;
  }
  if (now - rec.persisted_progress_ms >= kProgressPersistMs) {
    if (auto s = PersistJob(rec); !s.ok()) {
      log::Error("store.failed").F("job", rec.job.id()).Msg(s.ToString());
    }
  }
  Changed(rec);
}

absl::Status Coordinator::HandleWorkerMessage(const v1::WorkerMessage& message) {
  const int64_t now = clock_->NowMs();
  if (message.body_case() == v1::WorkerMessage::kHeartbeat) {
    // Fast path: liveness and the ack only, without mu_.
    std::shared_ptr<SessionSink> sink;
    {
      std::lock_guard<std::mutex> lock(live_mu_);
      auto it = live_.find(message.worker_id());
      if (it == live_.end()) {
        return absl::FailedPreconditionError("worker " + message.worker_id() +
                                             " is not registered");
      }
      Liveness& l = it->second;
      if (message.generation() != l.generation || !l.fenced_reason.empty()) {
        return FencedError(message.worker_id(), message.generation(), l.generation,
                           l.fenced_reason);
      }
      l.last_ms = now;
      sink = l.sink;
    }
    if (sink) {
      v1::CoordinatorMessage ack;
      ack.mutable_ack()->set_seq(message.seq());
      sink->Send(ack);
    }
    return absl::OkStatus();
  }
  Outbox out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = workers_.find(message.worker_id());
    if (it == workers_.end()) {
      return absl::FailedPreconditionError("worker " + message.worker_id() + " is not registered");
    }
    WorkerRec& w = it->second;
    if (message.generation() != w.info.generation() || !w.fenced_reason.empty()) {
      return FencedError(message.worker_id(), message.generation(), w.info.generation(),
                         w.fenced_reason);
    }
    SyncLive(w, /*touch=*/true);
    JobRec* rec = nullptr;
    int rank = w.info.rank();
    if (!w.info.job_id().empty()) {
      auto j = jobs_.find(w.info.job_id());
      if (j != jobs_.end() && rank >= 0 && rank < static_cast<int>(j->second->ranks.size()) &&
          j->second->ranks[rank].worker_id == w.info.id()) {
        rec = j->second.get();
      }
    }
    // A report that names a job is about a rank of this worker's own job; one about any other
    // job (an impostor's, or a stale one resent after the worker moved on) changes nothing.
    const std::string* named = message.has_checkpoint()   ? &message.checkpoint().job_id()
                               : message.has_finished()   ? &message.finished().job_id()
                               : message.has_policy_ack() ? &message.policy_ack().job_id()
                                                          : nullptr;
    if (named && !named->empty() && (!rec || *named != rec->job.id())) {
      ++counters_.foreign_reports;
      log::Warn("report.refused")
          .F("worker", w.info.id())
          .F("generation", w.info.generation())
          .F("job", *named)
          .Msg("a report for job " + *named + ", of which worker " + w.info.id() +
               " is not a rank" + (rec ? " (it is a rank of " + rec->job.id() + ")" : ""));
      rec = nullptr;
    }
    switch (message.body_case()) {
      case v1::WorkerMessage::kHeartbeat:  // handled on the fast path above
        break;
      case v1::WorkerMessage::kProgress:
        w.info.set_last_step(message.progress().step());
        if (rec) OnProgress(*rec, rank, message.progress(), out);
        break;
      case v1::WorkerMessage::kCatalog:
        if (rec && rank == 0) {
          // A command job's spec globs are checked once its program names its layers, as the
          // built-in trainer's are at submit: one that matches nothing would do nothing.
          if (std::string problem = CommandSpecGlobProblem(rec->spec, message.catalog());
              !problem.empty()) {
            FailAttempt(*rec, problem, /*restartable=*/false, out);
            break;
          }
          rec->catalog.assign(message.catalog().layers().begin(), message.catalog().layers().end());
          rec->schedules = ComputeSchedules(rec->catalog, rec->policies.back(),
                                            rec->job.world_size(), rec->spec.geometry_refresh);
          v1::CoordinatorMessage m;
          m.mutable_refresh()->set_job_id(rec->job.id());
          m.mutable_refresh()->set_policy_version(rec->policies.back().version());
          for (const auto& s : rec->schedules) *m.mutable_refresh()->add_schedules() = s;
          SendToRanks(*rec, m, out);
        }
        break;
      case v1::WorkerMessage::kSummaries:
        if (rec) {
          for (const auto& l : message.summaries().layers()) {
            v1::LayerSummary& kept = rec->layers[l.layer()];
            if (l.step() < kept.step()) continue;
            const v1::LayerSummary probed = kept;  // the probe fields are the coordinator's own
            kept = l;
            kept.set_probe_step(probed.probe_step());
            kept.set_probe_gain(probed.probe_gain());
            kept.set_probe_basis(probed.probe_basis());
            kept.set_geometry_on(probed.geometry_on());
          }
        }
        break;
      case v1::WorkerMessage::kProbes:
        if (rec && rec->spec.auto_policy.enabled && !IsFinal(rec->job.state())) {
          std::vector<v1::ProbeResult> probes(message.probes().probes().begin(),
                                              message.probes().probes().end());
          auto decisions = DecideAuto(rec->spec.auto_policy, rec->spec.geometry_refresh,
                                      rec->policies.back(), probes);
          if (!decisions.empty()) {
            std::vector<v1::LayerPatch> patches;
            std::string reason = "auto:";
            for (auto& d : decisions) {
              patches.push_back(d.patch);
              reason += " " + d.reason + ";";
            }
            reason.pop_back();
            auto s = AddPolicyVersion(*rec, patches, reason, "auto", out);
            // At a bound the engine's decision waits for its next probe; the worker's message
            // was fine.
            if (!s.ok() && s.status().code() != absl::StatusCode::kResourceExhausted) {
              return s.status();
            }
            if (!s.ok()) {
              log::Warn("policy.refused")
                  .F("job", rec->job.id())
                  .F("author", "auto")
                  .Msg(std::string(s.status().message()));
            }
          }
          // What `describe` shows per layer: the latest gain, its basis, and the state after the
          // decision (the engine's own record; summaries do not carry it).
          for (const auto& probe : probes) {
            if (probe.layer().empty() || !(probe.error_with() > 0)) continue;
            v1::LayerSummary& kept = rec->layers[probe.layer()];
            kept.set_layer(probe.layer());
            kept.set_probe_step(probe.step());
            kept.set_probe_gain(probe.error_without() / probe.error_with());
            kept.set_probe_basis(probe.basis());
            kept.set_geometry_on(
                ResolveLayer(rec->policies.back(), probe.layer()).policy.geometry() !=
                v1::GEOMETRY_NONE);
          }
        }
        break;
      case v1::WorkerMessage::kCheckpoint:
        // A report resent after a broken stream may repeat one already taken: the recovery
        // point only moves forward, and only within the attempt that wrote it.
        if (rec && rank == 0 &&
            SameAttempt(*rec, message.checkpoint().job_id(), message.checkpoint().attempt()) &&
            message.checkpoint().step() > rec->job.progress().checkpoint_step()) {
          rec->job.mutable_progress()->set_checkpoint_step(message.checkpoint().step());
          if (auto s = PersistJob(*rec); !s.ok()) return s;
          log::Info("checkpoint.recorded")
              .F("job", rec->job.id())
              .F("attempt", rec->job.attempt())
              .F("rank", rank)
              .F("step", message.checkpoint().step())
              .Msg("recovery point is now step " + std::to_string(message.checkpoint().step()));
          Changed(*rec);
        }
        break;
      case v1::WorkerMessage::kFinished:
        // Resent after a broken stream: a second success changes nothing; a report of an
        // attempt that has since ended is ignored.
        if (rec && SameAttempt(*rec, message.finished().job_id(), message.finished().attempt())) {
          if (!message.finished().success()) {
            // A command job's program that crashed is restartable (JobFinished.restartable):
            // the job's restart policy decides, as for a dead worker.
            FailAttempt(*rec,
                        "rank " + std::to_string(rank) + " failed: " + message.finished().reason(),
                        message.finished().restartable(), out);
          } else {
            rec->ranks[rank].finished = true;
            // Progress sent while the coordinator was away may have been lost; the report of
            // the finish says how far the rank got.
            if (message.finished().steps() - 1 > rec->job.progress().step()) {
              rec->job.mutable_progress()->set_step(message.finished().steps() - 1);
            }
            if (std::all_of(rec->ranks.begin(), rec->ranks.end(),
                            [](const RankState& r) { return r.finished; })) {
              ReleaseRanks(*rec, "job succeeded", v1::STOP_JOB_SUCCEEDED, out);
              SetState(*rec, v1::JOB_SUCCEEDED,
                       "all ranks finished at step " + std::to_string(rec->job.progress().step()));
            }
          }
          TrySchedule(out);
        }
        break;
      case v1::WorkerMessage::kPolicyAck: {
        // Rank 0 says at which step the ranks took a version: a resumed attempt replays by it,
        // and OnProgress checks every rank against it.
        const v1::PolicyAck& pa = message.policy_ack();
        if (rec && rank == 0 && pa.has_step() && pa.version() >= 1 &&
            pa.version() <= rec->policies.size() && SameAttempt(*rec, pa.job_id(), pa.attempt())) {
          v1::Policy& taken = rec->policies[pa.version() - 1];
          if (!taken.has_taken_step() || taken.taken_step() != pa.step()) {
            taken.set_taken_step(pa.step());
            if (auto s = store_->PutPolicy(taken); !s.ok()) return s;
            log::Info("policy.taken")
                .F("job", rec->job.id())
                .F("attempt", rec->job.attempt())
                .F("version", taken.version())
                .F("author", taken.author())
                .F("effective_step", taken.effective_step())
                .F("taken_step", taken.taken_step())
                .F("step", taken.taken_step())
                .Msg("the ranks put policy v" + std::to_string(taken.version()) +
                     " in force at step " + std::to_string(taken.taken_step()));
            Changed(*rec);
          }
        }
        break;
      }
      case v1::WorkerMessage::BODY_NOT_SET:
        break;
    }
    // Handled (and persisted where it changed the job): the worker may forget the message.
    if (message.want_ack() && w.sink) {
      v1::CoordinatorMessage ack;
      ack.mutable_ack()->set_seq(message.seq());
      if (message.has_checkpoint() || message.has_finished()) {
        const std::string& reported =
            message.has_checkpoint() ? message.checkpoint().job_id() : message.finished().job_id();
        const std::string& job_id = reported.empty() && rec ? rec->job.id() : reported;
        auto j = jobs_.find(job_id);
        if (j != jobs_.end()) {
          ack.mutable_ack()->set_job_id(job_id);
          ack.mutable_ack()->set_checkpoint_step(j->second->job.progress().checkpoint_step());
        }
      }
      out.emplace_back(w.sink, std::move(ack));
    }
  }
  Flush(out);
  return absl::OkStatus();
}

bool Coordinator::SameAttempt(const JobRec& rec, const std::string& job_id, int32_t attempt) {
  return job_id.empty() || (job_id == rec.job.id() && attempt == rec.job.attempt());
}

Coordinator::Counts Coordinator::GetCounts() {
  std::lock_guard<std::mutex> lock(mu_);
  Counts c = counters_;
  c.fenced_messages = fenced_messages_.load();
  for (const JobRec* rec : job_order_) {
    ++c.jobs_by_state[rec->job.state()];
    c.job_restarts += rec->job.restarts();
  }
  c.deleted_by_state = deleted_.by_state;
  c.job_restarts += static_cast<uint64_t>(deleted_.restarts);
  for (const auto& [id, w] : workers_) ++c.workers_by_state[w.info.state()];
  return c;
}

void Coordinator::SyncLive(const WorkerRec& w, bool touch) {
  std::lock_guard<std::mutex> lock(live_mu_);
  Liveness& l = live_[w.info.id()];
  l.generation = w.info.generation();
  l.fenced_reason = w.fenced_reason;
  l.sink = w.sink;
  if (touch) l.last_ms = clock_->NowMs();
}

int64_t Coordinator::LastSeen(const std::string& worker_id) {
  std::lock_guard<std::mutex> lock(live_mu_);
  auto it = live_.find(worker_id);
  return it == live_.end() ? 0 : it->second.last_ms;
}

absl::Status Coordinator::FencedError(const std::string& worker_id, uint64_t generation,
                                      uint64_t current, const std::string& reason) {
  ++fenced_messages_;
  return absl::FailedPreconditionError("worker " + worker_id + " generation " +
                                       std::to_string(generation) +
                                       " is fenced (current generation " + std::to_string(current) +
                                       (reason.empty() ? "" : ", " + reason) + ")");
}

void Coordinator::Shutdown() {
  std::vector<std::shared_ptr<SessionSink>> sinks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
    for (auto& [id, w] : workers_) {
      if (w.sink) sinks.push_back(w.sink);
    }
  }
  changed_.notify_all();
  kv_.Shutdown();
  // Session streams otherwise stay open until the server's grace period ends. Workers reconnect
  // (with backoff) to the next coordinator.
  for (const auto& sink : sinks) sink->End();
}

}  // namespace geofp8::coordinator
