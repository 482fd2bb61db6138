// Codec behaviour through the public API: wire layout, scaling rules of DESIGN.md section 3,
// MXFP8/NVFP4 block scales, non-finite handling, odd sizes and unaligned buffers, error bounds.
#include "kernels/codec/codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/codec/codec_internal.h"
#include "kernels/codec/element.h"
#include "kernels/codec/error_metrics.h"
#include "kernels/common/check.h"

namespace geofp8 {
namespace {

using element::BitsFloat;
using element::FloatBits;

constexpr Format kAllFormats[] = {Format::kFp32,    Format::kBf16,  Format::kFp8E4M3,
                                  Format::kFp8E5M2, Format::kMxfp8, Format::kNvfp4};

std::vector<float> Gaussian(size_t n, uint32_t seed, float sigma = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<uint8_t> EncodeVec(std::span<const float> x, const CodecOptions& o,
                               EncodeStats* st = nullptr) {
  std::vector<uint8_t> buf(EncodedBytes(o, x.size()));
  const EncodeStats s = Encode(x, o, buf);
  if (st) *st = s;
  return buf;
}

std::vector<float> DecodeVec(std::span<const uint8_t> buf) {
  const EncodedView v = ParseEncoded(buf);
  std::vector<float> out(v.header.count);
  Decode(buf, out);
  return out;
}

float Scale(std::span<const uint8_t> buf, size_t i) {
  const EncodedView v = ParseEncoded(buf);
  float s;
  std::memcpy(&s, v.scales.data() + 4 * i, 4);
  return s;
}

// The scale bytes a buffer must hold for finite input x, computed here from the rules of
// DESIGN.md section 3 and codec.h rather than read back from the buffer under test:
// - fp8_e4m3/e5m2: fp32 fmt_max / amax per block (or tensor), one ulp lower if amax * scale would
//   exceed fmt_max; 1 for an all-zero block.
// - mxfp8 (OCP MX v1.0): E8M0 code of 2^(floor(log2(amax)) - emax_elem), emax_elem = 8 for E4M3,
//   per 32 elements; 127 (X = 1) for an all-zero block.
// - nvfp4: fp32 g = amax_tensor / (6 * 448), then per 16 elements the E4M3 value nearest to
//   amax_block / (6 g) (ties to even, saturating at 448), 0x38 (1.0) where that is zero.
float ExpectedFp8Scale(float amax, float fmt_max) {
  if (!(amax > 0.f)) return 1.f;
  float s = std::min(fmt_max / amax, std::numeric_limits<float>::max());
  if (amax * s > fmt_max) s = std::nextafter(s, 0.f);
  return s;
}
uint8_t NearestE4M3(float q) {
  int best = 0;
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(double(element::E4M3ToFloat(uint8_t(c))) - q);
    const double bd = std::fabs(double(element::E4M3ToFloat(uint8_t(best))) - q);
    if (d < bd || (d == bd && c % 2 == 0)) best = c;
  }
  return uint8_t(best);
}
std::vector<uint8_t> ExpectedScaleBytes(std::span<const float> x, Format f, Scaling sc,
                                        uint32_t block) {
  auto amax = [&](size_t b, size_t e) {
    float a = 0.f;
    for (size_t i = b; i < std::min(e, x.size()); ++i) a = std::max(a, std::fabs(x[i]));
    return a;
  };
  std::vector<uint8_t> out;
  auto put_f32 = [&](float v) {
    uint8_t b[4];
    std::memcpy(b, &v, 4);
    out.insert(out.end(), b, b + 4);
  };
  switch (f) {
    case Format::kFp32:
    case Format::kBf16:
      break;
    case Format::kFp8E4M3:
    case Format::kFp8E5M2: {
      const float fmax = f == Format::kFp8E4M3 ? 448.f : 57344.f;
      if (sc == Scaling::kTensor) put_f32(ExpectedFp8Scale(amax(0, x.size()), fmax));
      if (sc == Scaling::kBlock)
        for (size_t b = 0; b < x.size(); b += block)
          put_f32(ExpectedFp8Scale(amax(b, b + block), fmax));
      break;
    }
    case Format::kMxfp8:
      for (size_t b = 0; b < x.size(); b += 32) {
        const float a = amax(b, b + 32);
        out.push_back(a > 0.f ? uint8_t(std::clamp(std::ilogb(a) - 8 + 127, 0, 254)) : 127);
      }
      break;
    case Format::kNvfp4: {
      const float at = amax(0, x.size());
      float g = at / (6.f * 448.f);
      if (!(g > 0.f)) g = 1.f;
      put_f32(g);
      for (size_t b = 0; b < x.size(); b += 16) {
        const uint8_t c = NearestE4M3(amax(b, b + 16) / (6.f * g));
        out.push_back(c == 0 ? 0x38 : c);
      }
      break;
    }
  }
  return out;
}

std::vector<uint8_t> ScaleBytes(std::span<const uint8_t> buf) {
  const EncodedView v = ParseEncoded(buf);
  return std::vector<uint8_t>(v.scales.begin(), v.scales.end());
}

TEST(CodecFormat, NamesRoundTrip) {
  for (Format f : kAllFormats) EXPECT_EQ(ParseFormat(FormatName(f)), f);
  for (Scaling s : {Scaling::kNone, Scaling::kTensor, Scaling::kBlock}) {
    EXPECT_EQ(ParseScaling(ScalingName(s)), s);
  }
  for (Rounding r : {Rounding::kNearest, Rounding::kStochastic}) {
    EXPECT_EQ(ParseRounding(RoundingName(r)), r);
  }
  EXPECT_FALSE(ParseFormat("fp8"));
  EXPECT_FALSE(ParseScaling("row"));
  EXPECT_FALSE(ParseRounding("up"));
  EXPECT_EQ(FormatMax(Format::kFp8E4M3), 448.f);
  EXPECT_EQ(FormatMax(Format::kFp8E5M2), 57344.f);
  EXPECT_EQ(FormatMax(Format::kNvfp4), 6.f);
  EXPECT_EQ(FormatBits(Format::kNvfp4), 4);
  EXPECT_EQ(FormatBits(Format::kBf16), 16);
}

TEST(CodecOptions, ValidationNamesTheField) {
  CodecOptions o;
  EXPECT_EQ(ValidateCodecOptions(o), "");
  o.block = 0;
  EXPECT_NE(ValidateCodecOptions(o).find("block"), std::string::npos);
  o = {};
  o.format = static_cast<Format>(9);
  EXPECT_NE(ValidateCodecOptions(o).find("format"), std::string::npos);
  std::vector<float> x(4);
  std::vector<uint8_t> out(256);
  EXPECT_THROW(Encode(x, o, out), Error);
  o = {};
  o.scaling = static_cast<Scaling>(7);
  EXPECT_NE(ValidateCodecOptions(o).find("scaling"), std::string::npos);
  o = {};
  o.rounding = static_cast<Rounding>(7);
  EXPECT_NE(ValidateCodecOptions(o).find("rounding"), std::string::npos);
}

TEST(CodecLayout, ByteCounts) {
  CodecOptions o;
  o.block = 128;
  EXPECT_EQ(PayloadBytes(o, 300), 300u);
  EXPECT_EQ(ScaleBytes(o, 300), 3u * 4);
  EXPECT_EQ(EncodedBytes(o, 300), 24u + 12 + 300);
  o.scaling = Scaling::kTensor;
  EXPECT_EQ(ScaleBytes(o, 300), 4u);
  EXPECT_EQ(ScaleBytes(o, 0), 4u);
  o.scaling = Scaling::kNone;
  EXPECT_EQ(ScaleBytes(o, 300), 0u);
  o.format = Format::kMxfp8;
  EXPECT_EQ(ScaleBytes(o, 65), 3u);
  EXPECT_EQ(PayloadBytes(o, 65), 65u);
  o.format = Format::kNvfp4;
  EXPECT_EQ(ScaleBytes(o, 33), 4u + 3);
  EXPECT_EQ(PayloadBytes(o, 33), 17u);
  o.format = Format::kBf16;
  EXPECT_EQ(PayloadBytes(o, 5), 10u);
  EXPECT_EQ(ScaleBytes(o, 5), 0u);
  o.format = Format::kFp32;
  EXPECT_EQ(PayloadBytes(o, 5), 20u);
}

// MaxEncodedBytes bounds the real encoded size of every option set the codec accepts, whatever
// the element count: the exchange sizes receives with it for ranks whose options may differ.
TEST(CodecLayout, MaxEncodedBytesBoundsEveryOptionSet) {
  std::vector<float> x(4097);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::ldexp(static_cast<float>(i % 37) - 18.f, -3);
  for (Format f : {Format::kFp32, Format::kBf16, Format::kFp8E4M3, Format::kFp8E5M2, Format::kMxfp8,
                   Format::kNvfp4}) {
    for (Scaling s : {Scaling::kNone, Scaling::kTensor, Scaling::kBlock}) {
      for (uint32_t block : {1u, 2u, 3u, 7u, 16u, 32u, 100u, 128u, 4096u, 0xffffffffu}) {
        for (Rounding rounding : {Rounding::kNearest, Rounding::kStochastic}) {
          CodecOptions o;
          o.format = f;
          o.scaling = s;
          o.block = block;
          o.rounding = rounding;
          ASSERT_EQ(ValidateCodecOptions(o), "");
          for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{15}, size_t{33}, size_t{1000},
                           size_t{4097}}) {
            const size_t bytes = EncodedBytes(o, n);
            ASSERT_LE(bytes, MaxEncodedBytes(n))
                << FormatName(f) << " " << ScalingName(s) << " block " << block << " n " << n;
            // The real encode fills exactly that many bytes and parses back to n elements.
            std::vector<uint8_t> out(bytes);
            Encode(std::span<const float>(x).first(n), o, out);
            ASSERT_EQ(ParseEncoded(out).header.count, n);
          }
        }
      }
    }
  }
  // fp8 with block 1 is the largest: 4 scale bytes and 1 payload byte per element.
  CodecOptions worst;
  worst.block = 1;
  EXPECT_EQ(EncodedBytes(worst, 1000), MaxEncodedBytes(1000) - 4);
}

