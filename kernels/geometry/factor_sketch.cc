// The streaming Kronecker-factor sketch of factor_sketch.h: a randomized range finder per update,
// small eigenproblems by Jacobi, every sum in a fixed order so that all ranks agree bit for bit.
#include "kernels/geometry/factor_sketch.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kernels/common/check.h"
#include "kernels/geometry/factors.h"

namespace geofp8 {
namespace geometry {

// The two products over G dominate the update (O(mn) each per column). They vectorize across the
// independent outputs only, so each output is summed in index order whatever the vector width:
// the AVX2 clone and the baseline give the same bits. This file is compiled without FMA
// contraction (CMakeLists.txt) for the same reason.
__attribute__((target_clones("avx2", "default"))) void MulDeterministic(
    const float* G, int64_t m, int64_t n, const float* x, int c, float* y) {
  for (int64_t i = 0; i < m; ++i) {
    float* __restrict yi = y + i * c;
    std::fill(yi, yi + c, 0.f);
    const float* gi = G + i * n;
    for (int64_t j = 0; j < n; ++j) {
      const float g = gi[j];
      const float* __restrict xj = x + j * c;
      for (int a = 0; a < c; ++a) yi[a] += g * xj[a];
    }
  }
}

__attribute__((target_clones("avx2", "default"))) void MulTransposedDeterministic(
    const float* q, int64_t m, int c, const float* G, int64_t n, float* b) {
  std::fill(b, b + static_cast<size_t>(c) * n, 0.f);
  for (int64_t i = 0; i < m; ++i) {
    const float* __restrict gi = G + i * n;
    for (int a = 0; a < c; ++a) {
      const float qa = q[i * c + a];
      float* __restrict ba = b + static_cast<int64_t>(a) * n;
      for (int64_t j = 0; j < n; ++j) ba[j] += qa * gi[j];
    }
  }
}

int OrthonormalizeColumns(std::vector<double>& a, int64_t rows, int cols, double drop) {
  int kept = 0;
  for (int j = 0; j < cols; ++j) {
    double* v = a.data() + j * rows;
    double original = 0.0;
    for (int64_t r = 0; r < rows; ++r) original += v[r] * v[r];
    original = std::sqrt(original);
    // Classical Gram-Schmidt twice ("twice is enough"): orthogonal to float round-off even for
    // nearly dependent columns, which the warm-started range finder produces on purpose.
    for (int pass = 0; pass < 2; ++pass) {
      for (int i = 0; i < kept; ++i) {
        const double* q = a.data() + i * rows;
        double d = 0.0;
        for (int64_t r = 0; r < rows; ++r) d += q[r] * v[r];
        for (int64_t r = 0; r < rows; ++r) v[r] -= d * q[r];
      }
    }
    double norm = 0.0;
    for (int64_t r = 0; r < rows; ++r) norm += v[r] * v[r];
    norm = std::sqrt(norm);
    if (!(norm > drop * original) || !(norm > 0.0)) continue;
    double* dst = a.data() + kept * rows;
    for (int64_t r = 0; r < rows; ++r) dst[r] = v[r] / norm;
    ++kept;
  }
  return kept;
}

void SymmetricEigen(std::vector<double> s, int c, std::vector<double>& values,
                    std::vector<double>& vectors) {
  vectors.assign(static_cast<size_t>(c) * c, 0.0);
  for (int i = 0; i < c; ++i) vectors[i * c + i] = 1.0;
  auto at = [&](int i, int j) -> double& { return s[j * c + i]; };
  double total = 0.0;
  for (double x : s) total += x * x;
  // Cyclic Jacobi: each rotation zeroes one off-diagonal pair. Quadratic convergence; 60 sweeps
  // is far beyond what a c <= 128 matrix needs, and the loop stops once the off-diagonal part is
  // below double round-off of the whole.
  for (int sweep = 0; sweep < 60; ++sweep) {
    double off = 0.0;
    for (int j = 0; j < c; ++j)
      for (int i = 0; i < j; ++i) off += at(i, j) * at(i, j);
    if (!(off > 1e-30 * total)) break;
    for (int p = 0; p < c; ++p) {
      for (int q = p + 1; q < c; ++q) {
        const double apq = at(p, q);
        if (apq == 0.0) continue;
        const double theta = (at(q, q) - at(p, p)) / (2.0 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
        const double cs = 1.0 / std::sqrt(t * t + 1.0), sn = t * cs;
        for (int r = 0; r < c; ++r) {  // columns p, q
          const double x = at(r, p), y = at(r, q);
          at(r, p) = cs * x - sn * y;
          at(r, q) = sn * x + cs * y;
        }
        for (int r = 0; r < c; ++r) {  // rows p, q
          const double x = at(p, r), y = at(q, r);
          at(p, r) = cs * x - sn * y;
          at(q, r) = sn * x + cs * y;
        }
        for (int r = 0; r < c; ++r) {
          double* vp = &vectors[p * c + r];
          double* vq = &vectors[q * c + r];
          const double x = *vp, y = *vq;
          *vp = cs * x - sn * y;
          *vq = sn * x + cs * y;
        }
      }
    }
  }
  std::vector<int> order(static_cast<size_t>(c));
  std::iota(order.begin(), order.end(), 0);
  // Stable on ties, so the order is a pure function of the values.
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return at(x, x) > at(y, y); });
  values.resize(static_cast<size_t>(c));
  std::vector<double> sorted(static_cast<size_t>(c) * c);
  for (int i = 0; i < c; ++i) {
    values[i] = at(order[i], order[i]);
    std::memcpy(&sorted[static_cast<size_t>(i) * c], &vectors[static_cast<size_t>(order[i]) * c],
                sizeof(double) * c);
  }
  vectors = std::move(sorted);
}

}  // namespace geometry

