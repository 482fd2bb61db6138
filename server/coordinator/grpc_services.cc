// gRPC adapters: each method checks auth, calls the handler, converts absl::Status to
// grpc::Status (the codes map one to one) and records the call. No logic lives here.
#include "server/coordinator/grpc_services.h"

#include <google/protobuf/stubs/logging.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/support/server_interceptor.h>
#include <malloc.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "geofp8/v1/geofp8.grpc.pb.h"
#include "platform/common/log.h"
#include "proto/bounds.h"
#include "server/coordinator/grpc_status.h"
#include "server/coordinator/secrets.h"
#include "server/coordinator/session_stream.h"

namespace geofp8::coordinator {
namespace {

// Protobuf rejects a request whose string field holds invalid UTF-8 before any handler runs, and
// gRPC then answers INTERNAL with an empty message. Protobuf names the field only in a log line:
// the log handler keeps that name for the thread (the sync server parses the request and sends
// its status on one thread), and the interceptor turns the answer into INVALID_ARGUMENT naming it.
thread_local std::string t_invalid_utf8_field;

// A request refused by its bounds at least this large is followed by malloc_trim (about a
// millisecond, small next to receiving such a request).
constexpr size_t kTrimAfterRefusedBytes = size_t{64} << 10;

void ProtobufLog(google::protobuf::LogLevel level, const char* file, int line,
                 const std::string& message) {
  static const std::string kPrefix = "String field '";
  if (message.rfind(kPrefix, 0) == 0 &&
      message.find("invalid UTF-8 data when parsing") != std::string::npos) {
    std::string field =
        message.substr(kPrefix.size(), message.find('\'', kPrefix.size()) - kPrefix.size());
    if (field.rfind("geofp8.v1.", 0) == 0) field.erase(0, 10);
    t_invalid_utf8_field = field;
    return;  // the client is told; logging each bad request would let any client flood the log
  }
  static const char* const kLevels[] = {"INFO", "WARNING", "ERROR", "FATAL"};
  std::fprintf(stderr, "[libprotobuf %s %s:%d] %s\n", kLevels[level & 3], file, line,
               message.c_str());
}

class UnparsableRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status s = methods->GetSendStatus();
      if (s.error_code() == grpc::StatusCode::INTERNAL && s.error_message().empty()) {
        const std::string field = std::exchange(t_invalid_utf8_field, "");
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            field.empty() ? "request: not a valid geofp8.v1 message (are all strings UTF-8?)"
                          : field + ": invalid UTF-8 (string fields must be UTF-8)"));
      }
    }
    methods->Proceed();
  }
};

class UnparsableRequestInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo*) override {
    return new UnparsableRequestInterceptor;
  }
};

// Shared by the four services: auth and instrumentation.
class Common {
 public:
  Common(Coordinator* c, Metrics* m, std::string token) : c_(c), m_(m), token_(std::move(token)) {}

  grpc::Status Authorize(grpc::ServerContextBase* ctx) const {
    if (token_.empty()) return grpc::Status::OK;
    const auto& md = ctx->client_metadata();
    auto it = md.find("authorization");
    if (it == md.end()) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "authorization: missing bearer token (this coordinator requires one)");
    }
    if (!SecretEquals("Bearer " + token_, std::string_view(it->second.data(), it->second.size()))) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "authorization: wrong token");
    }
    return grpc::Status::OK;
  }

  // Authorizes (every geofp8.v1 call, reads included: a job's events and reason, its spec and
  // the worker list are the token holder's; only grpc.health.v1 and /metrics are open), checks
  // the request against its bounds (proto/bounds.h: INVALID_ARGUMENT naming the field), runs fn
  // (returning grpc::Status) and records method, code and latency.
  template <typename Fn>
  grpc::Status Call(const char* method, grpc::ServerContext* ctx,
                    const google::protobuf::Message& request, Fn&& fn) {
    const auto start = std::chrono::steady_clock::now();
    grpc::Status s = Authorize(ctx);
    if (!s.ok()) {
      log::Warn("auth.refused").F("peer", ctx->peer()).F("method", method).Msg(s.error_message());
    } else if (absl::Status bounded = bounds::Check(request); !bounded.ok()) {
      s = ToGrpc(bounded);
      // A large refused request leaves its buffers in malloc's free lists, where glibc keeps them
      // (issue #31 item 7): give the free memory back, as SubmitJob does for a refused spec.
      if (request.ByteSizeLong() >= kTrimAfterRefusedBytes) malloc_trim(0);
    } else {
      s = fn();
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    m_->RecordRpc(method, absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())),
                  secs);
    return s;
  }

  template <typename T, typename Out>
  static grpc::Status Reply(absl::StatusOr<T> r, Out* out) {
    if (!r.ok()) return ToGrpc(r.status());
    *out = std::move(*r);
    return grpc::Status::OK;
  }

  Coordinator* c_;
  Metrics* m_;
  std::string token_;
};

