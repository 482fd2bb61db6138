// Durable coordinator state in embedded SQLite (WAL, synchronous=FULL): jobs, their events,
// policy versions and worker generations. Write-through; the coordinator reads it only at start.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "geofp8/v1/geofp8.pb.h"

struct sqlite3;

namespace geofp8::coordinator {

class Store {
 public:
  // Opens (creating if needed) <data_dir>/coordinator.db. An empty data_dir keeps everything in
  // memory, for tests.
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& data_dir);
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

  struct Snapshot {
    std::vector<v1::Job> jobs;         // oldest first, events filled in
    std::vector<v1::Policy> policies;  // by job, then version
  };
  absl::StatusOr<Snapshot> Load();

 private:
  explicit Store(sqlite3* db) : db_(db) {}
  // Upgrades a file written under an older schema (PRAGMA user_version) in one transaction;
  // fails for a newer one.
  absl::Status Migrate();
  absl::StatusOr<int> SchemaVersion();
  absl::Status Exec(const std::string& sql);
  absl::Status Error(const std::string& what) const;

  sqlite3* db_;
  std::mutex mu_;  // SQLite handle is used from one thread at a time
  bool in_transaction_ = false;
};

}  // namespace geofp8::coordinator
