// The streaming Kronecker-factor sketch of factor_sketch.h: a randomized range finder per update
// (two thin products over G, the first fused with ||G||^2 in thin_product.h), Cholesky QR2 on
// the left (Householder when ill-conditioned), the right side from the Gram of a thin root of its
// factor, and small symmetric eigenproblems by lapack.h's own tridiagonal QL.
#include "kernels/geometry/factor_sketch.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/common/check.h"
#include "kernels/geometry/factors.h"
#include "kernels/geometry/lapack.h"
#include "kernels/geometry/thin_product.h"

namespace geofp8 {

namespace {

// Buffers of one update, kept per thread across updates: fresh multi-megabyte allocations on
// every call cost more page faults and zeroing than the small algebra itself.
struct Scratch {
  std::vector<float> x, y, qf, bf;
  std::vector<double> q, bd, r_left, z, r_right, e, row, rot, s_left, s_right, values_left,
      values_right, work;
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

// out (rows x w, row-major float) = basis (rows x c, column-major double) times the eigenvectors
// of the w largest eigenvalues, largest first. `vecs` holds all c eigenvectors (c x c,
// column-major) in LAPACK's ascending order, so those are its last w columns, reversed.
void Rotate(const double* basis, int64_t rows, int c, const double* vecs, int w,
            std::vector<double>& scratch, std::vector<float>& out) {
  double* r = Sized(scratch, rows * w);
  cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, rows, w, c, 1.0, basis, rows,
              vecs + static_cast<int64_t>(c - w) * c, c, 0.0, r, rows);
  out.resize(static_cast<size_t>(rows * w));
  for (int j = 0; j < w; ++j) {
    const double* col = r + static_cast<int64_t>(w - 1 - j) * rows;
    for (int64_t i = 0; i < rows; ++i) out[i * w + j] = static_cast<float>(col[i]);
  }
}

// The upper triangle of S (c x c, column-major) = beta C diag(energy) C^T + (1 - beta) E E^T.
// C is c x held (column-major, leading dimension ldc); E is c x e, given column-major as E
// (e_trans false, leading dimension lde >= c) or as E^T (e x c, e_trans true, lde >= e). Only the
// upper triangle is formed: the eigensolver reads nothing else.
void FoldedFactor(const double* C, int ldc, const double* energy, int held, const double* E,
                  int lde, int e, bool e_trans, int c, double beta, std::vector<double>& scaled,
                  std::vector<double>& s) {
  s.assign(static_cast<size_t>(c) * c, 0.0);
  if (held > 0 && beta > 0.0) {
    // C diag(energy) C^T = (C diag(sqrt energy)) (C diag(sqrt energy))^T; energies are >= 0.
    double* sc = Sized(scaled, int64_t(c) * held);
    for (int h = 0; h < held; ++h) {
      const double root = std::sqrt(energy[h]);
      for (int i = 0; i < c; ++i) sc[h * c + i] = C[int64_t(h) * ldc + i] * root;
    }
    cblas_dsyrk(CblasColMajor, CblasUpper, CblasNoTrans, c, held, beta, sc, c, 0.0, s.data(), c);
  }
  if (e > 0) {
    cblas_dsyrk(CblasColMajor, CblasUpper, e_trans ? CblasTrans : CblasNoTrans, c, e, 1.0 - beta, E,
                lde, 1.0, s.data(), c);
  }
}

// Seeded probe columns for one update: the same on every rank for the same (seed, update).
// Rademacher signs (+-1), one bit of splitmix64 output each: a randomized range finder needs
// only a random test matrix with independent zero-mean unit-variance entries, and signs cost no
// logarithms or sines (Gaussian probes by Box-Muller were a tenth of the update).
void Probes(uint64_t seed, uint64_t update, int64_t n, int p, float* x, int ld, int col0) {
  uint64_t state = (seed * 0x9e3779b97f4a7c15ull + update + 1) ^ 0x6a09e667f3bcc909ull;
  uint64_t bits = 0;
  int left = 0;
  for (int64_t r = 0; r < n; ++r) {
    for (int j = 0; j < p; ++j) {
      if (left == 0) {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        bits = z ^ (z >> 31);
        left = 64;
      }
      x[r * ld + col0 + j] = (bits & 1u) ? 1.f : -1.f;
      bits >>= 1;
      --left;
    }
  }
}

// Below this fraction of the top eigenvalue, RightFromGram's vectors W phi / sqrt(s) would lose
// orthogonality beyond float's (about eps_double / 1e-6 = 2e-10 << 6e-8): the orthonormalizing
// path takes over.
constexpr double kGramFloor = 1e-6;

// W (n x cw, column-major double) = [V diag(sqrt(beta R)), sqrt(1 - beta) B^T]: the right factor
// is W W^T. V and R are the sketch's held right basis and energies, B^T is bd (n x ca).
double* RightFactorRoot(const FactorSketch& s, const double* bd, int64_t n, int held, int ca,
                        double beta, Scratch& sc) {
  double* W = Sized(sc.z, n * (held + ca));
  for (int j = 0; j < held; ++j) {
    const double root = std::sqrt(beta * std::max(s.right_energy[j], 0.0));
    double* __restrict col = W + int64_t(j) * n;
    for (int64_t r = 0; r < n; ++r) col[r] = double(s.right[r * held + j]) * root;
  }
  const double root = std::sqrt(1.0 - beta);
  for (int64_t i = 0; i < int64_t(ca) * n; ++i) W[int64_t(held) * n + i] = bd[i] * root;
  return W;
}

// The new right basis and energies from the Gram of W (see UpdateFactorSketch). Returns false,
// changing nothing, when the w-th eigenvalue is below kGramFloor of the first.
bool RightFromGram(FactorSketch& s, const double* bd, int64_t n, int held, int ca, double beta,
                   int w, Scratch& sc) {
  const int cw = held + ca;
  if (w <= 0 || n < cw) return false;
  const double* W = RightFactorRoot(s, bd, n, held, ca, beta, sc);
  std::vector<double>& K = sc.s_right;
  K.assign(static_cast<size_t>(cw) * cw, 0.0);
  cblas_dsyrk(CblasColMajor, CblasUpper, CblasTrans, cw, n, 1.0, W, n, 0.0, K.data(), cw);
  double* values = Sized(sc.values_right, cw);
  geometry::lapack::SymmetricEigenInPlace(K.data(), cw, values, sc.work);
  const double top = values[cw - 1];
  if (!(top > 0.0) || !(values[cw - w] > kGramFloor * top)) return false;
  double* r = Sized(sc.rot, n * w);
  cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, n, w, cw, 1.0, W, n,
              K.data() + int64_t(cw - w) * cw, cw, 0.0, r, n);
  // W holds its own copy of the old basis, so the new one is written over it in place.
  s.right.resize(static_cast<size_t>(n * w));
  s.right_energy.resize(static_cast<size_t>(w));
  for (int j = 0; j < w; ++j) {  // descending: column cw - 1 - j of the eigenvectors
    const double value = values[cw - 1 - j];
    const double inv = 1.0 / std::sqrt(value);
    const double* col = r + int64_t(w - 1 - j) * n;
    for (int64_t i = 0; i < n; ++i) s.right[i * w + j] = static_cast<float>(col[i] * inv);
    s.right_energy[j] = value;
  }
  return true;
}

// The same by orthonormalizing [V, B^T] first: P = orth([V, B^T]) (n x cz), S_R = P^T (beta V R
// V^T + (1-beta) B^T B) P, P^T V is R_z's leading columns, E = P^T B^T by a product (B^T may not
// fit whole into P when n is small). For the cases RightFromGram declines.
void RightFromBasis(FactorSketch& s, const double* bd, int64_t n, int held, int ca, double beta,
                    int w, Scratch& sc) {
  const int cz = std::min<int>(held + ca, static_cast<int>(n));
  double* z = Sized(sc.z, n * cz);
  for (int j = 0; j < held; ++j)
    for (int64_t r = 0; r < n; ++r) z[j * n + r] = s.right[r * held + j];
  std::memcpy(z + int64_t(held) * n, bd, sizeof(double) * (cz - held) * n);
  geometry::lapack::OrthonormalizeInPlace(z, n, cz, &sc.r_right);
  double* e = Sized(sc.e, int64_t(cz) * ca);
  // E (cz x ca) = P^T B^T.
  cblas_dgemm(CblasColMajor, CblasTrans, CblasNoTrans, cz, ca, n, 1.0, z, n, bd, n, 0.0, e, cz);
  std::vector<double>& vectors_r = sc.s_right;
  FoldedFactor(sc.r_right.data(), cz, s.right_energy.data(), held, e, cz, ca, /*e_trans=*/false, cz,
               beta, sc.rot, vectors_r);
  double* values_r = Sized(sc.values_right, cz);
  geometry::lapack::SymmetricEigenInPlace(vectors_r.data(), cz, values_r, sc.work);
  Rotate(z, n, cz, vectors_r.data(), w, sc.rot, s.right);
  s.right_energy.resize(w);
  for (int i = 0; i < w; ++i) s.right_energy[i] = std::max(values_r[cz - 1 - i], 0.0);
}

// Whether `known` holds G's projections on exactly the sketch's held basis (all of it), so that
// the update can take them instead of reading G for them.
bool Matches(const FactorSketch& s, const InverseProducts* known, const float* G, int64_t m,
             int64_t n, int held) {
  if (!known || !known->valid || known->data != G || known->m != m || known->n != n || held == 0 ||
      known->k != held || s.width != held)
    return false;
  const size_t left = static_cast<size_t>(m) * held, right = static_cast<size_t>(n) * held;
  return known->U.size() == left && known->V.size() == right && known->ug.size() == right &&
         known->gv.size() == left && s.left.size() == left && s.right.size() == right &&
         std::memcmp(known->U.data(), s.left.data(), left * sizeof(float)) == 0 &&
         std::memcmp(known->V.data(), s.right.data(), right * sizeof(float)) == 0;
}

}  // namespace

