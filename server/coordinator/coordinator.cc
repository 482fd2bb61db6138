// The coordinator facade: each entry point takes mu_, calls into the concern that owns the work
// (WorkerRegistry, JobTable, PolicyBook, Place), and flushes its Outbox after releasing mu_.
#include "server/coordinator/coordinator.h"

#include <malloc.h>

#include <chrono>

#include "platform/common/log.h"
#include "platform/common/status.h"
#include "server/coordinator/scheduler.h"

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

// A refused spec at least this large is followed by malloc_trim: the trim costs about a
// millisecond, small next to receiving such a request.
constexpr size_t kTrimAfterRefusedBytes = size_t{64} << 10;

}  // namespace

Clock* SystemClock() {
  static RealClock clock;
  return &clock;
}

Coordinator::Coordinator(Store* store, Clock* clock, CoordinatorOptions options)
    : store_(store),
      clock_(clock),
      options_(options),
      workers_(store, clock,
               {.heartbeat_interval_ms = options.heartbeat_interval_ms,
                .heartbeat_timeout_ms = options.heartbeat_timeout_ms,
                .dead_worker_retention_ms = options.dead_worker_retention_ms,
                .fencing_holdoff_share = options.fencing_holdoff_share},
               [this](const std::string& job_id, const std::string& reason,
                      const std::string& early_leaver,
                      Outbox& out) { OnRankLost(job_id, reason, early_leaver, out); }),
      jobs_(store, clock, &kv_, &workers_,
            {.base_ms = options.restart_backoff_ms, .max_ms = options.restart_backoff_max_ms}),
      policies_(store, clock, &jobs_, &workers_) {
  // Rendezvous is for the ranks of a live attempt only (opened when scheduled, cleared when the
  // attempt ends), so keys of unknown or finished jobs cannot pile up.
  if (!options_.kv_any_job) kv_.RequireOpenJobs();
}

Coordinator::~Coordinator() { Shutdown(); }

void Coordinator::OnRankLost(const std::string& job_id, const std::string& reason,
                             const std::string& early_leaver, Outbox& out) {
  if (JobRec* rec = jobs_.FindOrNull(job_id)) {
    jobs_.FailAttempt(*rec, reason, /*restartable=*/true, out, early_leaver);
  }
}

absl::Status Coordinator::Recover() {
  GEOFP8_ASSIGN_OR_RETURN(Store::Snapshot snap, store_->Load());
  std::lock_guard<std::mutex> lock(mu_);
  const std::map<std::string, std::string> invalid_specs = jobs_.Load(snap);
  policies_.Load(snap.policies);
  jobs_.Restart(invalid_specs,
                [&](const std::string& job_id) { return policies_.LatestVersion(job_id); });
  return absl::OkStatus();
}

// ------------------------------------------------------------------------------------------
// Jobs

v1::Job Coordinator::Details(const JobRec& rec) const {
  v1::Job job = jobs_.Snapshot(rec, true);
  policies_.AddLayers(rec.job.id(), &job);
  return job;
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
  GEOFP8_ASSIGN_OR_RETURN(const JobSpec spec, ParseJobSpec(request.spec_yaml()));
  Outbox out;
  v1::SubmitJobResponse response;
  {
    std::lock_guard<std::mutex> lock(mu_);
    v1::Policy first;
    bool created = false;
    GEOFP8_ASSIGN_OR_RETURN(JobRec * rec, jobs_.Submit(
                                              request, spec,
                                              [&](const v1::Job& job, int64_t now) {
                                                return policies_.PutFirst(job, spec, now, &first);
                                              },
                                              &created));
    if (created) {
      policies_.Add(rec->job.id(), std::move(first));
      TrySchedule(out);
      jobs_.WakeWatchers();
    }
    *response.mutable_job() = jobs_.Snapshot(*rec, false);
    response.set_created(created);
  }
  Flush(out);
  return response;
}

absl::StatusOr<v1::Job> Coordinator::GetJob(const v1::GetJobRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  GEOFP8_ASSIGN_OR_RETURN(const JobRec* rec, jobs_.Find(request.job_id()));
  return Details(*rec);
}