TEST(CodecWire, HeaderIsSelfDescribing) {
  CodecOptions o;
  o.block = 64;
  const auto x = Gaussian(100, 1);
  const auto buf = EncodeVec(x, o);
  const EncodedView v = ParseEncoded(buf);
  EXPECT_EQ(buf[0], kEncodedMagic);
  EXPECT_EQ(buf[1], kEncodedVersion);
  EXPECT_EQ(v.header.format, static_cast<uint8_t>(Format::kFp8E4M3));
  EXPECT_EQ(v.header.scaling, static_cast<uint8_t>(Scaling::kBlock));
  EXPECT_EQ(v.header.block, 64u);
  EXPECT_EQ(v.header.count, 100u);
  EXPECT_EQ(v.header.flags, 0);
  EXPECT_EQ(v.scales.size(), 8u);
  EXPECT_EQ(v.payload.size(), 100u);
  o.format = Format::kMxfp8;
  const EncodedView m = ParseEncoded(EncodeVec(x, o));
  EXPECT_EQ(m.header.block, 32u);
  EXPECT_EQ(m.header.scaling, static_cast<uint8_t>(Scaling::kBlock));
}

TEST(CodecWire, MalformedBuffersAreRejected) {
  CodecOptions o;
  const auto x = Gaussian(50, 2);
  auto buf = EncodeVec(x, o);
  EXPECT_THROW(ParseEncoded(std::span(buf).first(10)), Error);
  EXPECT_THROW(ParseEncoded(std::span(buf).first(buf.size() - 1)), Error);
  auto bad = buf;
  bad[0] = 0;
  EXPECT_THROW(ParseEncoded(bad), Error);
  bad = buf;
  bad[1] = 2;
  EXPECT_THROW(ParseEncoded(bad), Error);
  bad = buf;
  bad[2] = 17;
  EXPECT_THROW(ParseEncoded(bad), Error);
  bad = buf;
  bad[4] = 0;  // block 0 with block scaling
  bad[5] = 0;
  EXPECT_THROW(ParseEncoded(bad), Error);
  std::vector<float> wrong(49);
  EXPECT_THROW(Decode(buf, wrong), Error);
  std::vector<uint8_t> small(buf.size() - 1);
  EXPECT_THROW(Encode(x, o, small), Error);
}

