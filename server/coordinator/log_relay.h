// The coordinator's half of `geofp8ctl logs` (docs/logs.md): the log reads it has sent to
// workers and is waiting on, and how many log streams each worker serves. A reader pulls: one
// LogRead is out per stream at a time, and the next is sent only after the client took the
// chunk, so a slow reader holds back its own stream and never a worker's session.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "geofp8/v1/geofp8.pb.h"
#include "server/coordinator/session.h"

namespace geofp8::coordinator {

// The rank output one Logs call reads: resolved once, at its start.
struct LogTarget {
  std::string job_id;
  int32_t attempt = 0;
  int32_t rank = 0;
  v1::LogStream stream = v1::LOG_STDOUT;
  std::string worker_id;  // the worker that ran (or runs) the rank
};

// Locking: its own mutex, taken after the coordinator's where both are held (never the other
// way); waits release it.
class LogRelay {
 public:
  // Log streams one worker serves at once: each has at most one read (64 KiB) in flight, so this
  // also bounds what a worker's session carries for readers.
  static constexpr int kMaxStreamsPerWorker = 8;

  // Takes one of the worker's stream slots; RESOURCE_EXHAUSTED (naming the worker) when all are
  // taken. Every successful Acquire is paired with a Release.
  absl::Status Acquire(const std::string& worker_id);
  void Release(const std::string& worker_id);

  // Registers a read about to be sent on `sink`, the session of (worker_id, generation); returns
  // its request id.
  uint64_t Begin(const std::string& worker_id, uint64_t generation, const SessionSink* sink);
  // The answer to read `id`, once Deliver has it; UNAVAILABLE when its session closed first or
  // `timeout` passed (naming the worker; not UNAVAILABLE, which a client takes for the
  // coordinator being unreachable). Forgets the read either way.
  absl::StatusOr<v1::LogData> Wait(uint64_t id, std::chrono::milliseconds timeout);
  // An answer from the session of (worker_id, generation). False, and counted, when no read of
  // that id is waiting for that worker and generation: another worker's, a fenced generation's,
  // or a late answer to a read that timed out changes nothing.
  bool Deliver(const std::string& worker_id, uint64_t generation, v1::LogData data);
  // `sink` ended: the reads sent on it fail now rather than at their timeout.
  void SessionClosed(const SessionSink* sink);

  uint64_t refused_answers() const;
  int streams(const std::string& worker_id) const;

 private:
  struct Pending {
    std::string worker_id;
    uint64_t generation = 0;
    const SessionSink* sink = nullptr;
    std::optional<v1::LogData> data;
    bool closed = false;
  };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Pending> pending_;
  std::map<std::string, int> streams_;  // by worker id; absent = 0
  uint64_t refused_answers_ = 0;
};

}  // namespace geofp8::coordinator
