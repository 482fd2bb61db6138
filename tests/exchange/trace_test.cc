// The exchange timeline: which spans a traced step records on which lane, the cap on spans, and
// the Chrome trace JSON it writes.
#include "kernels/exchange/trace.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "tests/exchange/exchange_harness.h"

namespace geofp8 {
namespace {

using namespace geofp8::testing;

// name -> lane -> count, and the groups seen per name.
struct Tally {
  std::map<std::string, std::map<int, int>> lanes;
  std::map<std::string, std::vector<int>> groups;
};

Tally Count(const ExchangeTrace& trace, uint64_t step) {
  Tally t;
  for (const auto& s : trace.spans()) {
    if (s.step != step) continue;
    ++t.lanes[s.name][s.lane];
    t.groups[s.name].push_back(s.group);
    EXPECT_GE(s.duration_us, 0) << s.name;
  }
  for (auto& [name, g] : t.groups) std::sort(g.begin(), g.end());
  return t;
}

// One Exchange() of `step` on two ranks, each recording into its own trace.
std::vector<ExchangeTrace> TracedStep(const std::vector<LayerSpec>& layers,
                                      const ExchangeOptions& options, uint64_t step,
                                      int channels = 2) {
  std::vector<ExchangeTrace> traces(2);
  const auto errors = RunRanks(
      2,
      [&](Communicator& comm) {
        ExchangeOptions mine = options;
        mine.trace = &traces[comm.rank()];
        Exchanger ex(comm, layers, mine);
        Tensors data = MakeInputs(comm.rank(), layers, step);
        std::vector<std::span<float>> grads(data.begin(), data.end());
        ex.Exchange(step, grads);
      },
      std::chrono::milliseconds(60000), channels);
  EXPECT_EQ(JoinErrors(errors), "") << "channels " << channels;
  return traces;
}

// Three layers in one bucket, one pipeline group each: every group is encoded, exchanged,
// summed, gathered and decoded once, the all-to-alls on the main lane and the all-gathers on the
// side channel's lane (or the main lane without one).
TEST(ExchangeTrace, TwoPhaseStepSpansPerLane) {
  std::vector<LayerSpec> layers = {{"a", 300, 1, {}}, {"b", 40, 10, {}}, {"c", 1000, 1, {}}};
  for (int channels : {1, 2}) {
    ExchangeOptions options;
    options.segment_bytes = 1;
    const std::vector<ExchangeTrace> traces = TracedStep(layers, options, 7, channels);
    ASSERT_FALSE(HasFailure()) << channels;
    const int gather_lane = channels == 2 ? ExchangeTrace::kSideLane : ExchangeTrace::kMainLane;
    for (int r = 0; r < 2; ++r) {
      const Tally t = Count(traces[r], 7);
      const std::string where =
          "channels " + std::to_string(channels) + " rank " + std::to_string(r);
      EXPECT_EQ(t.lanes.at("fingerprints"), (std::map<int, int>{{ExchangeTrace::kMainLane, 1}}))
          << where;
      EXPECT_EQ(t.lanes.at("all_to_all"), (std::map<int, int>{{ExchangeTrace::kMainLane, 3}}))
          << where;
      EXPECT_EQ(t.lanes.at("all_gather"), (std::map<int, int>{{gather_lane, 3}})) << where;
      for (const char* codec : {"encode", "sum_requantize", "decode"}) {
        EXPECT_EQ(t.lanes.at(codec), (std::map<int, int>{{ExchangeTrace::kCodecLane, 3}}))
            << where << " " << codec;
        EXPECT_EQ(t.groups.at(codec), (std::vector<int>{0, 1, 2})) << where << " " << codec;
      }
      EXPECT_EQ(t.lanes.size(), 6u) << where;  // nothing else, nothing under another step
      EXPECT_EQ(traces[r].dropped(), 0u);
    }
  }
}

TEST(ExchangeTrace, BaselineRecordsOneAllReduce) {
  std::vector<LayerSpec> layers = {{"a", 300, 1, {}}, {"b", 40, 10, {}}};
  ExchangeOptions options;
  options.algorithm = Algorithm::kFp32;
  const std::vector<ExchangeTrace> traces = TracedStep(layers, options, 0);
  ASSERT_FALSE(HasFailure());
  const Tally t = Count(traces[0], 0);
  EXPECT_EQ(t.lanes.at("fingerprints").at(ExchangeTrace::kMainLane), 1);
  EXPECT_EQ(t.lanes.at("all_reduce").at(ExchangeTrace::kMainLane), 1);
  EXPECT_EQ(t.lanes.size(), 2u);
}

TEST(ExchangeTrace, CapsSpansAndCountsTheRest) {
  ExchangeTrace trace(3);
  const auto now = ExchangeTrace::Clock::now();
  for (int i = 0; i < 5; ++i) trace.Add("encode", ExchangeTrace::kCodecLane, 1, i, now, now);
  EXPECT_EQ(trace.spans().size(), 3u);
  EXPECT_EQ(trace.dropped(), 2u);
}

TEST(ExchangeTrace, WritesChromeTraceJson) {
  ExchangeTrace trace;
  const auto t0 = ExchangeTrace::Clock::now();
  trace.Add("all_to_all", ExchangeTrace::kMainLane, 4, 2, t0, t0 + std::chrono::microseconds(1500));
  const std::string path = ::testing::TempDir() + "/geofp8_trace_test.json";
  trace.WriteChromeJson(path, 3);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string json = text.str();
  std::remove(path.c_str());
  EXPECT_EQ(json.rfind("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[", 0), 0u) << json;
  EXPECT_NE(json.find("\"args\":{\"name\":\"rank 3\"}"), std::string::npos) << json;
  EXPECT_NE(json.find("\"name\":\"all_to_all\",\"ph\":\"X\",\"pid\":3,\"tid\":0"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("\"dur\":1500,\"args\":{\"step\":4,\"group\":2}"), std::string::npos) << json;
  // Balanced braces and brackets: a loader will at least get past the structure.
  EXPECT_EQ(std::count(json.begin(), json.end(), '{'), std::count(json.begin(), json.end(), '}'));
  EXPECT_EQ(std::count(json.begin(), json.end(), '['), std::count(json.begin(), json.end(), ']'));
  try {
    trace.WriteChromeJson("/nonexistent-dir/x.json", 0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/x.json"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace geofp8
