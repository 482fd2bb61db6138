// A streaming low-rank sketch of a layer gradient's Kronecker factors E[G G^T] and E[G^T G], kept
// as an exponential moving average over steps, and the lowrank geometry it yields.
#pragma once

// Why: the top-k subspace of a single small-batch gradient is replaced within a step or two, so a
// basis estimated from one gradient is stale when it is used (docs/benchmarks.md, "Geometry on
// training trajectories"). The anisotropy worth whitening is the persistent one, the statistics
// Shampoo, SOAP and K-FAC precondition with. Holding the m x m and n x n factors costs m^2 + n^2
// per layer, so each factor is kept as its top `width` eigenpairs instead and updated per step by a
// randomized range finder in O(mn * width): memory O((m + n) width).
//
// Every rank feeds the sketch the same post-exchange averaged gradient, and the update does its
// arithmetic in a fixed order with no BLAS or LAPACK call (whose kernels differ between CPUs and
// whose results then differ in the last bits). So every rank holds the same sketch bit for bit
// and derives the same transform without any broadcast: the exchange's fingerprint carries a
// digest of each layer's geometry to prove it every step.

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/geometry/geometry.h"

namespace geofp8 {

struct FactorSketchOptions {
  int width = 16;         // eigenpairs kept per factor; >= the geometry's rank k
  int probes = 4;         // fresh random directions per update, so new directions can enter
  float beta = 0.9f;      // EMA decay per update: factor = beta * factor + (1 - beta) * G G^T
  uint64_t seed = 0;      // probe matrices derive from (seed, update count): the same on all ranks
};

// One layer's sketch. Plain data: ranks, checkpoints and tests compare it field by field.
struct FactorSketch {
  int64_t m = 0, n = 0;
  int width = 0;                    // columns held (<= options.width, <= min(m, n))
  uint64_t updates = 0;             // gradients folded in; 0 = empty
  std::vector<float> left;          // m x width, orthonormal columns (row-major)
  std::vector<double> left_energy;  // width eigenvalues of the left factor, descending
  std::vector<float> right;         // n x width
  std::vector<double> right_energy;
  double energy = 0.0;              // EMA of ||G||_F^2, the trace of either factor
  // How well the sketch's top-k basis, as it stood before the last update, fit that gradient:
  // the fraction of ||G||_F^2 inside span(U_k) (left) and span(V_k) (right), over the fraction the
  // sketch predicted. 1 when the gradient follows the persistent anisotropy, near 0 when the basis
  // has gone stale. Feeds the whitening strength and selective application.
  double fit = 1.0;
  int fit_k = 0;  // the k `fit` was measured at (0: not measured yet)
};

// Folds G (m x n, row-major float32, finite) into the sketch. `k` is the geometry rank whose fit
// is recorded. Throws geofp8::Error on a shape mismatch or a non-finite value.
void UpdateFactorSketch(FactorSketch& sketch, std::span<const float> G, int64_t m, int64_t n,
                        int k, const FactorSketchOptions& options);

// How the whitening strength follows the sketch's fit to the last gradient.
struct SketchGeometryOptions {
  int rank = 8;          // k: directions whitened per side, <= sketch width
  float alpha = 0.25f;   // full strength (Shampoo's 1/4)
  // Strength t = min(1, fit)^adapt scales the exponent: factors (e / delta)^(-alpha t), carried
  // in sigma (the geometry keeps alpha). 0 turns the adaptation off.
  float adapt = 1.0f;
};

// The lowrank geometry of the sketch: U, V its top-k eigenvectors, per-side energies from its
// eigenvalues and the bulk from the EMA energy left outside them. Identity (version 0) for an
// empty sketch. `version` is stamped on the result.
Geometry GeometryFromSketch(const FactorSketch& sketch, const SketchGeometryOptions& options,
                            uint64_t version);

// Wire and checkpoint form: little-endian, versioned, checksummed (as SerializeGeometry).
std::vector<uint8_t> SerializeFactorSketch(const FactorSketch& sketch);
FactorSketch DeserializeFactorSketch(std::span<const uint8_t> bytes);  // throws if malformed

// 64-bit digest of a geometry's numbers (FNV-1a over its wire form), for the exchange fingerprint.
uint64_t GeometryDigest(const Geometry& geometry);

namespace geometry {
// The deterministic building blocks, exposed for tests. Row-major float, fixed summation order
// (the same bits whichever vector unit runs them).
// y (m x c) = G (m x n) x (n x c).
void MulDeterministic(const float* G, int64_t m, int64_t n, const float* x, int c, float* y);
// b (c x n) = q^T (c x m) G (m x n), q is m x c.
void MulTransposedDeterministic(const float* q, int64_t m, int c, const float* G, int64_t n,
                                float* b);
// Orthonormalizes the columns of a (rows x cols, column-major double) by Gram-Schmidt applied
// twice; columns that fall below `drop` times their original norm are removed. Returns the
// number of columns kept (at the front of a).
int OrthonormalizeColumns(std::vector<double>& a, int64_t rows, int cols, double drop = 1e-10);
// Eigen-decomposition of the symmetric c x c matrix s (column-major) by cyclic Jacobi: on return
// values are descending and vectors (column-major c x c) match them.
void SymmetricEigen(std::vector<double> s, int c, std::vector<double>& values,
                    std::vector<double>& vectors);
}  // namespace geometry

}  // namespace geofp8
