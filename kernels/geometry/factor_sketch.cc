// The streaming Kronecker-factor sketch of factor_sketch.h: a randomized range finder per update
// (two thin GEMMs over G), Householder QR and small symmetric eigenproblems by Jacobi.
#include "kernels/geometry/factor_sketch.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/common/check.h"
#include "kernels/geometry/factors.h"
#include "kernels/geometry/lapack.h"

namespace geofp8 {

namespace {

// Buffers of one update, kept per thread across updates: fresh multi-megabyte allocations on
// every call cost more page faults and zeroing than the small algebra itself.
struct Scratch {
  std::vector<float> x, y, qf, b;
  std::vector<double> q, bt, r_left, z, r_right, e, row, rot;
};
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

template <typename T>
T* Sized(std::vector<T>& v, int64_t count) {
  if (v.size() < static_cast<size_t>(count)) v.resize(static_cast<size_t>(count));
  return v.data();
}

// out (rows x w, row-major float) = basis (rows x c, column-major double) * vecs[:, :w].
void Rotate(const double* basis, int64_t rows, int c, const std::vector<double>& vecs, int w,
            std::vector<double>& scratch, std::vector<float>& out) {
  double* r = Sized(scratch, rows * w);
  cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, rows, w, c, 1.0, basis, rows, vecs.data(),
              c, 0.0, r, rows);
  out.resize(static_cast<size_t>(rows * w));
  for (int64_t i = 0; i < rows; ++i)
    for (int j = 0; j < w; ++j) out[i * w + j] = static_cast<float>(r[j * rows + i]);
}

// S (c x c, column-major) = beta * C diag(energy) C^T + (1 - beta) * E E^T, where C is c x held
// and E is c x e, both column-major with leading dimension ldc / lde.
std::vector<double> FoldedFactor(const double* C, int ldc, const std::vector<double>& energy,
                                 int held, const double* E, int lde, int e, int c, double beta) {
  std::vector<double> s(static_cast<size_t>(c) * c, 0.0);
  std::vector<double> scaled(static_cast<size_t>(c) * std::max(held, 1));
  for (int h = 0; h < held; ++h)
    for (int i = 0; i < c; ++i) scaled[h * c + i] = C[h * ldc + i] * energy[h];
  if (held > 0) {
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasTrans, c, c, held, beta, scaled.data(), c, C, ldc,
                0.0, s.data(), c);
  }
  if (e > 0) {
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasTrans, c, c, e, 1.0 - beta, E, lde, E, lde, 1.0,
                s.data(), c);
  }
  for (int j = 0; j < c; ++j)  // exactly symmetric for Jacobi
    for (int i = 0; i < j; ++i) s[j * c + i] = s[i * c + j] = 0.5 * (s[j * c + i] + s[i * c + j]);
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
  // ||G||^2 accumulated in double; a NaN or inf anywhere makes it non-finite (a finite float's
  // square cannot overflow a double), and only then is G searched for the culprit.
  const double g2 = cblas_dsdot(static_cast<int>(G.size()), G.data(), 1, G.data(), 1);
  if (!std::isfinite(g2)) {
    for (size_t i = 0; i < G.size(); ++i) {
      if (!std::isfinite(G[i])) {
        GEOFP8_FAIL("UpdateFactorSketch: G holds a non-finite value (", G[i], ") at index ", i);
      }
    }
  }
  if (s.m != m || s.n != n) s = FactorSketch{};
  s.m = m;
  s.n = n;
  const int target = static_cast<int>(std::min<int64_t>({o.width, m, n}));
  const int held = s.updates == 0 ? 0 : s.width;
  // The range finder's inputs: the held right basis (where the persistent energy is) plus fresh
  // probes so that new directions can enter; on the first update probes only, as many as the
  // sketch will hold plus the extra. Q = orth([U, G X]) needs at most m columns.
  const int want = held == 0 ? target + o.probes : o.probes;
  const int p = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(want, m - 2 * held)));
  const int cx = held + p;
  Scratch& sc = ThreadScratch();
  float* x = Sized(sc.x, n * std::max(cx, 1));
  for (int64_t r = 0; r < n; ++r) std::memcpy(&x[r * cx], &s.right[r * held], sizeof(float) * held);
  if (p > 0) Probes(o.seed, s.updates, n, p, x, cx, held);
  float* y = Sized(sc.y, m * std::max(cx, 1));
  if (cx > 0) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, cx, n, 1.f, G.data(), n, x, cx, 0.f,
                y, cx);
  }

  // Left: Q = orth([U, G X]) (Householder), B = Q^T G, S_L = Q^T (beta U L U^T + (1-beta) G G^T) Q.
  // U is Q's leading columns, so Q^T U is R's leading columns.
  const int ca = std::min<int>(held + cx, static_cast<int>(m));
  sc.q.resize(static_cast<size_t>(m * ca));
  double* q = sc.q.data();
  for (int64_t r = 0; r < m; ++r) {
    for (int j = 0; j < held; ++j) q[j * m + r] = s.left[r * held + j];
    for (int j = held; j < ca; ++j) q[j * m + r] = y[r * cx + (j - held)];
  }
  geometry::lapack::QrInPlace(sc.q, m, ca, &sc.r_left);
  const std::vector<double>& r_left = sc.r_left;
  float* qf = Sized(sc.qf, m * ca);
  for (int64_t r = 0; r < m; ++r)
    for (int j = 0; j < ca; ++j) qf[r * ca + j] = static_cast<float>(q[j * m + r]);
  float* b = Sized(sc.b, int64_t(ca) * n);  // ca x n, row-major
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ca, n, m, 1.f, qf, ca, G.data(), n, 0.f, b,
              n);
  // B in double, column-major ca x n (= B^T row-major): the operand of E E^T and of P^T B^T.
  double* bt = Sized(sc.bt, int64_t(ca) * n);
  for (int a = 0; a < ca; ++a)
    for (int64_t h = 0; h < n; ++h) bt[h * ca + a] = b[a * n + h];

  // How the basis that was in force fit this gradient, before the gradient moves it: the energy
  // of G inside span(U_k) (rows of U^T G = C^T B) and span(V_k) (columns of G V = Y), against the
  // fraction the sketch predicted.
  const int kk = std::min(k, held);
  if (kk > 0 && s.energy > 0.0 && g2 > 0.0) {
    double in_left = 0.0, in_right = 0.0, pred_left = 0.0, pred_right = 0.0;
    double* row = Sized(sc.row, n);
    for (int i = 0; i < kk; ++i) {
      cblas_dgemv(CblasColMajor, CblasTrans, ca, n, 1.0, bt, ca, &r_left[i * ca], 1, 0.0, row, 1);
      for (int64_t h = 0; h < n; ++h) in_left += row[h] * row[h];
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
  geometry::lapack::SymmetricEigen(
      FoldedFactor(r_left.data(), ca, s.left_energy, held, bt, ca, static_cast<int>(n), ca, beta),
      ca, values, vectors);
  const int w_left = std::min(target, ca);

  // Right: P = orth([V, B^T]), S_R = P^T (beta V R V^T + (1-beta) B^T B) P; P^T V is R_z's
  // leading columns, E = P^T B^T by a product (B^T may not fit whole into P when n is small).
  const int cz = std::min<int>(held + ca, static_cast<int>(n));
  sc.z.resize(static_cast<size_t>(n * cz));
  double* z = sc.z.data();
  for (int j = 0; j < held; ++j)
    for (int64_t r = 0; r < n; ++r) z[j * n + r] = s.right[r * held + j];
  for (int j = held; j < cz; ++j)
    for (int64_t r = 0; r < n; ++r) z[j * n + r] = b[static_cast<int64_t>(j - held) * n + r];
  geometry::lapack::QrInPlace(sc.z, n, cz, &sc.r_right);
  double* e = Sized(sc.e, int64_t(cz) * ca);
  // E (cz x ca) = P^T B^T = P^T (bt)^T.
  cblas_dgemm(CblasColMajor, CblasTrans, CblasTrans, cz, ca, n, 1.0, z, n, bt, ca, 0.0, e, cz);
  std::vector<double> values_r, vectors_r;
  geometry::lapack::SymmetricEigen(
      FoldedFactor(sc.r_right.data(), cz, s.right_energy, held, e, cz, ca, cz, beta), cz, values_r,
      vectors_r);
  const int w = std::min(w_left, cz);

  Rotate(q, m, ca, vectors, w, sc.rot, s.left);
  Rotate(z, n, cz, vectors_r, w, sc.rot, s.right);
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
    const double shaped =
        (t < 1.0 && delta > 0.0 && e > delta) ? delta * std::pow(e / delta, t) : e;
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
