// A rank's stop: the coordinator's Stop (its reason), the end of the rank's thread, and the
// watchdog that aborts the attempt's communicator when a Stop waits too long for the rank to
// reach a step boundary. Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

#include "geofp8/v1/geofp8.pb.h"
#include "kernels/exchange/communicator.h"

namespace geofp8::worker {

// The first stop asked for: its reason ("stop requested" when none is given) and cause. Its owner
// locks.
struct StopRequest {
  std::string reason;  // empty: none yet
  v1::StopCause cause = v1::STOP_CAUSE_UNSPECIFIED;
  void Record(const std::string& why, v1::StopCause c) {
    if (!reason.empty()) return;
    reason = why.empty() ? "stop requested" : why;
    cause = c;
  }
};

class StopControl {
 public:
  // Records the first stop's reason (empty: "stop requested") and cause.
  void Request(const std::string& reason, v1::StopCause cause);
  v1::StopCause cause() const;
  // Non-empty once a stop was asked for.
  std::string reason() const;
  bool requested() const;
  // Waits up to `timeout` for a stop; returns whether one was asked for.
  bool WaitFor(std::chrono::milliseconds timeout);

  // The attempt's communicator while it exists (nullptr: gone), for the watchdog.
  void SetCommunicator(Communicator* comm);
  // The rank's thread has ended.
  void MarkDone();
  bool done() const;

  // A Stop is honoured at the next step boundary, where the ranks agree on it (Control). A rank
  // whose peer hangs never gets there: it waits inside a collective. After `abort_after` the
  // communicator is aborted, which ends that collective now and closes the connections, so the
  // peers that are alive leave theirs too. Returns once the rank is done or aborted.
  void Watchdog(std::chrono::milliseconds abort_after, const std::string& job_id, int rank);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  StopRequest stop_;
  Communicator* comm_ = nullptr;
  bool done_ = false;
};

}  // namespace geofp8::worker
