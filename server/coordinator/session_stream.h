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
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "geofp8/v1/geofp8.pb.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/metrics.h"
#include "server/coordinator/session.h"

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

// The write side of a Session call as QueuedSink drives it: the reactor in the server, a fake in
// tests. Write starts one write (its completion is QueuedSink::WriteDone), Close finishes the
// call, Cancel cancels it (the pending Read fails, and the call ends).
class StreamWriter {
 public:
  virtual ~StreamWriter() = default;
  virtual void Write(const v1::CoordinatorMessage* message) = 0;
  virtual void Close(const grpc::Status& status) = 0;
  virtual void Cancel() = 0;
};

// The write side of one stream, shared with the coordinator (which holds it as the worker's
// SessionSink, possibly after the call is done). One write is in flight at a time; the rest wait
// in order, at most kMaxQueuedMessages of them: the next Send cancels the call instead (the
// worker reconnects and is sent its state again). Close is sent once the queue has drained, so a
// Stop queued before the stream ends (a fenced generation's) still reaches the worker.
class QueuedSink final : public SessionSink {
 public:
  QueuedSink(StreamWriter* writer, std::string worker)
      : writer_(writer), worker_(std::move(worker)) {}

  void Send(const v1::CoordinatorMessage& message) override;
  void End() override;
  // The write in flight completed. Starts the next one, or the deferred Close.
  void WriteDone(bool ok);
  // No message is accepted after this; Close(status) is sent once the queue has drained.
  void FinishWhenDrained(grpc::Status status);
  // The call is done: the writer is gone.
  void Detach();

  size_t queued();  // for tests

 private:
  std::mutex mu_;
  StreamWriter* writer_;
  const std::string worker_;
  std::deque<v1::CoordinatorMessage> queue_;
  bool writing_ = false;
  bool closing_ = false;
  std::optional<grpc::Status> finish_;
};

// The reactor of one Session call. `authorized` is the call's auth check: not OK finishes the
// call with it at once. The reactor deletes itself when the call is done; `pool` and
// `coordinator` must outlive the server.
grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* NewSessionReactor(
    grpc::CallbackServerContext* ctx, grpc::Status authorized, Coordinator* coordinator,
    Metrics* metrics, SessionPool* pool);

}  // namespace geofp8::coordinator
