// A job spec's size bound (issue #31 item 7): a spec over kMaxSpecBytes is refused before the
// YAML parser sees it, with the bound and the size; one at the bound still parses.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "kernels/policy/job_spec.h"

namespace geofp8 {
namespace {

TEST(JobSpecSize, ASpecOverTheBoundIsRefusedBeforeParsing) {
  // 3 MB of deep nesting: the YAML parser would take seconds and hundreds of MB on it.
  const std::string hostile = "name: a\nx: " + std::string(3'000'000, '[');
  const auto start = std::chrono::steady_clock::now();
  auto r = ParseJobSpec(hostile);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "spec: at most 1048576 bytes (3000011)");
  // A size check, not a parse: well under a second even on a loaded 2-core machine.
  EXPECT_LT(seconds, 0.5);
}

TEST(JobSpecSize, ASpecAtTheBoundStillParses) {
  std::string yaml = "name: a\n# ";
  yaml += std::string(kMaxSpecBytes - yaml.size() - 1, 'x');
  yaml += "\n";
  ASSERT_EQ(yaml.size(), kMaxSpecBytes);
  auto ok = ParseJobSpec(yaml);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->name, "a");
  yaml.insert(yaml.size() - 1, "x");
  EXPECT_EQ(ParseJobSpec(yaml).status().message(), "spec: at most 1048576 bytes (1048577)");
}

}  // namespace
}  // namespace geofp8
