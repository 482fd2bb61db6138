// HookService on a Unix socket (see hook_server.h). One mutex orders everything written to the
// streams: a stream that attaches gets the welcome, every policy version and the schedule, and
// a version that arrives meanwhile is written after them, never before.
#include "worker/daemon/hook_server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <optional>

#include "proto/bounds.h"

namespace geofp8::worker {

class HookServer::Service final : public v1::HookService::Service {
 public:
  Service(v1::HookWelcome welcome, std::vector<v1::Policy> policies, RelayFn relay)
      : welcome_(std::move(welcome)),
        policies_(std::move(policies)),
        relay_(std::move(relay)),
        open_(true) {}
  Service(AttachFn on_attach, WithdrawFn on_withdraw)
      : gate_(true), on_attach_(std::move(on_attach)), on_withdraw_(std::move(on_withdraw)) {}

  using Stream = grpc::ServerReaderWriter<v1::HookCommand, v1::HookMessage>;

  // Gate mode: the stream's HookAttach, forwarded, then the wait for its attempt. OK to go on
  // to the welcome; any other status ends the stream.
  grpc::Status Admit(grpc::ServerContext* context, Stream* stream) {
    v1::HookMessage first;
    if (!stream->Read(&first)) return grpc::Status(grpc::StatusCode::CANCELLED, "no attach");
    auto refuse = [&](const std::string& why) {
      v1::HookCommand c;
      c.set_refused(why);
      stream->Write(c);
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, why);
    };
    if (!first.has_attach()) {
      return refuse(
          "this worker runs attach-only (--attach): a program's first message must be "
          "its attach (set GEOFP8_JOB to the external job's name)");
    }
    if (absl::Status b = bounds::Check(first); !b.ok()) return refuse(std::string(b.message()));
    const v1::HookAttach& a = first.attach();
    {
      std::unique_lock<std::mutex> lock(mu_);
      // A launcher's restart can attach before the worker has ended the attempt its last
      // program left (its stream is gone): give the worker a moment to end it.
      cv_.wait_for(lock, std::chrono::seconds(10),
                   [&] { return closed_ || !open_ || !streams_.empty(); });
      if (closed_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "hook server closed");
      if (waiting_ || open_) {
        return refuse("this worker already serves rank " + std::to_string(served_.rank()) +
                      " of job " + served_.job() +
                      ": start one attach-only worker per rank on this node, each with its own "
                      "--hook-socket");
      }
      waiting_ = true;
      refused_.clear();
      served_ = a;
    }
    if (std::string why = on_attach_(a); !why.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      waiting_ = false;
      return refuse(why);
    }
    std::unique_lock<std::mutex> lock(mu_);
    // The claim lives in the coordinator's memory: say it again now and then, so that a
    // coordinator that restarted meanwhile learns it again (a repeat replaces it).
    auto said = std::chrono::steady_clock::now();
    while (waiting_ && refused_.empty() && !closed_ && !context->IsCancelled()) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      if (std::chrono::steady_clock::now() - said >= std::chrono::seconds(5) && waiting_ &&
          refused_.empty()) {
        said = std::chrono::steady_clock::now();
        lock.unlock();
        on_attach_(a);
        lock.lock();
      }
    }
    if (waiting_) {  // not admitted
      waiting_ = false;
      const std::string why = refused_;
      lock.unlock();
      if (!why.empty()) return refuse(why);
      on_withdraw_(a);
      return grpc::Status(grpc::StatusCode::CANCELLED, "the program left before its attempt");
    }
    return grpc::Status::OK;
  }

  grpc::Status Attach(grpc::ServerContext* context, Stream* stream) override {
    if (gate_) {
      if (grpc::Status admitted = Admit(context, stream); !admitted.ok()) return admitted;
    }
    RelayFn relay;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_ || !open_) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "hook server closed");
      }
      relay = relay_;
      v1::HookCommand c;
      *c.mutable_welcome() = welcome_;
      bool ok = stream->Write(c);
      for (const v1::Policy& p : policies_) {
        v1::HookCommand pc;
        *pc.mutable_policy() = p;
        ok = ok && stream->Write(pc);
      }
      if (refresh_) {
        v1::HookCommand rc;
        *rc.mutable_refresh() = *refresh_;
        ok = ok && stream->Write(rc);
      }
      if (!ok) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream closed");
      streams_[stream] = context;
      ++attaches_;
    }
    v1::HookMessage m;
    absl::Status bounded;
    // A message past its bounds (proto/bounds.h) ends the stream naming the field; nothing of it
    // is relayed to the coordinator, which would end the worker's session for it.
    while (stream->Read(&m) && (bounded = bounds::Check(m)).ok()) relay(m);
    std::lock_guard<std::mutex> lock(mu_);
    streams_.erase(stream);
    cv_.notify_all();
    if (!bounded.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(bounded.message()));
    }
    return grpc::Status::OK;
  }

  void Broadcast(const v1::HookCommand& c) {
    std::lock_guard<std::mutex> lock(mu_);
    if (c.has_policy()) {
      for (const auto& p : policies_) {
        if (p.version() == c.policy().version()) return;  // a repeat
      }
      policies_.push_back(c.policy());
    }
    if (c.has_refresh()) refresh_ = c.refresh();
    for (auto& [s, ctx] : streams_) s->Write(c);  // a broken stream ends its Attach on its own
  }

  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }

  bool Open(v1::HookWelcome welcome, std::vector<v1::Policy> policies, RelayFn relay) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!waiting_ || closed_) return false;
    welcome_ = std::move(welcome);
    policies_ = std::move(policies);
    relay_ = std::move(relay);
    refresh_.reset();
    attaches_ = 0;
    open_ = true;
    waiting_ = false;
    cv_.notify_all();
    return true;
  }

  void Refuse(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (waiting_) refused_ = reason.empty() ? "refused" : reason;
    cv_.notify_all();
  }

  void Write(const v1::HookCommand& c) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [s, ctx] : streams_) s->Write(c);
  }

  void EndAttempt(std::chrono::milliseconds grace) {
    std::unique_lock<std::mutex> lock(mu_);
    open_ = false;
    cv_.notify_all();
    relay_ = [](const v1::HookMessage&) {};
    if (!cv_.wait_for(lock, grace, [&] { return streams_.empty(); })) {
      for (auto& [s, ctx] : streams_) ctx->TryCancel();
      cv_.wait_for(lock, std::chrono::seconds(5), [&] { return streams_.empty(); });
    }
  }

  bool waiting() const {
    std::lock_guard<std::mutex> lock(mu_);
    return waiting_;
  }

  int attached() const {
    std::lock_guard<std::mutex> lock(mu_);
    return int(streams_.size());
  }

  int64_t attaches() const {
    std::lock_guard<std::mutex> lock(mu_);
    return attaches_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  v1::HookWelcome welcome_;
  std::vector<v1::Policy> policies_;
  std::optional<v1::RefreshSchedules> refresh_;
  RelayFn relay_;
  bool closed_ = false;
  int64_t attaches_ = 0;
  std::map<Stream*, grpc::ServerContext*> streams_;
  // Gate mode: the program waiting for its attempt (waiting_), what it attached as, and why the
  // coordinator refused it; open_ while an attempt is open (always, outside gate mode).
  const bool gate_ = false;
  AttachFn on_attach_;
  WithdrawFn on_withdraw_;
  bool waiting_ = false;
  bool open_ = false;
  std::string refused_;
  v1::HookAttach served_;
};

