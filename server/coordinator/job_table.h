// The coordinator's jobs: their records and events, the watch stream, and what the ranks report
// about them (progress, checkpoints, finishes). A job's policy versions are PolicyBook's.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "geofp8/v1/geofp8.pb.h"
#include "platform/policy/job_spec.h"
#include "server/coordinator/kv.h"
#include "server/coordinator/session.h"
#include "server/coordinator/store.h"
#include "server/coordinator/worker_registry.h"

namespace geofp8::coordinator {

// Where a watcher stands in a job's change stream.
struct WatchCursor {
  uint64_t change = 0;  // last change number seen
  size_t events = 0;    // events already delivered
};

struct RankState {
  std::string worker_id;
  uint64_t generation = 0;
  int64_t step = -1;  // -1 until the rank reports progress in this attempt
  uint64_t bytes_sent = 0, bytes_baseline = 0;
  bool finished = false;
  // A command job's rank (CommandStatus, JobFinished.hook_never_attached): its program runs; it
  // has not attached to the hook `hook_wait_s` seconds after starting (-1: no such report, or it
  // attached since); it ended without attaching.
  bool process_started = false;
  double hook_wait_s = -1;
  bool hook_never_attached = false;
};

struct JobRec {
  v1::Job job;  // without events
  std::vector<v1::JobEvent> events;
  JobSpec spec;
  std::vector<RankState> ranks;  // current attempt, empty unless SCHEDULED or RUNNING
  uint64_t change = 1;
  int64_t persisted_progress_ms = 0;
  // After a coordinator restart or a restartable failure, until the job is scheduled again:
  // the attempt that was running and its ranks' worker ids (by rank). The checkpoints they report
  // when they register again may allow a later resume step than the persisted recovery point
  // (ResumeAfterOutage).
  int32_t interrupted_attempt = -1;
  std::vector<std::string> interrupted_workers;
  // The worker of each rank (by rank) of every attempt placed while this coordinator ran, and of
  // the one a restart interrupted (from the stored ranks): where `geofp8ctl logs` reads a rank's
  // output from. In memory only: attempts that ended before a restart are not here.
  std::map<int32_t, std::vector<std::string>> attempt_workers;
  // When the current (or last) attempt was placed: an attempt that ran for the back-off's reset
  // window before failing starts the count of failures in a row over.
  int64_t attempt_started_ms = 0;
  // Workers whose early departure restarted this job without charging it (once per worker).
  std::set<std::string> uncharged_workers;
  // An external job while PENDING: the attach-only worker each rank's program attached to (rank
  // -> worker id), until every rank has and the attempt is placed. In memory only: a rank whose
  // claim a coordinator restart lost attaches again (docs/launchers.md).
  std::map<int32_t, std::string> attached;
};

// Restarts after restartable failures in a row back off (docs/reliability.md, "Crash loops"),
// as Kubernetes' CrashLoopBackOff does, except that the first restart is at once: a single
// failure (a lost peer) is common and says nothing of a loop.
struct RestartBackoff {
  int64_t base_ms = 10000;  // the wait before the second restart in a row; 0: no back-off
  int64_t max_ms = 300000;  // the cap; an attempt that ran 2 * max_ms resets the count
  // The wait before the next attempt after `failures` restartable failures in a row.
  int64_t Delay(int failures) const;
};

std::string StateName(v1::JobState s);

// ListJobs pages (AIP-158): page_size jobs, 0 = kDefaultJobsPageSize, at most kMaxJobsPageSize;
// a page also ends before kMaxJobsPageBytes (it holds at least one job, and a job is at most a
// spec of kMaxSpecBytes and fields bounded at the edge), so an answer stays under gRPC's 4 MiB.
inline constexpr int kDefaultJobsPageSize = 100;
inline constexpr int kMaxJobsPageSize = 1000;
inline constexpr size_t kMaxJobsPageBytes = size_t{1} << 20;

// The number of a job id ("job-000042" -> 42); 0 for anything else.
uint64_t JobNumber(const std::string& id);

// Locking: none of its own; every call runs under the coordinator's mutex, which WatchNext
// releases while it waits (on changed_).
class JobTable {
 public:
  JobTable(Store* store, Clock* clock, RendezvousKv* kv, WorkerRegistry* workers,
           RestartBackoff backoff);

  static bool IsFinal(v1::JobState s);

  // Recover, in two steps around PolicyBook's load: Load takes the stored jobs (and returns the
  // ids of those whose spec no longer parses, with the reason); Restart then fails the jobs
  // without a policy or with such a spec, takes each job's policy_version from its versions, and
  // sends SCHEDULED and RUNNING ones back to PENDING.
  std::map<std::string, std::string> Load(Store::Snapshot& snap);
  // `latest_policy` gives a job's newest policy version, 0 if it has none.
  void Restart(const std::map<std::string, std::string>& invalid_specs,
               const std::function<uint64_t(const std::string& job_id)>& latest_policy);

