// HookService on a Unix socket (see hook_server.h). One mutex orders everything written to the
// streams: a stream that attaches gets the welcome, every policy version and the schedule, and
// a version that arrives meanwhile is written after them, never before.
#include "worker/daemon/hook_server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>

#include "proto/bounds.h"

namespace geofp8::worker {

class HookServer::Service final : public v1::HookService::Service {
 public:
  Service(v1::HookWelcome welcome, std::vector<v1::Policy> policies, RelayFn relay)
      : welcome_(std::move(welcome)), policies_(std::move(policies)), relay_(std::move(relay)) {}

  grpc::Status Attach(grpc::ServerContext*,
                      grpc::ServerReaderWriter<v1::HookCommand, v1::HookMessage>* stream) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "hook server closed");
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
      streams_.insert(stream);
      ++attaches_;
    }
    v1::HookMessage m;
    absl::Status bounded;
    // A message past its bounds (proto/bounds.h) ends the stream naming the field; nothing of it
    // is relayed to the coordinator, which would end the worker's session for it.
    while (stream->Read(&m) && (bounded = bounds::Check(m)).ok()) relay_(m);
    std::lock_guard<std::mutex> lock(mu_);
    streams_.erase(stream);
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
    for (auto* s : streams_) s->Write(c);  // a broken stream ends its Attach on its own
  }

  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
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
  v1::HookWelcome welcome_;
  std::vector<v1::Policy> policies_;
  std::optional<v1::RefreshSchedules> refresh_;
  RelayFn relay_;
  bool closed_ = false;
  int64_t attaches_ = 0;
  std::set<grpc::ServerReaderWriter<v1::HookCommand, v1::HookMessage>*> streams_;
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