namespace {

// A page size in [0, kMaxJobsPageSize] (0: the default), or INVALID_ARGUMENT naming `field`.
absl::StatusOr<size_t> PageSizeOf(const char* field, int32_t value) {
  if (value < 0 || value > kMaxJobsPageSize) {
    return absl::InvalidArgumentError(
        std::string(field) + ": must be in [0, " + std::to_string(kMaxJobsPageSize) +
        "], 0 = " + std::to_string(kDefaultJobsPageSize) + " (" + std::to_string(value) + ")");
  }
  return value == 0 ? kDefaultJobsPageSize : value;
}

}  // namespace

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const v1::ListJobsRequest& request) {
  GEOFP8_ASSIGN_OR_RETURN(const size_t limit, PageSizeOf("limit", request.limit()));
  GEOFP8_ASSIGN_OR_RETURN(size_t page_size, PageSizeOf("page_size", request.page_size()));
  if (request.page_size() == 0) page_size = limit;  // limit: the older name of page_size
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.List(request, page_size);
}

absl::StatusOr<v1::Job> Coordinator::CancelJob(const v1::CancelJobRequest& request) {
  Outbox out;
  v1::Job result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    GEOFP8_ASSIGN_OR_RETURN(JobRec * rec, jobs_.Find(request.job_id()));
    GEOFP8_RETURN_IF_ERROR(jobs_.Cancel(*rec, request.reason(), out));
    TrySchedule(out);
    result = Details(*rec);
  }
  Flush(out);
  return result;
}

absl::StatusOr<std::optional<v1::WatchJobResponse>> Coordinator::WatchNext(
    const std::string& job_id, WatchCursor* cursor, int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  return jobs_.WatchNext(lock, job_id, cursor, timeout_ms, shutdown_);
}

absl::StatusOr<v1::DeleteJobResponse> Coordinator::DeleteJob(const v1::DeleteJobRequest& request) {
  if (!request.job_id().empty() && !request.name().empty()) {
    return absl::InvalidArgumentError("job_id, name: give one of them, not both");
  }
  std::lock_guard<std::mutex> lock(mu_);
  GEOFP8_ASSIGN_OR_RETURN(JobRec * rec, request.name().empty() ? jobs_.Find(request.job_id())
                                                               : jobs_.NewestNamed(request.name()));
  const std::string id = rec->job.id();
  GEOFP8_ASSIGN_OR_RETURN(v1::DeleteJobResponse response, jobs_.Delete(rec));
  policies_.Erase(id);
  return response;
}

// ------------------------------------------------------------------------------------------
// Policies

absl::StatusOr<v1::Policy> Coordinator::GetPolicy(const v1::GetPolicyRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  GEOFP8_ASSIGN_OR_RETURN(const JobRec* rec, jobs_.Find(request.job_id()));
  return policies_.Get(*rec, request.version());
}

absl::StatusOr<v1::ListPolicyVersionsResponse> Coordinator::ListPolicyVersions(
    const v1::ListPolicyVersionsRequest& request) {
  GEOFP8_ASSIGN_OR_RETURN(const size_t page_size, PolicyBook::PageSize(request));
  std::lock_guard<std::mutex> lock(mu_);
  GEOFP8_ASSIGN_OR_RETURN(const JobRec* rec, jobs_.Find(request.job_id()));
  return policies_.ListVersions(*rec, request.page_token(), page_size);
}

absl::StatusOr<v1::UpdatePolicyResponse> Coordinator::UpdatePolicy(
    const v1::UpdatePolicyRequest& request) {
  GEOFP8_ASSIGN_OR_RETURN(const PolicyUpdate update, PolicyBook::ParseUpdate(request));
  Outbox out;
  v1::UpdatePolicyResponse response;
  Store::WriteHandle write;
  absl::Status written;
  {
    std::unique_lock<std::mutex> lock(mu_);
    GEOFP8_ASSIGN_OR_RETURN(JobRec * rec, jobs_.Find(request.job_id()));
    GEOFP8_ASSIGN_OR_RETURN(response, policies_.Update(*rec, update, request.reason(), &write));
    if (write) {
      // Not under mu_, so that updates arriving together share one commit. Readers and ranks
      // see the version only once Publish finds it durable.
      lock.unlock();
      written = store_->Wait(write);
      lock.lock();
      // The job may have been deleted meanwhile (cancelled, then DeleteJob): after this version
      // was durable, since the delete was written after it. Versions published here (this one
      // and any durable before it) go out even when this one failed.
      if (JobRec* again = jobs_.FindOrNull(request.job_id())) policies_.Publish(*again, out);
    }
  }
  Flush(out);
  GEOFP8_RETURN_IF_ERROR(written);
  return response;
}