absl::StatusOr<std::unique_ptr<HookServer>> HookServer::Start(const std::string& socket_path,
                                                              v1::HookWelcome welcome,
                                                              std::vector<v1::Policy> policies,
                                                              RelayFn relay) {
  std::unique_ptr<HookServer> s(new HookServer());
  s->path_ = socket_path;
  s->address_ = "unix:" + socket_path;
  ::unlink(socket_path.c_str());
  s->service_ =
      std::make_unique<Service>(std::move(welcome), std::move(policies), std::move(relay));
  grpc::ServerBuilder b;
  b.AddListeningPort(s->address_, grpc::InsecureServerCredentials());
  b.RegisterService(s->service_.get());
  s->server_ = b.BuildAndStart();
  if (!s->server_) {
    return absl::UnavailableError("hook channel: cannot serve on " + s->address_);
  }
  ::chmod(socket_path.c_str(), 0600);  // the program runs as the worker's user
  return s;
}

absl::StatusOr<std::unique_ptr<HookServer>> HookServer::StartGate(const std::string& socket_path,
                                                                  AttachFn on_attach,
                                                                  WithdrawFn on_withdraw) {
  std::unique_ptr<HookServer> s(new HookServer());
  s->path_ = socket_path;
  s->address_ = "unix:" + socket_path;
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(socket_path).parent_path(), ec);
  ::unlink(socket_path.c_str());
  s->service_ = std::make_unique<Service>(std::move(on_attach), std::move(on_withdraw));
  grpc::ServerBuilder b;
  b.AddListeningPort(s->address_, grpc::InsecureServerCredentials());
  b.RegisterService(s->service_.get());
  s->server_ = b.BuildAndStart();
  if (!s->server_) {
    return absl::UnavailableError("--hook-socket: cannot serve on " + s->address_);
  }
  // The launcher's processes may run as another user (a sidecar's pod): the token, not the
  // socket's mode, proves that a rank belongs to the job (docs/launchers.md).
  ::chmod(socket_path.c_str(), 0666);
  return s;
}

bool HookServer::Open(v1::HookWelcome welcome, std::vector<v1::Policy> policies, RelayFn relay) {
  return service_->Open(std::move(welcome), std::move(policies), std::move(relay));
}

void HookServer::Refuse(const std::string& reason) { service_->Refuse(reason); }

void HookServer::Stop(const v1::HookStop& stop) {
  v1::HookCommand c;
  *c.mutable_stop() = stop;
  service_->Write(c);
}

void HookServer::EndAttempt(std::chrono::milliseconds grace) { service_->EndAttempt(grace); }

bool HookServer::waiting() const { return service_->waiting(); }

HookServer::~HookServer() { Shutdown(); }

void HookServer::OfferPolicy(const v1::Policy& policy) {
  v1::HookCommand c;
  *c.mutable_policy() = policy;
  service_->Broadcast(c);
}

void HookServer::OfferRefresh(const v1::RefreshSchedules& refresh) {
  v1::HookCommand c;
  *c.mutable_refresh() = refresh;
  service_->Broadcast(c);
}

void HookServer::Shutdown() {
  if (shut_) return;
  shut_ = true;
  service_->Close();
  // Open streams are cancelled at the deadline: their Read fails and Attach returns.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  server_->Wait();
  ::unlink(path_.c_str());
}

int HookServer::attached() const { return service_->attached(); }

int64_t HookServer::attaches() const { return service_->attaches(); }

}  // namespace geofp8::worker
