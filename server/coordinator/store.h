// Durable coordinator state in embedded SQLite (WAL, synchronous=FULL): jobs, their events,
// policy versions and worker generations. Write-through; the coordinator reads it only at start.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
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

// Beside coordinator.db, coordinator.seal (fsynced, replaced atomically) holds the database's
// identity and how many job ids it has issued. At start the database must pass PRAGMA
// quick_check, carry the seal's identity, and have issued at least as many job ids as the seal
// says; otherwise Open refuses (DATA_LOSS) with what is missing, unless accept_loss.
class Store {
 public:
  // Opens (creating if needed) <data_dir>/coordinator.db. An empty data_dir keeps everything in
  // memory, for tests (no seal).
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& data_dir,
                                                     const StoreOptions& options = {});
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Runs fn inside one transaction: everything it writes is durable when this returns OK, and
  // nothing of it is when fn fails.
  absl::Status Transaction(const std::function<absl::Status()>& fn);

  // The job row without its events (events are stored separately).
  absl::Status PutJob(const v1::Job& job);
  absl::Status AppendEvent(const std::string& job_id, const v1::JobEvent& event);
  absl::Status PutPolicy(const v1::Policy& policy);
  // Next generation for the worker name (1 for a new name), persisted so it never repeats.
  absl::StatusOr<uint64_t> NextGeneration(const std::string& worker_name);
  // The next job number (1, 2, ...: job-000001), persisted so it never repeats, even across a
  // store reset. Inside a Transaction the seal follows once it commits.
  absl::StatusOr<uint64_t> NextJobNumber();
  // Removes a job's row, its events and its policy versions in one transaction, and adds the
  // job to the totals of deleted jobs (Snapshot::deleted). The job-id counter and the seal stay
  // as they are, so the id is never issued again. NOT_FOUND when no such row exists.
  absl::Status DeleteJob(const v1::Job& job);
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
  };
  absl::StatusOr<Snapshot> Load();

 private:
  explicit Store(sqlite3* db) : db_(db) {}
  // quick_check, then the identity and job-id checks against the seal (see the class comment).
  absl::Status CheckIntegrity(const std::string& data_dir, const StoreOptions& options);
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

  sqlite3* db_;
  std::mutex mu_;  // SQLite handle is used from one thread at a time
  bool in_transaction_ = false;
  std::string seal_path_;  // empty: in memory, no seal
  std::string store_id_;
  uint64_t unsealed_jobs_ = 0;  // a job number issued in the open transaction, sealed at commit
};

}  // namespace geofp8::coordinator