// ------------------------------------------------------------------------------------------
// Workers

absl::StatusOr<v1::RegisterResponse> Coordinator::Register(const v1::RegisterRequest& request) {
  if (request.name().empty()) return absl::InvalidArgumentError("name: required");
  if (request.name().size() > 200) {
    return absl::InvalidArgumentError("name: longer than 200 characters");
  }
  auto refusal = [&]() -> absl::Status {
    if (shutdown_) return absl::UnavailableError("coordinator shutting down");
    return workers_.CheckName(request);
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
    response = workers_.Register(request, gen, out);
  }
  Flush(out);
  return response;
}

absl::Status Coordinator::Leave(const v1::LeaveRequest& request) {
  Outbox out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) return absl::UnavailableError("coordinator shutting down");
    GEOFP8_RETURN_IF_ERROR(workers_.Leave(request, out));
    TrySchedule(out);
  }
  Flush(out);
  return absl::OkStatus();
}

absl::Status Coordinator::OpenSession(const std::string& worker_id, uint64_t generation,
                                      const std::string& session_secret,
                                      std::shared_ptr<SessionSink> sink) {
  Outbox out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) return absl::UnavailableError("coordinator shutting down");
    GEOFP8_ASSIGN_OR_RETURN(WorkerRec * w, workers_.OpenSession(worker_id, generation,
                                                                session_secret, std::move(sink)));
    // A rank whose stream broke may have missed policy versions sent meanwhile. The ranks only
    // agree on versions every one of them holds, so resend those not yet taken, in order
    // (a rank ignores the ones it has).
    if (jobs_.FindOrNull(w->info.job_id())) {
      policies_.ResendUntaken(w->info.job_id(), w->sink, out);
    }
    TrySchedule(out);
  }
  Flush(out);
  return absl::OkStatus();
}

void Coordinator::CloseSession(const std::string& worker_id, uint64_t generation,
                               const std::shared_ptr<SessionSink>& sink) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    workers_.CloseSession(worker_id, generation, sink);
  }
  logs_.SessionClosed(sink.get());
}

v1::ListWorkersResponse Coordinator::ListWorkers() {
  std::lock_guard<std::mutex> lock(mu_);
  return workers_.List();
}

absl::StatusOr<v1::ListWorkersResponse> Coordinator::ListWorkers(
    const v1::ListWorkersRequest& request) {
  GEOFP8_ASSIGN_OR_RETURN(const size_t page_size, PageSizeOf("page_size", request.page_size()));
  v1::ListWorkersResponse all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all = workers_.List();
  }
  // In id order; the token is the last id of the previous page (this page starts after it).
  v1::ListWorkersResponse page;
  size_t bytes = 0;
  for (auto& w : *all.mutable_workers()) {
    if (!request.page_token().empty() && w.id() <= request.page_token()) continue;
    const size_t add = w.ByteSizeLong() + 6;
    if (page.workers_size() > 0 && (static_cast<size_t>(page.workers_size()) >= page_size ||
                                    bytes + add > kMaxJobsPageBytes)) {
      page.set_next_page_token(page.workers().rbegin()->id());
      break;
    }
    *page.add_workers() = std::move(w);
    bytes += add;
  }
  return page;
}

void Coordinator::CreditPause(int64_t paused_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  workers_.CreditPause(paused_ms);
}

void Coordinator::Tick() {
  Outbox out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    workers_.Tick(out);
    TrySchedule(out);
  }
  Flush(out);
}

// ------------------------------------------------------------------------------------------
// Scheduling