// Per-tensor: the scale is fmt_max / amax and the largest element lands on the format max.
TEST(CodecScaling, TensorScaleIsMaxOverAmax) {
  for (Format f : {Format::kFp8E4M3, Format::kFp8E5M2}) {
    CodecOptions o;
    o.format = f;
    o.scaling = Scaling::kTensor;
    std::vector<float> x = {0.5f, -3.f, 1.25f, 2.f};
    EncodeStats st;
    const auto buf = EncodeVec(x, o, &st);
    EXPECT_EQ(Scale(buf, 0), FormatMax(f) / 3.f);
    const EncodedView v = ParseEncoded(buf);
    EXPECT_EQ(v.payload[1], f == Format::kFp8E4M3 ? 0xFE : 0xFB);  // -max
    EXPECT_EQ(st.saturated, 0u);
    const auto y = DecodeVec(buf);
    EXPECT_FLOAT_EQ(y[1], -3.f);
  }
}

// Per-block with a block max that does not divide evenly: the largest element never counts as
// saturated (the scale is nudged down one ulp when amax * scale rounds above the max).
TEST(CodecScaling, BlockMaxNeverSaturates) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(1e-3f, 1e3f);
  CodecOptions o;
  o.block = 1;
  std::vector<float> x(5000);
  for (auto& v : x) v = u(rng);
  EncodeStats st;
  const auto buf = EncodeVec(x, o, &st);
  EXPECT_EQ(st.saturated, 0u);
  const EncodedView v = ParseEncoded(buf);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(v.payload[i], 0x7E) << i;
    ASSERT_LE(x[i] * Scale(buf, i), 448.f);
  }
}

