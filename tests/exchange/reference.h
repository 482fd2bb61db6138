// Test oracle for the exchange: computes what every rank must end with, straight from the codec
// API and the documented layout, without the communicator or the engine's algorithm code.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/exchange/bf16.h"
#include "kernels/exchange/chunking.h"
#include "kernels/exchange/policy.h"

namespace geofp8::testing {

// Scale-block size of the policy (chunk boundaries must be multiples of it).
inline size_t BlockOf(const LayerPolicy& p) {
  if (p.format == Format::kMxfp8) return 32;
  if (p.format == Format::kNvfp4) return 16;
  if (p.format == Format::kFp32 || p.format == Format::kBf16) return 1;
  return p.scaling == Scaling::kBlock ? p.block : 1;
}

inline std::vector<uint8_t> Enc(std::span<const float> x, const CodecOptions& o) {
  std::vector<uint8_t> out(EncodedBytes(o, x.size()));
  Encode(x, o, out);
  return out;
}

// inputs[r]: rank r's layer gradient, already divided by N (and transformed, if geometry).
inline std::vector<float> ReferenceTwoPhase(const std::vector<std::vector<float>>& inputs,
                                            const LayerPolicy& p, uint64_t seed, uint64_t step,
                                            uint32_t layer) {
  const int n = static_cast<int>(inputs.size());
  const size_t count = inputs[0].size();
  const size_t g = BlockOf(p);
  const size_t blocks = (count + g - 1) / g;
  std::vector<float> out(count);
  for (int j = 0; j < n; ++j) {
    const size_t b = std::min(blocks * j / n * g, count),
                 e = std::min(blocks * (j + 1) / n * g, count);
    std::vector<float> acc(e - b, 0.f);
    for (int r = 0; r < n; ++r) {
      const auto o = LayerCodecOptions(p, seed, step, layer, r, 1, j);
      const auto enc = Enc(std::span<const float>(inputs[r]).subspan(b, e - b), o);
      std::vector<float> dec(e - b);
      Decode(enc, dec);
      for (size_t i = 0; i < dec.size(); ++i) acc[i] += dec[i];  // rank order, fp32
    }
    const auto enc = Enc(acc, LayerCodecOptions(p, seed, step, layer, j, 2, j));
    Decode(enc, std::span<float>(out).subspan(b, e - b));
  }
  return out;
}

inline std::vector<float> ReferenceAllGather(const std::vector<std::vector<float>>& inputs,
                                             const LayerPolicy& p, uint64_t seed, uint64_t step,
                                             uint32_t layer) {
  std::vector<float> out(inputs[0].size(), 0.f);
  for (size_t r = 0; r < inputs.size(); ++r) {
    const auto enc = Enc(inputs[r], LayerCodecOptions(p, seed, step, layer, r, 1, 0));
    std::vector<float> dec(out.size());
    Decode(enc, dec);
    for (size_t i = 0; i < out.size(); ++i) out[i] += dec[i];
  }
  return out;
}

// Relative half-step of the element format, used for the error bound against the exact average:
// one quantization moves an element by at most rel * (its scale block's amax).
inline double FormatRelStep(Format f) {
  switch (f) {
    case Format::kFp32:
      return std::ldexp(1.0, -23);
    case Format::kBf16:
      return std::ldexp(1.0, -8);
    case Format::kFp8E4M3:
      return std::ldexp(1.0, -4);
    case Format::kFp8E5M2:
      return std::ldexp(1.0, -3);
    case Format::kMxfp8:
      return std::ldexp(1.0, -3);  // power-of-two scale: up to 2x less range
    case Format::kNvfp4:
      return 0.25;
  }
  return 1.0;
}

}  // namespace geofp8::testing
