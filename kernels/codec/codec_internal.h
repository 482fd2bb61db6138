// Internal pieces of the codec shared by the scalar reference (codec.cc), the AVX2 path
// (codec_avx2.cc) and the CUDA kernels: the resolved layout of one encoded tensor.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/codec/codec.h"
#include "kernels/codec/element.h"

namespace geofp8::detail {

// What an encode actually does once format-specific rules are applied: fp32/bf16 never scale,
// mxfp8 always uses E8M0 per 32, nvfp4 E4M3 per 16 plus an fp32 tensor scale.
struct Layout {
  Format format = Format::kFp8E4M3;
  Scaling scaling = Scaling::kNone;
  uint32_t block = 0;  // elements per scale (0 unless scaling == kBlock)
  size_t count = 0;
  size_t num_blocks = 0;  // scale entries (kTensor: 1)
  size_t scale_bytes = 0;
  size_t payload_bytes = 0;
};

Layout MakeLayout(Format format, Scaling scaling, uint32_t block, size_t n);
Layout MakeLayout(const CodecOptions& options, size_t n);

// Checks a header (magic, version, enums, block consistency); returns the total encoded bytes it
// implies. Throws geofp8::Error naming the problem.
size_t ValidateHeader(const EncodedHeader& header);

// Element constants of the vector paths, as in element::FloatToSmall: M mantissa bits, bias B,
// the sign's bit in the code; kNvfp4 means its E2M1 elements.
template <Format F>
struct Fp8Params {
  static constexpr bool kE2M1 = F == Format::kNvfp4;
  static constexpr int M = kE2M1 ? 1 : F == Format::kFp8E5M2 ? 2 : 3;
  static constexpr int B = kE2M1 ? 1 : F == Format::kFp8E5M2 ? 15 : 7;
  static constexpr int kSignBit = kE2M1 ? 3 : 7;
  static constexpr uint32_t kMaxCode = kE2M1 ? 0x7u : F == Format::kFp8E5M2 ? 0x7Bu : 0x7Eu;
  static constexpr float kMax = kE2M1 ? 6.f : F == Format::kFp8E5M2 ? 57344.f : 448.f;
};

// 1 / X for an mxfp8 scale code (X = E8M0ToFloat(code)), exactly: X is 2^(code - 127), so its
// inverse is the E8M0 value of 254 - code (2^-127, a float subnormal, for code 254). The vector
// paths multiply by it; the quotient x / X equals the product since both are one rounding of
// the same exact value.
inline float MxInverseScale(uint8_t code) {
  return element::E8M0ToFloat(static_cast<uint8_t>(254 - code));
}

// nvfp4's last, partial block by the scalar rule: len < 16 values y, its scale code to *code and
// its nibbles to payload (zeroed first); the vector paths end with it.
inline void EncodeNvPartialBlock(const float* y, size_t len, float g, uint8_t* code,
                                 uint8_t* payload, EncodeStats* st) {
  float amax = 0.f;
  for (size_t i = 0; i < len; ++i) amax = std::max(amax, element::AbsF(y[i]));
  *code = element::NvBlockScaleCode(amax, g);
  const float den = element::NvDenominator(*code, g);
  std::memset(payload, 0, (len + 1) / 2);
  for (size_t i = 0; i < len; ++i) {
    bool s;
    const uint8_t e = element::EncodeNvElement(y[i], den, false, 0, &s);
    st->saturated += s;
    payload[i / 2] |= static_cast<uint8_t>(e << (4 * (i & 1)));
  }
}

// One fp8 element (scalar reference; the AVX2 path uses it for blocks with non-finite values).
template <Format F>
inline uint8_t EncodeFp8Element(float x, float scale, bool stochastic, uint32_t r,
                                uint64_t* saturated) {
  bool sat;
  const uint8_t code =
      element::EncodeFp8Scaled(F == Format::kFp8E5M2, x, scale, stochastic, r, &sat);
  *saturated += sat;
  return code;
}

// Vectorized fp8 paths (E4M3/E5M2 with fp32 scales, and mxfp8), nearest rounding; defined in
// codec_avx2.cc.
// Return false (doing nothing) when the processor lacks AVX2+FMA+F16C or the case is not
// covered, in which case the caller runs the scalar reference. Results are bit-identical.
bool CpuHasAvx2();
bool EncodeFp8Avx2(const float* x, const Layout& layout, uint8_t* scales, uint8_t* payload,
                   EncodeStats* stats);
// The AVX-512 encode of the whole blocks of an fp8 block-scaled (blocks 16, 32, 64, 128) or
// mxfp8 layout, nearest rounding, into the layout's scales and payload; codec_avx512.cc. Returns
// how many leading elements it encoded (a multiple of the block), 0 when it declines (no
// AVX-512, Avx512Enabled() false, or a case it does not cover). Bit-identical to the scalar path.
size_t EncodeWholeBlocksAvx512(const float* x, const Layout& layout, uint8_t* scales,
                               uint8_t* payload, EncodeStats* stats);
// The AVX-512 nvfp4 encode of a whole tensor (nearest rounding); codec_avx512.cc. False, having
// written nothing that counts, without AVX-512, when Avx512Enabled() is false, or when the tensor
// holds a non-finite value (the scalar path's case).
bool EncodeNvAvx512(const float* x, const Layout& layout, uint8_t* scales, uint8_t* payload,
                    EncodeStats* stats);
bool DecodeFp8Avx2(const Layout& layout, const uint8_t* scales, const uint8_t* payload, float* out,
                   bool accumulate);

// Runtime switch for tests and the bench: false forces the scalar reference everywhere.
void SetVectorizedEnabled(bool enabled);
bool VectorizedEnabled();
// Runtime switch for the AVX-512 paths (tests and the bench compare them with AVX2): false keeps
// AVX2 where both exist. Avx512Enabled() is false whenever VectorizedEnabled() is.
void SetAvx512Enabled(bool enabled);
bool Avx512Enabled();

}  // namespace geofp8::detail
