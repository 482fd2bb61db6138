// The exchange engine's rendezvous Store over the coordinator's RendezvousService, so Gloo (and
// the NCCL unique id) rendezvous through the coordinator. Keys are scoped per job and attempt.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "kernels/exchange/store.h"
#include "worker/daemon/connection.h"

namespace geofp8::worker {

// Every key k is stored as `prefix + k` in job `job_id`'s namespace. The coordinator hands out
// prefix = Assignment.rendezvous_prefix ("<job>/<attempt>/"), so a restarted attempt never reads
// the keys of an earlier one. Errors throw geofp8::Error naming the key and the gRPC status, as
// the Store interface requires. Thread-safe.
class GrpcStore final : public Store {
 public:
  GrpcStore(std::shared_ptr<Connection> connection, std::string job_id, std::string prefix);

  void Set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> Get(const std::string& key, std::chrono::milliseconds timeout) override;
  void Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  int64_t Add(const std::string& key, int64_t delta) override;

  // Deadline of the calls that do not wait (Set, Add); transient UNAVAILABLE is retried within it.
  void set_rpc_timeout(std::chrono::milliseconds t) { rpc_timeout_ = t; }

 private:
  std::string Scoped(const std::string& key) const { return prefix_ + key; }

  std::shared_ptr<Connection> connection_;
  std::unique_ptr<v1::RendezvousService::Stub> stub_;
  std::string job_id_;
  std::string prefix_;
  std::chrono::milliseconds rpc_timeout_{10000};
};

}  // namespace geofp8::worker
