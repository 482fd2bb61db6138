// Seeded anisotropic gradients (synthetic.h): Haar-random orthonormal factors from the QR of a
// Gaussian matrix, spectra i^-p, and a drifted twin that rotates the bases by a controlled amount.
#include "kernels/geometry/synthetic.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "kernels/common/check.h"
#include "kernels/geometry/factors.h"
#include "kernels/geometry/lapack.h"

namespace geofp8 {

std::string_view SyntheticFamilyName(SyntheticFamily f) {
  switch (f) {
    case SyntheticFamily::kSpectral:
      return "spectral";
    case SyntheticFamily::kKronecker:
      return "kron";
    case SyntheticFamily::kLowRankNoise:
      return "lowrank_noise";
  }
  return "unknown";
}

std::optional<SyntheticFamily> ParseSyntheticFamily(std::string_view name) {
  if (name == "spectral") return SyntheticFamily::kSpectral;
  if (name == "kron") return SyntheticFamily::kKronecker;
  if (name == "lowrank_noise") return SyntheticFamily::kLowRankNoise;
  return std::nullopt;
}

namespace {

// rows x cols (rows >= cols) orthonormal, row-major float. `drift` > 0 perturbs the Gaussian
// that produced it before the QR, so the twin's span is a small rotation of the original's.
std::vector<float> Orthonormal(int64_t rows, int64_t cols, uint64_t seed, double drift,
                               uint64_t drift_seed) {
  std::vector<float> gauss(static_cast<size_t>(rows * cols));
  geometry::SeededGaussian(seed, gauss);
  std::vector<double> a(gauss.size());  // column-major
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) a[j * rows + i] = gauss[i * cols + j];
  geometry::lapack::QrInPlace(a, rows, cols, nullptr);
  if (drift > 0) {
    geometry::SeededGaussian(drift_seed, gauss);
    const double scale = drift / std::sqrt(static_cast<double>(rows));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) a[j * rows + i] += scale * gauss[i * cols + j];
    geometry::lapack::QrInPlace(a, rows, cols, nullptr);
  }
  std::vector<float> q(gauss.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) q[i * cols + j] = static_cast<float>(a[j * rows + i]);
  return q;
}

// out (m x n) = L (m x r) diag(s) R^T (R n x r).
std::vector<float> Compose(const std::vector<float>& l, const std::vector<double>& s,
                           const std::vector<float>& r, int64_t m, int64_t n, int64_t rank) {
  std::vector<float> ls(l);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < rank; ++j) ls[i * rank + j] *= static_cast<float>(s[j]);
  std::vector<float> out(static_cast<size_t>(m * n));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, rank, 1.f, ls.data(), rank, r.data(),
              rank, 0.f, out.data(), n);
  return out;
}

}  // namespace

std::vector<float> MakeSyntheticGradient(const SyntheticSpec& spec) {
  const int64_t m = spec.m, n = spec.n;
  if (m < 1 || n < 1) GEOFP8_FAIL("SyntheticSpec: shape must be at least 1x1 (", m, "x", n, ")");
  if (!(spec.decay >= 0 && spec.decay <= 8))
    GEOFP8_FAIL("SyntheticSpec.decay: must be in [0, 8] (", spec.decay, ")");
  if (!(spec.drift >= 0 && spec.drift <= 10))
    GEOFP8_FAIL("SyntheticSpec.drift: must be in [0, 10] (", spec.drift, ")");
  const uint64_t base = spec.seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(spec.family);
  const uint64_t dseed = base ^ 0xd1f7d1f7d1f7ull;
  const int64_t r = std::min(m, n);
  std::vector<float> g;
  switch (spec.family) {
    case SyntheticFamily::kSpectral: {
      std::vector<double> s(static_cast<size_t>(r));
      for (int64_t i = 0; i < r; ++i) s[i] = std::pow(double(i + 1), -spec.decay);
      g = Compose(Orthonormal(m, r, base + 1, spec.drift, dseed + 1), s,
                  Orthonormal(n, r, base + 2, spec.drift, dseed + 2), m, n, r);
      break;
    }
    case SyntheticFamily::kLowRankNoise: {
      const int64_t rank = std::min<int64_t>(32, r);
      std::vector<double> s(static_cast<size_t>(rank));
      for (int64_t i = 0; i < rank; ++i) s[i] = std::pow(double(i + 1), -spec.decay);
      g = Compose(Orthonormal(m, rank, base + 1, spec.drift, dseed + 1), s,
                  Orthonormal(n, rank, base + 2, spec.drift, dseed + 2), m, n, rank);
      // Gaussian noise whose largest singular value (~ sigma (sqrt m + sqrt n)) is 0.1 s_rank.
      std::vector<float> noise(g.size());
      geometry::SeededGaussian(base + (spec.drift > 0 ? 4 : 3), noise);
      const double sigma = 0.1 * s[rank - 1] / (std::sqrt(double(m)) + std::sqrt(double(n)));
      for (size_t i = 0; i < g.size(); ++i) g[i] += static_cast<float>(sigma * noise[i]);
      break;
    }
    case SyntheticFamily::kKronecker: {
      // Left factor Q_L diag(a) (m x m), right factor diag(b) Q_R^T (n x n), content Z (m x n).
      std::vector<float> ql = Orthonormal(m, m, base + 1, spec.drift, dseed + 1);
      std::vector<float> qr = Orthonormal(n, n, base + 2, spec.drift, dseed + 2);
      std::vector<float> z(static_cast<size_t>(m * n));
      geometry::SeededGaussian(base + 3, z);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j)
          z[i * n + j] *= static_cast<float>(std::pow(double(i + 1), -spec.decay / 2) *
                                             std::pow(double(j + 1), -spec.decay / 2));
      std::vector<float> t(static_cast<size_t>(m * n));
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1.f, ql.data(), m, z.data(),
                  n, 0.f, t.data(), n);
      g.assign(static_cast<size_t>(m * n), 0.f);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, n, 1.f, t.data(), n, qr.data(), n,
                  0.f, g.data(), n);
      break;
    }
    default:
      GEOFP8_FAIL("SyntheticSpec.family: unknown value (", static_cast<int>(spec.family),
                  "); accepted: spectral, kron, lowrank_noise");
  }
  double norm = 0;
  for (float x : g) norm += double(x) * x;
  norm = std::sqrt(norm);
  if (norm > 0) {
    for (float& x : g) x = static_cast<float>(x / norm);
  }
  return g;
}

}  // namespace geofp8
