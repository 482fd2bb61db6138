// The spec's limits and the inputs it used to accept silently: huge steps, batch and sequence,
// repeated keys, a second document, invalid UTF-8, and error lists too long for a gRPC trailer.
#include <gtest/gtest.h>

#include <string>

#include "platform/policy/job_spec.h"
#include "tests/server/job_spec_error.h"

namespace geofp8 {
namespace {

TEST(JobSpecLimits, StepsFitTheWorkersCounters) {
  EXPECT_EQ(ErrorOf("name: a\ntraining: {steps: 1099511627776}\n"),
            "line 2: spec.training.steps: must be in [1, 1000000000] (1099511627776)");
  EXPECT_EQ(ErrorOf("name: a\ncheckpoint: {dir: c, every: 1099511627776}\n"),
            "line 2: spec.checkpoint.every: must be in [0, 1000000000] (1099511627776)");
  auto ok = ParseJobSpec("name: a\ntraining: {steps: 1000000000}\n");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->training.steps, kMaxSteps);
}

TEST(JobSpecLimits, BatchAndSequenceAreBounded) {
  EXPECT_EQ(ErrorOf("name: a\ntraining:\n  batch_size: 1048576\n  seq_len: 1048576\n"),
            "line 3: spec.training.batch_size: must be in [1, 4096] (1048576); "
            "line 4: spec.training.seq_len: must be in [1, 8192] (1048576)");
  // Each within its field bound, together past the attention memory bound.
  const std::string e = ErrorOf("name: a\ntraining: {batch_size: 4096, seq_len: 8192}\n");
  EXPECT_NE(e.find("line 2: spec.training.batch_size: batch_size x heads x seq_len^2"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("(batch_size 4096, seq_len 8192: 8192 GiB)"), std::string::npos) << e;
  EXPECT_TRUE(ParseJobSpec("name: a\ntraining: {batch_size: 4096, seq_len: 128}\n").ok());
}

TEST(JobSpecLimits, RepeatedKeysAreErrors) {
  EXPECT_EQ(ErrorOf("name: a\nworld_size: 2\nworld_size: 4\n"),
            "line 3: spec.world_size: duplicate key (first at line 2)");
  EXPECT_EQ(ErrorOf("name: a\npolicy:\n  default:\n    format: fp8_e4m3\n    format: nvfp4\n"),
            "line 5: spec.policy.default.format: duplicate key (first at line 4)");
  EXPECT_EQ(ErrorOf("name: a\npolicy:\n  layers:\n    - {match: lm_head, rank: 2, rank: 3}\n"),
            "line 4: spec.policy.layers[0].rank: duplicate key (first at line 4)");
  auto patch = ParsePolicyPatch("layers:\n  - match: x\n    match: y\n");
  ASSERT_FALSE(patch.ok());
  EXPECT_EQ(patch.status().message(),
            "line 3: patch.layers[0].match: duplicate key (first at line 2)");
}

TEST(JobSpecLimits, OneDocumentOnly) {
  EXPECT_EQ(ErrorOf("name: a\n---\nname: b\n"),
            "line 3: spec: a second YAML document (--- starts one); a spec is one document");
  auto patch = ParsePolicyPatch("layers: [{match: x}]\n---\n");
  ASSERT_FALSE(patch.ok());
  EXPECT_NE(patch.status().message().find("patch: a second YAML document"), std::string::npos);
  // A leading document marker is still one document.
  EXPECT_TRUE(ParseJobSpec("---\nname: a\n").ok());
}

TEST(JobSpecLimits, InvalidUtf8NamesLineAndByte) {
  EXPECT_EQ(ErrorOf("name: a\nbackend: \"x\xffy\"\n"), "line 2: spec: invalid UTF-8 at byte 19");
  EXPECT_EQ(ErrorOf("name: \xc0\xaf\n"), "line 1: spec: invalid UTF-8 at byte 6");      // overlong
  EXPECT_EQ(ErrorOf("name: \xed\xa0\x80\n"), "line 1: spec: invalid UTF-8 at byte 6");  // surrogate
  EXPECT_EQ(ErrorOf("name: \xe2\x82"), "line 1: spec: invalid UTF-8 at byte 6");        // cut short
  // Valid multi-byte text reaches the name check, which names the value.
  EXPECT_EQ(ErrorOf("name: \xc3\xa9t\xc3\xa9\n"),
            "line 1: spec.name: must be 1-63 characters of [A-Za-z0-9._-] (\xc3\xa9t\xc3\xa9)");
}

TEST(JobSpecLimits, LongErrorListsAreCut) {
  std::string yaml = "name: a\ntraining:\n";
  for (int i = 0; i < 1000; ++i) yaml += "  bogus" + std::to_string(i) + ": 1\n";
  const std::string e = ErrorOf(yaml);
  EXPECT_LE(e.size(), kMaxErrorBytes + 40);
  const size_t more = e.rfind("; ... and ");
  ASSERT_NE(more, std::string::npos) << e;
  const int hidden = std::stoi(e.substr(more + 10));
  int shown = 0;
  for (size_t at = e.find("unknown field"); at != std::string::npos;
       at = e.find("unknown field", at + 1)) {
    ++shown;
  }
  EXPECT_EQ(shown + hidden, 1000);
  // A huge value is quoted cut short.
  const std::string big = ErrorOf("name: a\nbackend: " + std::string(100000, 'x') + "\n");
  EXPECT_LT(big.size(), 300u) << big.substr(0, 300);
  EXPECT_NE(big.find("... (100000 bytes)"), std::string::npos);
}

TEST(JobSpecLimits, PathsStayInsideTheWorkersDataDirectory) {
  EXPECT_EQ(ErrorOf("name: a\ncheckpoint: {dir: /etc, every: 5}\n"),
            "line 2: spec.checkpoint.dir: must be relative to the worker's data directory (/etc)");
  EXPECT_EQ(ErrorOf("name: a\ncheckpoint: {dir: ckpt/../../x, every: 5}\n"),
            "line 2: spec.checkpoint.dir: must stay inside the worker's data directory (no ..) "
            "(ckpt/../../x)");
  EXPECT_EQ(ErrorOf("name: a\ndata: {source: file, path: /etc/shadow}\n"),
            "line 2: spec.data.path: must be relative to the worker's data directory "
            "(/etc/shadow)");
  EXPECT_EQ(ErrorOf("name: a\ndata: {source: file, path: ..}\n"),
            "line 2: spec.data.path: must stay inside the worker's data directory (no ..) (..)");
  auto ok = ParseJobSpec(
      "name: a\ndata: {source: file, path: corpora/tiny.txt}\ncheckpoint: {dir: c/d, every: 5}\n");
  ASSERT_TRUE(ok.ok()) << ok.status();
}

TEST(JobSpecLimits, WorkerResolvesPathsOnlyInsideItsDataDirectory) {
  EXPECT_EQ(ResolveInDataDir("/var/lib/w", "ckpt"), "/var/lib/w/ckpt");
  EXPECT_EQ(ResolveInDataDir("/var/lib/w/", "a/./b"), "/var/lib/w/a/b");
  EXPECT_EQ(ResolveInDataDir("data", "x.txt"), "data/x.txt");
  EXPECT_EQ(ResolveInDataDir("/var/lib/w", "/etc/shadow"), std::nullopt);
  EXPECT_EQ(ResolveInDataDir("/var/lib/w", "../w2/x"), std::nullopt);
  EXPECT_EQ(ResolveInDataDir("/var/lib/w", "a/../../x"), std::nullopt);
  EXPECT_EQ(ResolveInDataDir("/var/lib/w", ""), std::nullopt);
  EXPECT_EQ(ResolveInDataDir("/var/lib/w", "."), "/var/lib/w/");  // the directory itself
}

}  // namespace
}  // namespace geofp8

