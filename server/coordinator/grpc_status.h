// absl::Status -> grpc::Status for the coordinator's gRPC adapters (the codes map one to one).
#pragma once

#include <grpcpp/support/status.h>

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "server/coordinator/store.h"

namespace geofp8::coordinator {

// The status message travels in the grpc-message trailer, percent-encoded (up to 3 bytes per
// byte); a client drops trailers over 8 KiB and reports a transport error instead. Handlers keep
// their messages short (job_spec.cc cuts its error list); this is the backstop.
inline constexpr size_t kMaxStatusMessageBytes = 2600;

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  std::string message(s.message());
  if (message.size() > kMaxStatusMessageBytes) {
    const size_t full = message.size();
    message.resize(kMaxStatusMessageBytes);
    message += "... (cut, " + std::to_string(full) + " bytes in all)";
  }
  if (s.GetPayload(kStoreUnwritablePayload).has_value()) {
    return grpc::Status(static_cast<grpc::StatusCode>(s.code()), message, kStoreUnwritableDetails);
  }
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), message);
}

}  // namespace geofp8::coordinator