void Coordinator::TrySchedule(Outbox& out) {
  const int64_t now = clock_->NowMs();
  std::vector<JobRec*> pending = jobs_.Pending();
  // A job backing off after failures in a row waits out its time (its scheduling says until
  // when) without holding back the jobs behind it.
  std::erase_if(pending, [&](JobRec* rec) { return jobs_.BackingOff(*rec, now); });
  size_t from = 0;
  while (from < pending.size()) {
    std::vector<PendingJob> jobs;
    for (size_t i = from; i < pending.size(); ++i) {
      const JobRec& rec = *pending[i];
      std::vector<std::string> attached;
      if (IsExternal(rec.spec)) {
        attached.resize(rec.job.world_size());
        for (const auto& [r, worker] : rec.attached) {
          if (r >= 0 && r < rec.job.world_size()) attached[r] = worker;
        }
      }
      jobs.push_back({.id = rec.job.id(),
                      .world_size = rec.job.world_size(),
                      .needs_gpu = rec.spec.backend == "nccl",
                      .needs_commands = !rec.spec.command.empty(),
                      .interrupted_workers = rec.interrupted_workers,
                      .external = IsExternal(rec.spec),
                      .attached = std::move(attached)});
    }
    const std::vector<Placement> placements = Place(jobs, workers_.Slots(), now);
    const size_t first = from;
    from = pending.size();
    for (size_t i = 0; i < placements.size(); ++i) {
      JobRec& rec = *pending[first + i];
      if (!placements[i].placed) {
        rec.job.set_scheduling(placements[i].waiting);
        continue;
      }
      rec.job.clear_scheduling();
      if (!StartAttempt(rec, placements[i].workers, out)) {
        // Its workers stay idle: place the later jobs again with them.
        from = first + i + 1;
        break;
      }
    }
  }
}

bool Coordinator::StartAttempt(JobRec& rec, const std::vector<std::string>& workers, Outbox& out) {
  const int world = rec.job.world_size();
  if (!rec.interrupted_workers.empty()) {
    policies_.RecordReportedTaken(rec);
    jobs_.ResumeInterrupted(rec, workers);
  }
  // What every rank's Assignment shares. Only what the rank can still need (issue #4: every
  // version since v1 grew without bound and past gRPC's message limit): see PolicyHistory.
  v1::Assignment base;
  base.set_job_id(rec.job.id());
  base.set_attempt(rec.job.attempt());
  base.set_world_size(world);
  base.set_spec_yaml(rec.job.spec_yaml());
  base.set_rendezvous_prefix(rec.job.id() + "/" + std::to_string(rec.job.attempt()) + "/");
  base.set_resume_step(rec.job.progress().checkpoint_step());
  base.set_checkpoint_path(rec.spec.checkpoint.dir);
  policies_.FillAssignment(rec.job.id(), &base);
  // UpdatePolicy keeps the versions under kMaxPolicyHistoryBytes; a store written before that
  // bound may hold more. Such an Assignment could never arrive: fail the job with the reason
  // rather than have every worker loop on it. A peer entry is at most 256 bytes (a 200-byte
  // worker id, its rank and generation).
  const size_t assignment_bytes = base.ByteSizeLong() + 6 + size_t{256} * world;
  if (assignment_bytes > kMaxAssignmentBytes) {
    jobs_.SetState(
        rec, v1::JOB_FAILED,
        "policy history: an assignment resuming at step " + std::to_string(base.resume_step()) +
            " would carry " + std::to_string(base.policy_history_size()) + " policy versions in " +
            std::to_string(assignment_bytes) + " bytes, over the " +
            std::to_string(kMaxAssignmentBytes) + "-byte bound on what a worker can receive");
    return false;
  }
  jobs_.BindRanks(rec, workers);
  rec.attached.clear();  // the claims are this attempt's ranks now
  for (int r = 0; r < world; ++r) {
    const WorkerRec& w = *workers_.Find(workers[r]);
    v1::CoordinatorMessage m;
    v1::Assignment* a = m.mutable_assignment();
    *a = base;
    a->set_rank(r);
    *a->mutable_peers() = rec.job.ranks();
    out.emplace_back(w.sink, std::move(m));
    log::Info("job.assigned")
        .F("job", rec.job.id())
        .F("attempt", rec.job.attempt())
        .F("rank", r)
        .F("worker", w.info.id())
        .F("generation", w.info.generation())
        .F("step", a->resume_step())
        .Msg("rank " + std::to_string(r) + " of " + std::to_string(world) + " to worker " +
             w.info.id());
  }
  std::string names;
  for (int r = 0; r < world; ++r) names += (r ? ", " : "") + workers[r];
  kv_.Open(rec.job.id());  // before the assignments leave (the Outbox is sent after this)
  jobs_.SetState(rec, v1::JOB_SCHEDULED,
                 "assigned ranks 0.." + std::to_string(world - 1) + " to " + names);
  return true;
}

