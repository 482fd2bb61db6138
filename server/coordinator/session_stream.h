// The coordinator's end of the workers' Session streams, on gRPC's asynchronous API with several
// completion queues.
//
// The synchronous API parks a thread on every open stream's Read. At 10,000 workers that was
// 10,000 threads, and handing each heartbeat from gRPC's poller to its parked thread and back
// (two context switches a message, more for the ack's Write) took most of the coordinator's two
// cores (docs/benchmarks.md, "Coordinator at 10,000 workers"). The callback API that replaced it
// parks no thread, but a server has one callback queue, and Debian's libgrpc checks every
// completion against the queue's list of outstanding tags, one by one: with 10,000 streams, each
// holding a read and its call's done tag, that scan of ~20,000 entries ran for every message and
// took a third of the coordinator's samples on one thread (docs/benchmarks.md, "Session streams
// on several completion queues"). Here the streams are spread over kSessionQueues completion
// queues, each with its own thread, so each scan is that many times shorter and both cores serve
// the streams. No thread belongs to a stream:
// - A heartbeat is handled on the queue thread that read it: it takes only the registry's
//   liveness lock, and its ack is queued on the stream.
// - Every other message may wait for the coordinator's lock and a store commit, so it runs on a
//   SessionPool thread. The stream's next Read starts only after its message is handled, so each
//   stream's messages are handled one at a time and in order.
// - Send queues the message and starts the write if none is in flight; a stream whose worker stops
//   reading is ended once kMaxQueuedMessages are waiting, instead of growing without bound.
#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "geofp8/v1/geofp8.grpc.pb.h"
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

// The write side of a Session call as QueuedSink drives it: the call in the server, a fake in
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

// Completion queues the Session streams are spread over, one thread each (the file comment says
// why several).
inline constexpr int kSessionQueues = 8;

// The Session method of `service` on the asynchronous API: requests calls on the server's
// completion queues and runs each stream until it ends. `authorize` is every call's auth check
// (not OK finishes the call with it at once). `coordinator`, `metrics` and `pool` must outlive
// Stop.
class SessionServer {
 public:
  using Service = v1::WorkerService::WithAsyncMethod_Session<v1::WorkerService::Service>;
  using Authorize = std::function<grpc::Status(grpc::ServerContextBase*)>;

  // `queues` come from grpc::ServerBuilder::AddCompletionQueue, made before BuildAndStart.
  SessionServer(Service* service, std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues,
                Authorize authorize, Coordinator* coordinator, Metrics* metrics, SessionPool* pool);
  ~SessionServer();  // Stop()

  // After BuildAndStart: requests the first calls and starts the queue threads.
  void Start();
  // Call once grpc::Server::Shutdown has begun (it cancels the streams at its deadline): takes no
  // new call, waits until every stream has ended, then shuts the queues down and joins their
  // threads. Idempotent.
  void Stop();

  int open_calls();  // requested or running calls, for tests

  struct Shared;  // what every call reaches (session_stream.cc)

 private:
  std::unique_ptr<Shared> shared_;
  std::vector<std::thread> threads_;
  bool started_ = false;
  bool stopped_ = false;
};

}  // namespace geofp8::coordinator
