// The coordinator's handlers: job lifecycle, policy versions, worker sessions with fencing, and
// rank assignment. Plain C++ over proto messages; the gRPC adapters (grpc_services.h) are thin.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "geofp8/v1/geofp8.pb.h"
#include "platform/policy/job_spec.h"
#include "server/coordinator/kv.h"
#include "server/coordinator/store.h"

namespace geofp8::coordinator {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual int64_t NowMs() = 0;  // wall clock, unix milliseconds
};
Clock* SystemClock();

// The coordinator's end of one worker's Session stream. Send must not block for long; after the
// stream ends it silently drops messages.
class SessionSink {
 public:
  virtual ~SessionSink() = default;
  virtual void Send(const v1::CoordinatorMessage& message) = 0;
  // Ends the stream from the coordinator's side (shutdown), so that its handler returns now
  // instead of when the worker next writes or the server's grace runs out.
  virtual void End() {}
};

// Bounds on policy updates: patches in one UpdatePolicy, and patches a version may hold after
// compaction (a version travels whole in every Policy message and Assignment).
inline constexpr int kMaxPatchesPerUpdate = 256;
inline constexpr int kMaxPatchesPerVersion = 4096;
// Bytes of policy versions one Assignment may carry in `policy` and `policy_history`: the latest
// version, and every version from the one in force at the job's recovery point on (those a
// resumed rank can need). UpdatePolicy refuses a version that would take them past this, so an
// Assignment stays deliverable: with the spec (kMaxSpecBytes) and its peers it is under
// kMaxAssignmentBytes. The versions before the recovery point drop out as checkpoints pass.
inline constexpr size_t kMaxPolicyHistoryBytes = size_t{2} << 20;
// gRPC's default limit on a received message (4 MiB), less room for the CoordinatorMessage
// around the Assignment. An Assignment over it (only from a store written before the bound
// above) fails its job with the reason instead of looping on every worker.
inline constexpr size_t kMaxAssignmentBytes = (size_t{4} << 20) - (size_t{64} << 10);
// ListPolicyVersions pages: page_size 0 means kDefaultPolicyPageSize, at most
// kMaxPolicyPageSize; a page also ends before kMaxPolicyPageBytes (it holds at least one
// version, and a version is at most kMaxPolicyHistoryBytes).
inline constexpr int kDefaultPolicyPageSize = 100;
inline constexpr int kMaxPolicyPageSize = 1000;
inline constexpr size_t kMaxPolicyPageBytes = size_t{1} << 20;

struct CoordinatorOptions {
  int heartbeat_interval_ms = 1000;  // told to workers at Register
  // Silence after which a worker is declared dead and fenced. 6 s: five missed heartbeats, and
  // with the restart on a spare (about 1.5 s) a dead worker's job runs again within 10 s.
  int heartbeat_timeout_ms = 6000;
  // Serve the rendezvous KV for any job id, not only jobs with a live attempt. Off in production;
  // for tests that drive the KV without running jobs (--debug-kv-any-job).
  bool kv_any_job = false;
};

// Where a watcher stands in a job's change stream.
struct WatchCursor {
  uint64_t change = 0;  // last change number seen
  size_t events = 0;    // events already delivered
};