class JobServiceImpl final : public v1::JobService::Service {
 public:
  explicit JobServiceImpl(Common* k) : k_(k) {}
  grpc::Status SubmitJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                         v1::SubmitJobResponse* resp) override {
    return k_->Call("JobService/SubmitJob", ctx, *req,
                    [&] { return Common::Reply(k_->c_->SubmitJob(*req), resp); });
  }
  grpc::Status GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                      v1::Job* resp) override {
    return k_->Call("JobService/GetJob", ctx, *req,
                    [&] { return Common::Reply(k_->c_->GetJob(*req), resp); });
  }
  grpc::Status ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                        v1::ListJobsResponse* resp) override {
    return k_->Call("JobService/ListJobs", ctx, *req,
                    [&] { return Common::Reply(k_->c_->ListJobs(*req), resp); });
  }
  grpc::Status CancelJob(grpc::ServerContext* ctx, const v1::CancelJobRequest* req,
                         v1::Job* resp) override {
    return k_->Call("JobService/CancelJob", ctx, *req,
                    [&] { return Common::Reply(k_->c_->CancelJob(*req), resp); });
  }
  grpc::Status WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                        grpc::ServerWriter<v1::WatchJobResponse>* writer) override {
    return k_->Call("JobService/WatchJob", ctx, *req, [&]() -> grpc::Status {
      WatchCursor cursor;
      while (!ctx->IsCancelled()) {
        auto next = k_->c_->WatchNext(req->job_id(), &cursor, 500);
        if (!next.ok()) return ToGrpc(next.status());
        if (!next->has_value()) continue;
        const v1::JobState state = (*next)->job().state();
        if (!writer->Write(**next)) return grpc::Status::OK;  // the client went away
        if (state == v1::JOB_SUCCEEDED || state == v1::JOB_FAILED || state == v1::JOB_CANCELLED) {
          return grpc::Status::OK;
        }
      }
      return grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled by the client");
    });
  }
  grpc::Status DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* req,
                         v1::DeleteJobResponse* resp) override {
    return k_->Call("JobService/DeleteJob", ctx, *req,
                    [&] { return Common::Reply(k_->c_->DeleteJob(*req), resp); });
  }
  // Write blocks while the client is slow (gRPC flow control): that holds back this stream's next
  // read from the worker, and nothing else.
  grpc::Status Logs(grpc::ServerContext* ctx, const v1::LogsRequest* req,
                    grpc::ServerWriter<v1::LogsChunk>* writer) override {
    return k_->Call("JobService/Logs", ctx, *req, [&] {
      return ToGrpc(k_->c_->StreamLogs(
          *req, [&](const v1::LogsChunk& chunk) { return writer->Write(chunk); },
          [&] { return ctx->IsCancelled(); }));
    });
  }

 private:
  Common* k_;
};

class PolicyServiceImpl final : public v1::PolicyService::Service {
 public:
  explicit PolicyServiceImpl(Common* k) : k_(k) {}
  grpc::Status GetPolicy(grpc::ServerContext* ctx, const v1::GetPolicyRequest* req,
                         v1::Policy* resp) override {
    return k_->Call("PolicyService/GetPolicy", ctx, *req,
                    [&] { return Common::Reply(k_->c_->GetPolicy(*req), resp); });
  }
  grpc::Status UpdatePolicy(grpc::ServerContext* ctx, const v1::UpdatePolicyRequest* req,
                            v1::UpdatePolicyResponse* resp) override {
    return k_->Call("PolicyService/UpdatePolicy", ctx, *req,
                    [&] { return Common::Reply(k_->c_->UpdatePolicy(*req), resp); });
  }
  grpc::Status ListPolicyVersions(grpc::ServerContext* ctx,
                                  const v1::ListPolicyVersionsRequest* req,
                                  v1::ListPolicyVersionsResponse* resp) override {
    return k_->Call("PolicyService/ListPolicyVersions", ctx, *req,
                    [&] { return Common::Reply(k_->c_->ListPolicyVersions(*req), resp); });
  }

