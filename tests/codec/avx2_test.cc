// The AVX2 fp8 path, and the AVX-512 block encode ahead of it where the CPU has AVX-512, against
// the scalar reference: identical encoded bytes, and identical decode and decode-accumulate bits,
// over random, wide-range and special inputs at many sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/codec/codec_internal.h"
#include "kernels/codec/element.h"
#include "kernels/common/cpu_features.h"

namespace geofp8 {
namespace {

class ScalarGuard {
 public:
  ScalarGuard() { detail::SetVectorizedEnabled(false); }
  ~ScalarGuard() { detail::SetVectorizedEnabled(true); }
};

std::vector<uint8_t> EncodeWith(bool vectorized, std::span<const float> x, const CodecOptions& o,
                                EncodeStats* st) {
  detail::SetVectorizedEnabled(vectorized);
  std::vector<uint8_t> buf(EncodedBytes(o, x.size()) + 1);
  *st = Encode(x, o, std::span(buf).subspan(1));  // odd output address
  detail::SetVectorizedEnabled(true);
  buf.erase(buf.begin());
  return buf;
}

std::vector<uint32_t> DecodeBits(bool vectorized, std::span<const uint8_t> buf, size_t n,
                                 bool accumulate) {
  detail::SetVectorizedEnabled(vectorized);
  std::vector<float> out(n + 1);
  for (size_t i = 0; i <= n; ++i) out[i] = accumulate ? 0.37f * static_cast<float>(i) - 3.f : 0.f;
  std::span<float> dst = std::span(out).subspan(1);  // 4-byte but not 32-byte aligned
  if (accumulate) {
    DecodeAccumulate(buf, dst);
  } else {
    Decode(buf, dst);
  }
  detail::SetVectorizedEnabled(true);
  std::vector<uint32_t> bits(n);
  for (size_t i = 0; i < n; ++i) {
    bits[i] = std::isnan(dst[i]) ? 0x7FC00000u : element::FloatBits(dst[i]);
  }
  return bits;
}

enum class Data { kGaussian, kWideRange, kRandomBits, kSpecials, kTies };

std::vector<float> MakeData(Data kind, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> x(n + 1);
  std::normal_distribution<float> g;
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_int_distribution<int> expo(-40, 40);
  for (size_t i = 0; i < x.size(); ++i) {
    switch (kind) {
      case Data::kGaussian:
        x[i] = g(rng);
        break;
      case Data::kWideRange:
        x[i] = std::ldexp(g(rng), expo(rng));
        break;
      case Data::kRandomBits:
        x[i] = element::BitsFloat(bits(rng));
        break;
      case Data::kSpecials: {
        const float s[] = {0.f,
                           -0.f,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(),
                           448.f,
                           464.f,
                           -465.f,
                           57344.f,
                           61440.f,
                           1e-45f,
                           std::ldexp(1.f, -10),
                           std::ldexp(1.f, -17),
                           3e38f,
                           -3e38f,
                           1.f};
        x[i] = (bits(rng) % 4 == 0) ? s[bits(rng) % 16] : g(rng);
        break;
      }
      case Data::kTies: {
        // Exact midpoints between E4M3/E5M2 neighbours, and their float neighbours.
        const float lo = element::E4M3ToFloat(static_cast<uint8_t>(bits(rng) % 0x7E));
        const float hi = element::E4M3ToFloat(static_cast<uint8_t>(element::FloatToE4M3(lo) + 1));
        const float mid = 0.5f * (lo + hi);
        x[i] = element::BitsFloat(element::FloatBits(mid) + static_cast<int>(bits(rng) % 3) - 1);
        if (bits(rng) & 1) x[i] = -x[i];
        if (bits(rng) % 3 == 0) {
          // bf16 ties and near-ties: low 16 bits 0x7FFF, 0x8000 or 0x8001.
          const uint32_t hi = bits(rng) & 0xBFFF0000u;  // finite, any sign
          x[i] = element::BitsFloat(hi | (0x7FFFu + bits(rng) % 3));
        }
        break;
      }
    }
  }
  return x;
}

// Every format, scaling, block and data kind at many sizes (several 2048-element tiles of the
// AVX-512 path, a partial last tile, a partial last block), with the AVX-512 path on or off.
void ExpectVectorizedMatchesScalar(bool avx512) {
  detail::SetAvx512Enabled(avx512);
  const size_t sizes[] = {0,   1,   7,   8,    15,   17,   31,   32,  33,
                          127, 128, 129, 1000, 4101, 2560, 6149, 8192};
  for (Format f :
       {Format::kFp8E4M3, Format::kFp8E5M2, Format::kMxfp8, Format::kNvfp4, Format::kBf16}) {
    for (Scaling s : {Scaling::kNone, Scaling::kTensor, Scaling::kBlock}) {
      const bool own_blocks = f == Format::kMxfp8 || f == Format::kNvfp4 || f == Format::kBf16;
      if (own_blocks && s != Scaling::kBlock) continue;  // mxfp8/nvfp4 ignore scaling
      for (uint32_t block : {1u, 16u, 32u, 64u, 100u, 128u}) {
        if ((s != Scaling::kBlock || own_blocks) && block != 128) continue;
        for (Data d :
             {Data::kGaussian, Data::kWideRange, Data::kRandomBits, Data::kSpecials, Data::kTies}) {
          for (size_t n : sizes) {
            const auto src = MakeData(d, n, static_cast<uint32_t>(n * 31 + block));
            std::span<const float> x(src.data() + 1, n);  // 4-byte but not 32-byte aligned
            CodecOptions o;
            o.format = f;
            o.scaling = s;
            o.block = block;
            EncodeStats sv, ss;
            const auto vec = EncodeWith(true, x, o, &sv);
            const auto ref = EncodeWith(false, x, o, &ss);
            const std::string where =
                std::string(avx512 ? "avx512 " : "avx2 ") + std::string(FormatName(f)) + "/" +
                std::string(ScalingName(s)) + " block " + std::to_string(block) + " data " +
                std::to_string(static_cast<int>(d)) + " n " + std::to_string(n);
            ASSERT_EQ(vec, ref) << where;
            ASSERT_EQ(sv.nonfinite, ss.nonfinite) << where;
            ASSERT_EQ(sv.saturated, ss.saturated) << where;
            for (bool acc : {false, true}) {
              ASSERT_EQ(DecodeBits(true, ref, n, acc), DecodeBits(false, ref, n, acc))
                  << where << " accumulate " << acc;
            }
          }
        }
      }
    }
  }
}

TEST(CodecAvx2, BitIdenticalToScalar) {
  if (!detail::CpuHasAvx2()) GTEST_SKIP() << "processor lacks AVX2";
  ExpectVectorizedMatchesScalar(false);
  detail::SetAvx512Enabled(true);
}

TEST(CodecAvx512, BitIdenticalToScalar) {
  if (!detail::CpuHasAvx2() || !CpuHasAvx512()) GTEST_SKIP() << "processor lacks AVX-512";
  ExpectVectorizedMatchesScalar(true);
}

// Every finite float as a block's values, one value per 16-element block next to 15 copies of a
// fixed amax (so the scale is the same for all; nvfp4's block scales then differ only with the
// amax, cycling over 41 powers of two): the AVX-512 conversion, its normal, subnormal
// and zero cases and every rounding tie, against the scalar rule for all 2^32 bit patterns in
// steps of a prime (about 34 million values).
TEST(CodecAvx512, EveryRoundingCaseMatchesScalar) {
  if (!detail::CpuHasAvx2() || !CpuHasAvx512()) GTEST_SKIP() << "processor lacks AVX-512";
  for (Format f : {Format::kFp8E4M3, Format::kFp8E5M2, Format::kMxfp8, Format::kNvfp4}) {
    CodecOptions o;
    o.format = f;
    o.scaling = Scaling::kBlock;
    o.block = f == Format::kMxfp8 ? 32 : 16;
    const uint32_t block = o.block;
    const size_t per = 4096;  // blocks per encode
    std::vector<float> x(per * block);
    uint64_t bits = 0;
    while (bits < (1ull << 32)) {
      for (size_t b = 0; b < per; ++b) {
        // The block's amax is 2^k for k in [-20, 20] cycling, so the scale varies too.
        const float amax = std::ldexp(1.f, int(b % 41) - 20);
        for (uint32_t i = 0; i < block; ++i) x[b * block + i] = i % 2 ? amax : -amax;
        uint32_t v = uint32_t(bits);
        bits += 383;
        float y = element::BitsFloat(v);
        if (!element::IsFinite(y)) y = amax / 3;
        if (element::AbsF(y) > amax) y = std::ldexp(y, -200);  // now below 2^-70
        x[b * block + 3] = y;
      }
      EncodeStats sv, ss;
      const auto vec = EncodeWith(true, x, o, &sv);
      const auto ref = EncodeWith(false, x, o, &ss);
      ASSERT_EQ(vec, ref) << FormatName(f) << " near bits " << bits;
      ASSERT_EQ(sv.saturated, ss.saturated);
    }
  }
}

TEST(CodecAvx2, DisabledSwitchForcesScalar) {
  ScalarGuard guard;
  EXPECT_FALSE(detail::VectorizedEnabled());
}

}  // namespace
}  // namespace geofp8
