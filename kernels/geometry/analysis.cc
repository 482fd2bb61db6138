// Band errors and residual-subspace error (DESIGN.md section 6): brute-force SVD of the true
// gradient once, then per candidate the projection U^T E V with two GEMMs.
#include "kernels/geometry/analysis.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "kernels/common/check.h"
#include "kernels/geometry/lapack.h"

namespace geofp8 {

SpectralReference ComputeSpectralReference(std::span<const float> G, int64_t m, int64_t n) {
  GEOFP8_CHECK(m >= 0 && n >= 0 && static_cast<int64_t>(G.size()) == m * n,
               "ComputeSpectralReference: ", G.size(), " elements for shape ", m, "x", n);
  for (size_t i = 0; i < G.size(); ++i) {
    if (!std::isfinite(G[i])) {
      GEOFP8_FAIL("ComputeSpectralReference: G holds a non-finite value (", G[i], ") at index ", i);
    }
  }
  SpectralReference ref;
  ref.m = m;
  ref.n = n;
  ref.r = std::min(m, n);
  if (ref.r == 0) return ref;
  std::vector<double> a(static_cast<size_t>(m * n));  // column-major
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) a[j * m + i] = G[i * n + j];
  geometry::lapack::Svd svd = geometry::lapack::ThinSvd(a, m, n);
  const int64_t r = ref.r;
  ref.sigma = svd.s;
  ref.U.resize(static_cast<size_t>(m * r));
  ref.V.resize(static_cast<size_t>(n * r));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < r; ++j) ref.U[i * r + j] = static_cast<float>(svd.u[j * m + i]);
  for (int64_t j = 0; j < r; ++j)
    for (int64_t c = 0; c < n; ++c) ref.V[c * r + j] = static_cast<float>(svd.vt[c * r + j]);
  return ref;
}

// A band whose energy is below (1e-6 ||G||_F)^2 holds only the float32 rounding of G itself
// (relative 6e-8 per element): its singular vectors are noise, so its error is not reported.
constexpr double kBandEnergyFloor = 1e-12;

std::vector<int64_t> BandEdges(int64_t r, int64_t k) {
  const int64_t half = r / 2;
  const int64_t e1 = std::clamp<int64_t>(k, 0, half);
  const int64_t e2 = std::clamp<int64_t>(4 * k, e1, half);
  return {0, e1, e2, half, r};
}

BandErrors ComputeBandErrors(const SpectralReference& ref, std::span<const float> G,
                             std::span<const float> G_hat, int64_t k) {
  const int64_t m = ref.m, n = ref.n, r = ref.r;
  GEOFP8_CHECK(static_cast<int64_t>(G.size()) == m * n && G_hat.size() == G.size(),
               "ComputeBandErrors: sizes ", G.size(), " and ", G_hat.size(), " for ", m, "x", n);
  GEOFP8_CHECK(k >= 0, "ComputeBandErrors: k must be >= 0 (", k, ")");
  BandErrors out;
  const std::vector<int64_t> edges = BandEdges(r, k);
  std::vector<double> band_num(4, 0.0);
  if (r > 0) {
    std::vector<float> e(G.size());
    for (size_t i = 0; i < G.size(); ++i) e[i] = G_hat[i] - G[i];
    // P = U^T E V (r x r); band b is the diagonal block [edge_b, edge_b+1)^2.
    std::vector<float> ute(static_cast<size_t>(r * n)), p(static_cast<size_t>(r * r));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r, n, m, 1.f, ref.U.data(), r, e.data(), n,
                0.f, ute.data(), n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r, r, n, 1.f, ute.data(), n,
                ref.V.data(), r, 0.f, p.data(), r);
    for (int b = 0; b < 4; ++b)
      for (int64_t i = edges[b]; i < edges[b + 1]; ++i)
        for (int64_t j = edges[b]; j < edges[b + 1]; ++j) {
          const double x = p[i * r + j];
          band_num[b] += x * x;
        }
  }
  double total = 0.0;
  for (double s : ref.sigma) total += s * s;
  for (int b = 0; b < 4; ++b) {
    BandError be;
    be.begin = edges[b];
    be.end = edges[b + 1];
    double den = 0.0;
    for (int64_t i = be.begin; i < be.end; ++i) den += ref.sigma[i] * ref.sigma[i];
    be.defined = den > kBandEnergyFloor * total;
    if (be.defined) {
      be.error = std::sqrt(band_num[b] / den);
      out.worst_band_error = std::max(out.worst_band_error, be.error);
    }
    out.bands.push_back(be);
  }
  return out;
}

namespace {

// X <- (I - U U^T) X (I - V V^T) in place, X m x n row-major, U m x k, V n x k.
void ProjectResidual(std::vector<float>& x, int64_t m, int64_t n, std::span<const float> U,
                     std::span<const float> V, int k) {
  if (k == 0 || m == 0 || n == 0) return;
  std::vector<float> w(static_cast<size_t>(k * n)), y(static_cast<size_t>(m * k));
  // Left: X -= U (U^T X).
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, k, n, m, 1.f, U.data(), k, x.data(), n, 0.f,
              w.data(), n);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, -1.f, U.data(), k, w.data(), n,
              1.f, x.data(), n);
  // Right: X -= (X V) V^T.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, k, n, 1.f, x.data(), n, V.data(), k,
              0.f, y.data(), k);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, -1.f, y.data(), k, V.data(), k, 1.f,
              x.data(), n);
}

double SumSquares(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  return s;
}

}  // namespace

std::optional<double> ResidualSubspaceError(std::span<const float> G, std::span<const float> G_hat,
                                            int64_t m, int64_t n, std::span<const float> U,
                                            std::span<const float> V, int k) {
  GEOFP8_CHECK(static_cast<int64_t>(G.size()) == m * n && G_hat.size() == G.size(),
               "ResidualSubspaceError: sizes ", G.size(), " and ", G_hat.size(), " for ", m, "x",
               n);
  GEOFP8_CHECK(
      k >= 0 && static_cast<int64_t>(U.size()) == m * k && static_cast<int64_t>(V.size()) == n * k,
      "ResidualSubspaceError: basis sizes ", U.size(), ", ", V.size(), " for k=", k);
  std::vector<float> e(G.size()), g(G.begin(), G.end());
  for (size_t i = 0; i < G.size(); ++i) e[i] = G_hat[i] - G[i];
  ProjectResidual(e, m, n, U, V, k);
  ProjectResidual(g, m, n, U, V, k);
  const double den = SumSquares(g);
  if (!(den > 0.0)) return std::nullopt;
  return std::sqrt(SumSquares(e) / den);
}

double RelFroError(std::span<const float> G, std::span<const float> G_hat) {
  GEOFP8_CHECK(G.size() == G_hat.size(), "RelFroError: sizes ", G.size(), " and ", G_hat.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < G.size(); ++i) {
    const double d = static_cast<double>(G_hat[i]) - G[i];
    num += d * d;
    den += static_cast<double>(G[i]) * G[i];
  }
  if (!(den > 0.0)) return num > 0.0 ? 1.0 : 0.0;
  return std::sqrt(num / den);
}

}  // namespace geofp8
