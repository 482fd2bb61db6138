// The coordinator's handlers: job lifecycle, policy versions, worker sessions with fencing, and
// rank assignment. Plain C++ over proto messages; the gRPC adapters (grpc_services.h) are thin.
//
// Coordinator is a facade over one class per concern, each with its own state:
//   WorkerRegistry (worker_registry.h)  workers: registration, generations and session secrets,
//                                       session streams, liveness (heartbeats), fencing;
//   JobTable (job_table.h)              jobs and their events, watchers, and the ranks' progress,
//                                       checkpoint and finish reports; attempts and restarts;
//   PolicyBook (policy_book.h)          each job's policy versions (compaction, the history
//                                       bound, taken steps), catalog, refresh schedules, layer
//                                       summaries, probes and the auto policy engine;
//   Place (scheduler.h)                 placement, a pure function of (pending jobs, workers).
// Dependencies point one way: PolicyBook -> JobTable -> WorkerRegistry. The registry reports a
// lost rank through a callback (the facade fails the attempt in the JobTable), and the facade
// does what spans concerns: scheduling (Place, then the attempt's Assignments), the policy
// resend on a new session, and the dispatch of worker messages to the concern that owns each.
//
// Locking. One mutex, Coordinator::mu_, guards the registry, the job table and the policy book:
// nearly every call crosses them (a lost worker fails its job's attempt, which frees the other
// ranks' workers and schedules onto the freed ones; a policy version is sent to the ranks' streams)
// and each RPC's store write is its durability point, so one lock per concern would only trade
// this lock for an ordering protocol. Store writes happen under mu_; stream writes after it is
// released (the Outbox). The heartbeat fast path takes only WorkerRegistry::live_mu_.
// Lock order (never take one to the left while holding one to its right):
//   Coordinator::mu_  ->  WorkerRegistry::live_mu_  ->  RendezvousKv::mu_
// (live_mu_ and the KV's mutex are never held together; the KV is also used without mu_ by the
// rendezvous RPCs.) LogRelay's mutex (log reads in flight) is taken after mu_ or alone, and
// nothing is taken while it is held. Watchers wait on JobTable's condition variable with mu_.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
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
#include "server/coordinator/job_table.h"
#include "server/coordinator/kv.h"
#include "server/coordinator/log_relay.h"
#include "server/coordinator/policy_book.h"
#include "server/coordinator/session.h"
#include "server/coordinator/store.h"
#include "server/coordinator/worker_registry.h"

namespace geofp8::coordinator {

struct CoordinatorOptions {
  int heartbeat_interval_ms = 1000;  // told to workers at Register
  // Silence after which a worker is declared dead and fenced. 6 s: five missed heartbeats, and
  // with the restart on a spare (about 1.5 s) a dead worker's job runs again within 10 s.
  int heartbeat_timeout_ms = 6000;
  // Serve the rendezvous KV for any job id, not only jobs with a live attempt. Off in production;
  // for tests that drive the KV without running jobs (--debug-kv-any-job).
  bool kv_any_job = false;
  // Logs: with follow, how long to wait before asking again for output that is not there yet;
  // and how long a worker has to answer one log read.
  int log_poll_ms = 500;
  int log_read_timeout_ms = 10000;
  // Crash loops (RestartBackoff, docs/reliability.md): the second restartable failure in a row
  // waits restart_backoff_ms before the next attempt, each further one twice as long, at most
  // restart_backoff_max_ms; an attempt that ran twice the cap starts the count over. 0: off.
  int64_t restart_backoff_ms = 10000;
  int64_t restart_backoff_max_ms = 300000;
  // A dead worker's entry (name, last generation, back-off) is dropped this long after its death.
  int64_t dead_worker_retention_ms = 600000;
  // More than this share of at least kHoldOffMinWorkers live workers not heard for two heartbeat
  // intervals at once holds off fencing (WorkerRegistry::Tick); >= 1 turns the hold-off off.
  double fencing_holdoff_share = 0.5;
};

// Durability (issue #30: group commit). The store batches writes that arrive together into one
// transaction (Store: group commit); the coordinator lets them arrive together by not holding
// mu_ across the fsync on its hot paths, and shows nothing before it is durable:
// - Register: the next generation is reserved in the store (a write of its own, mu_ released),
//   then installed under mu_ (WorkerRegistry::CheckName, Register). The generation order is the
//   commit order, so of two racing registrations of one name the later commit has the higher
//   generation: installed second, it fences the first (DeclareDead), or, installed first, the lower
//   one finds itself overtaken and is answered with its generation already fenced, as though it had
//   been registered and then replaced. The live-session check is made again at install: a name
//   whose session opened meanwhile is refused as before (the reserved number is burnt, never handed
//   out). Nothing of a generation is in memory, sent or answered before it is durable.
// - UpdatePolicy: version v is staged under mu_ (JobPolicies::staged: numbered after the
//   newest durable or staged version, its write submitted in that order), then mu_ is released
//   for the wait. PolicyBook's versions, which every reader uses (GetPolicy, ListPolicyVersions,
//   Assignments, resends, divergence checks), holds durable versions only: PolicyBook::Publish
//   moves the durable prefix of the staged ones there, in order, under mu_, and only then are they
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
  // A rank's program output (LogsRequest), read from its worker chunk by chunk (log_relay.h,
  // docs/logs.md) and handed to `write` (false: the client went away). Ends when the file is
  // read, or with `follow` when the rank has ended and its output is drained; CANCELLED once
  // `cancelled` says so. Errors as JobService.Logs's comment in the proto says.
  absl::Status StreamLogs(const v1::LogsRequest& request,
                          const std::function<bool(const v1::LogsChunk&)>& write,
                          const std::function<bool()>& cancelled);

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
  // One page of the workers, in id order (a page ends as ListJobs' do, kMaxJobsPageBytes).
  absl::StatusOr<v1::ListWorkersResponse> ListWorkers(const v1::ListWorkersRequest& request);
  // Every worker on one page (in-process callers only: no transport limit applies).
  v1::ListWorkersResponse ListWorkers();

