// Durable coordinator state in embedded SQLite (WAL, synchronous=FULL): jobs, their events,
// policy versions and worker generations. Write-through; the coordinator reads it only at start.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "geofp8/v1/geofp8.pb.h"

struct sqlite3;

namespace geofp8::coordinator {

// The payload (absl::Status::GetPayload) of a store error that means the coordinator cannot
// write its --data-dir (full, read-only, I/O error): it is up, but records nothing. The gRPC
// adapter passes it on as the status details kStoreUnwritableDetails.
inline constexpr char kStoreUnwritablePayload[] = "type.geofp8/store-unwritable";
inline constexpr char kStoreUnwritableDetails[] = "geofp8.store_unwritable";

struct StoreOptions {
  // --accept-store-loss: open a database that its seal shows was truncated, replaced or rolled
  // back (jobs acknowledged once are missing), instead of refusing to start. Logged; job ids
  // still continue after the highest ever issued.
  bool accept_loss = false;
};

// Group commit (issue #30). Every write is a closure queued on the store; writes that arrive
// together share one transaction and so one fsync:
// - Submit queues a closure; Wait blocks until it is durable (or failed) and returns its own
//   result. Transaction(fn) is Wait(Submit(fn)); a write method (PutJob, NextGeneration, ...)
//   called outside a closure is a Transaction of its own, so every write takes this path.
// - Leader/follower: a waiter that finds no commit under way becomes the leader and takes the
//   whole queue as one batch: BEGIN IMMEDIATE, each closure in its own SAVEPOINT in submission
//   order, one COMMIT. The writers queued meanwhile wait; when the batch is done every one of its
//   callers is woken with its result and the next waiter leads the next batch. A lone caller
//   leads at once: nothing waits for company, so an idle store adds no latency.
// - Durable when: a closure's writes are on disk when Wait returns OK, and not before (callers
//   acknowledge only then). Batches commit one after another in submission order, so a write
//   submitted after another is durable only with or after it.
// - Failure: a closure that fails rolls back its savepoint only, and its caller gets its error;
//   the other closures of the batch are unaffected (later ones see the store without its
//   writes). A failed BEGIN or COMMIT, or one that SQLite rolled back itself (a full disk or an
//   I/O error in mid-statement), fails every closure of that transaction with the store's error
//   (payload kStoreUnwritablePayload for a full disk or an unwritable --data-dir).
// - Closures run on the leader's thread, which may be any caller's: a closure must not take the
//   caller's locks, and may touch the caller's state only while that caller is blocked in Wait
//   holding the lock that guards it. A submitter must call Wait (the queue advances only while
//   someone waits); it may release its own lock between Submit and Wait, which is what lets
//   callers batch.
//
// Beside coordinator.db, coordinator.seal (fsynced, replaced atomically) holds the database's
// identity and how many job ids it has issued. At start the database must pass PRAGMA
// quick_check, carry the seal's identity, and have issued at least as many job ids as the seal
// says, and a database that has tables must have all of its tables (a dropped one is not made
// anew as empty); otherwise Open refuses (DATA_LOSS) with what is missing, unless accept_loss.
class Store {
 public:
  // Opens (creating if needed) <data_dir>/coordinator.db. An empty data_dir keeps everything in
  // memory, for tests (no seal).
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& data_dir,
                                                     const StoreOptions& options = {});
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // One queued write (group commit, above).
  class Write;
  using WriteHandle = std::shared_ptr<Write>;
  // Queues fn to run in the next batch; never blocks on the disk.
  WriteHandle Submit(std::function<absl::Status()> fn);
  // Blocks until w's batch is done (leading it if no commit is under way); w's own result.
  absl::Status Wait(const WriteHandle& w);
  // w's result once its batch is done; nullopt while it is queued or being committed.
  std::optional<absl::Status> Result(const WriteHandle& w);
  // Runs fn as one write: everything it writes is durable when this returns OK, and nothing of
  // it is when fn fails. Inside another write's closure, fn is a nested savepoint of that write.
  absl::Status Transaction(const std::function<absl::Status()>& fn);

  struct CommitStats {
    uint64_t commits = 0;  // batches led (one BEGIN ... COMMIT each)
    uint64_t writes = 0;   // closures they ran
  };
  CommitStats commit_stats();
  size_t queued();  // writes submitted and not yet taken by a leader (for tests)

