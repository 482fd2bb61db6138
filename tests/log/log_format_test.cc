// The event line format of both daemons (platform/common/log.h): logfmt quoting and escaping,
// JSON types, field order, base fields, and lines that never interleave across threads.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "platform/common/log.h"

namespace geofp8::log {
namespace {

class LogFormatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetSinkForTesting([this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.push_back(line);
    });
  }
  void TearDown() override {
    SetSinkForTesting(nullptr);
    Configure(Format::kText);
  }
  std::string Last() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_.empty() ? "" : lines_.back();
  }
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// ts=2026-12-01T17:01:20.123Z: RFC 3339, UTC, milliseconds.
const std::regex kTs(R"(^ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z )");

TEST_F(LogFormatTest, LogfmtQuotesOnlyWhatNeedsIt) {
  Configure(Format::kText, {{"worker", "w0"}});
  Info("job.submitted")
      .F("job", "job-000001")
      .F("name", "my job")
      .F("step", int64_t{40})
      .F("empty", "")
      .F("eq", "a=b")
      .F("loss", 3.25)
      .F("ok", true)
      .Msg("said \"hi\"\nbye\\");
  const std::string line = Last();
  EXPECT_TRUE(std::regex_search(line, kTs)) << line;
  EXPECT_NE(line.find(" level=info event=job.submitted worker=w0 job=job-000001 name=\"my job\" "
                      "step=40 empty=\"\" eq=\"a=b\" loss=3.25 ok=true "
                      "msg=\"said \\\"hi\\\"\\nbye\\\\\""),
            std::string::npos)
      << line;
  EXPECT_EQ(line.find('\n'), std::string::npos);  // one event, one line
  Warn("x").F("nan", std::nan(""));
  EXPECT_NE(Last().find("level=warn event=x worker=w0 nan=NaN"), std::string::npos) << Last();
  Error("y");  // no fields, no msg
  EXPECT_EQ(Last().substr(Last().find(" level=")), " level=error event=y worker=w0");
}

TEST_F(LogFormatTest, JsonTypesAndEscapes) {
  Configure(Format::kJson, {{"worker", "w\"1"}});
  Info("policy.changed")
      .F("version", uint64_t{3})
      .F("rank", -1)
      .F("loss", 2.5)
      .F("bad", INFINITY)
      .F("on", false)
      .F("ctl", std::string("a\x01"
                            "b"))
      .Msg("tab\there");
  const std::string line = Last();
  EXPECT_TRUE(std::regex_search(
      line, std::regex(R"(^\{"ts":"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z","level":"info",)")))
      << line;
  EXPECT_NE(line.find(R"("event":"policy.changed","worker":"w\"1","version":3,"rank":-1,)"
                      R"("loss":2.5,"bad":"Inf","on":false,"ctl":"a\u0001b","msg":"tab\there"})"),
            std::string::npos)
      << line;
}

TEST(LogFormat, ParseFormatAcceptsTextAndJsonOnly) {
  EXPECT_EQ(ParseFormat("text"), Format::kText);
  EXPECT_EQ(ParseFormat("json"), Format::kJson);
  EXPECT_FALSE(ParseFormat("JSON").has_value());
  EXPECT_FALSE(ParseFormat("").has_value());
}

// Lines from many threads arrive whole: each is one sink call with every field of its event.
TEST_F(LogFormatTest, ConcurrentEventsStayWhole) {
  Configure(Format::kText);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) Info("e").F("t", t).F("i", i).Msg("m");
    });
  }
  for (auto& th : threads) th.join();
  std::lock_guard<std::mutex> lock(mu_);
  ASSERT_EQ(lines_.size(), 1600u);
  const std::regex whole(R"(^ts=\S+ level=info event=e t=\d i=\d+ msg=m$)");
  for (const auto& l : lines_) ASSERT_TRUE(std::regex_match(l, whole)) << l;
}

}  // namespace
}  // namespace geofp8::log
