// absl::Status helpers for the services: RETURN_IF_ERROR / ASSIGN_OR_RETURN, and the one place
// where the numeric core's geofp8::Error becomes a Status (STYLE.md section 5).
#pragma once

#include <exception>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace geofp8 {

// Runs fn() (which may throw geofp8::Error from the core) and turns a throw into a Status with
// the given code; anything else passes through unchanged.
absl::Status StatusFromException(const std::exception& e,
                                 absl::StatusCode code = absl::StatusCode::kInvalidArgument);

template <typename Fn>
auto CallCore(Fn&& fn, absl::StatusCode code = absl::StatusCode::kInvalidArgument)
    -> absl::StatusOr<decltype(fn())> {
  try {
    return fn();
  } catch (const std::exception& e) {
    return StatusFromException(e, code);
  }
}

// Prefixes a status message with context ("spec.policy: ...") and keeps the code.
absl::Status Annotate(const absl::Status& status, const std::string& context);

}  // namespace geofp8

#define GEOFP8_STATUS_CONCAT_INNER(a, b) a##b
#define GEOFP8_STATUS_CONCAT(a, b) GEOFP8_STATUS_CONCAT_INNER(a, b)

// RETURN_IF_ERROR(expr): return the Status of expr from the current function if it is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status geofp8_status_ = (expr);          \
    if (!geofp8_status_.ok()) return geofp8_status_; \
  } while (0)

// ASSIGN_OR_RETURN(lhs, expr): lhs = *expr if OK, else return its Status. lhs may declare.
#define ASSIGN_OR_RETURN(lhs, expr) \
  GEOFP8_ASSIGN_OR_RETURN_IMPL(GEOFP8_STATUS_CONCAT(geofp8_statusor_, __LINE__), lhs, expr)
#define GEOFP8_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(*tmp)
