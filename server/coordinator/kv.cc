// Rendezvous KV: one mutex and one condition variable; waiters re-check their keys on each set.
#include "server/coordinator/kv.h"

#include <algorithm>
#include <charconv>
#include <chrono>

namespace geofp8::coordinator {
namespace {
absl::Status CheckIds(const std::string& job_id, const std::string& key) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: required");
  if (key.empty()) return absl::InvalidArgumentError("key: required");
  return absl::OkStatus();
}
}  // namespace

void RendezvousKv::RequireOpenJobs() {
  std::lock_guard<std::mutex> lock(mu_);
  require_open_ = true;
}

void RendezvousKv::Open(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  open_.insert(job_id);
}

absl::Status RendezvousKv::Admit(const std::string& job_id) const {
  if (shutdown_) return absl::UnavailableError("coordinator shutting down");
  if (require_open_ && !open_.count(job_id)) {
    return absl::FailedPreconditionError("job_id: no running attempt of job " + job_id +
                                         " (unknown, not yet scheduled, or ended)");
  }
  return absl::OkStatus();
}

absl::Status RendezvousKv::Put(const std::string& job_id, const std::string& key,
                               std::string value) {
  if (key.size() > limits_.max_key_bytes) {
    return absl::InvalidArgumentError("key: longer than " + std::to_string(limits_.max_key_bytes) +
                                      " bytes (" + std::to_string(key.size()) + ")");
  }
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError("value: longer than " +
                                      std::to_string(limits_.max_value_bytes) + " bytes (" +
                                      std::to_string(value.size()) + " for key " + key + ")");
  }
  JobKeys& job = jobs_[job_id];
  auto it = job.keys.find(key);
  const size_t old = it == job.keys.end() ? 0 : key.size() + it->second.size();
  if (it == job.keys.end() && job.keys.size() >= limits_.max_keys_per_job) {
    if (job.keys.empty()) jobs_.erase(job_id);
    return absl::ResourceExhaustedError("job " + job_id + ": rendezvous would hold more than " +
                                        std::to_string(limits_.max_keys_per_job) + " keys (" +
                                        std::to_string(job.keys.size() + 1) + " with key " + key +
                                        ")");
  }
  const size_t bytes = job.bytes - old + key.size() + value.size();
  if (bytes > limits_.max_bytes_per_job) {
    if (job.keys.empty()) jobs_.erase(job_id);
    return absl::ResourceExhaustedError("job " + job_id + ": rendezvous would hold more than " +
                                        std::to_string(limits_.max_bytes_per_job) + " bytes (" +
                                        std::to_string(bytes) + " with key " + key + ")");
  }
  job.bytes = bytes;
  job.keys[key] = std::move(value);
  return absl::OkStatus();
}

absl::Status RendezvousKv::Set(const std::string& job_id, const std::string& key,
                               std::string value) {
  if (auto s = CheckIds(job_id, key); !s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto s = Admit(job_id); !s.ok()) return s;
    if (auto s = Put(job_id, key, std::move(value)); !s.ok()) return s;
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousKv::Get(const std::string& job_id, const std::string& key,
                                              int64_t wait_ms) {
  if (auto s = CheckIds(job_id, key); !s.ok()) return s;
  if (wait_ms < 0) {
    return absl::InvalidArgumentError("wait_ms: must be >= 0 (" + std::to_string(wait_ms) + ")");
  }
  if (wait_ms > 0) {
    if (auto s = Wait(job_id, {key}, wait_ms); !s.ok()) return s;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (auto s = Admit(job_id); !s.ok()) return s;
  auto job = jobs_.find(job_id);
  if (job != jobs_.end()) {
    auto it = job->second.keys.find(key);
    if (it != job->second.keys.end()) return it->second;
  }
  return absl::NotFoundError("key " + key + " of job " + job_id + " is not set");
}

absl::Status RendezvousKv::Wait(const std::string& job_id, const std::vector<std::string>& keys,
                                int64_t timeout_ms) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: required");
  if (timeout_ms < 0) {
    return absl::InvalidArgumentError("timeout_ms: must be >= 0, 0 = 30000 (" +
                                      std::to_string(timeout_ms) + ")");
  }
  if (timeout_ms == 0) timeout_ms = 30000;
  // steady_clock counts nanoseconds in int64: now + 2^63-1 ms would wrap into the past.
  timeout_ms = std::min(timeout_ms, kMaxWaitMs);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::unique_lock<std::mutex> lock(mu_);
  std::string missing;
  auto all_present = [&] {
    auto job = jobs_.find(job_id);  // find, not []: waiting must not create a job's entry
    for (const auto& k : keys) {
      if (job == jobs_.end() || !job->second.keys.count(k)) {
        missing = k;
        return false;
      }
    }
    return true;
  };
  for (;;) {
    // Re-checked after every wake-up: a job that ends (Clear) releases its waiters at once.
    if (auto s = Admit(job_id); !s.ok()) return s;
    if (all_present()) return absl::OkStatus();
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      if (auto s = Admit(job_id); !s.ok()) return s;
      if (all_present()) return absl::OkStatus();
      return absl::DeadlineExceededError("key " + missing + " of job " + job_id +
                                         " not set within " + std::to_string(timeout_ms) + " ms");
    }
  }
}

absl::StatusOr<int64_t> RendezvousKv::Add(const std::string& job_id, const std::string& key,
                                          int64_t delta) {
  if (auto s = CheckIds(job_id, key); !s.ok()) return s;
  int64_t value = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto s = Admit(job_id); !s.ok()) return s;
    std::string stored;
    if (auto job = jobs_.find(job_id); job != jobs_.end()) {
      if (auto it = job->second.keys.find(key); it != job->second.keys.end()) stored = it->second;
    }
    if (!stored.empty()) {
      auto [p, ec] = std::from_chars(stored.data(), stored.data() + stored.size(), value);
      if (ec != std::errc() || p != stored.data() + stored.size()) {
        return absl::FailedPreconditionError("key " + key + " holds a non-integer value");
      }
    }
    if (__builtin_add_overflow(value, delta, &value)) {
      return absl::OutOfRangeError("key " + key + ": adding " + std::to_string(delta) + " to " +
                                   stored + " overflows int64");
    }
    if (auto s = Put(job_id, key, std::to_string(value)); !s.ok()) return s;
  }
  cv_.notify_all();
  return value;
}

void RendezvousKv::Clear(const std::string& job_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.erase(job_id);
    open_.erase(job_id);
  }
  cv_.notify_all();
}

void RendezvousKv::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
}

size_t RendezvousKv::KeyCount() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [job, m] : jobs_) n += m.keys.size();
  return n;
}

size_t RendezvousKv::JobCount() {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.size();
}

}  // namespace geofp8::coordinator
