#include "server/coordinator/session_stream.h"

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "platform/common/log.h"
#include "proto/bounds.h"
#include "server/coordinator/grpc_status.h"
#include "server/coordinator/session.h"

namespace geofp8::coordinator {

SessionPool::SessionPool(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

SessionPool::~SessionPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void SessionPool::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void SessionPool::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, and everything posted has run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void QueuedSink::Send(const v1::CoordinatorMessage& message) {
  const v1::CoordinatorMessage* start = nullptr;
  StreamWriter* writer = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_ || !writer_) return;
    writer = writer_;
    if (queue_.size() >= kMaxQueuedMessages) {
      // The worker does not read its stream: end it rather than hold its messages without bound.
      closing_ = true;
      log::Warn("session.overflow")
          .F("worker", worker_)
          .F("queued", queue_.size())
          .Msg("the worker is not reading its session stream; ending it");
      writer_->Cancel();
      return;
    }
    queue_.push_back(message);
    if (!writing_) {
      writing_ = true;
      start = &queue_.front();
    }
  }
  // Outside mu_: a reaction may run on this thread. Only this thread may touch front() until
  // WriteDone, and a deque keeps references to its elements across push_back.
  if (start) writer->Write(start);
}

void QueuedSink::End() {
  std::lock_guard<std::mutex> lock(mu_);
  if (writer_) writer_->Cancel();
}

void QueuedSink::WriteDone(bool ok) {
  const v1::CoordinatorMessage* next = nullptr;
  std::optional<grpc::Status> finish;
  StreamWriter* writer = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    writer = writer_;
    queue_.pop_front();
    if (!ok) queue_.clear();  // the stream is broken; the Read fails too
    if (!queue_.empty()) {
      next = &queue_.front();
    } else {
      writing_ = false;
      if (finish_) finish = std::exchange(finish_, std::nullopt);
    }
  }
  if (!writer) return;
  if (next) writer->Write(next);
  if (finish) writer->Close(*finish);
}

void QueuedSink::FinishWhenDrained(grpc::Status status) {
  bool now = false;
  StreamWriter* writer = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    writer = writer_;
    closing_ = true;
    if (writing_) {
      finish_ = std::move(status);
    } else {
      now = true;
    }
  }
  if (now && writer) writer->Close(status);
}

void QueuedSink::Detach() {
  std::lock_guard<std::mutex> lock(mu_);
  closing_ = true;
  writer_ = nullptr;
  queue_.clear();
}

