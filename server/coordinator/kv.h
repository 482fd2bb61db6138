// The rendezvous key-value store: per-job keys with set, get (optionally waiting), wait and add.
// In memory only: a coordinator restart ends every attempt, and attempts use fresh key prefixes.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace geofp8 {

class RendezvousKv {
 public:
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
  // Drops a job's keys (when it ends).
  void Clear(const std::string& job_id);
  // Wakes every waiter with UNAVAILABLE; later calls fail the same way.
  void Shutdown();
  size_t KeyCount();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::map<std::string, std::string>> jobs_;
  bool shutdown_ = false;
};

}  // namespace geofp8
