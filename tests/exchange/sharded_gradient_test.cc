// ShardedGradient: the factor sketch fed from a reduce-scatter's row shards. Every rank must
// derive the same sketch bit for bit, and it must be the sketch of the whole gradient up to float
// summation order; over the loopback Gloo communicator, with uneven rows and ranks owning none.
#include "kernels/exchange/sharded_gradient.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/exchange/chunking.h"
#include "kernels/geometry/geometry.h"
#include "kernels/geometry/synthetic.h"
#include "tests/exchange/rank_threads.h"

namespace geofp8::testing {
namespace {

// Step t's gradient: a power-law spectrum (decay 2: neighbouring singular values at least 20%
// apart among the top 4, so their vectors are stable under round-off) drifting with t.
std::vector<float> Grad(int64_t m, int64_t n, int t) {
  SyntheticSpec spec{SyntheticFamily::kSpectral, m, n, 2.0, 11, 0.05 * t};
  return MakeSyntheticGradient(spec);
}

struct Shape {
  int64_t m, n;
  int ranks;
};

TEST(ShardedGradient, EveryRankDerivesTheWholeGradientsSketch) {
  // 48 rows over 3 ranks; 37 over 4 (10, 10, 10, 7); 5 over 4 (2, 2, 1, 0: a rank owns none).
  for (const Shape& s : {Shape{48, 40, 3}, Shape{37, 29, 4}, Shape{5, 16, 4}}) {
    constexpr int kSteps = 5, kRank = 4;
    FactorSketchOptions o;
    o.seed = 3;
    // The reference: the same updates over the whole gradient in one process.
    FactorSketch whole;
    for (int t = 0; t < kSteps; ++t) {
      const std::vector<float> g = Grad(s.m, s.n, t);
      UpdateFactorSketch(whole, g, s.m, s.n, kRank, o);
    }
    std::vector<FactorSketch> sharded(s.ranks);
    const auto errors = RunRanks(s.ranks, [&](Communicator& comm) {
      FactorSketch& mine = sharded[comm.rank()];
      for (int t = 0; t < kSteps; ++t) {
        const std::vector<float> g = Grad(s.m, s.n, t);
        const ChunkRange rows = RowChunkOf(g.size(), size_t(s.n), comm.size(), comm.rank());
        ShardedGradient products(comm, std::span(g).subspan(rows.begin, rows.size()), s.m, s.n);
        UpdateFactorSketch(mine, products, s.m, s.n, kRank, o);
      }
    });
    ASSERT_EQ(JoinErrors(errors), "") << s.m << "x" << s.n;
    // Bit for bit the same on every rank: each product is one collective's result.
    for (int r = 1; r < s.ranks; ++r) {
      EXPECT_EQ(SerializeFactorSketch(sharded[r]), SerializeFactorSketch(sharded[0]))
          << s.m << "x" << s.n << " rank " << r;
    }
    // The whole gradient's sketch up to summation order. The products differ by a few float
    // round-offs of ||G|| (n terms: about n 2^-24 = 3e-6 relative); an eigenvalue moves by as
    // much and an eigenvector by that over the relative gap (>= 0.2 here), about 2e-5: held to
    // 1e-3, and the energies to 1e-4.
    SketchGeometryOptions go;
    go.rank = kRank;
    const Geometry a = GeometryFromSketch(whole, go, 1), b = GeometryFromSketch(sharded[0], go, 1);
    ASSERT_FALSE(a.is_identity());
    EXPECT_LT(SubspaceDrift(a, b), 1e-3) << s.m << "x" << s.n;
    ASSERT_EQ(whole.left_energy.size(), sharded[0].left_energy.size());
    for (size_t i = 0; i < std::min<size_t>(kRank, whole.left_energy.size()); ++i) {
      EXPECT_NEAR(sharded[0].left_energy[i], whole.left_energy[i], 1e-4 * whole.left_energy[0])
          << s.m << "x" << s.n << " eigenvalue " << i;
      EXPECT_NEAR(sharded[0].right_energy[i], whole.right_energy[i], 1e-4 * whole.right_energy[0])
          << s.m << "x" << s.n << " eigenvalue " << i;
    }
    EXPECT_NEAR(sharded[0].energy, whole.energy, 1e-5 * whole.energy) << s.m << "x" << s.n;
  }
}

TEST(ShardedGradient, ANonFiniteValueOnOneRankIsFoundOnEvery) {
  const int64_t m = 12, n = 8;
  const auto errors = RunRanks(3, [&](Communicator& comm) {
    std::vector<float> g = Grad(m, n, 0);
    g[9 * n + 5] = std::nanf("");  // row 9: rank 2's (rows 8-11)
    const ChunkRange rows = RowChunkOf(g.size(), size_t(n), comm.size(), comm.rank());
    ShardedGradient products(comm, std::span(g).subspan(rows.begin, rows.size()), m, n);
    FactorSketch s;
    try {
      UpdateFactorSketch(s, products, m, n, 4, FactorSketchOptions{});
      ADD_FAILURE() << "rank " << comm.rank() << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("at index 77"), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.updates, 0u) << "a failed update must leave the sketch as it was";
  });
  EXPECT_EQ(JoinErrors(errors), "");
}

TEST(ShardedGradient, RowsOtherThanThisRanksShareAreRefused) {
  const auto errors = RunRanks(2, [&](Communicator& comm) {
    std::vector<float> rows(3 * 8);  // 3 rows of 10 x 8 over 2 ranks, whose share is 5
    try {
      ShardedGradient products(comm, rows, 10, 8);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("its rows of 10x8 are 40"), std::string::npos)
          << e.what();
    }
  });
  EXPECT_EQ(JoinErrors(errors), "");
}

}  // namespace
}  // namespace geofp8::testing
