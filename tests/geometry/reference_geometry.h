// A float64 reference of the lowrank geometry written from DESIGN.md section 2, apart from the
// library: dense P_L, P_R and their exact inverses, and the round-off bound tests compare with.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/geometry/geometry.h"

namespace geofp8::testing {

// f = min(1, (energy / delta)^-alpha), with the zero-bulk floor delta >= energy_max / 1e8 that
// geometry_math.h documents (kMaxEnergyRatio); a direction without energy keeps f = 1.
inline double ReferenceFactor(double energy, double delta, double energy_max, double alpha) {
  if (!(energy > 0.0) || !(alpha > 0.0)) return 1.0;
  const double d = std::max(delta, energy_max / 1e8);
  if (!(d > 0.0)) return 1.0;
  return std::min(1.0, std::pow(energy / d, -alpha));
}

// One side of a lowrank geometry as dense dim x dim row-major matrices.
struct ReferenceSide {
  int64_t dim = 0;
  std::vector<double> p, p_inv;  // P = I - Q diag(1 - f) Q^T and its inverse
};

// Dense inverse by Gauss-Jordan elimination with partial pivoting (dim is small in tests).
inline std::vector<double> DenseInverse(std::vector<double> a, int64_t dim) {
  std::vector<double> inv(static_cast<size_t>(dim * dim), 0.0);
  for (int64_t i = 0; i < dim; ++i) inv[i * dim + i] = 1.0;
  for (int64_t c = 0; c < dim; ++c) {
    int64_t piv = c;
    for (int64_t r = c + 1; r < dim; ++r)
      if (std::abs(a[r * dim + c]) > std::abs(a[piv * dim + c])) piv = r;
    for (int64_t j = 0; j < dim; ++j) {
      std::swap(a[c * dim + j], a[piv * dim + j]);
      std::swap(inv[c * dim + j], inv[piv * dim + j]);
    }
    const double d = a[c * dim + c];
    for (int64_t j = 0; j < dim; ++j) {
      a[c * dim + j] /= d;
      inv[c * dim + j] /= d;
    }
    for (int64_t r = 0; r < dim; ++r) {
      if (r == c) continue;
      const double x = a[r * dim + c];
      if (x == 0.0) continue;
      for (int64_t j = 0; j < dim; ++j) {
        a[r * dim + j] -= x * a[c * dim + j];
        inv[r * dim + j] -= x * inv[c * dim + j];
      }
    }
  }
  return inv;
}

// The side of `g` (left: U, delta_L, m; right: V, delta_R, n) built from its float basis as held,
// so the reference inverse is the exact inverse of the map the library applies. dim is the
// side's size (m or n), given because an identity geometry (warm-up) need not carry its shape.
// Identity when the geometry is, or when the side has no residual dimension (dim <= k).
inline ReferenceSide MakeReferenceSide(const Geometry& g, bool left, int64_t dim) {
  ReferenceSide s;
  s.dim = dim;
  s.p.assign(static_cast<size_t>(dim * dim), 0.0);
  for (int64_t i = 0; i < dim; ++i) s.p[i * dim + i] = 1.0;
  if (!g.is_identity() && g.mode == GeometryMode::kLowRank && g.k > 0 && dim > g.k) {
    const std::vector<float>& q = left ? g.U : g.V;
    const double delta = left ? g.delta_L : g.delta_R;
    const double top = double(g.sigma[0]) * g.sigma[0];
    const int k = g.k;
    for (int p = 0; p < k; ++p) {
      const double c = 1.0 - ReferenceFactor(double(g.sigma[p]) * g.sigma[p], delta, top, g.alpha);
      for (int64_t i = 0; i < dim; ++i)
        for (int64_t j = 0; j < dim; ++j) s.p[i * dim + j] -= c * q[i * k + p] * q[j * k + p];
    }
  }
  s.p_inv = DenseInverse(s.p, dim);
  return s;
}

// a (m x m) * x (m x n) * b (n x n), all row-major double.
inline std::vector<double> Sandwich(const std::vector<double>& a, const std::vector<double>& x,
                                    const std::vector<double>& b, int64_t m, int64_t n) {
  std::vector<double> ax(static_cast<size_t>(m * n), 0.0), out(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < m; ++p) {
      const double v = a[i * m + p];
      if (v == 0.0) continue;
      for (int64_t j = 0; j < n; ++j) ax[i * n + j] += v * x[p * n + j];
    }
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < n; ++p) {
      const double v = ax[i * n + p];
      for (int64_t j = 0; j < n; ++j) out[i * n + j] += v * b[p * n + j];
    }
  return out;
}

// Largest singular value of a dense dim x dim matrix by power iteration on A^T A.
inline double SpectralNorm(const std::vector<double>& a, int64_t dim) {
  if (dim == 0) return 0.0;
  std::vector<double> v(static_cast<size_t>(dim)), w(static_cast<size_t>(dim));
  for (int64_t i = 0; i < dim; ++i) v[i] = 1.0 + 0.01 * double(i % 7);
  double lambda = 0.0;
  for (int it = 0; it < 300; ++it) {
    std::fill(w.begin(), w.end(), 0.0);
    for (int64_t i = 0; i < dim; ++i) {
      double s = 0.0;
      for (int64_t j = 0; j < dim; ++j) s += a[i * dim + j] * v[j];
      for (int64_t j = 0; j < dim; ++j) w[j] += a[i * dim + j] * s;
    }
    double norm = 0.0;
    for (double x : w) norm += x * x;
    norm = std::sqrt(norm);
    if (norm == 0.0) return 0.0;
    lambda = norm;
    for (int64_t i = 0; i < dim; ++i) v[i] = w[i] / norm;
  }
  return std::sqrt(lambda);
}

// Relative Frobenius round-trip error InvertGeometry(ApplyGeometry(G)) may have, for a map whose
// inverse has spectral norm kappa = ||P_L^-1|| ||P_R^-1|| (1 / (min f_L min f_R) for an
// orthonormal basis; larger when the basis is not) and whose longest float accumulation has
// length K = max(m, n, 2k).
// - Each pass is a chain of at most 4 dependent float GEMMs (W = U^T G or X = G V, C = W V, the
//   k x k cores, the rank-2k update), each of whose results carries a relative error of at most
//   lambda sqrt(K) u, u = 2^-24 (Higham & Mary 2019, probabilistic bound; lambda = 2). The
//   magnitudes involved are those of G in the forward pass and of P^-1 y in the inverse one.
// - The forward error is then scaled by ||P^-1|| <= kappa, and the inverse pass's own error
//   (its cores are up to 1/f) is at most kappa times its relative error too.
// So ||G' - G|| / ||G|| <= 2 passes * 4 GEMMs * 2 sqrt(K) u * kappa.
inline double RoundTripBound(double kappa, int64_t K) {
  const double u = std::ldexp(1.0, -24);
  return 2 * 4 * 2 * std::sqrt(double(std::max<int64_t>(K, 1))) * u * kappa;
}

}  // namespace geofp8::testing
