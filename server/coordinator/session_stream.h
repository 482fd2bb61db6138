// The coordinator's end of the workers' Session streams, on gRPC's callback API.
//
// The synchronous API parks a thread on every open stream's Read. At 10,000 workers that was
// 10,000 threads, and handing each heartbeat from gRPC's poller to its parked thread and back
// (two context switches a message, more for the ack's Write) took most of the coordinator's two
// cores: the heartbeat load alone saturated it, and policy updates got what was left
// (docs/benchmarks.md, "Coordinator at 10,000 workers"). Here no thread belongs to a stream:
// - A heartbeat is handled on the gRPC thread that read it: it takes only the registry's
//   liveness lock, and its ack is queued on the stream.
// - Every other message may wait for the coordinator's lock and a store commit, so it runs on a
//   SessionPool thread. The stream's next Read starts only after its message is handled, so each
//   stream's messages are handled one at a time and in order, as before.
// - Send queues the message and starts the write if none is in flight; a stream whose worker stops
//   reading is ended once kMaxQueuedMessages are waiting, instead of growing without bound.
#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "geofp8/v1/geofp8.pb.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/metrics.h"

namespace geofp8::coordinator {

// A few threads that run the session work that may block, first posted first started.
class SessionPool {
 public:
  explicit SessionPool(int threads);
  ~SessionPool();  // runs what was posted, then joins
  void Post(std::function<void()> task);

 private:
  void Loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// Messages a stream may have waiting to be written before it is ended as not reading.
inline constexpr size_t kMaxQueuedMessages = 10000;

// The reactor of one Session call. `authorized` is the call's auth check: not OK finishes the
// call with it at once. The reactor deletes itself when the call is done; `pool` and
// `coordinator` must outlive the server.
grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* NewSessionReactor(
    grpc::CallbackServerContext* ctx, grpc::Status authorized, Coordinator* coordinator,
    Metrics* metrics, SessionPool* pool);

}  // namespace geofp8::coordinator