// Durability (issue #30: group commit). The store batches writes that arrive together into one
// transaction (Store: group commit); the coordinator lets them arrive together by not holding
// mu_ across the fsync on its hot paths, and shows nothing before it is durable:
// - Register: the next generation is reserved in the store (a write of its own, mu_ released),
//   then installed under mu_. The generation order is the commit order, so of two racing
//   registrations of one name the later commit has the higher generation: installed second, it
//   fences the first (DeclareDead), or, installed first, the lower one finds itself overtaken
//   and is answered with its generation already fenced, as though it had been registered and
//   then replaced. The live-session check is made again at install: a name whose session opened
//   meanwhile is refused as before (the reserved number is burnt, never handed out). Nothing
//   of a generation is in memory, sent or answered before it is durable.
// - UpdatePolicy: version v is staged under mu_ (JobRec::staged_policies: numbered after the
//   newest durable or staged version, its write submitted in that order), then mu_ is released
//   for the wait. rec.policies, which every reader uses (GetPolicy, ListPolicyVersions,
//   Assignments, resends, divergence checks), holds durable versions only: PublishPolicies moves
//   the durable prefix of the staged ones there, in order, under mu_, and only then are they
//   sent to ranks (the Outbox is flushed after) and acknowledged. A version's write checks that
//   v-1 is stored (Store::PutNextPolicy), so v+1 never becomes durable without v; when v fails,
//   v and every version staged after it are dropped (their writes fail too), and the next
//   version made takes v's number: versions stay dense and ordered. The job row's
//   policy_version is a cache that Recover rebuilds from the versions.
// - Other writes (SetState with its event, progress, PolicyAck's taken step, SubmitJob, ...)
//   wait under mu_, as before: what they record is observable the moment mu_ is released, so
//   it must be durable by then. They still share a commit with the registrations and policy
//   versions waiting meanwhile. A failed batch fails exactly the writes it held; each caller
//   handles its own error as before (SetState and progress log it).
class Coordinator {
 public:
  Coordinator(Store* store, Clock* clock, CoordinatorOptions options);
  ~Coordinator();

  // Loads jobs and policies from the store. Jobs that were SCHEDULED or RUNNING go back to
  // PENDING: their workers must re-register with this coordinator.
  absl::Status Recover();