 private:
  Common* k_;
};

// Session is on the asynchronous API (SessionServer; session_stream.h says why); the unary
// methods stay synchronous.
class WorkerServiceImpl final : public SessionServer::Service {
 public:
  explicit WorkerServiceImpl(Common* k) : k_(k) {}
  grpc::Status Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                        v1::RegisterResponse* resp) override {
    return k_->Call("WorkerService/Register", ctx, *req,
                    [&] { return Common::Reply(k_->c_->Register(*req), resp); });
  }
  grpc::Status Leave(grpc::ServerContext* ctx, const v1::LeaveRequest* req,
                     v1::LeaveResponse*) override {
    return k_->Call("WorkerService/Leave", ctx, *req, [&] { return ToGrpc(k_->c_->Leave(*req)); });
  }
  grpc::Status ListWorkers(grpc::ServerContext* ctx, const v1::ListWorkersRequest* req,
                           v1::ListWorkersResponse* resp) override {
    return k_->Call("WorkerService/ListWorkers", ctx, *req,
                    [&] { return Common::Reply(k_->c_->ListWorkers(*req), resp); });
  }

 private:
  Common* k_;
};

// A rendezvous call the KV refused (not a key that is simply absent yet, nor a wait that timed
// out: those are the normal course of a rendezvous) is logged with the job and key.
absl::Status LogKvRefusal(const char* method, grpc::ServerContext* ctx, const std::string& job_id,
                          const std::string& key, absl::Status s) {
  if (s.ok() || s.code() == absl::StatusCode::kNotFound ||
      s.code() == absl::StatusCode::kDeadlineExceeded ||
      s.code() == absl::StatusCode::kUnavailable) {
    return s;
  }
  log::Warn("kv.refused")
      .F("job", job_id)
      .F("key", key.size() > 200 ? key.substr(0, 200) + "..." : key)
      .F("method", method)
      .F("peer", ctx->peer())
      .F("code", absl::StatusCodeToString(s.code()))
      .Msg(std::string(s.message()));
  return s;
}

class RendezvousServiceImpl final : public v1::RendezvousService::Service {
 public:
  explicit RendezvousServiceImpl(Common* k) : k_(k) {}
  grpc::Status Set(grpc::ServerContext* ctx, const v1::KvSetRequest* req,
                   v1::KvSetResponse*) override {
    return k_->Call("RendezvousService/Set", ctx, *req, [&] {
      return ToGrpc(LogKvRefusal("RendezvousService/Set", ctx, req->job_id(), req->key(),
                                 k_->c_->kv().Set(req->job_id(), req->key(), req->value())));
    });
  }
  grpc::Status Get(grpc::ServerContext* ctx, const v1::KvGetRequest* req,
                   v1::KvGetResponse* resp) override {
    return k_->Call("RendezvousService/Get", ctx, *req, [&]() -> grpc::Status {
      auto v = k_->c_->kv().Get(req->job_id(), req->key(), req->wait_ms());
      if (!v.ok()) {
        return ToGrpc(
            LogKvRefusal("RendezvousService/Get", ctx, req->job_id(), req->key(), v.status()));
      }
      resp->set_value(std::move(*v));
      return grpc::Status::OK;
    });
  }
  grpc::Status Wait(grpc::ServerContext* ctx, const v1::KvWaitRequest* req,
                    v1::KvWaitResponse*) override {
    return k_->Call("RendezvousService/Wait", ctx, *req, [&] {
      std::vector<std::string> keys(req->keys().begin(), req->keys().end());
      return ToGrpc(LogKvRefusal("RendezvousService/Wait", ctx, req->job_id(),
                                 keys.empty() ? std::string() : keys.front(),
                                 k_->c_->kv().Wait(req->job_id(), keys, req->timeout_ms())));
    });
  }
  grpc::Status Add(grpc::ServerContext* ctx, const v1::KvAddRequest* req,
                   v1::KvAddResponse* resp) override {
    return k_->Call("RendezvousService/Add", ctx, *req, [&]() -> grpc::Status {
      auto v = k_->c_->kv().Add(req->job_id(), req->key(), req->delta());
      if (!v.ok()) {
        return ToGrpc(
            LogKvRefusal("RendezvousService/Add", ctx, req->job_id(), req->key(), v.status()));
      }
      resp->set_value(*v);
      return grpc::Status::OK;
    });
  }

