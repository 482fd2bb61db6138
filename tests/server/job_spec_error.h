// Test helper for the job-spec tests: the message of a spec that must be refused as
// INVALID_ARGUMENT ("" and a test failure when it is accepted).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "platform/policy/job_spec.h"

namespace geofp8 {

inline std::string ErrorOf(const std::string& yaml) {
  auto r = ParseJobSpec(yaml);
  EXPECT_FALSE(r.ok()) << yaml;
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(r.status().message());
}

}  // namespace geofp8