// ------------------------------------------------------------------------------------------
// Worker messages

absl::Status Coordinator::HandleWorkerMessage(const v1::WorkerMessage& message) {
  // Fast path: liveness and the ack only, without mu_.
  if (message.body_case() == v1::WorkerMessage::kHeartbeat) return workers_.Heartbeat(message);
  // A log answer changes no state: it goes to the reader waiting on it, without mu_, and only
  // if that read was sent to this session's (worker, generation) (LogRelay::Deliver).
  if (message.has_log_data()) {
    if (!logs_.Deliver(message.worker_id(), message.generation(), message.log_data())) {
      log::Warn("log_data.refused")
          .F("worker", message.worker_id())
          .F("generation", message.generation())
          .F("request", message.log_data().request_id())
          .Msg("a log answer for no read sent to this worker's session");
    }
    return absl::OkStatus();
  }
  Outbox out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    GEOFP8_ASSIGN_OR_RETURN(WorkerRec * w, workers_.Current(message));
    JobRec* rec = ReportedJob(*w, message);
    GEOFP8_RETURN_IF_ERROR(Dispatch(message, *w, rec, out));
    Ack(message, *w, rec, out);
  }
  Flush(out);
  return absl::OkStatus();
}

JobRec* Coordinator::ReportedJob(const WorkerRec& w, const v1::WorkerMessage& message) {
  JobRec* rec = nullptr;
  const int rank = w.info.rank();
  if (!w.info.job_id().empty()) {
    JobRec* j = jobs_.FindOrNull(w.info.job_id());
    if (j && rank >= 0 && rank < static_cast<int>(j->ranks.size()) &&
        j->ranks[rank].worker_id == w.info.id()) {
      rec = j;
    }
  }
  // A report that names a job is about a rank of this worker's own job; one about any other
  // job (an impostor's, or a stale one resent after the worker moved on) changes nothing.
  const std::string* named = message.has_checkpoint()       ? &message.checkpoint().job_id()
                             : message.has_finished()       ? &message.finished().job_id()
                             : message.has_policy_ack()     ? &message.policy_ack().job_id()
                             : message.has_command_status() ? &message.command_status().job_id()
                                                            : nullptr;
  if (named && !named->empty() && (!rec || *named != rec->job.id())) {
    ++foreign_reports_;
    log::Warn("report.refused")
        .F("worker", w.info.id())
        .F("generation", w.info.generation())
        .F("job", *named)
        .Msg("a report for job " + *named + ", of which worker " + w.info.id() + " is not a rank" +
             (rec ? " (it is a rank of " + rec->job.id() + ")" : ""));
    rec = nullptr;
  }
  return rec;
}