  // A new job, with its number, first event and (through `put_policy`, in the same store
  // transaction) policy v1; or the job an earlier request with the same idempotency key made
  // (*created false).
  absl::StatusOr<JobRec*> Submit(
      const v1::SubmitJobRequest& request, const JobSpec& spec,
      const std::function<absl::Status(const v1::Job& job, int64_t now)>& put_policy,
      bool* created);
  // One page of the jobs, newest first (see kMaxJobsPageBytes); the caller checked page_size.
  absl::StatusOr<v1::ListJobsResponse> List(const v1::ListJobsRequest& request,
                                            size_t page_size) const;
  absl::Status Cancel(JobRec& rec, const std::string& request_reason, Outbox& out);
  // See Coordinator::WatchNext; `lock` holds the coordinator's mutex.
  absl::StatusOr<std::optional<v1::WatchJobResponse>> WatchNext(std::unique_lock<std::mutex>& lock,
                                                                const std::string& job_id,
                                                                WatchCursor* cursor, int timeout_ms,
                                                                const bool& shutdown);
  // Removes a finished job (store, then memory); FAILED_PRECONDITION unless it is finished.
  absl::StatusOr<v1::DeleteJobResponse> Delete(JobRec* rec);

  v1::Job Snapshot(const JobRec& rec, bool with_events) const;
  absl::StatusOr<JobRec*> Find(const std::string& job_id);
  JobRec* FindOrNull(const std::string& job_id);
  // The job that is not finished and has `name`, if any (names are unique among those).
  const JobRec* LiveJobNamed(const std::string& name) const;
  // The newest job ever submitted with `name`: NOT_FOUND when there is none, or when that job
  // was deleted (naming it, and the newest older job of the name, which only its id reaches).
  absl::StatusOr<JobRec*> NewestNamed(const std::string& name);
  // PENDING jobs in submission order.
  std::vector<JobRec*> Pending() const;

  // State change with a reason: persisted with its event before anyone can observe it.
  void SetState(JobRec& rec, v1::JobState state, const std::string& reason);
  absl::Status PersistJob(JobRec& rec);
  // Appends `event` to the job, in the store and then in memory; false if the store refused.
  bool AppendEvent(JobRec& rec, const v1::JobEvent& event);
  void Changed(JobRec& rec);
  void WakeWatchers() { changed_.notify_all(); }

  void ReleaseRanks(JobRec& rec, const std::string& stop_reason, v1::StopCause cause, Outbox& out);
  // Ends the current attempt. A restartable failure restarts the job while max_restarts allows
  // (backing off after failures in a row, RestartBackoff), else fails it. `early_leaver` names
  // the worker that left within kUnchargedLossWindowMs of its assignment, if that was the cause:
  // the first such restart per worker is not charged to the job.
  void FailAttempt(JobRec& rec, const std::string& reason, bool restartable, Outbox& out,
                   const std::string& early_leaver = "");
  // Whether rec is PENDING but backing off until after `now_ms` (its Job.scheduling says so).
  bool BackingOff(JobRec& rec, int64_t now_ms) const;
  // The newest step past the persisted recovery point that every rank of the interrupted
  // attempt reported holding, when one of `chosen` is such a rank (it broadcasts the
  // checkpoint); -1 otherwise.
  int64_t ResumeAfterOutage(const JobRec& rec, const std::vector<std::string>& chosen) const;
  // Moves the recovery point to what the interrupted attempt's ranks hold (ResumeAfterOutage)
  // and forgets that attempt: the job is being placed on `chosen`.
  void ResumeInterrupted(JobRec& rec, const std::vector<std::string>& chosen);
  // Binds ranks 0.. of a new attempt to `workers` (the registry marks them assigned).
  void BindRanks(JobRec& rec, const std::vector<std::string>& workers);

  // Rank reports. `policies` are the job's versions (PolicyBook), for the divergence check.
  void OnProgress(JobRec& rec, int rank, const v1::StepProgress& p,
                  const std::vector<v1::Policy>& policies, Outbox& out);
  absl::Status OnCheckpoint(JobRec& rec, int rank, const v1::Checkpoint& checkpoint);
  // A command job's rank: its program started (RUNNING once every rank runs), has not attached
  // to the hook in time (the job's note and an event) or attached.
  void OnCommandStatus(JobRec& rec, int rank, const v1::CommandStatus& status);
  // Whether the report was of the current attempt (then the caller tries to schedule).
  bool OnFinished(JobRec& rec, int rank, const v1::JobFinished& finished, Outbox& out);
  // Whether a report naming (job_id, attempt) belongs to rec's current attempt; an empty job_id
  // (an older worker) does.
  static bool SameAttempt(const JobRec& rec, const std::string& job_id, int32_t attempt);

  // Jobs by state and restarts, of the jobs here and (restarts, final states) those deleted.
  void Count(std::map<int, int64_t>* by_state, std::map<int, int64_t>* deleted_by_state,
             uint64_t* restarts) const;

 private:
  static void LogState(const JobRec& rec, v1::JobState state, const std::string& reason);
  // The job and an event in the current state, in one store transaction, then in memory; false
  // if the store refused (logged).
  bool PersistWithEvent(JobRec& rec, const std::string& message);
  // SCHEDULED -> RUNNING once every rank runs: reported progress, or its program started.
  void RunningIfAllRanksRun(JobRec& rec, const std::string& reason);

  Store* store_;
  Clock* clock_;
  RendezvousKv* kv_;
  WorkerRegistry* workers_;
  const RestartBackoff backoff_;

  std::condition_variable changed_;
  std::map<std::string, std::unique_ptr<JobRec>> jobs_;
  std::vector<JobRec*> job_order_;  // submission order: scheduling is first come, first served
  std::map<std::string, std::string> by_idempotency_key_;
  Store::DeletedTotals deleted_;  // of jobs deleted, ever (persisted with each delete)
  // Name -> id of the newest deleted job of that name (persisted with each delete): a delete by
  // name never reaches past it to an older job (NewestNamed).
  std::map<std::string, std::string> deleted_names_;
};

}  // namespace geofp8::coordinator
