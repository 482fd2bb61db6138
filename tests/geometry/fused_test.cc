// Tests of the geometry transform fused with the codec (fused.h): the same bytes as ApplyGeometry
// then Encode, the same floats as Decode then InvertGeometry, over modes, formats, odd shapes,
// several row tiles and chunk layouts, plus range decoding and bad-argument errors.
#include "kernels/geometry/fused.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/check.h"
#include "kernels/exchange/chunking.h"
#include "kernels/geometry/factors.h"
#include "kernels/geometry/geometry.h"
#include "kernels/geometry/geometry_math.h"
#include "kernels/geometry/synthetic.h"

namespace geofp8 {
namespace {

using Range = ChunkRange;

// Block-aligned, near-even cut of n elements into `parts` ranges, as two_phase chunks a layer.
std::vector<Range> Chunks(size_t n, size_t align, int parts) {
  std::vector<Range> out;
  for (int j = 0; j < parts; ++j) out.push_back(ChunkOf(n, align, parts, j));
  return out;
}

std::vector<std::pair<std::string, CodecOptions>> Codecs() {
  std::vector<std::pair<std::string, CodecOptions>> out;
  CodecOptions o;
  o.format = Format::kFp8E4M3;
  o.scaling = Scaling::kBlock;
  o.block = 128;
  out.push_back({"e4m3 block128", o});
  o.block = 100;  // blocks straddle rows and tiles
  out.push_back({"e4m3 block100", o});
  o.block = 1 << 20;  // one block larger than any chunk: staged whole
  out.push_back({"e4m3 block1M", o});
  o.scaling = Scaling::kTensor;
  out.push_back({"e4m3 tensor", o});
  o.format = Format::kFp8E5M2;
  o.scaling = Scaling::kNone;
  out.push_back({"e5m2 none", o});
  o = CodecOptions{};
  o.format = Format::kMxfp8;
  out.push_back({"mxfp8", o});
  o.format = Format::kNvfp4;
  out.push_back({"nvfp4", o});
  o.format = Format::kBf16;
  out.push_back({"bf16", o});
  o.format = Format::kFp32;
  out.push_back({"fp32", o});
  o = CodecOptions{};
  o.rounding = Rounding::kStochastic;
  o.seed = 99;
  o.step = 3;
  out.push_back({"e4m3 block128 stochastic", o});
  return out;
}

struct Case {
  int64_t m, n;
};

Geometry MakeGeometry(GeometryMode mode, const std::vector<float>& g, int64_t m, int64_t n) {
  if (mode == GeometryMode::kNone) return Geometry{};
  GeometryOptions o;
  o.mode = mode;
  o.rank = 8;
  o.seed = 5;
  return EstimateGeometry(g, m, n, o, nullptr).geometry;
}

std::vector<float> Gradient(int64_t m, int64_t n) {
  if (m >= 2 && n >= 2)
    return MakeSyntheticGradient({SyntheticFamily::kSpectral, m, n, 1.5, 3, 0.0});
  std::vector<float> g(static_cast<size_t>(m * n));
  for (size_t i = 0; i < g.size(); ++i) g[i] = std::sin(0.7 * i) * (i % 3 ? 1.f : 40.f);
  return g;
}

// The unfused reference: ApplyGeometry on a copy, then Encode of every range.
std::vector<std::vector<uint8_t>> Unfused(const Geometry& geo, const std::vector<float>& g,
                                          const std::vector<Range>& ranges, const CodecOptions& o,
                                          std::vector<EncodeStats>* stats) {
  std::vector<float> x = g;
  ApplyGeometry(geo, x);
  std::vector<std::vector<uint8_t>> out;
  for (size_t j = 0; j < ranges.size(); ++j) {
    CodecOptions oj = o;
    oj.rank = static_cast<uint32_t>(j);  // each chunk its own random stream, as two_phase does
    out.emplace_back(EncodedBytes(oj, ranges[j].end - ranges[j].begin));
    stats->push_back(
        Encode(std::span<const float>(x).subspan(ranges[j].begin, ranges[j].end - ranges[j].begin),
               oj, out.back()));
  }
  return out;
}

FusedEncodeTarget Target(size_t begin, size_t end, const CodecOptions& o, std::span<uint8_t> out) {
  FusedEncodeTarget t;
  t.begin = begin;
  t.end = end;
  t.options = o;
  t.out = out;
  return t;
}

class FusedTest : public ::testing::TestWithParam<GeometryMode> {};

// Shapes: a row, a column, odd sizes inside one tile, and 70 x 4001 (TileRows = 32: three tiles
// whose boundaries fall inside scale blocks).
TEST_P(FusedTest, EncodeAndDecodeAreBitIdenticalToTheUnfusedPath) {
  const GeometryMode mode = GetParam();
  ASSERT_GT(geometry::TileRows(70, 4001), 1);
  ASSERT_LT(geometry::TileRows(70, 4001), 35);
  for (const Case c : {Case{1, 37}, Case{37, 1}, Case{37, 53}, Case{70, 4001}}) {
    const std::vector<float> g = Gradient(c.m, c.n);
    const Geometry geo = MakeGeometry(mode, g, c.m, c.n);
    if (mode != GeometryMode::kNone && c.m >= 2 && c.n >= 2) {
      ASSERT_FALSE(geo.is_identity());
    }
    const size_t total = g.size();
    for (const auto& [name, o] : Codecs()) {
      for (int parts : {1, 3, 4}) {
        SCOPED_TRACE(name + ", " + std::to_string(c.m) + "x" + std::to_string(c.n) + ", " +
                     std::to_string(parts) + " chunks, mode " +
                     std::string(GeometryModeName(mode)));
        const std::vector<Range> ranges = Chunks(total, ChunkAlignment(o), parts);
        std::vector<EncodeStats> ref_stats;
        const auto ref = Unfused(geo, g, ranges, o, &ref_stats);

        const std::vector<float> g_before = g;
        std::vector<std::vector<uint8_t>> wire(ranges.size());
        std::vector<FusedEncodeTarget> targets(ranges.size());
        // Hand the targets over in reverse order: the API must not depend on it.
        for (size_t j = 0; j < ranges.size(); ++j) {
          const size_t t = ranges.size() - 1 - j;
          targets[t].begin = ranges[j].begin;
          targets[t].end = ranges[j].end;
          targets[t].options = o;
          targets[t].options.rank = static_cast<uint32_t>(j);
          wire[j].assign(ref[j].size(), 0xAB);
          targets[t].out = wire[j];
        }
        EncodeWithGeometry(geo, g, targets);
        EXPECT_EQ(g, g_before) << "G must be left unchanged";
        for (size_t j = 0; j < ranges.size(); ++j) {
          ASSERT_EQ(wire[j], ref[j]) << "chunk " << j;
          const EncodeStats& st = targets[ranges.size() - 1 - j].stats;
          EXPECT_EQ(st.nonfinite, ref_stats[j].nonfinite);
          EXPECT_EQ(st.saturated, ref_stats[j].saturated);
        }

        // Decode: Decode every chunk into place, then InvertGeometry.
        std::vector<float> expect(total, -1.f);
        std::vector<FusedDecodeSource> sources;
        for (size_t j = 0; j < ranges.size(); ++j) {
          Decode(wire[j], std::span<float>(expect).subspan(ranges[j].begin,
                                                           ranges[j].end - ranges[j].begin));
          sources.push_back({ranges[j].begin, ranges[j].end, wire[j]});
        }
        InvertGeometry(geo, expect);
        std::vector<float> got(total, 12345.f);
        DecodeWithGeometry(geo, sources, got);
        ASSERT_EQ(std::memcmp(got.data(), expect.data(), total * sizeof(float)), 0);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, FusedTest,
                         ::testing::Values(GeometryMode::kNone, GeometryMode::kDiag,
                                           GeometryMode::kLowRank),
                         [](const auto& info) {
                           return std::string(GeometryModeName(info.param));
                         });

// The targets need not cover G: rows no target needs are skipped, the others are unaffected.
TEST(FusedEncodeTest, PartialCoverEncodesOnlyTheTargets) {
  const int64_t m = 70, n = 4001;
  const std::vector<float> g = Gradient(m, n);
  const Geometry geo = MakeGeometry(GeometryMode::kLowRank, g, m, n);
  CodecOptions o;
  const std::vector<Range> all = Chunks(g.size(), 128, 5);
  std::vector<EncodeStats> st;
  const auto ref = Unfused(geo, g, {all[1], all[3]}, o, &st);
  std::vector<uint8_t> a(ref[0].size()), b(ref[1].size());
  std::vector<FusedEncodeTarget> t(2);
  t[0] = Target(all[1].begin, all[1].end, o, a);
  t[1] = Target(all[3].begin, all[3].end, o, b);
  t[1].options.rank = 1;
  EncodeWithGeometry(geo, g, t);
  EXPECT_EQ(a, ref[0]);
  EXPECT_EQ(b, ref[1]);
}

// The row-tiled in-place map against T(G) = P_L G P_R formed explicitly in double, on a matrix
// of several tiles: the tiling must not change the math.
TEST(FusedEncodeTest, TiledTransformMatchesExplicitProjections) {
  const int64_t m = 70, n = 4001;
  const std::vector<float> g = Gradient(m, n);
  const Geometry geo = MakeGeometry(GeometryMode::kLowRank, g, m, n);
  const int k = geo.k;
  const auto fl = geometry::WhitenFactors(geo, true), fr = geometry::WhitenFactors(geo, false);
  // P_L G = G - U diag(1 - fl) (U^T G); then (.) P_R = (.) - ((.) V) diag(1 - fr) V^T.
  std::vector<double> a(g.begin(), g.end());
  std::vector<double> utg(static_cast<size_t>(k * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j) utg[p * n + j] += double(geo.U[i * k + p]) * a[i * n + j];
  for (int64_t i = 0; i < m; ++i)
    for (int p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j)
        a[i * n + j] -= double(geo.U[i * k + p]) * (1.0 - fl[p]) * utg[p * n + j];
  for (int64_t i = 0; i < m; ++i) {
    std::vector<double> av(k, 0.0);
    for (int64_t j = 0; j < n; ++j)
      for (int p = 0; p < k; ++p) av[p] += a[i * n + j] * geo.V[j * k + p];
    for (int64_t j = 0; j < n; ++j)
      for (int p = 0; p < k; ++p) a[i * n + j] -= av[p] * (1.0 - fr[p]) * geo.V[j * k + p];
  }
  std::vector<float> x = g;
  ApplyGeometry(geo, x);
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - a[i]) * (x[i] - a[i]);
    den += a[i] * a[i];
  }
  EXPECT_LT(std::sqrt(num / den), 1e-5);
  // And the transform did something: the top direction was scaled down.
  EXPECT_LT(fl[0], 0.5f);
}

// The per-element form the fused CUDA kernel uses (geometry_math.h LowRankUpdateElement) on the
// CPU path's own update factors: T(G) element by element, within float round-off of the GEMMs.
TEST(FusedEncodeTest, PerElementUpdateOfTheCudaKernelMatchesTheCpuTransform) {
  const int64_t m = 37, n = 53;
  const std::vector<float> g = Gradient(m, n);
  const Geometry geo = MakeGeometry(GeometryMode::kLowRank, g, m, n);
  const geometry::LowRankUpdate u = geometry::PrepareLowRank(
      geo, false, [&](int64_t r0, int64_t, float*) -> const float* { return g.data() + r0 * n; });
  ASSERT_FALSE(u.identity);
  std::vector<float> x = g;
  ApplyGeometry(geo, x);
  double num = 0, den = 0, moved = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float t = geometry::LowRankUpdateElement(g[i * n + j], u.left.data() + i * u.k2,
                                                     u.right.data() + j, n, u.k2);
      num += (double(t) - x[i * n + j]) * (double(t) - x[i * n + j]);
      den += double(x[i * n + j]) * x[i * n + j];
      moved += (double(t) - g[i * n + j]) * (double(t) - g[i * n + j]);
    }
  EXPECT_LT(std::sqrt(num / den), 1e-6);
  EXPECT_GT(std::sqrt(moved / den), 0.1);  // the update is not the identity
}

TEST(FusedDecodeTest, DecodeRangeMatchesDecodeForEverySubRange) {
  std::vector<float> x(1000);
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng) * (rng() % 7 ? 1.f : 300.f);
  for (const auto& [name, o] : Codecs()) {
    SCOPED_TRACE(name);
    std::vector<uint8_t> wire(EncodedBytes(o, x.size()));
    Encode(x, o, wire);
    std::vector<float> all(x.size());
    Decode(wire, all);
    for (const Range r : {Range{0, 1000}, Range{0, 1}, Range{1, 2}, Range{15, 17}, Range{31, 333},
                          Range{100, 228}, Range{999, 1000}, Range{500, 500}, Range{7, 1000}}) {
      std::vector<float> part(r.end - r.begin, -7.f);
      geometry::DecodeRange(wire, r.begin, part);
      ASSERT_EQ(std::memcmp(part.data(), all.data() + r.begin, part.size() * sizeof(float)), 0)
          << "[" << r.begin << ", " << r.end << ")";
    }
  }
}

TEST(FusedErrorsTest, BadTargetsAndSourcesNameTheField) {
  const int64_t m = 8, n = 16;
  const std::vector<float> g = Gradient(m, n);
  const Geometry geo = MakeGeometry(GeometryMode::kLowRank, g, m, n);
  CodecOptions o;
  std::vector<uint8_t> a(EncodedBytes(o, 64)), b(EncodedBytes(o, 128));
  auto encode_error = [&](std::vector<FusedEncodeTarget> t) {
    try {
      EncodeWithGeometry(geo, g, t);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  using testing::HasSubstr;
  EXPECT_THAT(encode_error({Target(0, 64, o, a), Target(32, 96, o, b)}),
              HasSubstr("overlap at element 32"));
  EXPECT_THAT(encode_error({Target(0, 129, o, b)}), HasSubstr("targets[0].begin/end: [0, 129)"));
  EXPECT_THAT(encode_error({Target(0, 128, o, a)}), HasSubstr("targets[0].out: holds"));
  CodecOptions bad = o;
  bad.block = 0;
  EXPECT_THAT(encode_error({Target(0, 64, bad, a)}), HasSubstr("targets[0].options.block"));
  std::vector<float> wrong(m * n + 1);
  EXPECT_THROW(EncodeWithGeometry(geo, wrong, {}), Error);

  std::vector<FusedEncodeTarget> ok = {Target(0, 64, o, a), Target(64, 128, o, b)};
  EncodeWithGeometry(geo, g, ok);
  std::vector<float> out(m * n);
  auto decode_error = [&](std::vector<FusedDecodeSource> s) {
    try {
      DecodeWithGeometry(geo, s, out);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(decode_error({{0, 64, a}}), HasSubstr("sources cover [0, 64) but out has 128"));
  EXPECT_THAT(decode_error({{0, 64, a}, {32, 128, b}}),
              HasSubstr("sources[1].begin/end: [32, 128)"));
  std::vector<uint8_t> c(EncodedBytes(o, 32));
  Encode(std::span<const float>(g).first(32), o, c);
  EXPECT_THAT(decode_error({{0, 64, a}, {64, 128, c}}), HasSubstr("sources[1].in encodes 32"));
  EXPECT_EQ(decode_error({{64, 128, b}, {0, 64, a}}), "no error");
}

}  // namespace
}  // namespace geofp8