size_t QueuedSink::queued() {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

struct SessionServer::Shared {
  Shared(Service* service, std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues,
         Authorize authorize, Coordinator* c, Metrics* m, SessionPool* pool)
      : service(service),
        queues(std::move(queues)),
        authorize(std::move(authorize)),
        c(c),
        m(m),
        pool(pool) {}
  Service* service;
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues;
  Authorize authorize;
  Coordinator* c;
  Metrics* m;
  SessionPool* pool;

  std::mutex mu;
  std::condition_variable idle;  // open == 0
  int open = 0;                  // SessionCalls alive: requested, running or finishing
  bool stopping = false;         // no new call is requested
};

namespace {

// Calls requested ahead on each queue, so a cold start of thousands of workers is accepted
// without waiting for each acceptance to request the next.
constexpr int kRequestsPerQueue = 16;

class SessionCall;

// A completion-queue tag: one kind of operation of one call.
struct Op {
  enum Kind { kRequest, kRead, kWrite, kFinish, kDone };
  SessionCall* call;
  Kind kind;
};

// One Session call, from its request to the end of its last operation. Each operation counts in
// pending_ from its start to its completion; the call deletes itself once nothing is pending and
// either it never started (the server shut down first) or its Finish has completed (the done
// tag, counted from the start, has then come too). At most one Read and one Write or Finish are
// in flight, as the asynchronous API requires: reads start only after a message is handled, and
// QueuedSink starts one write at a time and the Finish once its queue has drained.
class SessionCall final : public StreamWriter {
 public:
  // Requests a new call on `cq` unless the server is stopping.
  static void Request(SessionServer::Shared* s, grpc::ServerCompletionQueue* cq) {
    {
      std::lock_guard<std::mutex> lock(s->mu);
      if (s->stopping) return;
      ++s->open;
    }
    new SessionCall(s, cq);
  }

  // On the queue's thread: an operation of this call completed.
  void Completed(Op::Kind kind, bool ok) {
    switch (kind) {
      case Op::kRequest:
        Accepted(ok);
        break;
      case Op::kRead:
        ReadDone(ok);
        break;
      case Op::kWrite:
        sink_->WriteDone(ok);
        break;
      case Op::kFinish:
      case Op::kDone:
        break;
    }
    Release();
  }

  // StreamWriter, from QueuedSink (one write or the finish at a time).
  void Write(const v1::CoordinatorMessage* message) override {
    Acquire(false);
    stream_.Write(*message, &write_op_);
  }
  void Close(const grpc::Status& status) override { Finish(status); }
  void Cancel() override { ctx_.TryCancel(); }

 private:
  SessionCall(SessionServer::Shared* s, grpc::ServerCompletionQueue* cq)
      : s_(s), cq_(cq), stream_(&ctx_) {
    ctx_.AsyncNotifyWhenDone(&done_op_);
    pending_ = 1;  // the request; the done tag comes only for a call that started
    s_->service->RequestSession(&ctx_, &stream_, cq_, cq_, &request_op_);
  }

  void Accepted(bool ok) {
    if (!ok) return;  // the server is shutting down: the call never started
    Acquire(false);   // the done tag
    {
      std::lock_guard<std::mutex> lock(mu_);
      started_ = true;
    }
    Request(s_, cq_);  // the next call on this queue
    grpc::Status authorized = s_->authorize(&ctx_);
    if (!authorized.ok()) {
      s_->m->RecordRpc("WorkerService/Session", "UNAUTHENTICATED", 0);
      Finish(authorized);
      return;
    }
    Read();
  }

  void ReadDone(bool ok) {
    if (!ok) {
      if (!sink_) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "session: stream ended before the first message"));
        return;
      }
      s_->pool->Post([this] { End(absl::OkStatus()); });
      return;
    }
    // A message past its bounds (proto/bounds.h) ends the stream, naming the field.
    if (absl::Status bounded = bounds::Check(in_); !bounded.ok()) {
      if (!sink_) {
        Finish(ToGrpc(bounded));
      } else {
        s_->pool->Post([this, bounded] { End(bounded); });
      }
      return;
    }
    if (!sink_) {
      read_at_ = std::chrono::steady_clock::now();
      s_->pool->Post([this] { Open(); });
      return;
    }
    // A heartbeat takes only the registry's liveness lock: handled here, on the queue's thread.
    if (in_.body_case() == v1::WorkerMessage::kHeartbeat) {
      Handle();
    } else {
      s_->pool->Post([this] { Handle(); });
    }
  }

  // The first message: the stream belongs to the (worker, generation) it names and proves with
  // the generation's secret; every later message must name the same one.
  void Open() {
    id_ = in_.worker_id();
    generation_ = in_.generation();
    sink_ = std::make_shared<QueuedSink>(this, id_);
    absl::Status status = s_->c->OpenSession(id_, generation_, in_.session_secret(), sink_);
    if (!status.ok()) {
      if (status.code() == absl::StatusCode::kPermissionDenied) {
        log::Warn("session.refused")
            .F("peer", ctx_.peer())
            .F("worker", id_)
            .Msg(std::string(status.message()));
      }
      End(status);
      return;
    }
    // The hello waited for a pool thread and the coordinator's lock: at a cold start of
    // thousands, that wait is the coordinator's lag, and no heartbeat has measured it yet.
    s_->c->RecordHandlingLag(std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::steady_clock::now() - read_at_)
                                 .count());
    Handle();
  }

  // Handles in_ (timed on its own: that is the latency a worker's heartbeat sees), then reads
  // the next message or ends the stream.
  void Handle() {
    const auto start = std::chrono::steady_clock::now();
    absl::Status status;
    if (in_.worker_id() != id_ || in_.generation() != generation_) {
      status = absl::PermissionDeniedError("session: this stream belongs to worker " + id_ +
                                           " generation " + std::to_string(generation_) +
                                           "; a message named worker " + in_.worker_id() +
                                           " generation " + std::to_string(in_.generation()));
      log::Warn("session.refused")
          .F("peer", ctx_.peer())
          .F("worker", id_)
          .Msg(std::string(status.message()));
    } else {
      status = s_->c->HandleWorkerMessage(in_);
    }
    s_->m->RecordRpc(
        "WorkerService/Session", absl::StatusCodeToString(status.code()),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (status.ok()) {
      Read();
    } else if (in_.body_case() == v1::WorkerMessage::kHeartbeat) {
      s_->pool->Post([this, status] { End(status); });  // End takes the coordinator's lock
    } else {
      End(status);
    }
  }

  void End(const absl::Status& status) {
    s_->c->CloseSession(id_, generation_, sink_);
    sink_->FinishWhenDrained(ToGrpc(status));
  }

  void Read() {
    Acquire(false);
    stream_.Read(&in_, &read_op_);
  }

  void Finish(const grpc::Status& status) {
    Acquire(true);
    stream_.Finish(status, &finish_op_);
  }

  void Acquire(bool finish) {
    std::lock_guard<std::mutex> lock(mu_);
    ++pending_;
    if (finish) finishing_ = true;
  }

  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ > 0 || (started_ && !finishing_)) return;
    }
    if (sink_) sink_->Detach();
    Retire(s_);
    delete this;
  }

  static void Retire(SessionServer::Shared* s) {
    std::lock_guard<std::mutex> lock(s->mu);
    if (--s->open == 0) s->idle.notify_all();
  }

  SessionServer::Shared* s_;
  grpc::ServerCompletionQueue* cq_;
  grpc::ServerContext ctx_;
  grpc::ServerAsyncReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage> stream_;
  Op request_op_{this, Op::kRequest};
  Op read_op_{this, Op::kRead};
  Op write_op_{this, Op::kWrite};
  Op finish_op_{this, Op::kFinish};
  Op done_op_{this, Op::kDone};

  std::mutex mu_;
  int pending_ = 0;
  bool started_ = false;
  bool finishing_ = false;

  v1::WorkerMessage in_;
  std::string id_;
  uint64_t generation_ = 0;
  std::shared_ptr<QueuedSink> sink_;
  std::chrono::steady_clock::time_point read_at_;  // when the first message was read
};

}  // namespace