TEST(CodecScaling, AllZeroBlocksGetScaleOne) {
  std::vector<float> x(300, 0.f);
  x[299] = 2.f;
  x[5] = -0.f;
  for (Format f : kAllFormats) {
    for (Scaling s : {Scaling::kTensor, Scaling::kBlock}) {
      CodecOptions o;
      o.format = f;
      o.scaling = s;
      const auto buf = EncodeVec(std::span(x).first(256), o);
      const EncodedView v = ParseEncoded(buf);
      if (f == Format::kFp8E4M3 || f == Format::kFp8E5M2) {
        for (size_t b = 0; b < v.scales.size() / 4; ++b) EXPECT_EQ(Scale(buf, b), 1.f);
      } else if (f == Format::kMxfp8) {
        for (uint8_t c : v.scales) EXPECT_EQ(c, 127);
      } else if (f == Format::kNvfp4) {
        EXPECT_EQ(Scale(buf, 0), 1.f);
        for (size_t b = 4; b < v.scales.size(); ++b) EXPECT_EQ(v.scales[b], 0x38);
      }
      for (float y : DecodeVec(buf)) EXPECT_EQ(y, 0.f);
      // A zero block next to a nonzero one.
      const auto buf2 = EncodeVec(x, o);
      const auto y2 = DecodeVec(buf2);
      for (size_t i = 0; i < 299; ++i) ASSERT_EQ(y2[i], 0.f) << FormatName(f) << " " << i;
      EXPECT_EQ(y2[299], 2.f) << FormatName(f);
      // Every scale, of the zero blocks and of the one holding 2.
      EXPECT_EQ(ScaleBytes(buf2), ExpectedScaleBytes(x, f, s, o.block))
          << FormatName(f) << " " << ScalingName(s);
      const EncodedView v2 = ParseEncoded(buf2);
      if (f == Format::kFp8E4M3 || f == Format::kFp8E5M2) {
        const float fmax = f == Format::kFp8E4M3 ? 448.f : 57344.f;
        EXPECT_EQ(Scale(buf2, v2.scales.size() / 4 - 1), fmax / 2);  // amax 2, exact quotient
      } else if (f == Format::kMxfp8) {
        EXPECT_EQ(v2.scales[299 / 32], 127 + 1 - 8);  // floor(log2 2) - 8
      } else if (f == Format::kNvfp4) {
        EXPECT_EQ(Scale(buf2, 0), 2.f / 2688);
        EXPECT_EQ(v2.scales[4 + 299 / 16], 0x7E);  // 2 / (6 g) = 448
      }
    }
  }
}

TEST(CodecScaling, TinyAmaxGivesFiniteScale) {
  std::vector<float> x = {1e-44f, -3e-45f, 0.f};
  for (Format f : {Format::kFp8E4M3, Format::kFp8E5M2, Format::kMxfp8, Format::kNvfp4}) {
    CodecOptions o;
    o.format = f;
    o.scaling = Scaling::kTensor;
    EncodeStats st;
    const auto buf = EncodeVec(x, o, &st);
    EXPECT_EQ(st.nonfinite, 0u);
    for (float y : DecodeVec(buf)) EXPECT_TRUE(std::isfinite(y)) << FormatName(f);
  }
}

