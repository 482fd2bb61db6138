// Wire formats, scaling modes and rounding modes of the low-precision codec, with their names.
// The one place that maps names to enums: every parser (CLI, YAML, proto) goes through here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace geofp8 {

// Element format on the wire. Values are stable: they are written into encoded headers.
enum class Format : uint8_t {
  kFp32 = 0,     // baseline, 4 bytes per element
  kBf16 = 1,     // baseline, 2 bytes per element, round-to-nearest-even
  kFp8E4M3 = 2,  // OCP E4M3 "fn": bias 7, max 448, no inf, NaN = S.1111.111
  kFp8E5M2 = 3,  // bias 15, max 57344, inf and NaN
  kMxfp8 = 4,    // OCP MX v1.0: E4M3 elements, E8M0 scale per 32 elements
  kNvfp4 = 5,    // E2M1 elements, E4M3 scale per 16 elements, plus one fp32 tensor scale
};

// How scale factors are chosen before conversion. mxfp8 and nvfp4 always use their own blocks.
enum class Scaling : uint8_t {
  kNone = 0,    // raw conversion, scale 1
  kTensor = 1,  // one fp32 scale per tensor: fmt_max / amax
  kBlock = 2,   // one fp32 scale per block of `block` elements
};

enum class Rounding : uint8_t {
  kNearest = 0,     // round to nearest, ties to even (matches the CUDA toolkit's conversions)
  kStochastic = 1,  // unbiased; random bits from a counter-based RNG, reproducible per stream
};

// Canonical lower-case names: "fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4".
std::string_view FormatName(Format f);
std::string_view ScalingName(Scaling s);    // "none", "tensor", "block"
std::string_view RoundingName(Rounding r);  // "nearest", "stochastic"

// Parsers return nullopt for an unknown name; callers report it with the accepted list below.
std::optional<Format> ParseFormat(std::string_view name);
std::optional<Scaling> ParseScaling(std::string_view name);
std::optional<Rounding> ParseRounding(std::string_view name);
std::string_view AcceptedFormats();    // "fp32, bf16, fp8_e4m3, fp8_e5m2, mxfp8, nvfp4"
std::string_view AcceptedScalings();   // "none, tensor, block"
std::string_view AcceptedRoundings();  // "nearest, stochastic"

// Largest finite magnitude of the element format (448 for E4M3, 6 for E2M1, FLT_MAX for fp32).
float FormatMax(Format f);

// Payload bits per element: 32, 16, 8 or 4.
int FormatBits(Format f);

}  // namespace geofp8
