// Conversion of core exceptions to absl::Status and small Status utilities for the services.
#include "server/common/status.h"

namespace geofp8 {

absl::Status StatusFromException(const std::exception& e, absl::StatusCode code) {
  return absl::Status(code, e.what());
}

absl::Status Annotate(const absl::Status& status, const std::string& context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), context + ": " + std::string(status.message()));
}

}  // namespace geofp8