// OCP MX v1.0: X = 2^(floor(log2(amax)) - 8) as E8M0; elements E4M3(x / X), saturating.
TEST(CodecMxfp8, SharedScaleFollowsTheSpec) {
  std::vector<float> x(96, 0.f);
  x[0] = 1.f;     // block 0: amax 1 -> X = 2^-8 (code 119), 1.0 -> 256
  x[1] = -0.5f;   //   -> -128
  x[32] = 500.f;  // block 1: amax 500 -> floor(log2) = 8 -> X = 1 (code 127), 500 -> 448 (sat)
  x[33] = 3.f;
  x[64] = 7e-3f;  // block 2: floor(log2(0.007)) = -8 -> X = 2^-16 (code 111); 458.75 -> 448
  x[65] = 5e-3f;  //   -> 327.68
  EncodeStats st;
  CodecOptions o;
  o.format = Format::kMxfp8;
  const auto buf = EncodeVec(x, o, &st);
  const EncodedView v = ParseEncoded(buf);
  ASSERT_EQ(v.scales.size(), 3u);
  EXPECT_EQ(v.scales[0], 119);
  EXPECT_EQ(v.scales[1], 127);
  EXPECT_EQ(v.scales[2], 111);
  EXPECT_EQ(v.payload[0], element::FloatToE4M3(256.f));
  EXPECT_EQ(v.payload[1], element::FloatToE4M3(-128.f));
  EXPECT_EQ(v.payload[32], 0x7E);
  EXPECT_EQ(v.payload[64], 0x7E);
  EXPECT_EQ(v.payload[65], element::FloatToE4M3(5e-3f * 65536.f));
  EXPECT_EQ(st.saturated, 2u);
  const auto y = DecodeVec(buf);
  EXPECT_EQ(y[0], 1.f);
  EXPECT_EQ(y[1], -0.5f);
  EXPECT_EQ(y[32], 448.f);
  EXPECT_EQ(y[33], 3.f);
  EXPECT_EQ(element::MxScaleCode(0.f), 127);
  EXPECT_EQ(element::MxScaleCode(3.4e38f), 246);              // floor(log2) = 127 -> 127 - 8 + 127
  EXPECT_EQ(element::MxScaleCode(BitsFloat(1)), 0);           // 2^-149 clamps at 0
  EXPECT_EQ(element::MxScaleCode(std::ldexp(1.f, -120)), 0);  // 2^-128 clamps at 0
  EXPECT_EQ(element::MxScaleCode(std::ldexp(1.5f, -100)), 19);  // 2^-108 -> 19
}

// NVFP4: g = amax_t / 2688, d_b = E4M3(amax_b / (6 g)), element = E2M1(x / (d_b g)),
// element 2i in the low nibble.
TEST(CodecNvfp4, ScalesAndNibbleOrder) {
  std::vector<float> x(48, 0.f);
  x[0] = 2688.f;  // block 0: d_b = 448 (0x7E); 2688 / 448 = 6 -> code 7 in the low nibble
  x[1] = -448.f;  // -1 -> 0xA in the high nibble
  x[16] = 6.f;    // block 1: d_b = 1 (0x38): 6 -> 7
  x[17] = 0.5f;   //   0.5 -> 1
  x[32] = 3.f;    // block 2: d_b = 0.5 (0x30): 3 -> 6 -> 7
  x[33] = 0.75f;  //   1.5 -> 3
  CodecOptions o;
  o.format = Format::kNvfp4;
  EncodeStats st;
  const auto buf = EncodeVec(x, o, &st);
  const EncodedView v = ParseEncoded(buf);
  ASSERT_EQ(v.scales.size(), 4u + 3);
  EXPECT_EQ(Scale(buf, 0), 1.f);
  EXPECT_EQ(v.scales[4], 0x7E);
  EXPECT_EQ(v.scales[5], 0x38);
  EXPECT_EQ(v.scales[6], 0x30);
  EXPECT_EQ(v.payload[0], 0xA7);
  EXPECT_EQ(v.payload[8], 0x17);
  EXPECT_EQ(v.payload[16], 0x37);
  EXPECT_EQ(st.saturated, 0u);
  const auto y = DecodeVec(buf);
  EXPECT_EQ(y[0], 2688.f);
  EXPECT_EQ(y[1], -448.f);
  EXPECT_EQ(y[17], 0.5f);
  EXPECT_EQ(y[33], 0.75f);
  // The largest block scale lands at E4M3's max for any tensor amax.
  for (float amax : {1e-3f, 0.37f, 5.f, 1e6f}) {
    std::vector<float> z = {amax, amax / 10};
    const auto b = EncodeVec(z, o);
    EXPECT_EQ(ParseEncoded(b).scales[4], 0x7E) << amax;
    EXPECT_EQ(ParseEncoded(b).payload[0] & 0xF, 7) << amax;
  }
}

