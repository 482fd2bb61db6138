// What every part of the coordinator shares: the clock, a worker's session stream, and the
// Outbox of messages that are sent to streams only after the coordinator's lock is released.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "geofp8/v1/geofp8.pb.h"

namespace geofp8::coordinator {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual int64_t NowMs() = 0;  // wall clock, unix milliseconds
};
Clock* SystemClock();

// The coordinator's end of one worker's Session stream. Send must not block for long; after the
// stream ends it silently drops messages.
class SessionSink {
 public:
  virtual ~SessionSink() = default;
  virtual void Send(const v1::CoordinatorMessage& message) = 0;
  // Ends the stream from the coordinator's side (shutdown), so that its handler returns now
  // instead of when the worker next writes or the server's grace runs out.
  virtual void End() {}
};

// Messages to send after the lock is released, so a slow stream never stalls the coordinator.
using Outbox = std::vector<std::pair<std::shared_ptr<SessionSink>, v1::CoordinatorMessage>>;

// Sends and empties `out`. Call without the coordinator's lock.
inline void Flush(Outbox& out) {
  for (auto& [sink, message] : out) sink->Send(message);
  out.clear();
}

}  // namespace geofp8::coordinator