SessionServer::SessionServer(Service* service,
                             std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues,
                             Authorize authorize, Coordinator* coordinator, Metrics* metrics,
                             SessionPool* pool)
    : shared_(std::make_unique<Shared>(service, std::move(queues), std::move(authorize),
                                       coordinator, metrics, pool)) {}

SessionServer::~SessionServer() { Stop(); }

void SessionServer::Start() {
  started_ = true;
  for (auto& cq : shared_->queues) {
    for (int i = 0; i < kRequestsPerQueue; ++i) SessionCall::Request(shared_.get(), cq.get());
    threads_.emplace_back([cq = cq.get()] {
      void* tag = nullptr;
      bool ok = false;
      while (cq->Next(&tag, &ok)) {
        Op* op = static_cast<Op*>(tag);
        op->call->Completed(op->kind, ok);
      }
    });
  }
}

void SessionServer::Stop() {
  if (stopped_) return;
  stopped_ = true;
  {
    std::unique_lock<std::mutex> lock(shared_->mu);
    shared_->stopping = true;
    // The server's shutdown fails the requested calls and cancels the running ones at its
    // deadline; each then finishes through its queue (and the pool) and retires.
    if (started_) shared_->idle.wait(lock, [&] { return shared_->open == 0; });
  }
  for (auto& cq : shared_->queues) cq->Shutdown();
  for (auto& t : threads_) t.join();
  // Drain what a queue that never had a thread still holds (none once Start ran).
  if (!started_) {
    for (auto& cq : shared_->queues) {
      void* tag = nullptr;
      bool ok = false;
      while (cq->Next(&tag, &ok)) {
      }
    }
  }
}

int SessionServer::open_calls() {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->open;
}

}  // namespace geofp8::coordinator