  // --- JobService
  absl::StatusOr<v1::SubmitJobResponse> SubmitJob(const v1::SubmitJobRequest& request);
  absl::StatusOr<v1::Job> GetJob(const v1::GetJobRequest& request);
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const v1::ListJobsRequest& request);
  absl::StatusOr<v1::Job> CancelJob(const v1::CancelJobRequest& request);
  // Returns the snapshot and new events once the job changed after *cursor, or nullopt when
  // timeout_ms passed without a change. Snapshot.job.state tells the watcher when to stop.
  absl::StatusOr<std::optional<v1::WatchJobResponse>> WatchNext(const std::string& job_id,
                                                                WatchCursor* cursor,
                                                                int timeout_ms);
  // Removes a finished job and its records (store and memory); FAILED_PRECONDITION naming the
  // job and its state unless it is SUCCEEDED, FAILED or CANCELLED. Watchers of it get NOT_FOUND.
  absl::StatusOr<v1::DeleteJobResponse> DeleteJob(const v1::DeleteJobRequest& request);

  // --- PolicyService
  absl::StatusOr<v1::Policy> GetPolicy(const v1::GetPolicyRequest& request);
  absl::StatusOr<v1::UpdatePolicyResponse> UpdatePolicy(const v1::UpdatePolicyRequest& request);
  absl::StatusOr<v1::ListPolicyVersionsResponse> ListPolicyVersions(
      const v1::ListPolicyVersionsRequest& request);

  // --- WorkerService
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request);
  // The worker's generation leaves on purpose: fenced at once, and its job's attempt fails over.
  absl::Status Leave(const v1::LeaveRequest& request);
  // Attaches the stream of (worker_id, generation), which must carry the generation's session
  // secret (RegisterResponse.session_secret): PERMISSION_DENIED otherwise, counted as a forged
  // session. FAILED_PRECONDITION if fenced or unknown. A second stream with the right secret
  // replaces the first (the same process reconnecting before its old stream broke).
  absl::Status OpenSession(const std::string& worker_id, uint64_t generation,
                           const std::string& session_secret, std::shared_ptr<SessionSink> sink);
  // FAILED_PRECONDITION for a fenced or unknown generation: the adapter ends the stream. The
  // adapter has bound the stream to one (worker_id, generation) at OpenSession and passes only
  // messages naming it. A report for a job the worker is not a rank of changes nothing and is
  // counted (Counts::foreign_reports).
  absl::Status HandleWorkerMessage(const v1::WorkerMessage& message);
  // Detaches `sink` if it is still the worker's session: a stream that was replaced, or one a
  // session never owned, changes nothing.
  void CloseSession(const std::string& worker_id, uint64_t generation,
                    const std::shared_ptr<SessionSink>& sink);
  v1::ListWorkersResponse ListWorkers();

  // Declares workers dead whose heartbeats stopped; restarts or fails their jobs. Called by a
  // timer in the daemon and directly by tests (with a fake clock).
  void Tick();
  // The daemon's timer saw that the coordinator itself did not run for `paused_ms` (SIGSTOP, a
  // VM pause, starvation): the workers' silence is ours, not theirs. Every live worker's
  // heartbeat clock restarts now, so no worker is declared dead for it (a false death).
  void CreditPause(int64_t paused_ms);

  RendezvousKv& kv() { return kv_; }

  struct Counts {
    std::map<int, int64_t> jobs_by_state;     // v1::JobState -> count
    std::map<int, int64_t> deleted_by_state;  // final v1::JobState -> jobs deleted in it
    std::map<int, int64_t> workers_by_state;  // v1::WorkerState -> count
    uint64_t policy_updates = 0;              // versions created after v1 (user and auto)
    uint64_t auto_policy_updates = 0;
    uint64_t fenced_messages = 0;  // messages rejected for a stale generation
    uint64_t forged_sessions = 0;  // sessions and Leaves refused for a wrong session secret
    uint64_t foreign_reports = 0;  // reports naming a job the worker is not a rank of
    uint64_t workers_declared_dead = 0;
    uint64_t job_restarts = 0;  // attempts ended by a restartable failure and restarted
                                // (those of deleted jobs included)
  };
  Counts GetCounts();

  // Wakes watchers and stops accepting sessions.
  void Shutdown();

 private:
  struct RankState {
    std::string worker_id;
    uint64_t generation = 0;
    int64_t step = -1;  // -1 until the rank reports progress in this attempt
    uint64_t bytes_sent = 0, bytes_baseline = 0;
    bool finished = false;
  };
  // A policy version whose write is submitted but not yet published (PublishPolicies).
  struct StagedPolicy {
    v1::Policy policy;
    v1::JobEvent event;                          // recorded with it
    std::vector<v1::RefreshSchedule> schedules;  // JobRec::schedules once published
    Store::WriteHandle write;
  };
  struct JobRec {
    v1::Job job;  // without events
    std::vector<v1::JobEvent> events;
    JobSpec spec;
    std::vector<v1::Policy> policies;  // policies[v - 1] is version v; durable ones only
    std::vector<v1::LayerInfo> catalog;
    std::vector<v1::RefreshSchedule> schedules;
    std::map<std::string, v1::LayerSummary> layers;  // latest summary per layer
    std::vector<RankState> ranks;  // current attempt, empty unless SCHEDULED or RUNNING
    uint64_t change = 1;
    int64_t persisted_progress_ms = 0;
    // After a coordinator restart or a restartable failure, until the job is scheduled again:
    // the attempt that was running and its ranks' worker ids (by rank). The checkpoints they report
    // when they register again may allow a later resume step than the persisted recovery point
    // (ResumeAfterOutage).
    int32_t interrupted_attempt = -1;
    std::vector<std::string> interrupted_workers;
    // Versions after policies.back() whose writes are submitted and not yet published, in
    // version order (see "Durability" above).
    std::deque<StagedPolicy> staged_policies;
  };
  struct WorkerRec {
    v1::Worker info;
    std::shared_ptr<SessionSink> sink;
    std::string fenced_reason;              // non-empty once the current generation is fenced
    std::vector<v1::HeldCheckpoints> held;  // reported at its last Register
    std::string session_secret;             // of the current generation (RegisterResponse)
  };
  // Heartbeat fast path: what a heartbeat needs, under its own mutex, so heartbeats never wait
  // behind a store fsync held under mu_. Written under mu_ + live_mu_ (that order); the last
  // heartbeat time lives only here.
  struct Liveness {
    uint64_t generation = 0;
    std::string fenced_reason;
    std::shared_ptr<SessionSink> sink;
    int64_t last_ms = 0;
  };
  // Versions rank 0 of the interrupted attempt reported taken when it registered again (its
  // PolicyAcks were lost with its generation) are recorded before the job resumes, so that the
  // resumed ranks start under, and replay, the versions that attempt ran under.
  void RecordReportedTaken(JobRec& rec);
  void SyncLive(const WorkerRec& w, bool touch);
  int64_t LastSeen(const std::string& worker_id);
  absl::Status FencedError(const std::string& worker_id, uint64_t generation, uint64_t current,
                           const std::string& reason);
  // PERMISSION_DENIED (counted) unless `secret` is w's session secret; `what` names the call.
  absl::Status CheckSecret(const WorkerRec& w, const std::string& secret, const char* what);

  // Messages to send after the lock is released, so a slow stream never stalls the coordinator.
  using Outbox = std::vector<std::pair<std::shared_ptr<SessionSink>, v1::CoordinatorMessage>>;

  static bool IsFinal(v1::JobState s);
  v1::Job Snapshot(const JobRec& rec, bool with_events) const;
  absl::StatusOr<JobRec*> FindJob(const std::string& job_id);
  // The job that is not finished and has `name`, if any (names are unique among those).
  const JobRec* LiveJobNamed(const std::string& name) const;
  // State change with a reason: persisted with its event before anyone can observe it.
  void SetState(JobRec& rec, v1::JobState state, const std::string& reason);
  static void LogState(const JobRec& rec, v1::JobState state, const std::string& reason);
  // SubmitJob without its log line (the line says whether and why it was refused).
  absl::StatusOr<v1::SubmitJobResponse> SubmitJobUnlogged(const v1::SubmitJobRequest& request);
  absl::Status PersistJob(JobRec& rec);
  void Changed(JobRec& rec);
  void ReleaseRanks(JobRec& rec, const std::string& stop_reason, v1::StopCause cause, Outbox& out);
  void FailAttempt(JobRec& rec, const std::string& reason, bool restartable, Outbox& out);
  void TrySchedule(Outbox& out);
  // The newest step past the persisted recovery point that every rank of the interrupted
  // attempt reported holding, when one of `chosen` is such a rank (it broadcasts the
  // checkpoint); -1 otherwise.
  int64_t ResumeAfterOutage(const JobRec& rec, const std::vector<WorkerRec*>& chosen) const;
  void SendToRanks(const JobRec& rec, const v1::CoordinatorMessage& m, Outbox& out);
  // The latest version (durable or staged) with `patches` appended (and `default_policy` in
  // place of its default, when given), compacted, staged with its write submitted (*write).
  // When that equals the latest version, no version is made: *unchanged is set and the latest
  // version is returned, with *write the staged one's write (null when it is durable).
  absl::StatusOr<v1::Policy> StagePolicyVersion(
      JobRec& rec, const std::vector<v1::LayerPatch>& patches, const std::string& reason,
      const std::string& author, Store::WriteHandle* write,
      const v1::LayerPolicy* default_policy = nullptr, bool* unchanged = nullptr);
  // Moves the durable prefix of rec's staged versions to rec.policies, in order, and queues
  // them to the ranks; drops every staged version from the first failed one on.
  void PublishPolicies(JobRec& rec, Outbox& out);
  // StagePolicyVersion, then waits for the write under mu_ and publishes: durable when it
  // returns OK.
  absl::StatusOr<v1::Policy> AddPolicyVersion(JobRec& rec,
                                              const std::vector<v1::LayerPatch>& patches,
                                              const std::string& reason, const std::string& author,
                                              Outbox& out);
  void DeclareDead(WorkerRec& w, const std::string& reason, Outbox& out);
  void OnProgress(JobRec& rec, int rank, const v1::StepProgress& p, Outbox& out);
  static void Flush(Outbox& out);
  // Whether a report naming (job_id, attempt) belongs to rec's current attempt; an empty job_id
  // (an older worker) does.
  static bool SameAttempt(const JobRec& rec, const std::string& job_id, int32_t attempt);

  Store* store_;
  Clock* clock_;
  CoordinatorOptions options_;
  RendezvousKv kv_;

  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::unique_ptr<JobRec>> jobs_;
  std::vector<JobRec*> job_order_;  // submission order: scheduling is first come, first served
  std::map<std::string, std::string> by_idempotency_key_;
  std::map<std::string, WorkerRec> workers_;  // by worker id (= name)
  Counts counters_;
  Store::DeletedTotals deleted_;  // of jobs deleted, ever (persisted with each delete)
  std::atomic<uint64_t> fenced_messages_{0};
  bool shutdown_ = false;
  std::mutex live_mu_;
  std::map<std::string, Liveness> live_;
};

}  // namespace geofp8::coordinator
