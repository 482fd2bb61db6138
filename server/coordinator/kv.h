// The rendezvous key-value store: per-job keys with set, get (optionally waiting), wait and add.
// In memory only: a coordinator restart ends every attempt, and attempts use fresh key prefixes.
// Bounded per job (key size, value size, key count, total bytes) so one client cannot exhaust the
// coordinator's memory; the coordinator admits only jobs with a live attempt.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace geofp8::coordinator {

// Per-job bounds. Gloo's rendezvous stores one address (tens of bytes) per rank and context, and
// the exchange engine a few contexts per job: these leave orders of magnitude of room.
struct KvLimits {
  size_t max_key_bytes = 1024;
  size_t max_value_bytes = 1 << 20;
  size_t max_keys_per_job = 65536;
  size_t max_bytes_per_job = 64 << 20;  // keys and values together
};

class RendezvousKv {
 public:
  explicit RendezvousKv(KvLimits limits = {}) : limits_(limits) {}

  // From now on only jobs opened with Open() (and not cleared since) are served; others get
  // FAILED_PRECONDITION. The coordinator turns this on; a bare store serves any job id.
  void RequireOpenJobs();
  // The job has a live attempt (it was just scheduled): its clients may use the store.
  void Open(const std::string& job_id);
  // Longest wait of Get and Wait: a longer one is cut to this (a day, the longest exchange
  // timeout a spec accepts).
  static constexpr int64_t kMaxWaitMs = int64_t{86400} * 1000;

  absl::Status Set(const std::string& job_id, const std::string& key, std::string value);
  // wait_ms == 0: NOT_FOUND when absent; else wait up to wait_ms (DEADLINE_EXCEEDED).
  absl::StatusOr<std::string> Get(const std::string& job_id, const std::string& key,
                                  int64_t wait_ms);
  // Waits until every key exists; DEADLINE_EXCEEDED names the first missing key.
  absl::Status Wait(const std::string& job_id, const std::vector<std::string>& keys,
                    int64_t timeout_ms);
  // Adds delta to the integer stored (as decimal text) at key, creating it at 0. OUT_OF_RANGE
  // (and nothing stored) if the sum overflows int64.
  absl::StatusOr<int64_t> Add(const std::string& job_id, const std::string& key, int64_t delta);
  // Drops a job's keys and closes it (its attempt ended); waiters on it return at once.
  void Clear(const std::string& job_id);
  // Wakes every waiter with UNAVAILABLE; later calls fail the same way.
  void Shutdown();
  size_t KeyCount();
  size_t JobCount();  // jobs holding at least one key

 private:
  struct JobKeys {
    std::map<std::string, std::string> keys;
    size_t bytes = 0;  // sum of key and value sizes
  };
  // Checks that job_id may be served; mu_ held.
  absl::Status Admit(const std::string& job_id) const;
  // Stores key=value within the limits; mu_ held.
  absl::Status Put(const std::string& job_id, const std::string& key, std::string value);

  const KvLimits limits_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, JobKeys> jobs_;
  bool require_open_ = false;
  std::set<std::string> open_;
  bool shutdown_ = false;
};

}  // namespace geofp8::coordinator