namespace geofp8 {
namespace {

// Issue #31 item 8: `world_size: 0x2` was taken as 2 (yaml-cpp reads hex and octal); integer
// fields are decimal only.
TEST(JobSpecLimits, IntegerFieldsAreDecimalOnly) {
  EXPECT_EQ(ErrorOf("name: a\nworld_size: 0x2\n"),
            "line 2: spec.world_size: expected a decimal integer (0x2)");
  EXPECT_EQ(ErrorOf("name: a\ntraining: {steps: 0o17}\n"),
            "line 2: spec.training.steps: expected a decimal integer (0o17)");
  EXPECT_EQ(ErrorOf("name: a\nworld_size: 1e1\n"),
            "line 2: spec.world_size: expected a decimal integer (1e1)");
  EXPECT_TRUE(ParseJobSpec("name: a\nworld_size: +2\ntraining: {steps: 010}\n").ok());
  EXPECT_EQ(ParseJobSpec("name: a\ntraining: {steps: 010}\n")->training.steps, 10);
}

// Issue #31 item 8: 10 KB of nesting gave only "malformed YAML: bad file".
TEST(JobSpecLimits, DeepNestingIsRefusedWithItsLine) {
  for (const std::string& deep :
       {std::string(10000, '['), std::string(5000, '[') + std::string(5000, ']'),
        std::string(5000, '{') + std::string(5000, '}')}) {
    EXPECT_EQ(ErrorOf("name: a\nextra: " + deep + "\n"),
              "line 2: spec: flow collections ([ and {) nested deeper than 32 levels");
  }
  // Brackets inside quotes and comments are text, not nesting: the spec gets as far as
  // checking the name.
  const std::string quoted = "name: '" + std::string(100, '[') + "' # " + std::string(100, '{');
  EXPECT_NE(ErrorOf(quoted + "\n").find("spec.name: must be 1-63 characters"), std::string::npos);
  EXPECT_TRUE(ParseJobSpec("name: a # " + std::string(100, '{') + "\n").ok());
  // Block collections as deep: yaml-cpp's own depth limit, with the line.
  std::string block = "name: a\nextra:\n";
  for (int i = 0; i < 3000; ++i) block += "- ";
  block += "x\n";
  const std::string e = ErrorOf(block);
  EXPECT_EQ(e.rfind("line 3: spec: nested deeper than", 0), 0u) << e.substr(0, 300);
}

}  // namespace
}  // namespace geofp8
