// The heavy corner of the exchange sweep: 2^20 elements, world sizes {1,2,3,4,8}, every CPU
// algorithm, against the same reference as exchange_test.cc. Labelled `slow`.
#include <gtest/gtest.h>

#include <tuple>

#include "tests/exchange/exchange_harness.h"

namespace geofp8 {
namespace {

using namespace geofp8::testing;

class LargeSweep : public ::testing::TestWithParam<std::tuple<int, Algorithm>> {};

TEST_P(LargeSweep, MatchesReferenceOnEveryRank) {
  const auto [n, algorithm] = GetParam();
  ExchangeOptions options;
  options.algorithm = algorithm;
  const std::vector<LayerSpec> layers = {{"big", 1024, 1024, {}}};
  const auto run = RunStep(n, layers, options);
  CheckRun(run, layers, options);
}

INSTANTIATE_TEST_SUITE_P(Exchange, LargeSweep,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::Values(Algorithm::kTwoPhase,
                                                              Algorithm::kAllGather,
                                                              Algorithm::kFp32, Algorithm::kBf16)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::string(AlgorithmName(std::get<1>(info.param)));
                         });

}  // namespace
}  // namespace geofp8
