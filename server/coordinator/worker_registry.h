// The coordinator's workers: registration, generations and their session secrets, session
// streams, liveness (heartbeats) and fencing. A worker is known by its name; each Register gives
// it a new generation, and every older generation is fenced: its messages are refused.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "geofp8/v1/geofp8.pb.h"
#include "server/coordinator/session.h"
#include "server/coordinator/store.h"

namespace geofp8::coordinator {

struct WorkerRec {
  v1::Worker info;
  std::shared_ptr<SessionSink> sink;
  std::string fenced_reason;              // non-empty once the current generation is fenced
  std::vector<v1::HeldCheckpoints> held;  // reported at its last Register
  std::string session_secret;             // of the current generation (RegisterResponse)
  int64_t registered_ms = 0;              // when the current generation registered
  int64_t assigned_ms = 0;                // when it was given its current rank
  int64_t dead_ms = 0;                    // when it was declared dead; 0 while live
  // Generations of this name in a row that ended within kStableSessionMs of registering, and
  // the placement back-off they earned (kept across generations, as the name is).
  int short_sessions = 0;
  int64_t backoff_until_ms = 0;
};

// Flapping workers (docs/reliability.md): a generation that ends within kStableSessionMs of
// registering was short; from the second short one in a row, placement backs off from the name
// for kWorkerBackoffBaseMs, doubling with each further one, at most kWorkerBackoffMaxMs.
inline constexpr int64_t kStableSessionMs = 60000;
inline constexpr int64_t kWorkerBackoffBaseMs = 1000;
inline constexpr int64_t kWorkerBackoffMaxMs = 300000;
// A worker that goes (leaves, or falls silent) within this long of receiving its assignment,
// before its rank ran anything, restarts the job without charging a restart to it, once per
// worker and job (JobTable::FailAttempt).
inline constexpr int64_t kUnchargedLossWindowMs = 10000;
// Fencing hold-off (docs/reliability.md, "A starved coordinator"): applies to fleets of at least
// this many live workers, and lasts at most this many heartbeat timeouts once the coordinator
// keeps up with the heartbeats it does get.
inline constexpr int kHoldOffMinWorkers = 10;
inline constexpr int kMaxHoldTimeouts = 10;

// What liveness needs to know (CoordinatorOptions has the documented defaults).
struct LivenessOptions {
  int heartbeat_interval_ms = 1000;
  int heartbeat_timeout_ms = 6000;
  // A dead worker's entry is dropped from the registry this long after it was declared dead.
  int64_t dead_worker_retention_ms = 600000;
  // When more than this share of the live workers have not been heard for two heartbeat
  // intervals in one check, the coordinator is behind: it holds off fencing; >= 1: never.
  double fencing_holdoff_share = 0.5;
};

// What the scheduler needs to know of a worker (Scheduler::Place).
struct WorkerSlot {
  std::string id;
  std::string device;
  bool accepts_commands = false;
  bool attach_only = false;  // --attach: runs only the external job ranks that attached to it
  bool connected = false;    // has a session stream
  bool fenced = false;
  bool idle = false;
  int64_t registered_ms = 0;     // placement prefers the oldest sessions
  int64_t backoff_until_ms = 0;  // not placed on before this (a flapping worker)
};

// Locking: everything but Heartbeat, LastSeen and the fenced count runs under the coordinator's
// mutex (the caller holds it). The heartbeat fast path has its own live_mu_, taken after the
// coordinator's mutex where both are held, so heartbeats never wait behind a store fsync.
class WorkerRegistry {
 public:
  // Called when a worker that held a rank is declared dead (fenced, timed out, left): the job's
  // attempt has lost `rank`; `reason` names the worker and why. Runs under the coordinator's lock.
  // `early_leaver` is the worker's id when it went within kUnchargedLossWindowMs of its
  // assignment (JobTable::FailAttempt may then not charge the restart), else empty.
  using RankLost = std::function<void(const std::string& job_id, const std::string& reason,
                                      const std::string& early_leaver, Outbox& out)>;

  WorkerRegistry(Store* store, Clock* clock, LivenessOptions options, RankLost rank_lost);

  // Register in two steps around the store's write of the next generation (made without the
  // coordinator's mutex, see "Durability" in coordinator.h): ALREADY_EXISTS while the name is
  // held by a live session; then the generation `gen` is installed, fencing the one before it,
  // or, when a later generation of the name was installed meanwhile, answered already fenced.
  absl::Status CheckName(const v1::RegisterRequest& request) const;
  v1::RegisterResponse Register(const v1::RegisterRequest& request, uint64_t gen, Outbox& out);
  absl::Status Leave(const v1::LeaveRequest& request, Outbox& out);
  // Attaches `sink` as the session of (worker_id, generation); see Coordinator::OpenSession.
  absl::StatusOr<WorkerRec*> OpenSession(const std::string& worker_id, uint64_t generation,
                                         const std::string& session_secret,
                                         std::shared_ptr<SessionSink> sink);
  void CloseSession(const std::string& worker_id, uint64_t generation,
                    const std::shared_ptr<SessionSink>& sink);
  v1::ListWorkersResponse List();

  // The worker a (non-heartbeat) message comes from, if it is its current, unfenced generation;
  // its heartbeat clock restarts. FAILED_PRECONDITION otherwise.
  absl::StatusOr<WorkerRec*> Current(const v1::WorkerMessage& message);
  // The heartbeat fast path: liveness and the ack only. Takes live_mu_, never the coordinator's
  // mutex.
  absl::Status Heartbeat(const v1::WorkerMessage& message);