  // The job row without its events (events are stored separately).
  absl::Status PutJob(const v1::Job& job);
  absl::Status AppendEvent(const std::string& job_id, const v1::JobEvent& event);
  absl::Status PutPolicy(const v1::Policy& policy);
  // A new version v of its job, refused unless version v-1 is stored: v is made from v-1, so it
  // never becomes durable without it (when v-1's write failed, v fails too, with the store's
  // unwritable payload).
  absl::Status PutNextPolicy(const v1::Policy& policy);
  // Next generation for the worker name (1 for a new name), persisted so it never repeats.
  absl::StatusOr<uint64_t> NextGeneration(const std::string& worker_name);
  // The next job number (1, 2, ...: job-000001), persisted so it never repeats, even across a
  // store reset. Inside a Transaction the seal follows once it commits.
  absl::StatusOr<uint64_t> NextJobNumber();
  // Removes a job's row, its events and its policy versions in one transaction, and adds the
  // job to the totals of deleted jobs (Snapshot::deleted). The job-id counter and the seal stay
  // as they are, so the id is never issued again. NOT_FOUND when no such row exists. With
  // `newest_of_name`, the job is recorded as its name's newest deleted job
  // (Snapshot::deleted_names).
  absl::Status DeleteJob(const v1::Job& job, bool newest_of_name = false);
  // This database's identity (32 hex digits; empty for an in-memory store).
  const std::string& store_id() const { return store_id_; }

  // What deleted jobs leave behind: how many ended in each final state and how many restarts
  // they had, so that counters derived from job records (geofp8_jobs_total) never go down.
  struct DeletedTotals {
    std::map<int, int64_t> by_state;  // v1::JobState -> jobs deleted in that state
    int64_t restarts = 0;
  };
  struct Snapshot {
    std::vector<v1::Job> jobs;         // oldest first, events filled in
    std::vector<v1::Policy> policies;  // by job, then version
    DeletedTotals deleted;
    std::map<std::string, std::string> deleted_names;  // name -> its newest deleted job's id
  };
  absl::StatusOr<Snapshot> Load();

 private:
  explicit Store(sqlite3* db) : db_(db) {}
  // quick_check, then the identity and job-id checks against the seal (see the class comment).
  absl::Status CheckIntegrity(const std::string& data_dir, const StoreOptions& options);
  // Before the schema is applied: a database with tables but without one of the first layout's
  // (`path` names it in the error).
  absl::Status CheckTables(const std::string& path, const StoreOptions& options);
  absl::StatusOr<std::string> GetMeta(const std::string& key);
  absl::Status SetMeta(const std::string& key, const std::string& value);
  // Rewrites the seal with jobs_issued (mu_ not held).
  absl::Status WriteSeal(uint64_t jobs_issued);
  // Upgrades a file written under an older schema (PRAGMA user_version) in one transaction;
  // fails for a newer one.
  absl::Status Migrate();
  absl::StatusOr<int> SchemaVersion();
  absl::Status Exec(const std::string& sql);
  absl::Status Error(const std::string& what) const;
  // Whether this thread is leading a batch of this store (a closure, or a write it calls).
  bool InBatch() const;
  // f() on the leader's thread: inline inside a closure, else as a Transaction of its own.
  template <typename F>
  auto AsWrite(F f) -> decltype(f());
  // The leader's part: one transaction for batch, each closure in its savepoint; then the seal.
  void RunBatch(const std::vector<WriteHandle>& batch);
  // fn in a savepoint of the open transaction, rolled back alone when fn fails.
  absl::Status Savepoint(const std::function<absl::Status()>& fn);

  sqlite3* db_;            // used only by the leader (and by Open, before anyone else can)
  std::string seal_path_;  // empty: in memory, no seal
  std::string store_id_;
  uint64_t unsealed_jobs_ = 0;  // a job number issued in the open transaction, sealed at commit
  int savepoint_depth_ = 0;

  std::mutex queue_mu_;  // guards the queue, leading_, stats_ and every Write's done/status
  std::deque<WriteHandle> queue_;
  bool leading_ = false;  // a batch is being committed
  CommitStats stats_;
};

}  // namespace geofp8::coordinator
