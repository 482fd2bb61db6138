// Session client (see session.h). One thread owns the stream's reads and its lifecycle; the
// heartbeat thread and the job runner write through Send under write_mu_.
#include "worker/daemon/session.h"

#include "worker/daemon/log.h"

namespace geofp8::worker {

using std::chrono::milliseconds;

SessionClient::SessionClient(std::shared_ptr<Connection> connection, SessionOptions options,
                             SessionEvents events)
    : connection_(std::move(connection)),
      options_(std::move(options)),
      events_(std::move(events)),
      stub_(v1::WorkerService::NewStub(connection_->channel())) {}

SessionClient::~SessionClient() { Stop(); }

void SessionClient::Start() {
  thread_ = std::thread([this] { Loop(); });
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
}

void SessionClient::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
    if (context_) context_->TryCancel();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (heartbeat_.joinable()) heartbeat_.join();
}

std::string SessionClient::worker_id() const {
  std::lock_guard<std::mutex> lock(mu_);
  return worker_id_;
}

bool SessionClient::WaitConnected(milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return connected_.load() || stop_; }) &&
         connected_.load();
}

bool SessionClient::SleepUnlessStopped(milliseconds d) {
  std::unique_lock<std::mutex> lock(mu_);
  return !cv_.wait_for(lock, d, [&] { return stop_; });
}

bool SessionClient::Send(v1::WorkerMessage message, bool reliable) {
  std::lock_guard<std::mutex> write_lock(write_mu_);
  grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>* stream = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    message.set_worker_id(worker_id_);
    message.set_generation(generation_.load());
    message.set_seq(++seq_);
    message.set_want_ack(reliable);
    if (connected_.load()) stream = stream_.get();
    if (!stream) {
      if (reliable) {
        unsent_.push_back(std::move(message));
      } else {
        ++counters_.send_failures;
      }
      return false;
    }
    // Kept before the write: the Ack may come back before Write returns.
    if (reliable) unacked_.push_back(message);
    if (reliable && !debug_broke_ && !options_.debug_break_stream_on.empty() &&
        ((options_.debug_break_stream_on == "finished" && message.has_finished()) ||
         (options_.debug_break_stream_on == "checkpoint" && message.has_checkpoint()))) {
      debug_broke_ = true;
      Log("debug: losing this " + options_.debug_break_stream_on +
          " message on the wire and breaking the stream");
      if (context_) context_->TryCancel();
      return true;
    }
  }
  if (!stream->Write(message)) {
    // A reliable message stays in unacked_ and goes out again on the next stream.
    ++counters_.send_failures;
    return false;
  }
  return true;
}

bool SessionClient::Leave(const std::string& reason, milliseconds timeout) {
  v1::LeaveRequest req;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_id_.empty()) return false;  // never registered: nothing to leave
    req.set_worker_id(worker_id_);
    req.set_session_secret(session_secret_);
  }
  req.set_generation(generation_.load());
  req.set_reason(reason);
  v1::LeaveResponse resp;
  const grpc::Status s = stub_->Leave(connection_->Context(timeout).get(), req, &resp);
  if (!s.ok()) {
    Log("leave: " + DescribeStatus(s) + " (the coordinator finds out by the heartbeat timeout)");
    return false;
  }
  log::Info("worker.left")
      .F("generation", generation_.load())
      .Msg("left the coordinator (" + reason + ")");
  return true;
}

bool SessionClient::Register(std::string* error) {
  v1::RegisterRequest req;
  req.set_name(options_.name);
  req.set_host(options_.host);
  req.set_device(options_.device);
  req.set_memory_bytes(options_.memory_bytes);
  req.set_accepts_commands(options_.accepts_commands);
  req.set_attach_only(options_.attach_only);
  if (events_.held_checkpoints) {
    for (auto& h : events_.held_checkpoints()) *req.add_checkpoints() = std::move(h);
  }
  v1::RegisterResponse resp;
  grpc::Status s = stub_->Register(connection_->Context(options_.rpc_timeout).get(), req, &resp);
  if (!s.ok()) {
    *error = DescribeStatus(s);
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    worker_id_ = resp.worker_id();
    session_secret_ = resp.session_secret();
    generation_ = resp.generation();
    if (resp.heartbeat_interval_ms() > 0)
      heartbeat_interval_ = milliseconds(resp.heartbeat_interval_ms());
    if (resp.heartbeat_timeout_ms() > 0) heartbeat_timeout_ms_ = resp.heartbeat_timeout_ms();
    unsent_.clear();  // they belonged to the previous generation
    unacked_.clear();
  }
  ++counters_.registrations;
  log::Info("worker.registered")
      .F("coordinator", connection_->address())
      .F("worker_id", resp.worker_id())
      .F("generation", resp.generation())
      .F("heartbeat_ms", resp.heartbeat_interval_ms())
      .Msg("registered with " + connection_->address() + " as " + resp.worker_id() +
           " generation " + std::to_string(resp.generation()) + " (heartbeat every " +
           std::to_string(resp.heartbeat_interval_ms()) + " ms)");
  return true;
}