namespace {

using geometry::MulDeterministic;
using geometry::MulTransposedDeterministic;
using geometry::OrthonormalizeColumns;
using geometry::SymmetricEigen;

// out (rows x w, row-major float) = basis (rows x c, column-major double) * vecs[:, :w].
void Rotate(const std::vector<double>& basis, int64_t rows, int c, const std::vector<double>& vecs,
            int w, std::vector<float>& out) {
  out.assign(static_cast<size_t>(rows * w), 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < w; ++j) {
      double s = 0.0;
      for (int i = 0; i < c; ++i) s += basis[i * rows + r] * vecs[j * c + i];
      out[r * w + j] = static_cast<float>(s);
    }
}

// proj (c x held, column-major) = basis^T (c x rows) held_cols (rows x held, row-major float).
std::vector<double> Project(const std::vector<double>& basis, int64_t rows, int c,
                            const std::vector<float>& held_cols, int held) {
  std::vector<double> out(static_cast<size_t>(c) * held, 0.0);
  for (int j = 0; j < held; ++j)
    for (int i = 0; i < c; ++i) {
      double s = 0.0;
      for (int64_t r = 0; r < rows; ++r) s += basis[i * rows + r] * held_cols[r * held + j];
      out[j * c + i] = s;
    }
  return out;
}

// S (c x c, column-major) = beta * C diag(energy) C^T + (1 - beta) * E E^T, C is c x held, E is
// c x e (both column-major).
std::vector<double> FoldedFactor(const std::vector<double>& C, const std::vector<double>& energy,
                                 int held, const std::vector<double>& E, int e, int c,
                                 double beta) {
  std::vector<double> s(static_cast<size_t>(c) * c, 0.0);
  for (int j = 0; j < c; ++j)
    for (int i = 0; i <= j; ++i) {
      double a = 0.0, b = 0.0;
      for (int h = 0; h < held; ++h) a += C[h * c + i] * energy[h] * C[h * c + j];
      for (int h = 0; h < e; ++h) b += E[h * c + i] * E[h * c + j];
      s[j * c + i] = s[i * c + j] = beta * a + (1.0 - beta) * b;
    }
  return s;
}

// Seeded probe columns for one update: the same on every rank for the same (seed, update).
void Probes(uint64_t seed, uint64_t update, int64_t n, int p, float* x, int ld, int col0) {
  std::vector<float> g(static_cast<size_t>(n * p));
  geometry::SeededGaussian(seed * 0x9e3779b97f4a7c15ull + update + 1, g);
  for (int64_t r = 0; r < n; ++r)
    for (int j = 0; j < p; ++j) x[r * ld + col0 + j] = g[r * p + j];
}

}  // namespace

