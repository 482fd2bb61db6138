// The worker's end of a `command:` job's hook channel (proto HookService; the program's end is
// worker/hook/hook_client.h): a gRPC server on a Unix socket that relays the program's reports
// to the coordinator as this worker's WorkerMessages, and the coordinator's policy versions and
// refresh schedules down to every attached stream.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "geofp8/v1/geofp8.grpc.pb.h"

namespace geofp8::worker {

class HookServer {
 public:
  // Called for every report a program sends, on a gRPC thread.
  using RelayFn = std::function<void(const v1::HookMessage& message)>;

  // Serves on `socket_path` (removed first if it exists). `welcome` is sent first on every
  // stream, then `policies` (every version known, oldest first) and the refresh schedule.
  static absl::StatusOr<std::unique_ptr<HookServer>> Start(const std::string& socket_path,
                                                           v1::HookWelcome welcome,
                                                           std::vector<v1::Policy> policies,
                                                           RelayFn relay);
  ~HookServer();  // Shutdown()

  // New coordinator messages, kept for later streams and sent to the open ones.
  void OfferPolicy(const v1::Policy& policy);
  void OfferRefresh(const v1::RefreshSchedules& refresh);
  // Ends every stream and stops serving; removes the socket. Idempotent.
  void Shutdown();

  const std::string& address() const { return address_; }  // "unix:<path>"
  int attached() const;                                    // streams open now
  int64_t attaches() const;  // streams opened since Start (a program that attached and left)

  class Service;

 private:
  HookServer() = default;
  std::string path_;
  std::string address_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  bool shut_ = false;
};

}  // namespace geofp8::worker
