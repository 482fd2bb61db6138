// Tests of the geometry wire form: bit-exact round trip for every mode, and clear errors for
// truncated, corrupted or inconsistent buffers.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "kernels/common/check.h"
#include "kernels/geometry/geometry.h"
#include "tests/geometry/test_matrices.h"

namespace geofp8 {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

void ExpectSame(const Geometry& a, const Geometry& b) {
  EXPECT_EQ(a.mode, b.mode);
  EXPECT_EQ(a.version, b.version);
  EXPECT_EQ(a.m, b.m);
  EXPECT_EQ(a.n, b.n);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.alpha, b.alpha);
  EXPECT_EQ(a.delta_L, b.delta_L);
  EXPECT_EQ(a.delta_R, b.delta_R);
  EXPECT_EQ(a.U, b.U);
  EXPECT_EQ(a.V, b.V);
  EXPECT_EQ(a.sigma, b.sigma);
  EXPECT_EQ(a.row_scale, b.row_scale);
  EXPECT_EQ(a.col_scale, b.col_scale);
}

Geometry Estimated(GeometryMode mode) {
  auto ks = testing::MakeKnownSvd(24, 18, testing::PowerSpectrum(18, 1.0), 3);
  GeometryOptions o;
  o.mode = mode;
  o.rank = 5;
  o.alpha = 0.3f;
  Geometry first = EstimateGeometry(ks.G, 24, 18, o, nullptr).geometry;
  return EstimateGeometry(ks.G, 24, 18, o, &first).geometry;  // version 2
}

TEST(GeometrySerializeTest, RoundTripIsBitExactForEveryMode) {
  for (GeometryMode mode : {GeometryMode::kNone, GeometryMode::kDiag, GeometryMode::kLowRank}) {
    const Geometry g = Estimated(mode);
    EXPECT_EQ(g.version, 2u);
    const std::vector<uint8_t> bytes = SerializeGeometry(g);
    ExpectSame(DeserializeGeometry(bytes), g);
  }
  ExpectSame(DeserializeGeometry(SerializeGeometry(Geometry{})), Geometry{});
}

TEST(GeometrySerializeTest, SizeIsHeaderPlusArraysPlusChecksum) {
  const Geometry g = Estimated(GeometryMode::kLowRank);
  EXPECT_EQ(SerializeGeometry(g).size(), 48u + 4 * (24 + 18 + 1) * 5 + 4);
}

TEST(GeometrySerializeTest, CorruptionIsDetected) {
  const std::vector<uint8_t> good = SerializeGeometry(Estimated(GeometryMode::kLowRank));
  std::vector<uint8_t> bad = good;
  bad[100] ^= 0x10;
  EXPECT_THAT([&] { DeserializeGeometry(bad); },
              ThrowsMessage<Error>(HasSubstr("checksum mismatch")));
  bad = good;
  bad[0] = 'X';
  EXPECT_THAT([&] { DeserializeGeometry(bad); }, ThrowsMessage<Error>(HasSubstr("bad magic")));
  bad.assign(good.begin(), good.begin() + 20);
  EXPECT_THAT([&] { DeserializeGeometry(bad); },
              ThrowsMessage<Error>(HasSubstr("shorter than the header")));
  EXPECT_THROW(DeserializeGeometry({}), Error);
}

TEST(GeometrySerializeTest, InconsistentFieldsAreRejectedEvenWithAValidChecksum) {
  Geometry g = Estimated(GeometryMode::kLowRank);
  g.U.pop_back();
  EXPECT_THROW(SerializeGeometry(g), Error);
  // A payload shorter than k says: re-serialize a consistent geometry with a smaller k but keep
  // the declared k by patching the header and fixing the checksum, as a buggy peer might.
  Geometry small = Estimated(GeometryMode::kLowRank);
  std::vector<uint8_t> bytes = SerializeGeometry(small);
  const int32_t k = 6;
  std::memcpy(bytes.data() + 32, &k, 4);
  uint32_t h = 2166136261u;
  for (size_t i = 0; i + 4 < bytes.size(); ++i) h = (h ^ bytes[i]) * 16777619u;
  std::memcpy(bytes.data() + bytes.size() - 4, &h, 4);
  EXPECT_THAT([&] { DeserializeGeometry(bytes); }, ThrowsMessage<Error>(HasSubstr("payload is")));
}

}  // namespace
}  // namespace geofp8
