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

namespace {

using Reactor = grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>;

class SessionReactor final : public Reactor, public StreamWriter {
 public:
  SessionReactor(grpc::CallbackServerContext* ctx, grpc::Status authorized, Coordinator* c,
                 Metrics* m, SessionPool* pool)
      : ctx_(ctx), c_(c), m_(m), pool_(pool) {
    if (!authorized.ok()) {
      m_->RecordRpc("WorkerService/Session", "UNAUTHENTICATED", 0);
      Finish(authorized);
      return;
    }
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (!sink_) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "session: stream ended before the first message"));
        return;
      }
      pool_->Post([this] { End(absl::OkStatus()); });
      return;
    }
    // A message past its bounds (proto/bounds.h) ends the stream, naming the field.
    if (absl::Status bounded = bounds::Check(in_); !bounded.ok()) {
      if (!sink_) {
        Finish(ToGrpc(bounded));
      } else {
        pool_->Post([this, bounded] { End(bounded); });
      }
      return;
    }
    if (!sink_) {
      read_at_ = std::chrono::steady_clock::now();
      pool_->Post([this] { Open(); });
      return;
    }
    // A heartbeat takes only the registry's liveness lock: handled here, on gRPC's thread.
    if (in_.body_case() == v1::WorkerMessage::kHeartbeat) {
      Handle();
    } else {
      pool_->Post([this] { Handle(); });
    }
  }

  void OnWriteDone(bool ok) override { sink_->WriteDone(ok); }

  void Write(const v1::CoordinatorMessage* message) override { StartWrite(message); }
  void Close(const grpc::Status& status) override { Finish(status); }
  void Cancel() override { ctx_->TryCancel(); }

  void OnDone() override {
    if (sink_) sink_->Detach();
    delete this;
  }

 private:
  // The first message: the stream belongs to the (worker, generation) it names and proves with
  // the generation's secret; every later message must name the same one.
  void Open() {
    id_ = in_.worker_id();
    generation_ = in_.generation();
    sink_ = std::make_shared<QueuedSink>(this, id_);
    absl::Status status = c_->OpenSession(id_, generation_, in_.session_secret(), sink_);
    if (!status.ok()) {
      if (status.code() == absl::StatusCode::kPermissionDenied) {
        log::Warn("session.refused")
            .F("peer", ctx_->peer())
            .F("worker", id_)
            .Msg(std::string(status.message()));
      }
      End(status);
      return;
    }
    // The hello waited for a pool thread and the coordinator's lock: at a cold start of
    // thousands, that wait is the coordinator's lag, and no heartbeat has measured it yet.
    c_->RecordHandlingLag(std::chrono::duration_cast<std::chrono::milliseconds>(
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
          .F("peer", ctx_->peer())
          .F("worker", id_)
          .Msg(std::string(status.message()));
    } else {
      status = c_->HandleWorkerMessage(in_);
    }
    m_->RecordRpc("WorkerService/Session", absl::StatusCodeToString(status.code()),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (status.ok()) {
      StartRead(&in_);
    } else if (in_.body_case() == v1::WorkerMessage::kHeartbeat) {
      pool_->Post([this, status] { End(status); });  // End takes the coordinator's lock
    } else {
      End(status);
    }
  }

  void End(const absl::Status& status) {
    c_->CloseSession(id_, generation_, sink_);
    sink_->FinishWhenDrained(ToGrpc(status));
  }

  grpc::CallbackServerContext* ctx_;
  Coordinator* c_;
  Metrics* m_;
  SessionPool* pool_;
  v1::WorkerMessage in_;
  std::string id_;
  uint64_t generation_ = 0;
  std::shared_ptr<QueuedSink> sink_;
  std::chrono::steady_clock::time_point read_at_;  // when the first message was read
};

}  // namespace

Reactor* NewSessionReactor(grpc::CallbackServerContext* ctx, grpc::Status authorized,
                           Coordinator* coordinator, Metrics* metrics, SessionPool* pool) {
  return new SessionReactor(ctx, std::move(authorized), coordinator, metrics, pool);
}

}  // namespace geofp8::coordinator
