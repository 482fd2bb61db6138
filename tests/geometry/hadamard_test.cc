// The block random Hadamard rotation against a dense reference built apart from the library
// (Sylvester's H_ij = (-1)^popcount(i & j) in float64): forward and inverse, orthogonality, the
// AVX2 path bit for bit against the GEOFP8_HD one, signs identical across ranks, the fused
// rotate-and-encode byte for byte, and the block validation.

#include "kernels/geometry/hadamard.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/codec/codec_internal.h"
#include "kernels/common/check.h"
#include "kernels/common/cpu_features.h"
#include "kernels/geometry/hadamard_math.h"

namespace geofp8 {
namespace {

constexpr double kU = 0x1p-24;  // float's unit roundoff

std::vector<float> Gaussian(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> x(n);
  for (float& v : x) v = d(rng);
  return x;
}

// Float64 forward of one block: y_i = sum_j H_ij s_j x_j / sqrt(b), signs from the library's
// documented rule (bit i % 64 of SignWord(seed, i / 64) set: negated).
std::vector<double> ReferenceForward(const std::vector<float>& x, int b, uint64_t seed) {
  std::vector<double> y(x.size());
  const size_t whole = x.size() / b * b;
  auto s = [&](size_t i) { return hadamard::Negated(seed, i) ? -1.0 : 1.0; };
  for (size_t k = 0; k < whole; k += b) {
    for (int i = 0; i < b; ++i) {
      double acc = 0;
      for (int j = 0; j < b; ++j) {
        acc += ((std::popcount(unsigned(i & j)) & 1) ? -1.0 : 1.0) * s(k + j) * x[k + j];
      }
      y[k + i] = acc / std::sqrt(double(b));
    }
  }
  for (size_t i = whole; i < x.size(); ++i) y[i] = s(i) * x[i];
  return y;
}

// Norm-wise error of one rotation in float: log2(b) butterfly stages, each an orthogonal map
// times sqrt(2) whose rounding adds at most u times the current 2-norm, then one scaling
// multiply and the scale constant's own rounding: |fl(Tx) - Tx| <= (log2 b + 2) u |x| to first
// order, per block.
double RotationBound(int b) { return (std::log2(double(b)) + 2) * kU * 1.01; }

TEST(Hadamard, ForwardMatchesTheDenseReferenceAndInverseUndoesIt) {
  for (int b : {2, 4, 8, 16, 32, 128, 1024}) {
    for (size_t n : {size_t(0), size_t(1), size_t(b), size_t(5 * b + 3), size_t(4096 + 7)}) {
      const std::vector<float> x = Gaussian(n, 11 + b);
      std::vector<float> y = x;
      HadamardForward(y, b, 99);
      const std::vector<double> ref = ReferenceForward(x, b, 99);
      std::vector<float> back = y;
      HadamardInverse(back, b, 99);
      for (size_t k = 0; k < n; k += b) {
        const size_t end = std::min(n, k + b);
        double e2 = 0, r2 = 0, x2 = 0, y2 = 0;
        for (size_t i = k; i < end; ++i) {
          e2 += (y[i] - ref[i]) * (y[i] - ref[i]);
          r2 += (double(back[i]) - x[i]) * (double(back[i]) - x[i]);
          x2 += double(x[i]) * x[i];
          y2 += double(y[i]) * y[i];
        }
        ASSERT_LE(std::sqrt(e2), RotationBound(b) * std::sqrt(x2)) << b << " " << n << " " << k;
        // Back again: the inverse's own error on |y| (= |x| to first order) on top.
        ASSERT_LE(std::sqrt(r2), 2 * RotationBound(b) * std::sqrt(x2)) << b << " " << n << " " << k;
        // Orthogonal: the norm is kept to the same bound.
        ASSERT_NEAR(std::sqrt(y2), std::sqrt(x2), RotationBound(b) * std::sqrt(x2));
      }
    }
  }
}

TEST(Hadamard, IsOrthogonal) {
  // The images of the unit vectors are the columns of T: T^T T = I to the rotation's error.
  const int b = 32;
  std::vector<std::vector<float>> cols(b);
  for (int j = 0; j < b; ++j) {
    cols[j].assign(b, 0.f);
    cols[j][j] = 1.f;
    HadamardForward(cols[j], b, 5);
  }
  for (int i = 0; i < b; ++i) {
    for (int j = 0; j < b; ++j) {
      double dot = 0;
      for (int r = 0; r < b; ++r) dot += double(cols[i][r]) * cols[j][r];
      // |<Te_i, Te_j> - delta_ij| <= 2 |fl(Te) - Te| |Te| + |fl(Te) - Te|^2.
      const double e = RotationBound(b);
      EXPECT_NEAR(dot, i == j ? 1.0 : 0.0, 2 * e + e * e) << i << " " << j;
    }
  }
}

TEST(Hadamard, Avx2IsBitIdenticalToTheReference) {
  std::vector<float> x = Gaussian(3 * 1024 + 40, 3);
  x[7] = NAN;
  x[100] = INFINITY;
  x[101] = -0.f;
  for (int b : {8, 16, 32, 64, 128, 256, 4096}) {
    for (uint64_t first : {uint64_t(0), uint64_t(64 * b)}) {
      std::vector<float> fast = x, ref = x;
      HadamardForward(fast, b, 17, first);
      HadamardForward(ref, b, 17, first, /*reference=*/true);
      ASSERT_EQ(std::memcmp(fast.data(), ref.data(), x.size() * 4), 0) << b << " " << first;
      HadamardInverse(fast, b, 17, first);
      HadamardInverse(ref, b, 17, first, true);
      ASSERT_EQ(std::memcmp(fast.data(), ref.data(), x.size() * 4), 0) << b << " " << first;
    }
  }
}

TEST(Hadamard, SignsAreTheSameOnEveryRankAndDifferAcrossSeeds) {
  const std::vector<float> x = Gaussian(1000, 8);
  // Four "ranks" as threads that share nothing but the seed: the rotation never communicates,
  // so each computes its signs alone (the exchange test checks real ranks end to end).
  std::vector<std::vector<float>> per_rank(4);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.emplace_back([&, r] {
      std::vector<float> y = x;
      HadamardForward(y, 16, /*seed=*/1234);
      per_rank[r] = y;
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 1; r < 4; ++r) {
    EXPECT_EQ(std::memcmp(per_rank[r].data(), per_rank[0].data(), x.size() * 4), 0) << r;
  }
  int differ = 0;
  for (uint64_t w = 0; w < 16; ++w) differ += hadamard::SignWord(1, w) != hadamard::SignWord(2, w);
  EXPECT_EQ(differ, 16);
  // About half the signs are negative (a biased stream would rotate less).
  int negated = 0;
  for (uint64_t i = 0; i < 64000; ++i) negated += hadamard::Negated(1234, i);
  // Binomial(64000, 1/2): sd 126; 6 sd.
  EXPECT_NEAR(negated, 32000, 760);
}

TEST(Hadamard, RotateAndEncodeEqualsRotateThenEncode) {
  const std::vector<float> x = Gaussian(3 * 8192 + 200, 21);
  struct Case {
    Format format;
    Scaling scaling;
    uint32_t block;
    int hadamard;
    Rounding rounding;
  };
  for (const Case c : {Case{Format::kFp8E4M3, Scaling::kBlock, 128, 128, Rounding::kNearest},
                       Case{Format::kFp8E4M3, Scaling::kBlock, 96, 32, Rounding::kNearest},
                       Case{Format::kFp8E5M2, Scaling::kBlock, 128, 4, Rounding::kNearest},
                       Case{Format::kMxfp8, Scaling::kBlock, 32, 32, Rounding::kNearest},
                       Case{Format::kNvfp4, Scaling::kBlock, 16, 16, Rounding::kNearest},
                       Case{Format::kFp8E4M3, Scaling::kTensor, 128, 64, Rounding::kNearest},
                       Case{Format::kFp8E4M3, Scaling::kBlock, 128, 128, Rounding::kStochastic}}) {
    CodecOptions o;
    o.format = c.format;
    o.scaling = c.scaling;
    o.block = c.block;
    o.rounding = c.rounding;
    std::vector<float> rotated = x;
    HadamardForward(rotated, c.hadamard, 77);
    std::vector<uint8_t> a(EncodedBytes(o, x.size())), b(a.size());
    const EncodeStats sa = Encode(rotated, o, a);
    const EncodeStats sb = EncodeRotated(x, c.hadamard, 77, o, b);
    EXPECT_EQ(a, b) << FormatName(c.format) << " block " << c.block << " hadamard " << c.hadamard;
    EXPECT_EQ(sa.saturated, sb.saturated);
    EXPECT_EQ(sa.nonfinite, sb.nonfinite);
  }
}

// The three paths of EncodeRotated, byte for byte and count for count: AVX-512 (whole codec
// blocks in registers), the AVX2 tiles, and the scalar reference (HadamardForward's GEOFP8_HD
// code, then Encode with vectorization off). Every rotation block the AVX-512 path takes at
// every codec block it takes, on data with zeros, all-zero blocks, non-finite values, values
// whose rotation overflows, subnormals and a 2^60 spread of magnitudes, at sizes with several
// 2048-element tiles, a partial tile and a partial last block; and nvfp4 on finite data.
TEST(Hadamard, Avx512RotateAndEncodeIsBitIdenticalToAvx2AndTheReference) {
  if (!CpuHasAvx512() || !CpuHasAvx2()) GTEST_SKIP() << "processor lacks AVX-512";
  std::mt19937_64 rng(5);
  std::vector<float> x = Gaussian(3 * 2048 + 200 + 37, 9);
  for (size_t i = 0; i < x.size(); ++i) {
    const uint64_t r = rng();
    if (r % 97 == 0) x[i] = 0.f;
    x[i] = std::ldexp(x[i], int((i / 128) % 61) - 30);  // blocks of different magnitudes
  }
  std::fill(x.begin() + 256, x.begin() + 512, 0.f);  // whole zero blocks
  x[1000] = NAN;
  x[1500] = INFINITY;
  x[1501] = -INFINITY;
  x[2100] = 3e38f;  // the rotation of its block overflows to infinity
  x[2101] = 3e38f;
  x[2700] = 1e-40f;  // a float subnormal
  x[3333] = -0.f;
  struct Case {
    Format format;
    uint32_t block;
  };
  int covered = 0, cases = 0;
  for (const Case c :
       {Case{Format::kFp8E4M3, 16}, Case{Format::kFp8E4M3, 32}, Case{Format::kFp8E4M3, 64},
        Case{Format::kFp8E4M3, 128}, Case{Format::kFp8E5M2, 32}, Case{Format::kFp8E5M2, 128},
        Case{Format::kMxfp8, 32}}) {
    for (int hb = 16; hb <= int(c.block); hb *= 2) {
      for (size_t n : {size_t(0), size_t(c.block), size_t(2048), x.size()}) {
        CodecOptions o;
        o.format = c.format;
        o.scaling = Scaling::kBlock;
        o.block = c.block;
        const std::span<const float> in(x.data(), n);
        std::vector<uint8_t> fast(EncodedBytes(o, n)), avx2(fast.size()), ref(fast.size());
        const EncodeStats sf = EncodeRotated(in, hb, 31, o, fast);
        detail::SetAvx512Enabled(false);
        const EncodeStats s2 = EncodeRotated(in, hb, 31, o, avx2);
        detail::SetAvx512Enabled(true);
        std::vector<float> rotated(in.begin(), in.end());
        HadamardForward(rotated, hb, 31, 0, /*reference=*/true);
        detail::SetVectorizedEnabled(false);
        const EncodeStats sr = Encode(rotated, o, ref);
        detail::SetVectorizedEnabled(true);
        const std::string where = std::string(FormatName(c.format)) + " block " +
                                  std::to_string(c.block) + " hadamard " + std::to_string(hb) +
                                  " n " + std::to_string(n);
        ASSERT_EQ(fast, ref) << where;
        ASSERT_EQ(avx2, ref) << where;
        EXPECT_EQ(sf.nonfinite, sr.nonfinite) << where;
        EXPECT_EQ(s2.nonfinite, sr.nonfinite) << where;
        EXPECT_EQ(sf.saturated, sr.saturated) << where;
        EXPECT_EQ(s2.saturated, sr.saturated) << where;
        cases += n == x.size();
        covered += n == x.size() && sr.nonfinite > 0;
      }
    }
  }
  EXPECT_EQ(covered, cases);  // the non-finite blocks were in every case
  EXPECT_EQ(cases, 18);
  // nvfp4 takes the AVX-512 path only for a finite tensor (the reference path poisons the blocks
  // of a non-finite one): the same comparison on the data made finite, at lengths with and
  // without a partial last block and over several tiles.
  std::vector<float> finite = x;
  for (float& v : finite) {
    if (!std::isfinite(v) || std::fabs(v) > 1e30f) v = 1.f;
  }
  CodecOptions nv;
  nv.format = Format::kNvfp4;
  for (size_t n : {size_t(5), size_t(16), size_t(4096), finite.size()}) {
    const std::span<const float> in(finite.data(), n);
    std::vector<uint8_t> fast(EncodedBytes(nv, n)), ref(fast.size());
    const EncodeStats sf = EncodeRotated(in, 16, 31, nv, fast);
    std::vector<float> rotated(in.begin(), in.end());
    HadamardForward(rotated, 16, 31, 0, /*reference=*/true);
    detail::SetVectorizedEnabled(false);
    const EncodeStats sr = Encode(rotated, nv, ref);
    detail::SetVectorizedEnabled(true);
    ASSERT_EQ(fast, ref) << "nvfp4 n " << n;
    EXPECT_EQ(sf.saturated, sr.saturated) << n;
    EXPECT_EQ(sf.nonfinite, 0u);
  }
}

TEST(Hadamard, BlocksThatAreNotPowersOfTwoOrDoNotDivideTheCodecBlockAreRefused) {
  CodecOptions nv;
  nv.format = Format::kNvfp4;
  EXPECT_EQ(ValidateHadamardBlock(16, nv), "");
  EXPECT_EQ(ValidateHadamardBlock(32, nv),
            "hadamard_block: must divide the codec's scale block 16 (32)");
  EXPECT_EQ(ValidateHadamardBlock(24, nv),
            "hadamard_block: must be a power of two in [2, 4096] (24)");
  CodecOptions mx;
  mx.format = Format::kMxfp8;
  EXPECT_EQ(ValidateHadamardBlock(32, mx), "");
  EXPECT_EQ(ValidateHadamardBlock(64, mx),
            "hadamard_block: must divide the codec's scale block 32 (64)");
  CodecOptions fp8;
  fp8.block = 128;
  EXPECT_EQ(ValidateHadamardBlock(128, fp8), "");
  EXPECT_EQ(ValidateHadamardBlock(256, fp8),
            "hadamard_block: must divide the codec's scale block 128 (256)");
  EXPECT_EQ(ValidateHadamardBlock(1, fp8),
            "hadamard_block: must be a power of two in [2, 4096] (1)");
  fp8.scaling = Scaling::kTensor;  // no scale block: any power of two
  EXPECT_EQ(ValidateHadamardBlock(256, fp8), "");
  std::vector<float> x(64);
  EXPECT_THROW(HadamardForward(x, 12, 1), Error);
  EXPECT_THROW(HadamardForward(x, 16, 1, /*first=*/8), Error);
}

}  // namespace
}  // namespace geofp8