void UpdateFactorSketch(FactorSketch& s, std::span<const float> G, int64_t m, int64_t n, int k,
                        const FactorSketchOptions& o) {
  GEOFP8_CHECK(m > 0 && n > 0 && static_cast<int64_t>(G.size()) == m * n,
               "UpdateFactorSketch: G has ", G.size(), " elements, shape ", m, "x", n);
  GEOFP8_CHECK(o.width >= 1 && o.probes >= 0 && o.beta >= 0.f && o.beta < 1.f,
               "FactorSketchOptions: width ", o.width, ", probes ", o.probes, ", beta ", o.beta,
               " (need width >= 1, probes >= 0, beta in [0, 1))");
  double g2 = 0.0;
  for (size_t i = 0; i < G.size(); ++i) {
    if (!std::isfinite(G[i])) {
      GEOFP8_FAIL("UpdateFactorSketch: G holds a non-finite value (", G[i], ") at index ", i);
    }
    g2 += static_cast<double>(G[i]) * G[i];
  }
  if (s.m != m || s.n != n) s = FactorSketch{};
  s.m = m;
  s.n = n;
  const int target = static_cast<int>(std::min<int64_t>({o.width, m, n}));
  const int held = s.updates == 0 ? 0 : s.width;
  // The range finder's inputs: the held right basis (where the persistent energy is) plus fresh
  // probes; on the first update probes only, as many as the sketch will hold plus the extra.
  const int p = static_cast<int>(std::min<int64_t>(held == 0 ? target + o.probes : o.probes, n));
  const int cx = held + p;
  std::vector<float> x(static_cast<size_t>(n * cx));
  for (int64_t r = 0; r < n; ++r)
    std::memcpy(&x[r * cx], &s.right[r * held], sizeof(float) * held);
  if (p > 0) Probes(o.seed, s.updates, n, p, x.data(), cx, held);
  std::vector<float> y(static_cast<size_t>(m * cx));
  MulDeterministic(G.data(), m, n, x.data(), cx, y.data());

  // Left: Q = orth([U, G X]), B = Q^T G, S_L = Q^T (beta U L U^T + (1 - beta) G G^T) Q.
  const int ca = held + cx;
  std::vector<double> q(static_cast<size_t>(m * ca));
  for (int64_t r = 0; r < m; ++r) {
    for (int j = 0; j < held; ++j) q[j * m + r] = s.left[r * held + j];
    for (int j = 0; j < cx; ++j) q[(held + j) * m + r] = y[r * cx + j];
  }
  const int c = OrthonormalizeColumns(q, m, ca);
  std::vector<float> qf(static_cast<size_t>(m * c));
  for (int64_t r = 0; r < m; ++r)
    for (int j = 0; j < c; ++j) qf[r * c + j] = static_cast<float>(q[j * m + r]);
  std::vector<float> b(static_cast<size_t>(c) * n);
  MulTransposedDeterministic(qf.data(), m, c, G.data(), n, b.data());
  std::vector<double> bd(b.begin(), b.end());  // c x n row-major = n x c column-major (B^T)
  // E for the left fold is B (c x n): its column h is B[:, h], i.e. row h of B^T.
  std::vector<double> e_left(static_cast<size_t>(c) * n);
  for (int i = 0; i < c; ++i)
    for (int64_t h = 0; h < n; ++h) e_left[h * c + i] = bd[i * n + h];
  const std::vector<double> c_left = Project(q, m, c, s.left, held);

  // How the basis that was in force fit this gradient (before the gradient moves it).
  const int kk = std::min(k, held);
  if (kk > 0 && s.energy > 0.0 && g2 > 0.0) {
    double in_left = 0.0, in_right = 0.0, pred_left = 0.0, pred_right = 0.0;
    for (int i = 0; i < kk; ++i) {
      // Row i of U^T G = sum over Q's coordinates: C[:, i]^T B.
      for (int64_t h = 0; h < n; ++h) {
        double v = 0.0;
        for (int a = 0; a < c; ++a) v += c_left[i * c + a] * e_left[h * c + a];
        in_left += v * v;
      }
      for (int64_t r = 0; r < m; ++r) in_right += double(y[r * cx + i]) * y[r * cx + i];
      pred_left += s.left_energy[i];
      pred_right += s.right_energy[i];
    }
    const double fl = pred_left > 0 ? (in_left / g2) / (pred_left / s.energy) : 1.0;
    const double fr = pred_right > 0 ? (in_right / g2) / (pred_right / s.energy) : 1.0;
    s.fit = std::min(fl, fr);
    s.fit_k = kk;
  }

  const double beta = s.updates == 0 ? 0.0 : o.beta;
  std::vector<double> values, vectors;
  SymmetricEigen(FoldedFactor(c_left, s.left_energy, held, e_left, static_cast<int>(n), c, beta),
                 c, values, vectors);
  const int w_left = std::min(target, c);

  // Right: P = orth([V, B^T]), S_R = P^T (beta V R V^T + (1 - beta) B^T B) P.
  const int cz = held + c;
  std::vector<double> z(static_cast<size_t>(n * cz));
  for (int64_t r = 0; r < n; ++r) {
    for (int j = 0; j < held; ++j) z[j * n + r] = s.right[r * held + j];
    for (int j = 0; j < c; ++j) z[(held + j) * n + r] = bd[j * n + r];
  }
  const int c2 = OrthonormalizeColumns(z, n, cz);
  const std::vector<double> c_right = Project(z, n, c2, s.right, held);
  // E = P^T B^T (c2 x c): column a is P^T (row a of B).
  std::vector<double> e_right(static_cast<size_t>(c2) * c, 0.0);
  for (int a = 0; a < c; ++a)
    for (int i = 0; i < c2; ++i) {
      double v = 0.0;
      for (int64_t r = 0; r < n; ++r) v += z[i * n + r] * bd[a * n + r];
      e_right[a * c2 + i] = v;
    }
  std::vector<double> values_r, vectors_r;
  SymmetricEigen(FoldedFactor(c_right, s.right_energy, held, e_right, c, c2, beta), c2, values_r,
                 vectors_r);
  const int w = std::min(w_left, c2);

  Rotate(q, m, c, vectors, w, s.left);
  Rotate(z, n, c2, vectors_r, w, s.right);
  s.left_energy.assign(values.begin(), values.begin() + w);
  s.right_energy.assign(values_r.begin(), values_r.begin() + w);
  for (double& v : s.left_energy) v = std::max(v, 0.0);
  for (double& v : s.right_energy) v = std::max(v, 0.0);
  s.width = w;
  s.energy = beta * s.energy + (1.0 - beta) * g2;
  ++s.updates;
}

