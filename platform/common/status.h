// Status propagation for the services (server/, worker/, client/, platform/): one way to pass an
// error up, so that a function reads as its happy path.
//
//   GEOFP8_RETURN_IF_ERROR(store_->PutJob(job));
//   GEOFP8_ASSIGN_OR_RETURN(uint64_t generation, store_->NextGeneration(name));
//   GEOFP8_ASSIGN_OR_RETURN(auto spec, ParseJobSpec(yaml));
//
// Both return the error unchanged (its code, message and payloads). A function returning
// absl::StatusOr<T> may use them too: the Status converts. Where an error needs context, add it
// explicitly (Annotate) instead of hiding it in a macro.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace geofp8::internal {
// The Status of a Status or of a StatusOr, by reference, without copying a value.
inline const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace geofp8::internal

#define GEOFP8_STATUS_CONCAT_INNER_(a, b) a##b
#define GEOFP8_STATUS_CONCAT_(a, b) GEOFP8_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status or absl::StatusOr<T>) once and returns its status from the
// enclosing function unless it is OK.
#define GEOFP8_RETURN_IF_ERROR(expr)                          \
  do {                                                        \
    const auto& geofp8_status_ = (expr);                      \
    if (!::geofp8::internal::StatusOf(geofp8_status_).ok()) { \
      return ::geofp8::internal::StatusOf(geofp8_status_);    \
    }                                                         \
  } while (false)

// `lhs` is a declaration (`auto x`, `const Foo& y` is not allowed: it would dangle) or an
// existing lvalue; `rexpr` an absl::StatusOr<T>. On error returns its status; otherwise moves the
// value into lhs. Expands to more than one statement: not for the body of an unbraced if.
#define GEOFP8_ASSIGN_OR_RETURN(lhs, rexpr) \
  GEOFP8_ASSIGN_OR_RETURN_IMPL_(GEOFP8_STATUS_CONCAT_(geofp8_statusor_, __LINE__), lhs, rexpr)

#define GEOFP8_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                  \
  if (!statusor.ok()) {                                     \
    return std::move(statusor).status();                    \
  }                                                         \
  lhs = *std::move(statusor)