absl::Status Coordinator::Dispatch(const v1::WorkerMessage& message, WorkerRec& w, JobRec* rec,
                                   Outbox& out) {
  const int rank = w.info.rank();
  switch (message.body_case()) {
    case v1::WorkerMessage::kHeartbeat:  // handled on the fast paths
    case v1::WorkerMessage::kLogData:
    case v1::WorkerMessage::BODY_NOT_SET:
      break;
    case v1::WorkerMessage::kProgress:
      w.info.set_last_step(message.progress().step());
      if (rec) {
        jobs_.OnProgress(*rec, rank, message.progress(), policies_.Of(rec->job.id()).versions, out);
      }
      break;
    case v1::WorkerMessage::kCatalog:
      if (rec && rank == 0) policies_.OnCatalog(*rec, message.catalog(), out);
      break;
    case v1::WorkerMessage::kSummaries:
      if (rec) policies_.OnSummaries(*rec, message.summaries());
      break;
    case v1::WorkerMessage::kProbes:
      if (rec) GEOFP8_RETURN_IF_ERROR(policies_.OnProbes(*rec, message.probes(), out));
      break;
    case v1::WorkerMessage::kCheckpoint:
      if (rec) GEOFP8_RETURN_IF_ERROR(jobs_.OnCheckpoint(*rec, rank, message.checkpoint()));
      break;
    case v1::WorkerMessage::kFinished:
      if (rec && jobs_.OnFinished(*rec, rank, message.finished(), out)) TrySchedule(out);
      break;
    case v1::WorkerMessage::kCommandStatus:
      if (rec) jobs_.OnCommandStatus(*rec, rank, message.command_status());
      break;
    case v1::WorkerMessage::kPolicyAck:
      // Rank 0 says at which step the ranks took a version.
      if (rec && rank == 0) {
        GEOFP8_RETURN_IF_ERROR(policies_.OnPolicyAck(*rec, message.policy_ack()));
      }
      break;
    case v1::WorkerMessage::kAttach:
      HandleAttach(message.attach(), w, out);
      break;
  }
  return absl::OkStatus();
}

std::string Coordinator::AttachProblem(const v1::RankAttach& a, const WorkerRec& w,
                                       const JobRec* rec) {
  if (!w.info.attach_only()) {
    return "worker " + w.info.id() + " was not started with --attach, so it attaches no rank";
  }
  if (!rec) {
    return "job " + a.job() + ": no such job (GEOFP8_JOB names an external job: submit its spec " +
           "with launcher: external first)";
  }
  const v1::Job& j = rec->job;
  const std::string job = "job " + j.name() + " (" + j.id() + ")";
  if (!IsExternal(rec->spec)) {
    return job + " is not external (its spec's launcher is worker): GeoFP8's workers start its " +
           "ranks; submit a spec with launcher: external for ranks your launcher starts";
  }
  if (JobTable::IsFinal(j.state())) {
    return job + " is " + StateName(j.state()) + " (" + j.reason() +
           "); submit it again to run it again";
  }
  if (a.world_size() != j.world_size()) {
    return "world size: the launcher's is " + std::to_string(a.world_size()) +
           " (WORLD_SIZE) but " + job + " has " + std::to_string(j.world_size()) +
           " ranks (its spec.world_size)";
  }
  if (a.rank() < 0 || a.rank() >= j.world_size()) {
    return "rank " + std::to_string(a.rank()) + ": " + job + " has ranks 0.." +
           std::to_string(j.world_size() - 1);
  }
  if (j.state() != v1::JOB_PENDING) {
    const std::string where =
        a.rank() < int(rec->ranks.size()) ? rec->ranks[a.rank()].worker_id : std::string("?");
    return "rank " + std::to_string(a.rank()) + " of " + job + " already runs, in attempt " +
           std::to_string(j.attempt()) + " at worker " + where +
           ": another launch holds the job; cancel it or wait for it to end";
  }
  if (auto it = rec->attached.find(a.rank());
      it != rec->attached.end() && it->second != w.info.id()) {
    const WorkerRec* other = workers_.Find(it->second);
    if (other && other->sink && other->info.state() == v1::WORKER_IDLE) {
      return "rank " + std::to_string(a.rank()) + " of " + job +
             " is already attached, at worker " + it->second + " (host " + other->info.host() +
             "): another launch holds the job; cancel it or wait for it to end";
    }
  }
  return "";
}

