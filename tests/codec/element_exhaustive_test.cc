// Every one of the 2^32 float32 bit patterns through FloatToE4M3/E5M2/E2M1 against the CUDA
// toolkit's host conversions, on all cores (ctest label: slow).
#include <gtest/gtest.h>

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

#else
TEST(ElementOracleExhaustive, AllFloats) { GTEST_SKIP() << "cuda_fp8.h/cuda_fp4.h absent"; }
#endif

}  // namespace
}  // namespace geofp8::element