double HostGradient::ProductAndNorm(const float* x, int ldx, float* y) {
  return geometry::ThinProductAndNorm(g_, m_, n_, x, ldx, y);
}

void HostGradient::TransposeProduct(const float* q, int c, float* bt) {
  if (c == 8) {  // an update without probes: 8 columns, one register-blocked read of G
    q8_.resize(size_t(m_) * 8);
    bt8_.resize(size_t(n_) * 8);
    for (int64_t r = 0; r < m_; ++r)
      for (int j = 0; j < 8; ++j) q8_[r * 8 + j] = q[int64_t(j) * m_ + r];
    if (geometry::ThinBothSides(g_, m_, n_, q8_.data(), nullptr, 8, nullptr, bt8_.data(), false)) {
      for (int j = 0; j < 8; ++j)
        for (int64_t h = 0; h < n_; ++h) bt[int64_t(j) * n_ + h] = bt8_[h * 8 + j];
      return;
    }
  }
  cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, n_, c, m_, 1.f, g_, n_, q, m_, 0.f, bt,
              n_);
}

int64_t HostGradient::FindNonFinite() {
  for (int64_t i = 0; i < m_ * n_; ++i) {
    if (!std::isfinite(g_[i])) return i;
  }
  return -1;
}

bool UpdateFactorSketch(FactorSketch& s, std::span<const float> G, int64_t m, int64_t n, int k,
                        const FactorSketchOptions& o, const InverseProducts* known) {
  GEOFP8_CHECK(m > 0 && n > 0 && static_cast<int64_t>(G.size()) == m * n,
               "UpdateFactorSketch: G has ", G.size(), " elements, shape ", m, "x", n);
  HostGradient g(G.data(), m, n);
  return UpdateFactorSketch(s, g, m, n, k, o, known);
}