  // Declares dead the workers whose heartbeats stopped: silent for longer than the heartbeat
  // timeout plus the coordinator's own heartbeat processing lag (HeartbeatLagMs). When more than
  // fencing_holdoff_share of the live workers (kHoldOffMinWorkers or more) have not been heard
  // for two heartbeat intervals (or the timeout, if shorter), the coordinator is behind: it holds
  // off fencing (logged, counted) until fewer are, then gives every live worker a fresh timeout;
  // once it keeps up with the beats it does get (HeartbeatLagMs within an interval) for
  // kMaxHoldTimeouts timeouts, the silent ones are fenced. Drops dead workers' entries after
  // dead_worker_retention_ms.
  void Tick(Outbox& out);
  // How late the coordinator handles heartbeats now: the median, over the last full second, of
  // each beat's (arrival - Heartbeat.unix_ms) less the least such transit seen from that worker
  // (its clock skew and network time). Beats that wait in the coordinator's queues show here.
  int64_t HeartbeatLagMs();
  // A message that waited `lag_ms` in the coordinator before it was handled (a session's first,
  // whose transit cannot be told from clock skew): a sample of the same lag. Takes live_mu_ only.
  void RecordHandlingLag(int64_t lag_ms);
  // Every live worker's heartbeat clock restarts now (Coordinator::CreditPause).
  void CreditPause(int64_t paused_ms);
  // Fences w's generation: a Stop to its stream, and its rank (if any) is lost (RankLost).
  // `gone_ms`: when it went, for a worker found silent (its last heartbeat); -1: now (it left,
  // or was replaced).
  void DeclareDead(WorkerRec& w, const std::string& reason, Outbox& out, int64_t gone_ms = -1);

  WorkerRec* Find(const std::string& worker_id);
  const WorkerRec* Find(const std::string& worker_id) const;
  // Workers in id order, as the scheduler sees them.
  std::vector<WorkerSlot> Slots() const;
  // Marks the worker (at `generation`) the holder of `rank` of `job_id`.
  void Assign(const std::string& worker_id, const std::string& job_id, int rank);
  // The session stream of (worker_id, generation), if it has one.
  std::shared_ptr<SessionSink> SinkOf(const std::string& worker_id, uint64_t generation) const;

  // Queues `m` for every rank's worker that still is the generation it was assigned at and has a
  // stream. `Ranks` is a range of something with worker_id and generation (RankState).
  template <typename Ranks>
  void SendToRanks(const Ranks& ranks, const v1::CoordinatorMessage& m, Outbox& out) const {
    for (const auto& r : ranks) {
      if (auto sink = SinkOf(r.worker_id, r.generation)) out.emplace_back(std::move(sink), m);
    }
  }
  // Frees the ranks' workers (still at their assigned generation) of their job.
  template <typename Ranks>
  void ReleaseRanks(const Ranks& ranks) {
    for (const auto& r : ranks) Release(r.worker_id, r.generation);
  }

  // The session streams open now (for shutdown).
  std::vector<std::shared_ptr<SessionSink>> Sinks() const;
  void CountStates(std::map<int, int64_t>* by_state) const;
  uint64_t fenced_messages() const { return fenced_messages_.load(); }
  uint64_t forged_sessions() const { return forged_sessions_; }
  uint64_t workers_declared_dead() const { return workers_declared_dead_; }
  uint64_t workers_dropped() const { return workers_dropped_; }
  uint64_t fencing_holds() const { return fencing_holds_; }
  bool fencing_held() const { return fencing_held_; }

 private:
  // Heartbeat fast path: what a heartbeat needs, under its own mutex, so heartbeats never wait
  // behind a store fsync held under the coordinator's mutex. Written under that mutex + live_mu_
  // (that order); the last heartbeat time lives only here.
  struct Liveness {
    uint64_t generation = 0;
    std::string fenced_reason;
    std::shared_ptr<SessionSink> sink;
    int64_t last_ms = 0;
    int64_t min_transit_ms = INT64_MAX;  // of this generation's beats
  };
  // Under live_mu_: a heartbeat handled `lag_ms` late at `now`.
  void RecordLagLocked(int64_t now, int64_t lag_ms);
  void Release(const std::string& worker_id, uint64_t generation);
  void SyncLive(const WorkerRec& w, bool touch);
  int64_t LastSeen(const std::string& worker_id);
  absl::Status FencedError(const std::string& worker_id, uint64_t generation, uint64_t current,
                           const std::string& reason);
  // PERMISSION_DENIED (counted) unless `secret` is w's session secret; `what` names the call.
  absl::Status CheckSecret(const WorkerRec& w, const std::string& secret, const char* what);

  Store* store_;
  Clock* clock_;
  const int heartbeat_interval_ms_;
  const int heartbeat_timeout_ms_;
  const LivenessOptions options_;
  RankLost rank_lost_;

  std::map<std::string, WorkerRec> workers_;  // by worker id (= name)
  uint64_t forged_sessions_ = 0;
  uint64_t workers_declared_dead_ = 0;
  uint64_t workers_dropped_ = 0;
  // Fencing hold-off (Tick).
  bool fencing_held_ = false;
  int64_t held_since_ms_ = 0;
  int64_t hold_keeping_up_since_ms_ = 0;  // since when the hold saw no lag over an interval
  uint64_t fencing_holds_ = 0;
  std::atomic<uint64_t> fenced_messages_{0};
  std::mutex live_mu_;
  std::map<std::string, Liveness> live_;
  // Heartbeat lag samples of the current one-second window, and the median of the last one.
  int64_t lag_window_start_ms_ = 0;
  std::vector<int64_t> lag_samples_;
  int64_t lag_median_ms_ = 0;
};

}  // namespace geofp8::coordinator