TEST(CodecNonFinite, FlaggedCountedNeverFinite) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (Format f : kAllFormats) {
    for (Rounding r : {Rounding::kNearest, Rounding::kStochastic}) {
      std::vector<float> x = Gaussian(200, 4);
      x[3] = nan;
      x[70] = inf;
      x[150] = -inf;
      CodecOptions o;
      o.format = f;
      o.rounding = r;
      o.block = 32;
      EncodeStats st;
      const auto buf = EncodeVec(x, o, &st);
      EXPECT_EQ(st.nonfinite, 3u) << FormatName(f);
      EXPECT_EQ(ParseEncoded(buf).header.flags & kFlagNonFinite, kFlagNonFinite);
      const auto y = DecodeVec(buf);
      EXPECT_TRUE(std::isnan(y[3])) << FormatName(f);
      EXPECT_FALSE(std::isfinite(y[70])) << FormatName(f);
      EXPECT_FALSE(std::isfinite(y[150])) << FormatName(f);
      // Other blocks are unaffected.
      EXPECT_TRUE(std::isfinite(y[100])) << FormatName(f);
      EXPECT_NEAR(y[100], x[100], 0.3f * std::fabs(x[100]) + 0.1f) << FormatName(f);
    }
  }
  std::vector<float> ok = Gaussian(10, 5);
  EXPECT_EQ(ParseEncoded(EncodeVec(ok, CodecOptions{})).header.flags, 0);
}

TEST(CodecSaturation, NoneScalingSaturatesAndCounts) {
  CodecOptions o;
  o.scaling = Scaling::kNone;
  std::vector<float> x = {1000.f, -500.f, 448.f, 1.f, 3e38f};
  EncodeStats st;
  const auto y = DecodeVec(EncodeVec(x, o, &st));
  EXPECT_EQ(st.saturated, 3u);
  EXPECT_EQ(y[0], 448.f);
  EXPECT_EQ(y[1], -448.f);
  EXPECT_EQ(y[4], 448.f);
  o.format = Format::kBf16;
  const auto z = DecodeVec(EncodeVec(std::vector<float>{3.4028235e38f}, o));
  EXPECT_TRUE(std::isfinite(z[0]));
}

// Round-trip error bound per element for each format, on data spanning many magnitudes.
struct Bound {
  Format format;
  Scaling scaling;
  double rel;  // relative error bound per element (half an ulp of the element format)
  double fro;  // bound on the relative Frobenius error for Gaussian data
};

TEST(CodecRoundTrip, ErrorBoundsPerFormat) {
  const Bound bounds[] = {
      {Format::kFp32, Scaling::kNone, 0.0, 0.0},
      {Format::kBf16, Scaling::kNone, 1.0 / 256, 0.003},
      {Format::kFp8E4M3, Scaling::kBlock, 1.0 / 16, 0.03},
      {Format::kFp8E4M3, Scaling::kTensor, 1.0 / 16, 0.03},
      {Format::kFp8E5M2, Scaling::kBlock, 1.0 / 8, 0.06},
      {Format::kMxfp8, Scaling::kBlock, 1.0 / 16, 0.035},
      {Format::kNvfp4, Scaling::kBlock, 1.0 / 4, 0.11},
  };
  const auto x = Gaussian(4096, 6);
  for (const Bound& b : bounds) {
    CodecOptions o;
    o.format = b.format;
    o.scaling = b.scaling;
    EncodeStats st;
    const auto buf = EncodeVec(x, o, &st);
    const auto y = DecodeVec(buf);
    // The bound below is built from scales computed independently of the buffer, and the
    // buffer's scales must be exactly those: a wrong scale cannot widen its own bound.
    const std::vector<uint8_t> want = ExpectedScaleBytes(x, b.format, b.scaling, o.block);
    ASSERT_EQ(ScaleBytes(buf), want) << FormatName(b.format) << " " << ScalingName(b.scaling);
    auto want_f32 = [&](size_t i) {
      float f;
      std::memcpy(&f, want.data() + 4 * i, 4);
      return f;
    };
    double e2 = 0, x2 = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      e2 += double(y[i] - x[i]) * (y[i] - x[i]);
      x2 += double(x[i]) * x[i];
      // Absolute floor: half the smallest subnormal step, in input units.
      double floor_abs = 0, clip = 0;
      if (b.format == Format::kFp8E4M3)
        floor_abs = std::ldexp(1.0, -10) / want_f32(b.scaling == Scaling::kBlock ? i / 128 : 0);
      if (b.format == Format::kFp8E5M2) floor_abs = std::ldexp(1.0, -17) / want_f32(i / 128);
      if (b.format == Format::kMxfp8) {
        const double X = std::ldexp(1.0, int(want[i / 32]) - 127);
        floor_abs = std::ldexp(1.0, -10) * X;
        clip = std::max(0.0, std::fabs(x[i]) - 448 * X);
      }
      if (b.format == Format::kNvfp4) {
        const double den = double(element::E4M3ToFloat(want[4 + i / 16])) * want_f32(0);
        floor_abs = 0.25 * den;
        clip = std::max(0.0, std::fabs(x[i]) - 6 * den);
      }
      ASSERT_LE(std::fabs(y[i] - x[i]), b.rel * std::fabs(x[i]) + floor_abs + clip + 1e-30)
          << FormatName(b.format) << " i=" << i << " x=" << x[i] << " y=" << y[i];
    }
    EXPECT_LE(std::sqrt(e2 / x2), b.fro) << FormatName(b.format) << " " << ScalingName(b.scaling);
    if (b.format == Format::kFp32) {
      EXPECT_EQ(std::memcmp(y.data(), x.data(), 4 * x.size()), 0);
    }
  }
}