bool UpdateFactorSketch(FactorSketch& s, GradientProducts& G, int64_t m, int64_t n, int k,
                        const FactorSketchOptions& o, const InverseProducts* known) {
  GEOFP8_CHECK(m > 0 && n > 0, "UpdateFactorSketch: shape ", m, "x", n);
  GEOFP8_CHECK(o.width >= 1 && o.probes >= 0 && o.probe_every >= 1 && o.beta >= 0.f && o.beta < 1.f,
               "FactorSketchOptions: width ", o.width, ", probes ", o.probes, ", probe_every ",
               o.probe_every, ", beta ", o.beta,
               " (need width >= 1, probes >= 0, probe_every >= 1, beta in [0, 1))");
  // Nothing of the sketch changes until G has been checked, so a bad G leaves it as it was.
  const bool fresh = s.m != m || s.n != n;
  const uint64_t updates = fresh ? 0 : s.updates;
  const int target = static_cast<int>(std::min<int64_t>({o.width, m, n}));
  const int held = updates == 0 ? 0 : s.width;
  // The range finder's inputs: the held right basis (where the persistent energy is) plus fresh
  // probes so that new directions can enter; on the first update probes only, as many as the
  // sketch will hold plus the extra. Q = orth([U, G X]) needs at most m columns.
  const int want = held == 0 ? target + o.probes : updates % o.probe_every == 0 ? o.probes : 0;
  const int p = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(want, m - 2 * held)));
  const int cx = held + p;
  const int ldx = (cx + 7) / 8 * 8;  // X and Y padded with zero columns to whole AVX registers
  Scratch& sc = ThreadScratch();
  float* y = Sized(sc.y, m * std::max(ldx, 1));
  // Y = G X and ||G||^2 (in double) from one read of G; a NaN or inf anywhere makes the norm
  // non-finite, and only then is G searched for the culprit. When the inverse transform that
  // produced G already knows G V and ||G||^2 for the held V, only the probes' columns are read,
  // and on an update without probes nothing.
  const bool use_known = G.host_data() && Matches(s, known, G.host_data(), m, n, held);
  double g2 = 0.0;
  if (use_known) {
    g2 = known->norm2;
    const int ldp = (p + 7) / 8 * 8;
    float* yp = nullptr;
    if (p > 0) {
      float* xp = Sized(sc.x, n * ldp);  // the probes alone, the same signs as in X below
      for (int64_t r = 0; r < n; ++r) std::fill(&xp[r * ldp + p], &xp[r * ldp + ldp], 0.f);
      Probes(o.seed, updates, n, p, xp, ldp, 0);
      yp = Sized(sc.bf, m * ldp);  // bf is free until B is formed below
      G.ProductAndNorm(xp, ldp, yp);
    }
    for (int64_t r = 0; r < m; ++r) {
      float* __restrict out = y + r * ldx;
      std::memcpy(out, &known->gv[r * held], sizeof(float) * held);
      if (p > 0) std::memcpy(out + held, &yp[r * ldp], sizeof(float) * p);
      std::fill(out + cx, out + ldx, 0.f);
    }
  } else {
    // X = [V, probes], zero-padded to ldx columns.
    float* x = Sized(sc.x, n * std::max(ldx, 1));
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(&x[r * ldx], s.right.data() + r * held, sizeof(float) * held);
      std::fill(&x[r * ldx + cx], &x[r * ldx + ldx], 0.f);
    }
    if (p > 0) Probes(o.seed, updates, n, p, x, ldx, held);
    g2 = G.ProductAndNorm(x, ldx, y);
  }
  if (!std::isfinite(g2)) {
    const int64_t i = G.FindNonFinite();
    if (i >= 0) {
      const float* h = G.host_data();
      if (h)
        GEOFP8_FAIL("UpdateFactorSketch: G holds a non-finite value (", h[i], ") at index ", i);
      GEOFP8_FAIL("UpdateFactorSketch: G holds a non-finite value at index ", i);
    }
  }
  if (fresh) s = FactorSketch{};
  s.m = m;
  s.n = n;

  // Left: Q = orth([U, G X]) (Cholesky QR2, Householder when ill-conditioned), B = Q^T G,
  // S_L = Q^T (beta U L U^T + (1-beta) G G^T) Q. U is Q's leading columns, so Q^T U is R's
  // leading columns.
  const int ca = std::min<int>(held + cx, static_cast<int>(m));
  double* q = Sized(sc.q, m * ca);
  for (int j = 0; j < held; ++j)
    for (int64_t r = 0; r < m; ++r) q[j * m + r] = s.left[r * held + j];
  for (int j = held; j < ca; ++j)
    for (int64_t r = 0; r < m; ++r) q[j * m + r] = y[r * ldx + (j - held)];
  geometry::lapack::OrthonormalizeInPlace(q, m, ca, &sc.r_left);
  const std::vector<double>& r_left = sc.r_left;
  float* qf = Sized(sc.qf, m * ca);  // Q in float, column-major like q
  for (int64_t i = 0; i < m * ca; ++i) qf[i] = static_cast<float>(q[i]);
  // B^T = G^T Q (n x ca, column-major): G row-major is G^T column-major with leading dimension n.
  // With known projections only Q's columns past the held ones are multiplied by G: the held ones
  // are U R11^-1 (R11 = R's leading held x held block, since QR keeps the span of every leading
  // set of columns), so G^T Q's are (G^T U) R11^-1, a triangular solve on the known U^T G. U is
  // orthonormal in float, so R11 is the identity to float round-off and the solve amplifies
  // nothing.
  const int from = use_known ? held : 0;
  float* bf = Sized(sc.bf, int64_t(ca) * n);
  double* bd = Sized(sc.bd, int64_t(ca) * n);  // B^T in double, column-major n x ca
  if (ca > from) {
    G.TransposeProduct(qf + int64_t(from) * m, ca - from, bf + int64_t(from) * n);
    for (int64_t i = int64_t(from) * n; i < int64_t(ca) * n; ++i) bd[i] = bf[i];
  }
  if (use_known) {
    for (int64_t i = 0; i < int64_t(held) * n; ++i) bd[i] = known->ug[i];
    cblas_dtrsm(CblasColMajor, CblasRight, CblasUpper, CblasNoTrans, CblasNonUnit, n, held, 1.0,
                r_left.data(), ca, bd, n);
  }

  // How the basis that was in force fit this gradient, before the gradient moves it: the energy
  // of G inside span(U_k) (rows of U^T G = C^T B) and span(V_k) (columns of G V = Y), against the
  // fraction the sketch predicted.
  const int kk = std::min(k, held);
  if (kk > 0 && s.energy > 0.0 && g2 > 0.0) {
    double in_left = 0.0, in_right = 0.0, pred_left = 0.0, pred_right = 0.0;
    double* row = Sized(sc.row, n);
    for (int i = 0; i < kk; ++i) {
      pred_left += s.left_energy[i];
      pred_right += s.right_energy[i];
      for (int64_t r = 0; r < m; ++r) in_right += double(y[r * ldx + i]) * y[r * ldx + i];
      if (use_known) {  // G^T u_i is row i of the known U^T G
        for (int64_t h = 0; h < n; ++h)
          in_left += double(known->ug[i * n + h]) * known->ug[i * n + h];
        continue;
      }
      // row = B^T r_i = G^T Q Q^T u_i = G^T u_i by column axpys on this thread (OpenBLAS threads
      // dgemv at this size).
      double* __restrict out = row;
      for (int64_t h = 0; h < n; ++h) out[h] = 0.0;
      for (int c = 0; c < ca; ++c) {
        const double coef = r_left[i * ca + c];
        const double* __restrict col = bd + int64_t(c) * n;
        for (int64_t h = 0; h < n; ++h) out[h] += col[h] * coef;
      }
      for (int64_t h = 0; h < n; ++h) in_left += row[h] * row[h];
    }
    const double fl = pred_left > 0 ? (in_left / g2) / (pred_left / s.energy) : 1.0;
    const double fr = pred_right > 0 ? (in_right / g2) / (pred_right / s.energy) : 1.0;
    s.fit = std::min(fl, fr);
    s.fit_k = kk;
  }

  const double beta = s.updates == 0 ? 0.0 : o.beta;
  std::vector<double>& vectors = sc.s_left;  // S_L, then its eigenvectors (ascending)
  FoldedFactor(r_left.data(), ca, s.left_energy.data(), held, bd, static_cast<int>(n),
               static_cast<int>(n), /*e_trans=*/true, ca, beta, sc.e, vectors);
  double* values = Sized(sc.values_left, ca);
  geometry::lapack::SymmetricEigenInPlace(vectors.data(), ca, values, sc.work);
  const int w_left = std::min(target, ca);

  // Right: the right factor beta V R V^T + (1-beta) B^T B is W W^T with W = [V diag(sqrt(beta
  // R)), sqrt(1-beta) B^T] (n x cw), so its top eigenpairs come from the cw x cw Gram K = W^T W:
  // K phi = s phi, eigenvector W phi / sqrt(s), eigenvalue s. One dsyrk and one thin product,
  // where orthonormalizing [V, B^T] first took two Grams, two triangular solves and a product.
  // The Gram squares W's condition, which costs the top pairs nothing while they hold most of
  // the energy: W phi_i / sqrt(s_i) loses orthogonality like eps s_1 / s_i, so below
  // kGramFloor s_1 (a rank-deficient or nearly flat right side) the orthonormalizing path runs.
  const int w = std::min<int>(w_left, static_cast<int>(std::min<int64_t>(held + ca, n)));
  if (!RightFromGram(s, bd, n, held, ca, beta, w, sc))
    RightFromBasis(s, bd, n, held, ca, beta, w, sc);

  Rotate(q, m, ca, vectors.data(), w, sc.rot, s.left);
  s.left_energy.resize(w);
  for (int i = 0; i < w; ++i) {  // descending, clamped at 0
    s.left_energy[i] = std::max(values[ca - 1 - i], 0.0);
  }
  s.width = w;
  s.energy = beta * s.energy + (1.0 - beta) * g2;
  ++s.updates;
  return use_known;
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
