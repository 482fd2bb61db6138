// A job spec's size and shape bounds (issue #31 item 7): a spec over kMaxSpecBytes, or one whose
// flow collections nest too deep or that has too many entries, is refused before the YAML parser
// builds a node, with the bound and where; quotes and comments do not count.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "platform/policy/job_spec.h"

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

TEST(JobSpecShape, AFlowListOfAMillionEntriesIsRefusedBeforeParsing) {
  // Under the size bound: parsed, it cost half a second and 160 MB of nodes.
  std::string list = "name: a\nx: [";
  while (list.size() < 1'000'000) list += "1, ";
  list += "1]\n";
  const auto start = std::chrono::steady_clock::now();
  auto r = ParseJobSpec(list);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.status().message(),
            "line 2: spec: more than 50000 entries (lines and flow items) by this line");
  EXPECT_LT(seconds, 0.5);
  // As many lines: the same bound.
  std::string lines = "name: a\n";
  for (int i = 0; i < 50'001; ++i) lines += "# a comment line\n";
  EXPECT_EQ(ParseJobSpec(lines).status().message(),
            "line 50002: spec: more than 50000 entries (lines and flow items) by this line");
}

TEST(JobSpecShape, DeepNestingIsRefusedNamingItsLine) {
  // 10 KB of nesting gave only "malformed YAML: bad file" (issue #31 item 9).
  EXPECT_EQ(
      ParseJobSpec("name: a\ntraining:\n  steps: " + std::string(10'000, '[')).status().message(),
      "line 3: spec: flow collections ([ and {) nested deeper than 32 levels");
  EXPECT_EQ(ParsePolicyPatch("layers:\n- {match: " + std::string(40, '{')).status().message(),
            "line 2: patch: flow collections ([ and {) nested deeper than 32 levels");
  // 32 levels are allowed (and then fail as what they are: a value of the wrong kind).
  const std::string deep = std::string(32, '[') + std::string(32, ']');
  EXPECT_NE(ParseJobSpec("name: a\ntraining:\n  steps: " + deep + "\n")
                .status()
                .message()
                .find("spec.training.steps"),
            std::string::npos);
}

TEST(JobSpecShape, BracketsInQuotesAndCommentsDoNotCount) {
  const std::string many(40, '[');
  const std::string yaml = "name: a  # " + many + "\ncommand: [\"/bin/echo\", \"" + many +
                           "\", 'it''s " + many + "', \"esc\\\" " + many + "\"]\n";
  auto ok = ParseJobSpec(yaml);
  ASSERT_TRUE(ok.ok()) << ok.status() << "\n" << yaml;
  ASSERT_EQ(ok->command.size(), 4u);
  EXPECT_EQ(ok->command[1], many);
  EXPECT_EQ(ok->command[2], "it's " + many);
  EXPECT_EQ(ok->command[3], "esc\" " + many);
  // An apostrophe inside a plain scalar opens no quote: the nesting after it still counts.
  EXPECT_EQ(ParseJobSpec("name: a\ncommand: [it's, " + many + "\n").status().message(),
            "line 2: spec: flow collections ([ and {) nested deeper than 32 levels");
}

}  // namespace
}  // namespace geofp8