grpc::Status SessionClient::RunStream() {
  auto ctx = connection_->Context(milliseconds(0));
  // While the coordinator is down, the channel retries the connection on its own backoff and
  // fails calls fast in between; a session opened then would wait for our next try as well, up
  // to twice the backoff. Waiting for the channel instead opens the stream as soon as the
  // coordinator is back. Stop() cancels the wait.
  ctx->set_wait_for_ready(true);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return grpc::Status(grpc::StatusCode::CANCELLED, "stopping");
    context_ = ctx.get();
  }
  auto stream = stub_->Session(ctx.get());
  // The first message names (worker_id, generation): a heartbeat.
  v1::WorkerMessage hello;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hello.set_worker_id(worker_id_);
    hello.set_generation(generation_.load());
    hello.set_session_secret(session_secret_);
    hello.set_seq(++seq_);
    hello.mutable_heartbeat()->set_unix_ms(std::chrono::duration_cast<milliseconds>(
                                               std::chrono::system_clock::now().time_since_epoch())
                                               .count());
  }
  if (stream->Write(hello)) {
    std::deque<v1::WorkerMessage> backlog;
    {
      std::lock_guard<std::mutex> write_lock(write_mu_);
      std::lock_guard<std::mutex> lock(mu_);
      stream_ = std::move(stream);
      connected_ = true;
      backlog.swap(unsent_);
      // Reliable messages not acknowledged on the last stream, or queued while disconnected, go
      // out first, in order. They stay unacknowledged until the coordinator says otherwise.
      for (auto& m : backlog) {
        m.set_seq(++seq_);
        unacked_.push_back(m);
      }
      if (!backlog.empty()) {
        counters_.resent += backlog.size();
        Log("resending " + std::to_string(backlog.size()) +
            " reliable message(s) not acknowledged before the stream reopened");
      }
      for (const auto& m : backlog) {
        if (!stream_->Write(m)) break;
      }
    }
    cv_.notify_all();
    if (events_.on_connected) events_.on_connected(generation_.load());
    v1::CoordinatorMessage message;
    for (;;) {
      grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>* s;
      {
        std::lock_guard<std::mutex> lock(mu_);
        s = stream_.get();
      }
      if (!s->Read(&message)) break;
      if (message.has_ack()) {
        ++counters_.acks;
        {
          std::lock_guard<std::mutex> lock(mu_);
          for (auto it = unacked_.begin(); it != unacked_.end(); ++it) {
            if (it->seq() == message.ack().seq()) {
              unacked_.erase(it);
              break;
            }
          }
        }
        // A checkpoint's Ack carries the job's recovery point, for the rank to prune.
        if (message.ack().job_id().empty()) continue;
      }
      if (events_.on_message) events_.on_message(message);
    }
    std::lock_guard<std::mutex> write_lock(write_mu_);
    std::lock_guard<std::mutex> lock(mu_);
    connected_ = false;
    stream = std::move(stream_);
    // What this stream never acknowledged may not have arrived: it goes first on the next one.
    unsent_.insert(unsent_.begin(), std::make_move_iterator(unacked_.begin()),
                   std::make_move_iterator(unacked_.end()));
    unacked_.clear();
  }
  grpc::Status status = stream->Finish();
  std::lock_guard<std::mutex> lock(mu_);
  context_ = nullptr;
  return status;
}

void SessionClient::Loop() {
  milliseconds backoff = options_.backoff_initial;
  bool need_register = true;
  bool opened_before = false;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) break;
    }
    if (need_register) {
      std::string error;
      if (!Register(&error)) {
        log::Warn("worker.register_failed")
            .F("coordinator", connection_->address())
            .F("retry_ms", int64_t(backoff.count()))
            .Msg("register with " + connection_->address() + " failed: " + error +
                 "; retrying in " + std::to_string(backoff.count()) + " ms");
        if (!SleepUnlessStopped(backoff)) break;
        backoff = std::min(backoff * 2, options_.backoff_max);
        continue;
      }
      need_register = false;
    }
    const auto opened = std::chrono::steady_clock::now();
    if (opened_before) ++counters_.reconnects;
    opened_before = true;
    grpc::Status status = RunStream();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) break;
    }
    // A stream that stayed up a while resets the backoff: the failure is new.
    if (std::chrono::steady_clock::now() - opened > std::chrono::seconds(5)) {
      backoff = options_.backoff_initial;
    }
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
        status.error_code() == grpc::StatusCode::PERMISSION_DENIED ||
        status.error_code() == grpc::StatusCode::NOT_FOUND) {
      ++counters_.generations_lost;
      const std::string reason = "session rejected: " + DescribeStatus(status);
      log::Warn("worker.session_rejected").Msg(reason + "; registering again");
      if (events_.on_generation_lost) events_.on_generation_lost(reason);
      need_register = true;
      continue;
    }
    log::Warn("worker.session_lost")
        .F("coordinator", connection_->address())
        .F("retry_ms", int64_t(backoff.count()))
        .Msg("session with " + connection_->address() + " ended: " + DescribeStatus(status) +
             "; reconnecting in " + std::to_string(backoff.count()) + " ms");
    if (!SleepUnlessStopped(backoff)) break;
    backoff = std::min(backoff * 2, options_.backoff_max);
  }
  connected_ = false;
}

void SessionClient::HeartbeatLoop() {
  for (;;) {
    milliseconds interval;
    {
      std::lock_guard<std::mutex> lock(mu_);
      interval = heartbeat_interval_;
    }
    if (!SleepUnlessStopped(interval)) return;
    if (!connected_.load()) continue;
    v1::WorkerMessage m;
    m.mutable_heartbeat()->set_unix_ms(std::chrono::duration_cast<milliseconds>(
                                           std::chrono::system_clock::now().time_since_epoch())
                                           .count());
    if (Send(std::move(m))) ++counters_.heartbeats_sent;
  }
}

}  // namespace geofp8::worker
