// Channel and per-call context construction for the worker's coordinator connection.
#include "worker/daemon/connection.h"

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "platform/common/status.h"

namespace geofp8::worker {

absl::StatusOr<std::shared_ptr<Connection>> Connection::Open(const ConnectionOptions& options) {
  if (options.address.empty() || options.address.find(':') == std::string::npos) {
    return absl::InvalidArgumentError("--coordinator: expected host:port (" + options.address +
                                      ")");
  }
  auto c = std::shared_ptr<Connection>(new Connection());
  c->address_ = options.address;
  c->token_ = options.token;
  auto read = [](const std::string& flag, const std::string& path,
                 std::string* out) -> absl::Status {
    std::ifstream in(path);
    if (!in) return absl::InvalidArgumentError(flag + ": cannot read " + path);
    std::stringstream pem;
    pem << in.rdbuf();
    *out = pem.str();
    return absl::OkStatus();
  };
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert/--tls-key: give both or neither");
  }
  if (!options.tls_cert.empty() && options.tls_ca.empty()) {
    return absl::InvalidArgumentError("--tls-cert: needs --tls-ca (TLS is off without it)");
  }
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (options.tls_ca.empty()) {
    creds = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    GEOFP8_RETURN_IF_ERROR(read("--tls-ca", options.tls_ca, &ssl.pem_root_certs));
    if (!options.tls_cert.empty()) {
      GEOFP8_RETURN_IF_ERROR(read("--tls-cert", options.tls_cert, &ssl.pem_cert_chain));
      GEOFP8_RETURN_IF_ERROR(read("--tls-key", options.tls_key, &ssl.pem_private_key));
    }
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  // Reconnect quickly after a coordinator restart; the session client adds its own backoff.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  c->channel_ = grpc::CreateCustomChannel(options.address, creds, args);
  return c;
}

std::unique_ptr<grpc::ClientContext> Connection::Context(std::chrono::milliseconds timeout) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
  if (timeout.count() > 0) ctx->set_deadline(std::chrono::system_clock::now() + timeout);
  return ctx;
}

std::string DescribeStatus(const grpc::Status& status) {
  static const char* kNames[] = {"OK",
                                 "CANCELLED",
                                 "UNKNOWN",
                                 "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED",
                                 "NOT_FOUND",
                                 "ALREADY_EXISTS",
                                 "PERMISSION_DENIED",
                                 "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION",
                                 "ABORTED",
                                 "OUT_OF_RANGE",
                                 "UNIMPLEMENTED",
                                 "INTERNAL",
                                 "UNAVAILABLE",
                                 "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  const int code = int(status.error_code());
  std::string s = (code >= 0 && code <= 16) ? kNames[code] : "CODE " + std::to_string(code);
  if (!status.error_message().empty()) s += ": " + status.error_message();
  return s;
}

}  // namespace geofp8::worker
