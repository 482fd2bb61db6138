// Names and properties of the codec's formats, scalings and roundings: the one name<->enum map.
// CLI, YAML and proto parsers all go through these functions.
#include "kernels/codec/format.h"

#include <cfloat>

namespace geofp8 {
namespace {

struct FormatInfo {
  Format format;
  std::string_view name;
  float max;
  int bits;
};
constexpr FormatInfo kFormats[] = {
    {Format::kFp32, "fp32", FLT_MAX, 32},     {Format::kBf16, "bf16", 3.3895313892515355e38f, 16},
    {Format::kFp8E4M3, "fp8_e4m3", 448.f, 8}, {Format::kFp8E5M2, "fp8_e5m2", 57344.f, 8},
    {Format::kMxfp8, "mxfp8", 448.f, 8},      {Format::kNvfp4, "nvfp4", 6.f, 4},
};
constexpr std::string_view kScalingNames[] = {"none", "tensor", "block"};
constexpr std::string_view kRoundingNames[] = {"nearest", "stochastic"};

const FormatInfo* Find(Format f) {
  for (const auto& info : kFormats) {
    if (info.format == f) return &info;
  }
  return nullptr;
}

}  // namespace

std::string_view FormatName(Format f) {
  const FormatInfo* info = Find(f);
  return info ? info->name : "unknown";
}
std::string_view ScalingName(Scaling s) {
  const auto i = static_cast<size_t>(s);
  return i < std::size(kScalingNames) ? kScalingNames[i] : "unknown";
}
std::string_view RoundingName(Rounding r) {
  const auto i = static_cast<size_t>(r);
  return i < std::size(kRoundingNames) ? kRoundingNames[i] : "unknown";
}

std::optional<Format> ParseFormat(std::string_view name) {
  for (const auto& info : kFormats) {
    if (info.name == name) return info.format;
  }
  return std::nullopt;
}
std::optional<Scaling> ParseScaling(std::string_view name) {
  for (size_t i = 0; i < std::size(kScalingNames); ++i) {
    if (kScalingNames[i] == name) return static_cast<Scaling>(i);
  }
  return std::nullopt;
}
std::optional<Rounding> ParseRounding(std::string_view name) {
  for (size_t i = 0; i < std::size(kRoundingNames); ++i) {
    if (kRoundingNames[i] == name) return static_cast<Rounding>(i);
  }
  return std::nullopt;
}

std::string_view AcceptedFormats() { return "fp32, bf16, fp8_e4m3, fp8_e5m2, mxfp8, nvfp4"; }
std::string_view AcceptedScalings() { return "none, tensor, block"; }
std::string_view AcceptedRoundings() { return "nearest, stochastic"; }

float FormatMax(Format f) {
  const FormatInfo* info = Find(f);
  return info ? info->max : 0.f;
}
int FormatBits(Format f) {
  const FormatInfo* info = Find(f);
  return info ? info->bits : 0;
}

}  // namespace geofp8
