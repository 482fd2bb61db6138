// The coordinator's gRPC server: thin adapters from the four geofp8.v1 services (plus
// grpc.health.v1) onto Coordinator, with bearer-token auth, optional TLS and RPC metrics.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/metrics.h"

namespace geofp8::coordinator {

struct ServerOptions {
  std::string listen = "127.0.0.1:7070";  // host:port; port 0 picks a free one
  // When non-empty, mutating RPCs need "authorization: Bearer <token>" (UNAUTHENTICATED else).
  std::string token;
  std::string tls_cert;       // PEM server certificate chain; empty = plaintext
  std::string tls_key;        // PEM private key of tls_cert
  std::string tls_client_ca;  // PEM CA bundle; when set, clients must present a cert it signed
};

class CoordinatorServer {
 public:
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(Coordinator* coordinator,
                                                                  Metrics* metrics,
                                                                  const ServerOptions& options);
  ~CoordinatorServer();
  int port() const;
  // Stops accepting calls and waits up to grace_ms for running ones, then cancels the rest.
  void Shutdown(int grace_ms);
  void Wait();

 private:
  struct Impl;
  explicit CoordinatorServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Reads a whole file (for PEM paths); errors name the flag.
absl::StatusOr<std::string> ReadFileForFlag(const std::string& flag, const std::string& path);

}  // namespace geofp8::coordinator