void Coordinator::HandleAttach(const v1::RankAttach& a, WorkerRec& w, Outbox& out) {
  JobRec* rec = jobs_.FindOrNull(a.job());
  if (!rec) {
    if (const JobRec* live = jobs_.LiveJobNamed(a.job())) {
      rec = jobs_.FindOrNull(live->job.id());
    } else if (auto ended = jobs_.NewestNamed(a.job()); ended.ok()) {
      rec = *ended;  // a launch of a job that has ended: AttachProblem names its state
    }
  }
  // A worker holds one claim: a new attach or a withdrawal replaces the one it held.
  for (JobRec* p : jobs_.Pending()) {
    std::erase_if(p->attached, [&](const auto& kv) { return kv.second == w.info.id(); });
  }
  if (a.withdraw()) {
    log::Info("rank.attach_withdrawn")
        .F("worker", w.info.id())
        .F("job", a.job())
        .F("rank", a.rank())
        .Msg("rank " + std::to_string(a.rank()) + " of job " + a.job() +
             " left before its attempt was placed");
    TrySchedule(out);
    return;
  }
  // A repeat of a claim that is now the rank of the attempt placed on this worker (the worker
  // repeats its claim while its program waits, and the Assignment may still be on its way).
  // An ended job's claim is refused below, even from the worker that ran the rank: a launcher
  // that starts it again would otherwise wait for an answer that never comes.
  if (rec && rec->job.state() != v1::JOB_PENDING && !JobTable::IsFinal(rec->job.state()) &&
      a.rank() >= 0 && a.rank() < int(rec->ranks.size()) &&
      rec->ranks[a.rank()].worker_id == w.info.id()) {
    return;
  }
  if (std::string problem = AttachProblem(a, w, rec); !problem.empty()) {
    log::Warn("rank.attach_refused")
        .F("worker", w.info.id())
        .F("job", a.job())
        .F("rank", a.rank())
        .Msg(problem);
    if (!w.sink) return;
    v1::CoordinatorMessage m;
    m.mutable_attach_refused()->set_job(a.job());
    m.mutable_attach_refused()->set_rank(a.rank());
    m.mutable_attach_refused()->set_reason(problem);
    out.emplace_back(w.sink, std::move(m));
    return;
  }
  rec->attached[a.rank()] = w.info.id();
  log::Info("rank.attached")
      .F("worker", w.info.id())
      .F("job", rec->job.id())
      .F("rank", a.rank())
      .Msg("rank " + std::to_string(a.rank()) + " of job " + rec->job.id() +
           " attached at worker " + w.info.id() + " (" + std::to_string(rec->attached.size()) +
           " of " + std::to_string(rec->job.world_size()) + ")");
  TrySchedule(out);
}

void Coordinator::Ack(const v1::WorkerMessage& message, const WorkerRec& w, const JobRec* rec,
                      Outbox& out) {
  if (!message.want_ack() || !w.sink) return;
  v1::CoordinatorMessage ack;
  ack.mutable_ack()->set_seq(message.seq());
  if (message.has_checkpoint() || message.has_finished()) {
    const std::string& reported =
        message.has_checkpoint() ? message.checkpoint().job_id() : message.finished().job_id();
    const std::string& job_id = reported.empty() && rec ? rec->job.id() : reported;
    if (const JobRec* j = jobs_.FindOrNull(job_id)) {
      ack.mutable_ack()->set_job_id(job_id);
      ack.mutable_ack()->set_checkpoint_step(j->job.progress().checkpoint_step());
    }
  }
  out.emplace_back(w.sink, std::move(ack));
}

// ------------------------------------------------------------------------------------------

Coordinator::Counts Coordinator::GetCounts() {
  std::lock_guard<std::mutex> lock(mu_);
  Counts c;
  jobs_.Count(&c.jobs_by_state, &c.deleted_by_state, &c.job_restarts);
  workers_.CountStates(&c.workers_by_state);
  c.policy_updates = policies_.policy_updates();
  c.auto_policy_updates = policies_.auto_policy_updates();
  c.fenced_messages = workers_.fenced_messages();
  c.forged_sessions = workers_.forged_sessions();
  c.foreign_reports = foreign_reports_;
  c.refused_log_data = logs_.refused_answers();
  c.workers_declared_dead = workers_.workers_declared_dead();
  c.workers_dropped = workers_.workers_dropped();
  c.fencing_holds = workers_.fencing_holds();
  c.fencing_held = workers_.fencing_held();
  c.heartbeat_lag_ms = workers_.HeartbeatLagMs();
  return c;
}

void Coordinator::Shutdown() {
  std::vector<std::shared_ptr<SessionSink>> sinks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
    sinks = workers_.Sinks();
  }
  jobs_.WakeWatchers();
  kv_.Shutdown();
  // Session streams otherwise stay open until the server's grace period ends. Workers reconnect
  // (with backoff) to the next coordinator.
  for (const auto& sink : sinks) sink->End();
}

}  // namespace geofp8::coordinator
