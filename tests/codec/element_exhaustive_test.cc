// Every one of the 2^32 float32 bit patterns through FloatToE4M3/E5M2/E2M1 against the CUDA
// toolkit's host conversions, on all cores (ctest label: slow).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/codec/codec_internal.h"
#include "tests/codec/oracle_sweep.h"

namespace geofp8::element {
namespace {

#if GEOFP8_HAVE_CUDA_FP8_HEADERS
// Every one of the 2^32 float patterns (label: slow).
TEST(ElementOracleExhaustive, E4M3AllFloats) {
  uint32_t first = 0;
  EXPECT_EQ(SweepAllFloats(SameE4M3, 1, &first), 0u) << std::hex << "first 0x" << first;
}
TEST(ElementOracleExhaustive, E5M2AllFloats) {
  uint32_t first = 0;
  EXPECT_EQ(SweepAllFloats(SameE5M2, 1, &first), 0u) << std::hex << "first 0x" << first;
}
TEST(ElementOracleExhaustive, E2M1AllFloats) {
  uint32_t first = 0;
  EXPECT_EQ(SweepAllFloats(SameE2M1, 1, &first), 0u) << std::hex << "first 0x" << first;
}

// The vectorized fp8 encoder (scaling none, scale 1) over every float pattern, against the
// per-element rule it must reproduce (EncodeFp8Scaled: the oracle conversion for finite inputs,
// NaN/inf codes for non-finite ones). Chunks holding a non-finite value take the scalar rule.
TEST(ElementOracleExhaustive, VectorizedFp8AllFloats) {
  if (!detail::CpuHasAvx2()) GTEST_SKIP() << "processor lacks AVX2";
  for (bool e5m2 : {false, true}) {
    std::atomic<uint64_t> bad{0};
    std::vector<std::thread> pool;
    const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
    constexpr uint64_t kChunk = 1 << 16;
    constexpr uint64_t kChunks = (uint64_t{1} << 32) / kChunk;
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        CodecOptions o;
        o.format = e5m2 ? Format::kFp8E5M2 : Format::kFp8E4M3;
        o.scaling = Scaling::kNone;
        std::vector<float> x(kChunk);
        std::vector<uint8_t> buf(EncodedBytes(o, kChunk));
        for (uint64_t c = t; c < kChunks; c += threads) {
          for (uint64_t i = 0; i < kChunk; ++i)
            x[i] = BitsFloat(static_cast<uint32_t>(c * kChunk + i));
          Encode(x, o, buf);
          const uint8_t* payload = buf.data() + sizeof(EncodedHeader);
          for (uint64_t i = 0; i < kChunk; ++i) {
            bool sat;
            if (payload[i] != EncodeFp8Scaled(e5m2, x[i], 1.f, false, 0, &sat)) ++bad;
          }
        }
      });
    }
    for (auto& th : pool) th.join();
    EXPECT_EQ(bad.load(), 0u) << (e5m2 ? "e5m2" : "e4m3");
  }
}

#else
TEST(ElementOracleExhaustive, AllFloats) { GTEST_SKIP() << "cuda_fp8.h/cuda_fp4.h absent"; }
#endif

}  // namespace
}  // namespace geofp8::element