// Sizes around block and vector boundaries, buffers at odd addresses, decode vs accumulate.
TEST(CodecSizes, OddSizesAndUnalignedBuffers) {
  for (size_t n : {0, 1, 15, 17, 127, 129}) {
    const auto src = Gaussian(n + 1, 7 + n);
    for (Format f : kAllFormats) {
      for (Scaling s : {Scaling::kNone, Scaling::kTensor, Scaling::kBlock}) {
        for (Rounding r : {Rounding::kNearest, Rounding::kStochastic}) {
          CodecOptions o;
          o.format = f;
          o.scaling = s;
          o.rounding = r;
          o.block = 16;
          // Input one float past an aligned start, output one byte past it.
          std::span<const float> x(src.data() + 1, n);
          const auto aligned = EncodeVec(x, o);
          std::vector<uint8_t> raw(aligned.size() + 1, 0xCD);
          Encode(x, o, std::span(raw).subspan(1));
          ASSERT_EQ(std::memcmp(raw.data() + 1, aligned.data(), aligned.size()), 0)
              << FormatName(f) << " n=" << n;
          std::vector<float> out(n + 1, 0.f), acc(n + 1, 0.f), base(n + 1);
          Decode(std::span<const uint8_t>(raw).subspan(1), std::span(out).subspan(1));
          for (size_t i = 0; i <= n; ++i) acc[i] = base[i] = 0.25f * i;
          DecodeAccumulate(std::span<const uint8_t>(raw).subspan(1), std::span(acc).subspan(1));
          EXPECT_EQ(acc[0], base[0]);
          for (size_t i = 0; i < n; ++i) {
            ASSERT_EQ(acc[i + 1], base[i + 1] + out[i + 1]) << FormatName(f) << " n=" << n;
            ASSERT_TRUE(std::isfinite(out[i + 1]));
          }
          if (n && f == Format::kFp32) {
            EXPECT_EQ(out[1], x[0]);
          }
        }
      }
    }
  }
}

TEST(CodecStochastic, ReproduciblePerStreamAndDifferentAcrossStreams) {
  const auto x = Gaussian(1000, 8);
  for (Format f :
       {Format::kFp8E4M3, Format::kFp8E5M2, Format::kMxfp8, Format::kNvfp4, Format::kBf16}) {
    CodecOptions o;
    o.format = f;
    o.rounding = Rounding::kStochastic;
    o.seed = 1;
    o.step = 2;
    o.layer = 3;
    o.rank = 4;
    const auto a = EncodeVec(x, o);
    EXPECT_EQ(a, EncodeVec(x, o)) << FormatName(f);
    for (int field = 0; field < 4; ++field) {
      CodecOptions p = o;
      if (field == 0) p.seed = 9;
      if (field == 1) p.step = 9;
      if (field == 2) p.layer = 9;
      if (field == 3) p.rank = 9;
      EXPECT_NE(a, EncodeVec(x, p)) << FormatName(f) << " field " << field;
    }
    o.rounding = Rounding::kNearest;
    EXPECT_NE(a, EncodeVec(x, o)) << FormatName(f);
  }
}

