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
  // Gate mode (an attach-only worker, --attach): a program's first message is its HookAttach.
  // AttachFn returns "" when the worker forwards it to the coordinator (the stream then waits for
  // Open or Refuse), else why it is refused at once. WithdrawFn: the waiting program left.
  using AttachFn = std::function<std::string(const v1::HookAttach& attach)>;
  using WithdrawFn = std::function<void(const v1::HookAttach& attach)>;

  // Serves on `socket_path` (removed first if it exists). `welcome` is sent first on every
  // stream, then `policies` (every version known, oldest first) and the refresh schedule.
  static absl::StatusOr<std::unique_ptr<HookServer>> Start(const std::string& socket_path,
                                                           v1::HookWelcome welcome,
                                                           std::vector<v1::Policy> policies,
                                                           RelayFn relay);
  // Gate mode: serves on `socket_path` for the worker's lifetime, one rank at a time. Each
  // attempt of the rank that attached is an Open ... EndAttempt.
  static absl::StatusOr<std::unique_ptr<HookServer>> StartGate(const std::string& socket_path,
                                                               AttachFn on_attach,
                                                               WithdrawFn on_withdraw);
  ~HookServer();  // Shutdown()

  // Gate mode. Open: the waiting program's attempt was placed; it gets `welcome`, `policies` and
  // its reports go to `relay`. False when no program waits (it left). Refuse: the waiting
  // program is told why and its stream ends. Stop: the open streams are told to stop (the
  // program exits). EndAttempt: the attempt's streams end (cancelled after `grace`).
  bool Open(v1::HookWelcome welcome, std::vector<v1::Policy> policies, RelayFn relay);
  void Refuse(const std::string& reason);
  void Stop(const v1::HookStop& stop);
  void EndAttempt(std::chrono::milliseconds grace);
  bool waiting() const;  // a program waits for its attempt

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
