// Pending log reads and per-worker stream slots (see log_relay.h).
#include "server/coordinator/log_relay.h"

namespace geofp8::coordinator {

absl::Status LogRelay::Acquire(const std::string& worker_id) {
  std::lock_guard<std::mutex> lock(mu_);
  int& n = streams_[worker_id];
  if (n >= kMaxStreamsPerWorker) {
    return absl::ResourceExhaustedError("worker " + worker_id + " already serves " +
                                        std::to_string(n) +
                                        " log streams (the limit); try again when one ends");
  }
  ++n;
  return absl::OkStatus();
}

void LogRelay::Release(const std::string& worker_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(worker_id);
  if (it != streams_.end() && --it->second <= 0) streams_.erase(it);
}

uint64_t LogRelay::Begin(const std::string& worker_id, uint64_t generation,
                         const SessionSink* sink) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  Pending& p = pending_[id];
  p.worker_id = worker_id;
  p.generation = generation;
  p.sink = sink;
  return id;
}

absl::StatusOr<v1::LogData> LogRelay::Wait(uint64_t id, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = pending_.find(id);
  if (it == pending_.end()) {
    return absl::InternalError("log read " + std::to_string(id) + ": unknown");
  }
  const bool answered =
      cv_.wait_for(lock, timeout, [&] { return it->second.data || it->second.closed; });
  Pending p = std::move(it->second);
  pending_.erase(it);
  if (p.data) return std::move(*p.data);
  return absl::AbortedError("worker " + p.worker_id +
                            (answered ? ": its session closed before it answered the log read"
                                      : ": did not answer the log read within " +
                                            std::to_string(timeout.count()) + " ms"));
}

bool LogRelay::Deliver(const std::string& worker_id, uint64_t generation, v1::LogData data) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(data.request_id());
  if (it == pending_.end() || it->second.worker_id != worker_id ||
      it->second.generation != generation || it->second.data || it->second.closed) {
    ++refused_answers_;
    return false;
  }
  it->second.data = std::move(data);
  cv_.notify_all();
  return true;
}

void LogRelay::SessionClosed(const SessionSink* sink) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, p] : pending_) {
    if (p.sink == sink) p.closed = true;
  }
  cv_.notify_all();
}

uint64_t LogRelay::refused_answers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_answers_;
}

int LogRelay::streams(const std::string& worker_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(worker_id);
  return it == streams_.end() ? 0 : it->second;
}

}  // namespace geofp8::coordinator