  // Declares workers dead whose heartbeats stopped; restarts or fails their jobs. Called by a
  // timer in the daemon and directly by tests (with a fake clock).
  void Tick();
  // The daemon's timer saw that the coordinator itself did not run for `paused_ms` (SIGSTOP, a
  // VM pause, starvation): the workers' silence is ours, not theirs. Every live worker's
  // heartbeat clock restarts now, so no worker is declared dead for it (a false death).
  void CreditPause(int64_t paused_ms);
  // A worker's message (its session's first) waited `lag_ms` between being read and handled:
  // counted in the heartbeat lag that extends every deadline (WorkerRegistry::HeartbeatLagMs).
  void RecordHandlingLag(int64_t lag_ms) { workers_.RecordHandlingLag(lag_ms); }

  RendezvousKv& kv() { return kv_; }

  struct Counts {
    std::map<int, int64_t> jobs_by_state;     // v1::JobState -> count
    std::map<int, int64_t> deleted_by_state;  // final v1::JobState -> jobs deleted in it
    std::map<int, int64_t> workers_by_state;  // v1::WorkerState -> count
    uint64_t policy_updates = 0;              // versions created after v1 (user and auto)
    uint64_t auto_policy_updates = 0;
    uint64_t fenced_messages = 0;   // messages rejected for a stale generation
    uint64_t forged_sessions = 0;   // sessions and Leaves refused for a wrong session secret
    uint64_t foreign_reports = 0;   // reports naming a job the worker is not a rank of
    uint64_t refused_log_data = 0;  // log answers for no read sent to that worker's session
    uint64_t workers_declared_dead = 0;
    uint64_t workers_dropped = 0;  // dead workers' entries dropped after the retention time
    uint64_t fencing_holds = 0;    // times fencing was held off (WorkerRegistry::Tick)
    bool fencing_held = false;     // held off now
    int64_t heartbeat_lag_ms = 0;  // WorkerRegistry::HeartbeatLagMs
    uint64_t job_restarts = 0;     // attempts ended by a restartable failure and restarted
                                   // (those of deleted jobs included)
  };
  Counts GetCounts();

  // Wakes watchers and stops accepting sessions.
  void Shutdown();

 private:
  // SubmitJob without its log line (the line says whether and why it was refused).
  absl::StatusOr<v1::SubmitJobResponse> SubmitJobUnlogged(const v1::SubmitJobRequest& request);
  // RankLost of the registry: the worker holding a rank of `job_id` was declared dead.
  void OnRankLost(const std::string& job_id, const std::string& reason,
                  const std::string& early_leaver, Outbox& out);
  // Places what can be placed of the pending jobs (Place) and starts their attempts.
  void TrySchedule(Outbox& out);
  // Starts rec's next attempt on `workers` (by rank): assignments out, SCHEDULED. False if the
  // Assignment would be undeliverable: the job failed and the workers stay idle.
  bool StartAttempt(JobRec& rec, const std::vector<std::string>& workers, Outbox& out);
  // A snapshot with the events and the layer summaries.
  v1::Job Details(const JobRec& rec) const;
  // The job of which `w` is a rank, if any; nullptr (counted, logged) when `message` reports on
  // another job.
  JobRec* ReportedJob(const WorkerRec& w, const v1::WorkerMessage& message);
  // The case of HandleWorkerMessage for message's body, handed to the concern that owns it.
  absl::Status Dispatch(const v1::WorkerMessage& message, WorkerRec& w, JobRec* rec, Outbox& out);
  // A RankAttach from an attach-only worker: the rank's claim is recorded (and the attempt placed
  // once every rank has one), or refused with an AttachRefused naming what differs.
  void HandleAttach(const v1::RankAttach& attach, WorkerRec& w, Outbox& out);
  // "" when `attach` may claim its rank of `rec`, else why not.
  std::string AttachProblem(const v1::RankAttach& attach, const WorkerRec& w, const JobRec* rec);
  // The Ack of a want_ack message, once handled (and persisted where it changed the job).
  void Ack(const v1::WorkerMessage& message, const WorkerRec& w, const JobRec* rec, Outbox& out);
  // StreamLogs' steps (coordinator_logs.cc): the request's target (holding one of the worker's
  // stream slots when it returns one), one chunk read from the worker, and whether the rank's
  // attempt has ended (its output will not grow).
  absl::StatusOr<LogTarget> ResolveLogs(const v1::LogsRequest& request);
  absl::StatusOr<v1::LogData> ReadLog(const LogTarget& target, int64_t offset, int32_t tail_lines);
  bool RankEnded(const LogTarget& target);

  Store* store_;
  Clock* clock_;
  CoordinatorOptions options_;
  RendezvousKv kv_;

  // The coordinator's mutex: guards the registry (but its liveness), the job table and the
  // policy book, and shutdown_.
  std::mutex mu_;
  WorkerRegistry workers_;
  JobTable jobs_;
  PolicyBook policies_;
  LogRelay logs_;  // its own mutex, after mu_
  uint64_t foreign_reports_ = 0;
  bool shutdown_ = false;
};

}  // namespace geofp8::coordinator
