// Names of the exchange algorithms: the one place that maps algorithm names to enums.
// Every parser (CLI, YAML, proto) goes through ParseAlgorithm.
#include "kernels/exchange/policy.h"

#include <array>
#include <utility>

namespace geofp8 {
namespace {

constexpr std::array<std::pair<Algorithm, std::string_view>, 6> kAlgorithmNames = {{
    {Algorithm::kAuto, "auto"},
    {Algorithm::kTwoPhase, "two_phase"},
    {Algorithm::kAllGather, "allgather"},
    {Algorithm::kNative, "native"},
    {Algorithm::kFp32, "fp32"},
    {Algorithm::kBf16, "bf16"},
}};

}  // namespace

std::string_view AlgorithmName(Algorithm a) {
  for (const auto& [value, name] : kAlgorithmNames) {
    if (value == a) return name;
  }
  return "unknown";
}

std::optional<Algorithm> ParseAlgorithm(std::string_view name) {
  for (const auto& [value, n] : kAlgorithmNames) {
    if (n == name) return value;
  }
  return std::nullopt;
}

std::string_view AcceptedAlgorithms() { return "auto, two_phase, allgather, native, fp32, bf16"; }

uint32_t EffectiveHadamardBlock(const LayerPolicy& p) {
  if (!p.hadamard) return 0;
  if (p.hadamard_block) return p.hadamard_block;
  switch (p.format) {
    case Format::kNvfp4:
      return 16;
    case Format::kMxfp8:
      return 32;
    case Format::kFp8E4M3:
    case Format::kFp8E5M2:
      return p.scaling == Scaling::kBlock ? p.block : 128;
    default:
      return 128;
  }
}

Algorithm ResolveAlgorithm(Algorithm a, int ranks) {
  if (a != Algorithm::kAuto) return a;
  return ranks <= 2 ? Algorithm::kAllGather : Algorithm::kTwoPhase;
}

std::string_view GeometryEstimatorName(GeometryEstimator e) {
  switch (e) {
    case GeometryEstimator::kInstant:
      return "instant";
    case GeometryEstimator::kFactorEma:
      return "ema";
  }
  return "unknown";
}

std::optional<GeometryEstimator> ParseGeometryEstimator(std::string_view name) {
  if (name == "instant") return GeometryEstimator::kInstant;
  if (name == "ema") return GeometryEstimator::kFactorEma;
  return std::nullopt;
}

std::string_view AcceptedGeometryEstimators() { return "instant, ema"; }

}  // namespace geofp8
