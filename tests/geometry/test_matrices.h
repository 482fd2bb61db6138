// Test matrices with a known SVD for the geometry tests: G = Q_L diag(s) Q_R^T with random
// orthonormal factors (modified Gram-Schmidt in double, independent of the library's LAPACK QR).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace geofp8::testing {

// rows x cols (rows >= cols) with orthonormal columns, row-major double.
inline std::vector<double> RandomOrthonormal(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> q(static_cast<size_t>(rows * cols));
  for (auto& x : q) x = normal(rng);
  for (int64_t j = 0; j < cols; ++j) {
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t p = 0; p < j; ++p) {
        double dot = 0;
        for (int64_t i = 0; i < rows; ++i) dot += q[i * cols + p] * q[i * cols + j];
        for (int64_t i = 0; i < rows; ++i) q[i * cols + j] -= dot * q[i * cols + p];
      }
    }
    double norm = 0;
    for (int64_t i = 0; i < rows; ++i) norm += q[i * cols + j] * q[i * cols + j];
    norm = std::sqrt(norm);
    for (int64_t i = 0; i < rows; ++i) q[i * cols + j] /= norm;
  }
  return q;
}

struct KnownSvd {
  int64_t m, n;
  std::vector<double> U, V, s;  // m x r, n x r row-major; r = s.size()
  std::vector<float> G;         // float32 m x n row-major
};

// G = U diag(s) V^T; s.size() <= min(m, n).
inline KnownSvd MakeKnownSvd(int64_t m, int64_t n, const std::vector<double>& s, uint64_t seed) {
  KnownSvd k{m, n, RandomOrthonormal(m, s.size(), seed), RandomOrthonormal(n, s.size(), seed + 1),
             s, {}};
  const int64_t r = static_cast<int64_t>(s.size());
  k.G.assign(static_cast<size_t>(m * n), 0.f);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < r; ++p) acc += k.U[i * r + p] * s[p] * k.V[j * r + p];
      k.G[i * n + j] = static_cast<float>(acc);
    }
  return k;
}

// s_i = (i+1)^-p for i < count.
inline std::vector<double> PowerSpectrum(int64_t count, double p) {
  std::vector<double> s(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) s[i] = std::pow(static_cast<double>(i + 1), -p);
  return s;
}

// s_i = ratio^i for i < count: a constant gap, so subspace iteration converges geometrically.
inline std::vector<double> GeometricSpectrum(int64_t count, double ratio) {
  std::vector<double> s(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) s[i] = std::pow(ratio, static_cast<double>(i));
  return s;
}

// Singular values of a small row-major matrix by one-sided Jacobi in double (brute force, used
// as an oracle independent of LAPACK). Returns U (m x r), s (r, descending), V (n x r), r = min.
struct JacobiSvd {
  std::vector<double> U, s, V;
};
inline JacobiSvd BruteForceSvd(const std::vector<double>& a, int64_t m, int64_t n) {
  const bool transpose = m < n;
  const int64_t rows = transpose ? n : m, cols = transpose ? m : n;
  std::vector<double> w(static_cast<size_t>(rows * cols)), v(static_cast<size_t>(cols * cols), 0.0);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) w[i * cols + j] = transpose ? a[j * n + i] : a[i * n + j];
  for (int64_t j = 0; j < cols; ++j) v[j * cols + j] = 1.0;
  for (int sweep = 0; sweep < 60; ++sweep) {
    double off = 0;
    for (int64_t p = 0; p < cols; ++p)
      for (int64_t q = p + 1; q < cols; ++q) {
        double alpha = 0, beta = 0, gamma = 0;
        for (int64_t i = 0; i < rows; ++i) {
          alpha += w[i * cols + p] * w[i * cols + p];
          beta += w[i * cols + q] * w[i * cols + q];
          gamma += w[i * cols + p] * w[i * cols + q];
        }
        if (gamma == 0) continue;
        off = std::max(off, std::abs(gamma) / std::sqrt(alpha * beta));
        const double zeta = (beta - alpha) / (2 * gamma);
        const double t = (zeta >= 0 ? 1.0 : -1.0) / (std::abs(zeta) + std::sqrt(1 + zeta * zeta));
        const double c = 1 / std::sqrt(1 + t * t), sn = c * t;
        for (int64_t i = 0; i < rows; ++i) {
          const double x = w[i * cols + p], y = w[i * cols + q];
          w[i * cols + p] = c * x - sn * y;
          w[i * cols + q] = sn * x + c * y;
        }
        for (int64_t i = 0; i < cols; ++i) {
          const double x = v[i * cols + p], y = v[i * cols + q];
          v[i * cols + p] = c * x - sn * y;
          v[i * cols + q] = sn * x + c * y;
        }
      }
    if (off < 1e-15) break;
  }
  std::vector<int64_t> order(static_cast<size_t>(cols));
  std::vector<double> norms(static_cast<size_t>(cols));
  for (int64_t j = 0; j < cols; ++j) {
    double s = 0;
    for (int64_t i = 0; i < rows; ++i) s += w[i * cols + j] * w[i * cols + j];
    norms[j] = std::sqrt(s);
    order[j] = j;
  }
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return norms[x] > norms[y]; });
  JacobiSvd out;
  std::vector<double> left(static_cast<size_t>(rows * cols)),
      right(static_cast<size_t>(cols * cols));
  out.s.resize(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) {
    const int64_t j = order[c];
    out.s[c] = norms[j];
    for (int64_t i = 0; i < rows; ++i)
      left[i * cols + c] = norms[j] > 0 ? w[i * cols + j] / norms[j] : 0;
    for (int64_t i = 0; i < cols; ++i) right[i * cols + c] = v[i * cols + j];
  }
  out.U = transpose ? right : left;
  out.V = transpose ? left : right;
  return out;
}

}  // namespace geofp8::testing