 private:
  Common* k_;
};

}  // namespace

struct CoordinatorServer::Impl {
  Impl(Coordinator* c, Metrics* m, std::string token)
      : common(c, m, std::move(token)),
        jobs(&common),
        policies(&common),
        workers(&common),
        rendezvous(&common) {}
  // A server never shut down is shut down now, cancelling its calls; the sessions stop once
  // the server has ended them.
  ~Impl() {
    if (server) server->Shutdown(std::chrono::system_clock::now());
    if (sessions) sessions->Stop();
  }
  Common common;
  // Runs the session work that may block (session_stream.h). Declared before the sessions and
  // the server, so it outlives them: the streams' last steps run on it while the server shuts
  // down.
  SessionPool session_pool{8};
  JobServiceImpl jobs;
  PolicyServiceImpl policies;
  WorkerServiceImpl workers;
  RendezvousServiceImpl rendezvous;
  std::unique_ptr<SessionServer> sessions;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

absl::StatusOr<std::string> ReadFileForFlag(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(flag + ": cannot read " + path);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    Coordinator* coordinator, Metrics* metrics, const ServerOptions& options) {
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!options.tls_cert.empty() || !options.tls_key.empty()) {
    if (options.tls_cert.empty() || options.tls_key.empty()) {
      return absl::InvalidArgumentError("--tls-cert and --tls-key: both are required for TLS");
    }
    auto cert = ReadFileForFlag("--tls-cert", options.tls_cert);
    if (!cert.ok()) return cert.status();
    auto key = ReadFileForFlag("--tls-key", options.tls_key);
    if (!key.ok()) return key.status();
    grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    if (!options.tls_client_ca.empty()) {
      auto ca = ReadFileForFlag("--tls-client-ca", options.tls_client_ca);
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
      ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    }
    creds = grpc::SslServerCredentials(ssl);
  } else if (!options.tls_client_ca.empty()) {
    return absl::InvalidArgumentError("--tls-client-ca: needs --tls-cert and --tls-key");
  }
  auto impl = std::make_unique<Impl>(coordinator, metrics, options.token);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, creds, &impl->port);
  builder.RegisterService(&impl->jobs);
  builder.RegisterService(&impl->policies);
  builder.RegisterService(&impl->workers);
  builder.RegisterService(&impl->rendezvous);
  static std::once_flag log_handler_once;
  std::call_once(log_handler_once, [] {
    google::protobuf::SetLogHandler(ProtobufLog);
    // Debian builds abseil with mutex deadlock detection on, so every absl::Mutex lock (gRPC
    // takes several per stream operation) updates a process-wide lock graph: a debugging aid
    // that took 3-5% of the coordinator's CPU samples at 10,000 workers (perf).
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  });
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(std::make_unique<UnparsableRequestInterceptorFactory>());
  builder.experimental().SetInterceptorCreators(std::move(creators));
  // Idle streams must not be cut by keepalive defaults; workers keep their sessions for days.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues;
  for (int i = 0; i < kSessionQueues; ++i) queues.push_back(builder.AddCompletionQueue());
  Common* common = &impl->common;
  impl->sessions = std::make_unique<SessionServer>(
      &impl->workers, std::move(queues),
      [common](grpc::ServerContextBase* ctx) { return common->Authorize(ctx); }, coordinator,
      metrics, &impl->session_pool);
  impl->server = builder.BuildAndStart();
  if (!impl->server || impl->port == 0) {
    return absl::UnavailableError("--listen: cannot listen on " + options.listen);
  }
  impl->sessions->Start();
  impl->server->GetHealthCheckService()->SetServingStatus(true);
  return std::unique_ptr<CoordinatorServer>(new CoordinatorServer(std::move(impl)));
}

CoordinatorServer::CoordinatorServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CoordinatorServer::~CoordinatorServer() = default;

int CoordinatorServer::port() const { return impl_->port; }

void CoordinatorServer::Shutdown(int grace_ms) {
  if (auto* health = impl_->server->GetHealthCheckService()) health->SetServingStatus(false);
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  impl_->sessions->Stop();
}

void CoordinatorServer::Wait() { impl_->server->Wait(); }

}  // namespace geofp8::coordinator