Geometry GeometryFromSketch(const FactorSketch& s, const SketchGeometryOptions& o,
                            uint64_t version) {
  Geometry g;
  g.mode = GeometryMode::kLowRank;
  g.m = s.m;
  g.n = s.n;
  g.alpha = o.alpha;
  const int k = std::min(o.rank, s.width);
  if (s.updates == 0 || k <= 0 || !(s.energy > 0.0)) return g;  // version 0: identity
  g.version = version;
  g.k = k;
  g.U.resize(static_cast<size_t>(s.m * k));
  g.V.resize(static_cast<size_t>(s.n * k));
  for (int64_t r = 0; r < s.m; ++r)
    std::memcpy(&g.U[r * k], &s.left[r * s.width], sizeof(float) * k);
  for (int64_t r = 0; r < s.n; ++r)
    std::memcpy(&g.V[r * k], &s.right[r * s.width], sizeof(float) * k);
  double in_left = 0.0, in_right = 0.0;
  for (int i = 0; i < k; ++i) {
    in_left += s.left_energy[i];
    in_right += s.right_energy[i];
  }
  const double dl = s.m > k ? std::max(0.0, s.energy - in_left) / double(s.m - k) : 0.0;
  const double dr = s.n > k ? std::max(0.0, s.energy - in_right) / double(s.n - k) : 0.0;
  g.delta_L = static_cast<float>(dl);
  g.delta_R = static_cast<float>(dr);
  // Strength t in [0, 1] scales the whitening exponent: (e / delta)^(-alpha t). It is carried in
  // the energies, e' = delta (e / delta)^t, so the geometry keeps the policy's alpha (which the
  // fingerprint and a resume check) and the transform code stays as it is.
  const double t = o.adapt > 0.f ? std::pow(std::clamp(s.fit, 0.0, 1.0), double(o.adapt)) : 1.0;
  auto value = [t](double e, double delta) {
    const double shaped = (t < 1.0 && delta > 0.0 && e > delta) ? delta * std::pow(e / delta, t) : e;
    return static_cast<float>(std::sqrt(shaped));
  };
  g.sigma.resize(k);
  g.sigma_right.resize(k);
  for (int i = 0; i < k; ++i) {
    g.sigma[i] = value(s.left_energy[i], dl);
    g.sigma_right[i] = value(s.right_energy[i], dr);
  }
  return g;
}

}  // namespace geofp8
