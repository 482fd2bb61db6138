// How the worker reaches the coordinator: one gRPC channel (plaintext or TLS) plus the bearer
// token every call carries. Shared by the session client and the rendezvous store.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace geofp8::worker {

struct ConnectionOptions {
  std::string address;   // coordinator host:port
  std::string token;     // bearer token; empty: none sent
  std::string tls_ca;    // PEM CA bundle path; empty: plaintext
  std::string tls_cert;  // PEM client certificate path, for coordinators that require mutual TLS
  std::string tls_key;   // PEM private key of tls_cert
};

class Connection {
 public:
  // Reads the CA file when given; errors name the flag ("--tls-ca: cannot read ...").
  static absl::StatusOr<std::shared_ptr<Connection>> Open(const ConnectionOptions& options);

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  const std::string& address() const { return address_; }
  // A context with the token and a deadline `timeout` from now (none when timeout is zero).
  std::unique_ptr<grpc::ClientContext> Context(std::chrono::milliseconds timeout) const;

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::string address_;
  std::string token_;
};

// "UNAVAILABLE: connection refused" style text of a gRPC status, for error messages.
std::string DescribeStatus(const grpc::Status& status);

}  // namespace geofp8::worker
