// Rendezvous KV: one mutex and one condition variable; waiters re-check their keys on each set.
#include "server/coordinator/kv.h"

#include <algorithm>
#include <charconv>
#include <chrono>

namespace geofp8 {
namespace {
absl::Status CheckIds(const std::string& job_id, const std::string& key) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: required");
  if (key.empty()) return absl::InvalidArgumentError("key: required");
  return absl::OkStatus();
}
}  // namespace

absl::Status RendezvousKv::Set(const std::string& job_id, const std::string& key,
                               std::string value) {
  if (auto s = CheckIds(job_id, key); !s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) return absl::UnavailableError("coordinator shutting down");
    jobs_[job_id][key] = std::move(value);
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousKv::Get(const std::string& job_id, const std::string& key,
                                              int64_t wait_ms) {
  if (auto s = CheckIds(job_id, key); !s.ok()) return s;
  if (wait_ms > 0) {
    if (auto s = Wait(job_id, {key}, wait_ms); !s.ok()) return s;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto job = jobs_.find(job_id);
  if (job != jobs_.end()) {
    auto it = job->second.find(key);
    if (it != job->second.end()) return it->second;
  }
  return absl::NotFoundError("key " + key + " of job " + job_id + " is not set");
}

absl::Status RendezvousKv::Wait(const std::string& job_id, const std::vector<std::string>& keys,
                                int64_t timeout_ms) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: required");
  if (timeout_ms <= 0) timeout_ms = 30000;
  // steady_clock counts nanoseconds in int64: now + 2^63-1 ms would wrap into the past.
  timeout_ms = std::min(timeout_ms, kMaxWaitMs);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::unique_lock<std::mutex> lock(mu_);
  std::string missing;
  auto all_present = [&] {
    auto job = jobs_.find(job_id);  // find, not []: waiting must not create a job's entry
    for (const auto& k : keys) {
      if (job == jobs_.end() || !job->second.count(k)) {
        missing = k;
        return false;
      }
    }
    return true;
  };
  while (!all_present()) {
    if (shutdown_) return absl::UnavailableError("coordinator shutting down");
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !all_present()) {
      return absl::DeadlineExceededError("key " + missing + " of job " + job_id +
                                         " not set within " + std::to_string(timeout_ms) + " ms");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> RendezvousKv::Add(const std::string& job_id, const std::string& key,
                                          int64_t delta) {
  if (auto s = CheckIds(job_id, key); !s.ok()) return s;
  int64_t value = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) return absl::UnavailableError("coordinator shutting down");
    std::string& stored = jobs_[job_id][key];
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
    stored = std::to_string(value);
  }
  cv_.notify_all();
  return value;
}

void RendezvousKv::Clear(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.erase(job_id);
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
  for (const auto& [job, m] : jobs_) n += m.size();
  return n;
}

}  // namespace geofp8
