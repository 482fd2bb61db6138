// Where a Status meets code whose errors travel as exceptions: the worker's rank attempt and the
// Python module run the trainer and the exchange engine, which throw geofp8::Error. A failed
// Status crosses as a StatusError, which keeps it whole (code and payloads), so that a catch site
// classifies the failure by type and code, never by its message text.
//
//   spec_ = ValueOrThrow(ParseJobSpec(yaml), "spec: ");
//   ThrowIfError(store.Put(job), "job " + id + ": ");
#pragma once

#include <source_location>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/common/check.h"

namespace geofp8 {

// A geofp8::Error (so every catch of Error or std::exception still sees it) whose what() is the
// caller's context followed by the status message, for the user, and where() the line that threw
// ("rank_attempt.cc:37", as GEOFP8_CHECK's).
class StatusError : public Error {
 public:
  StatusError(absl::Status status, std::string_view context, std::string where = {})
      : Error(std::string(context) + std::string(status.message()), std::move(where)),
        status_(std::move(status)) {}

  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

// Throws StatusError(status, context) unless `status` is OK.
inline void ThrowIfError(absl::Status status, std::string_view context = {},
                         std::source_location at = std::source_location::current()) {
  if (status.ok()) [[likely]] {
    return;
  }
  const std::string_view file = at.file_name();
  throw StatusError(
      std::move(status), context,
      std::string(file.substr(file.rfind('/') + 1)) + ":" + std::to_string(at.line()));
}

// The value of `s`, or throws StatusError(s.status(), context).
template <typename T>
T ValueOrThrow(absl::StatusOr<T> s, std::string_view context = {},
               std::source_location at = std::source_location::current()) {
  if (!s.ok()) [[unlikely]] {
    ThrowIfError(std::move(s).status(), context, at);
  }
  return *std::move(s);
}

}  // namespace geofp8