// Unbiasedness: a value between two grid points, encoded N times with independent random bits,
// averages to itself. Each draw is lo or hi, so the mean's standard deviation is at most
// (hi - lo) / (2 sqrt(N)); we allow 6 of those (fixed seeds, so the test is deterministic; a
// correct implementation exceeds 6 sigma with probability ~2e-9). Nearest rounding misses by
// up to (hi - lo) / 2 = 1024 sigma at N = 2^22, so the test can fail.
TEST(CodecStochastic, UnbiasedWithinSixSigma) {
  constexpr size_t kN = size_t{1} << 22;
  struct Case {
    Format f;
    float x;
    float lo, hi;  // grid neighbours of x in the element format (scaling none)
  };
  const Case cases[] = {
      {Format::kFp8E4M3, 1.1f, 1.0f, 1.125f},
      {Format::kFp8E4M3, -300.3f, -320.f, -288.f},
      {Format::kFp8E4M3, 0.0041f, 0.00390625f, 0.005859375f},  // subnormal: 2^-8 and 3*2^-9
      {Format::kFp8E4M3, 0.0003f, 0.f, 0.001953125f},          // below half the min subnormal
      {Format::kFp8E5M2, 3.3f, 3.f, 3.5f},
      {Format::kBf16, 1.001f, 1.f, 1.0078125f},
  };
  for (const Case& c : cases) {
    CodecOptions o;
    o.format = c.f;
    o.scaling = Scaling::kNone;
    o.rounding = Rounding::kStochastic;
    o.seed = 12345;
    o.step = 7;
    const std::vector<float> x(kN, c.x);
    const auto y = DecodeVec(EncodeVec(x, o));
    double sum = 0;
    for (float v : y) {
      ASSERT_TRUE(v == c.lo || v == c.hi) << v;
      sum += v;
    }
    const double mean = sum / kN;
    const double sigma = (c.hi - c.lo) / (2 * std::sqrt(double(kN)));
    EXPECT_LE(std::fabs(mean - c.x), 6 * sigma)
        << FormatName(c.f) << " x=" << c.x << " mean=" << mean;
  }
  // E2M1 element: 2.4 between 2 and 3.
  double sum = 0;
  const uint64_t key = element::StreamKey(5, 0, 0, 0);
  for (size_t i = 0; i < kN; ++i) {
    sum += element::E2M1ToFloat(element::FloatToE2M1(2.4f, true, element::RandomBits(key, i)));
  }
  EXPECT_LE(std::fabs(sum / kN - 2.4), 6 * 1.0 / (2 * std::sqrt(double(kN))));
}

TEST(CodecMetrics, HandComputedValues) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> ref = {1.f, 2.f, 0.f, 4.f, nan};
  const std::vector<float> dec = {1.f, 2.5f, 0.f, 0.f, nan};
  const ErrorMetrics m = ComputeErrorMetrics(ref, dec, /*saturated=*/1);
  EXPECT_EQ(m.count, 5u);
  EXPECT_EQ(m.nonfinite_count, 1u);
  EXPECT_NEAR(m.rel_fro_error, std::sqrt(16.25 / 21.0), 1e-12);
  EXPECT_NEAR(m.cosine, 6.0 / std::sqrt(7.25 * 21.0), 1e-12);
  EXPECT_EQ(m.max_abs_error, 4.0);
  EXPECT_NEAR(m.underflow_fraction, 1.0 / 3.0, 1e-12);
  EXPECT_NEAR(m.saturation_fraction, 0.2, 1e-12);
  const ErrorMetrics z =
      ComputeErrorMetrics(std::vector<float>(3, 0.f), std::vector<float>(3, 0.f));
  EXPECT_EQ(z.rel_fro_error, 0.0);
  EXPECT_EQ(z.cosine, 1.0);
  EXPECT_THROW(ComputeErrorMetrics(ref, std::vector<float>(2)), Error);
  // A finite input decoded as NaN shows up in max_abs_error.
  const ErrorMetrics n = ComputeErrorMetrics(std::vector<float>{1.f}, std::vector<float>{nan});
  EXPECT_TRUE(std::isnan(n.max_abs_error));
}

TEST(CodecMetrics, AnalyzeReportsSizes) {
  const auto x = Gaussian(1000, 9);
  CodecOptions o;
  o.format = Format::kNvfp4;
  std::vector<float> decoded;
  const CodecReport r = AnalyzeCodec(x, o, &decoded);
  EXPECT_EQ(decoded.size(), x.size());
  EXPECT_EQ(r.payload_bytes, 500u);
  EXPECT_EQ(r.scale_bytes, 4u + 63);
  EXPECT_NEAR(r.compression_ratio, 4000.0 / 567, 1e-9);
  EXPECT_LT(r.metrics.rel_fro_error, 0.11);
  const std::string json = CodecReportJson(r);
  EXPECT_NE(json.find("\"format\": \"nvfp4\", \"scaling\": \"block\", \"block\": 16"),
            std::string::npos)
      << json;
}

}  // namespace
}  // namespace geofp8
