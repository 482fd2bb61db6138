// CPU implementation of the geometry contract (geometry.h): estimation by randomized subspace
// iteration, the low-rank Kronecker whitening and its inverse with thin GEMMs, diag mode, drift.
#include "kernels/geometry/geometry.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kernels/common/check.h"
#include "kernels/geometry/factors.h"
#include "kernels/geometry/geometry_math.h"
#include "kernels/geometry/lapack.h"
#include "kernels/geometry/thin_product.h"

namespace geofp8 {

std::string_view GeometryModeName(GeometryMode m) {
  switch (m) {
    case GeometryMode::kNone:
      return "none";
    case GeometryMode::kDiag:
      return "diag";
    case GeometryMode::kLowRank:
      return "lowrank";
  }
  return "unknown";
}

std::optional<GeometryMode> ParseGeometryMode(std::string_view name) {
  if (name == "none") return GeometryMode::kNone;
  if (name == "diag") return GeometryMode::kDiag;
  if (name == "lowrank") return GeometryMode::kLowRank;
  return std::nullopt;
}

std::string_view AcceptedGeometryModes() { return "none, diag, lowrank"; }

std::optional<GeometryTransform> ParseTransformName(std::string_view name) {
  constexpr std::string_view kSuffix = "+hadamard";
  if (name == "hadamard") return GeometryTransform{GeometryMode::kNone, true};
  const bool rotated = name.size() > kSuffix.size() && name.ends_with(kSuffix);
  if (rotated) name.remove_suffix(kSuffix.size());
  const std::optional<GeometryMode> g = ParseGeometryMode(name);
  if (!g || (rotated && *g == GeometryMode::kNone)) return std::nullopt;
  return GeometryTransform{*g, rotated};
}

std::string_view AcceptedTransformNames() {
  return "none, diag, lowrank, hadamard, diag+hadamard, lowrank+hadamard";
}

namespace geometry {

// Deterministic standard normals from a seed: splitmix64 + Box-Muller, so every rank and every
// standard library produce the same cold-start matrix.
void SeededGaussian(uint64_t seed, std::span<float> out) {
  uint64_t state = seed ^ 0x6a09e667f3bcc909ull;
  auto next = [&state]() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  constexpr double kTwoPi = 6.283185307179586;
  for (size_t i = 0; i < out.size(); i += 2) {
    const double u1 = (static_cast<double>(next() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(next() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    out[i] = static_cast<float>(r * std::cos(kTwoPi * u2));
    if (i + 1 < out.size()) out[i + 1] = static_cast<float>(r * std::sin(kTwoPi * u2));
  }
}

std::vector<float> WhitenFactors(const Geometry& g, bool left) {
  std::vector<float> f(static_cast<size_t>(g.k), 1.0f);
  const int64_t dim = left ? g.m : g.n;
  // A side without residual dimensions has no bulk to whiten towards: leave it alone.
  if (g.k <= 0 || dim <= g.k) return f;
  const double delta = left ? g.delta_L : g.delta_R;
  const std::vector<float>& sigma = left || g.sigma_right.empty() ? g.sigma : g.sigma_right;
  const double top = static_cast<double>(sigma[0]) * sigma[0];
  for (int i = 0; i < g.k; ++i) {
    const double e = static_cast<double>(sigma[i]) * sigma[i];
    f[i] = static_cast<float>(WhitenFactor(e, delta, top, g.alpha));
  }
  return f;
}

// Core matrix of one side. Forward: P = I - Q diag(1 - f) Q^T. Inverse: the exact inverse of that
// same P for the float basis Q we hold, by Woodbury, P^-1 = I - Q [-A (I - M A)^-1] Q^T with
// A = diag(1 - f) and M = Q^T Q accumulated in double. For an exactly orthonormal Q this is
// diag(1 - 1/f); using M makes the inverse exact for the basis we hold rather than for an ideal
// one. What remains of the round-trip error is the forward map's cancellation in the top
// directions: about float epsilon times the condition number 1 / (min f_L * min f_R).
std::vector<float> SideCore(const std::vector<float>& q, int64_t rows, int k,
                            const std::vector<float>& f, bool inverse) {
  std::vector<float> core(static_cast<size_t>(k * k), 0.f);
  if (!inverse) {
    for (int i = 0; i < k; ++i) core[i * k + i] = geometry::ForwardCoefficient(f[i]);
    return core;
  }
  std::vector<double> a(static_cast<size_t>(k));
  bool any = false;
  for (int i = 0; i < k; ++i) {
    a[i] = 1.0 - static_cast<double>(f[i]);
    any = any || a[i] != 0.0;
  }
  if (!any) return core;
  // S = I - M A (column-major for LAPACK), solve S X = I, core = -A X.
  std::vector<double> s_mat(static_cast<size_t>(k * k)), gram(static_cast<size_t>(k * k));
  geometry::CrossGram(q.data(), q.data(), rows, k, gram.data());  // M = Q^T Q in one read of Q
  for (int i = 0; i < k; ++i)
    for (int j = i; j < k; ++j) {
      const double mij = gram[i * k + j];
      s_mat[j * k + i] = (i == j ? 1.0 : 0.0) - mij * a[j];
      s_mat[i * k + j] = (i == j ? 1.0 : 0.0) - mij * a[i];
    }
  const std::vector<double> x = geometry::lapack::Inverse(s_mat, k);
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < k; ++j) core[i * k + j] = static_cast<float>(-a[i] * x[j * k + i]);
  return core;
}

int64_t TileRows(int64_t m, int64_t n) {
  const int64_t rows = static_cast<int64_t>(kTileBytes / sizeof(float)) / std::max<int64_t>(n, 1);
  return std::clamp<int64_t>(rows, 1, std::max<int64_t>(m, 1));
}

// G <- (I - U Ab U^T) G (I - V Bb V^T) with k x k cores Ab, Bb, as one rank-2k update:
//   G -= [U | X Bb - U Ab C Bb] [Ab W ; V^T],  W = U^T G, X = G V, C = W V.
// W and X are reduced over row tiles, so each tile of G is read once for both while it is in
// cache, and a fused caller can produce the tiles on the fly (decoding them from the wire).
LowRankUpdate PrepareLowRank(const Geometry& g, bool inverse, const RowSource& rows_of) {
  const int64_t m = g.m, n = g.n;
  const int k = g.k;
  GEOFP8_CHECK(
      g.mode == GeometryMode::kLowRank && k >= 0 && static_cast<int64_t>(g.U.size()) == m * k &&
          static_cast<int64_t>(g.V.size()) == n * k && static_cast<int64_t>(g.sigma.size()) == k &&
          (g.sigma_right.empty() || static_cast<int64_t>(g.sigma_right.size()) == k),
      "lowrank geometry arrays do not match m=", m, " n=", n, " k=", k);
  LowRankUpdate u;
  u.n = n;
  if (k == 0 || m == 0 || n == 0) return u;
  const std::vector<float> fl = WhitenFactors(g, /*left=*/true);
  const std::vector<float> fr = WhitenFactors(g, /*left=*/false);
  bool any = false;
  for (int i = 0; i < k; ++i) any = any || fl[i] != 1.f || fr[i] != 1.f;
  if (!any) return u;
  u.identity = false;
  u.k2 = 2 * k;
  const std::vector<float> ab = SideCore(g.U, m, k, fl, inverse);
  const std::vector<float> bb = SideCore(g.V, n, k, fr, inverse);
  const int k2 = u.k2;
  // Per-thread scratch, grown and never zeroed: every element is written before it is read
  // (the first tile's GEMM sets W with beta 0), and fresh zero-filled vectors of these sizes
  // (the tile alone is kTileBytes) were a fifth of this function.
  struct Scratch {
    FloatBuffer w, wt, x, c, t, abc, tile;
  };
  thread_local Scratch sc;
  FloatBuffer &w = sc.w, &x = sc.x, &c = sc.c, &t = sc.t, &abc = sc.abc;
  w.resize(static_cast<size_t>(k * n));
  x.resize(static_cast<size_t>(m * k));
  c.resize(static_cast<size_t>(k * k));
  t.resize(static_cast<size_t>(k * k));
  abc.resize(static_cast<size_t>(k * k));
  const int64_t tile = TileRows(m, n);
  sc.tile.resize(static_cast<size_t>(tile * n));  // pages are touched only if rows_of writes them
  // Width 8 on AVX2 machines: one register-blocked read of each tile for both reductions, W^T
  // accumulated row by row and transposed at the end (thin_product.h); elsewhere two sgemms.
  bool both = true;
  sc.wt.resize(static_cast<size_t>(n * k));
  for (int64_t r0 = 0; r0 < m; r0 += tile) {
    const int64_t r1 = std::min(m, r0 + tile), len = r1 - r0;
    const float* rows = rows_of(r0, r1, sc.tile.data());
    both = both && ThinBothSides(rows, len, n, g.U.data() + r0 * k, g.V.data(), k,
                                 x.data() + r0 * k, sc.wt.data(), /*accumulate=*/r0 > 0);
    if (both) continue;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, k, n, len, 1.f, g.U.data() + r0 * k, k,
                rows, n, r0 == 0 ? 0.f : 1.f, w.data(), n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, len, k, n, 1.f, rows, n, g.V.data(), k,
                0.f, x.data() + r0 * k, k);
  }
  if (both) {
    for (int64_t j = 0; j < n; ++j)
      for (int i = 0; i < k; ++i) w[i * n + j] = sc.wt[j * k + i];
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k, k, n, 1.f, w.data(), n, g.V.data(), k,
              0.f, c.data(), k);
  // t = Ab C Bb (k x k); left = [U | X Bb - U t] (m x 2k); right = [Ab W ; V^T] (2k x n).
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k, k, k, 1.f, ab.data(), k, c.data(), k,
              0.f, abc.data(), k);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k, k, k, 1.f, abc.data(), k, bb.data(), k,
              0.f, t.data(), k);
  u.left.resize(static_cast<size_t>(m * k2));
  for (int64_t i = 0; i < m; ++i) {
    std::memcpy(u.left.data() + i * k2, g.U.data() + i * k, k * sizeof(float));
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, k, k, 1.f, x.data(), k, bb.data(), k,
              0.f, u.left.data() + k, k2);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, k, k, -1.f, g.U.data(), k, t.data(), k,
              1.f, u.left.data() + k, k2);
  u.right.resize(static_cast<size_t>(k2 * n));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k, n, k, 1.f, ab.data(), k, w.data(), n,
              0.f, u.right.data(), n);
  for (int64_t j = 0; j < n; ++j)
    for (int i = 0; i < k; ++i) u.right[(k + i) * n + j] = g.V[j * k + i];
  u.w = w.data();
  u.x = x.data();
  return u;
}

void CheckDiag(const Geometry& g) {
  GEOFP8_CHECK(static_cast<int64_t>(g.row_scale.size()) == g.m &&
                   static_cast<int64_t>(g.col_scale.size()) == g.n,
               "diag geometry scale sizes ", g.row_scale.size(), ", ", g.col_scale.size());
}

void DiagRows(const Geometry& g, int64_t r0, int64_t r1, const float* in, float* out,
              bool inverse) {
  for (int64_t i = r0; i < r1; ++i) {
    const float* src = in + (i - r0) * g.n;
    float* dst = out + (i - r0) * g.n;
    const float rs = g.row_scale[i];
    if (inverse) {
      for (int64_t j = 0; j < g.n; ++j) dst[j] = DiagInverse(src[j], rs, g.col_scale[j]);
    } else {
      for (int64_t j = 0; j < g.n; ++j) dst[j] = DiagForward(src[j], rs, g.col_scale[j]);
    }
  }
}

void UpdateRows(const LowRankUpdate& u, int64_t r0, int64_t r1, float* rows) {
  if (u.identity || r1 <= r0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, u.n, u.k2, -1.f,
              u.left.data() + r0 * u.k2, u.k2, u.right.data(), u.n, 1.f, rows, u.n);
}

}  // namespace geometry

namespace {

using geometry::lapack::QrInPlace;

bool SameLowRankShape(const Geometry& a, int64_t m, int64_t n, int k) {
  return a.mode == GeometryMode::kLowRank && a.version > 0 && a.m == m && a.n == n && a.k == k &&
         static_cast<int64_t>(a.U.size()) == m * k && static_cast<int64_t>(a.V.size()) == n * k;
}

// Row-major float (rows x cols) <-> column-major double, the layouts of BLAS callers and LAPACK.
std::vector<double> ToColMajor(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<double> out(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[j * rows + i] = a[i * cols + j];
  return out;
}
void FromColMajor(const std::vector<double>& a, int64_t rows, int64_t cols,
                  std::vector<float>& out) {
  out.resize(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[i * cols + j] = static_cast<float>(a[j * rows + i]);
}

void CheckFinite(std::span<const float> G) {
  for (size_t i = 0; i < G.size(); ++i) {
    if (!std::isfinite(G[i])) {
      GEOFP8_FAIL("EstimateGeometry: G holds a non-finite value (", G[i], ") at index ", i,
                  "; refusing to estimate a geometry from it");
    }
  }
}

void ValidateOptions(const GeometryOptions& o) {
  if (o.mode == GeometryMode::kLowRank && o.rank < 1) {
    GEOFP8_FAIL("GeometryOptions.rank: must be >= 1 (", o.rank, ")");
  }
  if (!(o.alpha >= 0.f && o.alpha <= 1.f)) {
    GEOFP8_FAIL("GeometryOptions.alpha: must be in [0, 1] (", o.alpha, ")");
  }
  if (o.power_iters < 1)
    GEOFP8_FAIL("GeometryOptions.power_iters: must be >= 1 (", o.power_iters, ")");
  if (!(o.sigma_ema >= 0.f && o.sigma_ema < 1.f)) {
    GEOFP8_FAIL("GeometryOptions.sigma_ema: must be in [0, 1) (", o.sigma_ema, ")");
  }
}

void EstimateDiag(std::span<const float> G, int64_t m, int64_t n, float alpha, Geometry& g) {
  std::vector<double> row(static_cast<size_t>(m), 0.0), col(static_cast<size_t>(n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    const float* r = G.data() + i * n;
    double s = 0;
    for (int64_t j = 0; j < n; ++j) {
      const double x = r[j];
      s += x * x;
      col[j] += x * x;
    }
    row[i] = s;
  }
  // Each row's energy is compared with the median row energy (robust to the few dominant rows
  // that diag mode exists to tame); rows at or below it are never amplified.
  auto scales = [alpha](const std::vector<double>& e) {
    std::vector<float> out(e.size(), 1.0f);
    if (e.empty()) return out;
    std::vector<double> sorted = e;
    std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
    double ref = sorted[sorted.size() / 2];
    if (!(ref > 0.0)) ref = std::accumulate(e.begin(), e.end(), 0.0) / e.size();
    const double top = *std::max_element(e.begin(), e.end());
    for (size_t i = 0; i < e.size(); ++i) {
      out[i] = static_cast<float>(geometry::WhitenFactor(e[i], ref, top, alpha));
    }
    return out;
  };
  g.row_scale = scales(row);
  g.col_scale = scales(col);
}

void EstimateLowRank(std::span<const float> G, int64_t m, int64_t n, const GeometryOptions& o,
                     const Geometry* previous, Geometry& g) {
  const int k = static_cast<int>(std::min<int64_t>({o.rank, m, n}));
  g.k = k;
  if (k == 0) return;
  const bool warm = previous && SameLowRankShape(*previous, m, n, k);

  std::vector<float> omega(static_cast<size_t>(n * k));
  if (warm) {
    omega = previous->V;
  } else {
    geometry::SeededGaussian(o.seed, omega);
  }
  std::vector<float> y(static_cast<size_t>(m * k)), z(static_cast<size_t>(n * k));
  std::vector<float> u_f, v_f;
  std::vector<double> u_d, v_d, r_z;
  for (int it = 0; it < o.power_iters; ++it) {
    // Y = G Omega, U = qr(Y), Z = G^T U, V = qr(Z).
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, k, n, 1.f, G.data(), n, omega.data(),
                k, 0.f, y.data(), k);
    u_d = ToColMajor(y, m, k);
    QrInPlace(u_d, m, k, nullptr);
    FromColMajor(u_d, m, k, u_f);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, k, m, 1.f, G.data(), n, u_f.data(), k,
                0.f, z.data(), k);
    v_d = ToColMajor(z, n, k);
    QrInPlace(v_d, n, k, &r_z);
    FromColMajor(v_d, n, k, v_f);
    omega = v_f;
  }
  // Core B = U^T G V = Z^T V = R_z^T (Z = V R_z): its SVD rotates the bases onto singular vectors.
  std::vector<double> b(static_cast<size_t>(k * k));
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < k; ++j) b[j * k + i] = r_z[i * k + j];
  geometry::lapack::Svd svd = geometry::lapack::ThinSvd(b, k, k);
  std::vector<double> u_rot(static_cast<size_t>(m * k)), v_rot(static_cast<size_t>(n * k));
  cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, m, k, k, 1.0, u_d.data(), m, svd.u.data(),
              k, 0.0, u_rot.data(), m);
  // V_final = V Vb with Vb = Vt^T.
  cblas_dgemm(CblasColMajor, CblasNoTrans, CblasTrans, n, k, k, 1.0, v_d.data(), n, svd.vt.data(),
              k, 0.0, v_rot.data(), n);
  FromColMajor(u_rot, m, k, g.U);
  FromColMajor(v_rot, n, k, g.V);

  double total = 0.0;
  for (float x : G) total += static_cast<double>(x) * x;
  double captured = 0.0;
  g.sigma.resize(static_cast<size_t>(k));
  for (int i = 0; i < k; ++i) {
    captured += svd.s[i] * svd.s[i];
    g.sigma[i] = static_cast<float>(svd.s[i]);
  }
  const double residual = std::max(0.0, total - captured);
  g.delta_L = m > k ? static_cast<float>(residual / static_cast<double>(m - k)) : 0.f;
  g.delta_R = n > k ? static_cast<float>(residual / static_cast<double>(n - k)) : 0.f;
  if (warm && o.sigma_ema > 0.f) {
    for (int i = 0; i < k; ++i) {
      g.sigma[i] = o.sigma_ema * previous->sigma[i] + (1.f - o.sigma_ema) * g.sigma[i];
    }
    // Both sequences descend, so their convex combination does too: columns stay paired.
  }
}

void CheckShape(const Geometry& g, std::span<float> G) {
  GEOFP8_CHECK(g.m >= 0 && g.n >= 0 && static_cast<int64_t>(G.size()) == g.m * g.n,
               "geometry is for ", g.m, "x", g.n, " but the tensor has ", G.size(), " elements");
}

void ApplyDiag(const Geometry& g, std::span<float> G, bool inverse) {
  geometry::CheckDiag(g);
  geometry::DiagRows(g, 0, g.m, G.data(), G.data(), inverse);
}

// The result's projections from the input's (InverseProducts): with G = D - L R (L = u.left,
// R = u.right), G V = X - L (R V) and U^T G = W - (U^T L) R, four products of width k or 2k.
void ProjectionsOfResult(const Geometry& g, const geometry::LowRankUpdate& u, InverseProducts& p) {
  const int64_t m = g.m, n = g.n;
  const int k = g.k, k2 = u.k2;
  struct Scratch {
    geometry::FloatBuffer rv, ul;
  };
  thread_local Scratch sc;
  sc.rv.resize(static_cast<size_t>(k2 * k));
  sc.ul.resize(static_cast<size_t>(k * k2));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k2, k, n, 1.f, u.right.data(), n,
              g.V.data(), k, 0.f, sc.rv.data(), k);
  p.gv.assign(u.x, u.x + m * k);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, k, k2, -1.f, u.left.data(), k2,
              sc.rv.data(), k, 1.f, p.gv.data(), k);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, k, k2, m, 1.f, g.U.data(), k, u.left.data(),
              k2, 0.f, sc.ul.data(), k2);
  p.ug.assign(u.w, u.w + k * n);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k, n, k2, -1.f, sc.ul.data(), k2,
              u.right.data(), n, 1.f, p.ug.data(), n);
  p.U = g.U;
  p.V = g.V;
  p.m = m;
  p.n = n;
  p.k = k;
}

void ApplyLowRank(const Geometry& g, std::span<float> G, bool inverse, InverseProducts* products) {
  const int64_t n = g.n;
  const geometry::LowRankUpdate u = geometry::PrepareLowRank(
      g, inverse, [&](int64_t r0, int64_t, float*) -> const float* { return G.data() + r0 * n; });
  if (u.identity) return;
  // Taken before the update below: u.w and u.x live in scratch that nothing else touches, and G
  // itself is not read.
  if (products) ProjectionsOfResult(g, u, *products);
  const int64_t rows = geometry::TileRows(g.m, n);
  double norm2 = 0.0;
  for (int64_t r0 = 0; r0 < g.m; r0 += rows) {
    const int64_t r1 = std::min(g.m, r0 + rows);
    float* tile = G.data() + r0 * n;
    geometry::UpdateRows(u, r0, r1, tile);
    if (products) norm2 += geometry::ThinProductAndNorm(tile, r1 - r0, n, nullptr, 0, nullptr);
  }
  if (products) {
    products->norm2 = norm2;
    products->data = G.data();
    products->valid = true;
  }
}

void Transform(const Geometry& g, std::span<float> G, bool inverse,
               InverseProducts* products = nullptr) {
  if (products) products->valid = false;
  if (g.is_identity()) return;
  CheckShape(g, G);
  switch (g.mode) {
    case GeometryMode::kNone:
      return;
    case GeometryMode::kDiag:
      return ApplyDiag(g, G, inverse);
    case GeometryMode::kLowRank:
      return ApplyLowRank(g, G, inverse, products);
  }
  GEOFP8_FAIL("geometry.mode: unknown value (", static_cast<int>(g.mode),
              "); accepted: ", AcceptedGeometryModes());
}

// ||sin Theta||_2 between span(A) and span(B) (both rows x k, orthonormal columns): the largest
// singular value of B - A (A^T B), from the eigenvalues of its k x k Gram matrix. Working with
// sin directly avoids the cancellation of 1 - cos^2 for nearly equal bases.
double SinTheta(const std::vector<float>& A, const std::vector<float>& B, int64_t rows, int k) {
  // Two passes over the float bases with k x k double accumulators (thin_product.h): C = A^T B,
  // then the Gram of B's residual B - A C, formed a row at a time. The sketch estimator measures
  // drift after every step's refresh, and the copies to double and three dgemms this replaced
  // were a twentieth of the exchange.
  thread_local std::vector<double> atb, gram;
  atb.resize(static_cast<size_t>(k) * k);
  gram.resize(static_cast<size_t>(k) * k);
  geometry::CrossGram(A.data(), B.data(), rows, k, atb.data());
  geometry::ResidualGram(A.data(), B.data(), atb.data(), rows, k, gram.data());
  // Its largest eigenvalue is ||sin Theta||_2^2 (the Gram is exactly symmetric: each entry's
  // products are formed in the same order on both sides of the diagonal).
  const double lmax = geometry::lapack::LargestEigenvalue(gram, k);
  return std::clamp(std::sqrt(std::max(0.0, lmax)), 0.0, 1.0);
}

}  // namespace

RefreshResult EstimateGeometry(std::span<const float> G, int64_t m, int64_t n,
                               const GeometryOptions& options, const Geometry* previous) {
  const auto start = std::chrono::steady_clock::now();
  if (m < 0 || n < 0) GEOFP8_FAIL("EstimateGeometry: shape must be non-negative (", m, "x", n, ")");
  if (static_cast<int64_t>(G.size()) != m * n) {
    GEOFP8_FAIL("EstimateGeometry: G has ", G.size(), " elements, shape ", m, "x", n, " needs ",
                m * n);
  }
  ValidateOptions(options);
  CheckFinite(G);
  RefreshResult result;
  Geometry& g = result.geometry;
  g.mode = options.mode;
  g.version = previous ? previous->version + 1 : 1;
  g.m = m;
  g.n = n;
  g.alpha = options.alpha;
  switch (options.mode) {
    case GeometryMode::kNone:
      break;
    case GeometryMode::kDiag:
      EstimateDiag(G, m, n, options.alpha, g);
      break;
    case GeometryMode::kLowRank:
      EstimateLowRank(G, m, n, options, previous, g);
      break;
    default:
      GEOFP8_FAIL("GeometryOptions.mode: unknown value (", static_cast<int>(options.mode),
                  "); accepted: ", AcceptedGeometryModes());
  }
  if (previous && previous->version > 0 && previous->mode == g.mode && previous->m == m &&
      previous->n == n && previous->k == g.k) {
    result.drift = SubspaceDrift(*previous, g);
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

void ApplyGeometry(const Geometry& geometry, std::span<float> G) { Transform(geometry, G, false); }
void InvertGeometry(const Geometry& geometry, std::span<float> G) { Transform(geometry, G, true); }
void InvertGeometry(const Geometry& geometry, std::span<float> G, InverseProducts* products) {
  Transform(geometry, G, true, products);
}

namespace {
// Whether a lowrank geometry's inverse changes anything (some whitening factor is not 1), after
// the same checks PrepareLowRank makes.
bool LowRankInverseActs(const Geometry& g) {
  if (g.is_identity() || g.mode != GeometryMode::kLowRank) return false;
  GEOFP8_CHECK(g.k >= 0 && static_cast<int64_t>(g.U.size()) == g.m * g.k &&
                   static_cast<int64_t>(g.V.size()) == g.n * g.k &&
                   static_cast<int64_t>(g.sigma.size()) == g.k,
               "lowrank geometry arrays do not match m=", g.m, " n=", g.n, " k=", g.k);
  if (g.k == 0 || g.m == 0 || g.n == 0) return false;
  const std::vector<float> fl = geometry::WhitenFactors(g, /*left=*/true);
  const std::vector<float> fr = geometry::WhitenFactors(g, /*left=*/false);
  for (int i = 0; i < g.k; ++i) {
    if (fl[i] != 1.f || fr[i] != 1.f) return true;
  }
  return false;
}

// The shard's first row and row count, checked against the geometry's shape.
int64_t ShardRows(const Geometry& g, int64_t r0, size_t elements) {
  GEOFP8_CHECK(g.n > 0 && elements % static_cast<size_t>(g.n) == 0 && r0 >= 0 &&
                   r0 + static_cast<int64_t>(elements / g.n) <= g.m,
               "geometry is for ", g.m, "x", g.n, " but the shard at row ", r0, " has ", elements,
               " elements");
  return static_cast<int64_t>(elements / g.n);
}
}  // namespace

int ShardProductRows(const Geometry& geometry) {
  return LowRankInverseActs(geometry) ? geometry.k : 0;
}

void ShardColumnProducts(const Geometry& g, int64_t r0, std::span<const float> rows,
                         std::span<float> w) {
  const int k = ShardProductRows(g);
  GEOFP8_CHECK(w.size() == static_cast<size_t>(k) * static_cast<size_t>(std::max<int64_t>(g.n, 0)),
               "shard products: ", w.size(), " floats for ", k, "x", g.n);
  if (k == 0) return;
  const int64_t len = rows.empty() ? 0 : ShardRows(g, r0, rows.size());
  if (len == 0) {
    std::fill(w.begin(), w.end(), 0.f);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, k, g.n, len, 1.f, g.U.data() + r0 * k, k,
              rows.data(), g.n, 0.f, w.data(), g.n);
}

void InvertGeometryRows(const Geometry& g, int64_t r0, std::span<float> rows,
                        std::span<const float> w) {
  if (g.is_identity() || rows.empty()) return;
  const int64_t len = ShardRows(g, r0, rows.size());
  switch (g.mode) {
    case GeometryMode::kNone:
      return;
    case GeometryMode::kDiag:
      geometry::CheckDiag(g);
      for (int64_t i = 0; i < len; ++i) {
        float* row = rows.data() + i * g.n;
        const float rs = g.row_scale[r0 + i];
        for (int64_t j = 0; j < g.n; ++j)
          row[j] = geometry::DiagInverse(row[j], rs, g.col_scale[j]);
      }
      return;
    case GeometryMode::kLowRank:
      break;
    default:
      GEOFP8_FAIL("geometry.mode: unknown value (", static_cast<int>(g.mode),
                  "); accepted: ", AcceptedGeometryModes());
  }
  const int k = ShardProductRows(g);
  if (k == 0) return;
  const int64_t n = g.n;
  GEOFP8_CHECK(w.size() == static_cast<size_t>(k * n), "shard inverse: ", w.size(),
               " floats of U^T D for ", k, "x", n);
  const std::vector<float> fl = geometry::WhitenFactors(g, /*left=*/true);
  const std::vector<float> fr = geometry::WhitenFactors(g, /*left=*/false);
  const std::vector<float> ab = geometry::SideCore(g.U, g.m, k, fl, /*inverse=*/true);
  const std::vector<float> bb = geometry::SideCore(g.V, n, k, fr, /*inverse=*/true);
  const int k2 = 2 * k;
  std::vector<float> x(static_cast<size_t>(len * k)), c(static_cast<size_t>(k * k)),
      abc(static_cast<size_t>(k * k)), t(static_cast<size_t>(k * k)),
      left(static_cast<size_t>(len * k2)), right(static_cast<size_t>(k2 * n));
  const float* u = g.U.data() + r0 * k;
  // X = D_rows V, C = W V, t = Ab C Bb.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, len, k, n, 1.f, rows.data(), n, g.V.data(),
              k, 0.f, x.data(), k);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k, k, n, 1.f, w.data(), n, g.V.data(), k,
              0.f, c.data(), k);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k, k, k, 1.f, ab.data(), k, c.data(), k,
              0.f, abc.data(), k);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k, k, k, 1.f, abc.data(), k, bb.data(), k,
              0.f, t.data(), k);
  // left = [U_rows | X Bb - U_rows t], right = [Ab W ; V^T].
  for (int64_t i = 0; i < len; ++i) std::memcpy(left.data() + i * k2, u + i * k, k * sizeof(float));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, len, k, k, 1.f, x.data(), k, bb.data(), k,
              0.f, left.data() + k, k2);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, len, k, k, -1.f, u, k, t.data(), k, 1.f,
              left.data() + k, k2);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k, n, k, 1.f, ab.data(), k, w.data(), n,
              0.f, right.data(), n);
  for (int64_t j = 0; j < n; ++j)
    for (int i = 0; i < k; ++i) right[(k + i) * n + j] = g.V[j * k + i];
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, len, n, k2, -1.f, left.data(), k2,
              right.data(), n, 1.f, rows.data(), n);
}

double SubspaceDrift(const Geometry& a, const Geometry& b) {
  if (a.is_identity() && b.is_identity()) return 0.0;
  if (a.is_identity() || b.is_identity() || a.mode != b.mode) return 1.0;
  if (a.m != b.m || a.n != b.n || a.k != b.k) {
    GEOFP8_FAIL("SubspaceDrift: shapes differ (", a.m, "x", a.n, " k=", a.k, " vs ", b.m, "x", b.n,
                " k=", b.k, ")");
  }
  if (a.mode == GeometryMode::kDiag) {
    // Relative change of the scale vectors: 0 for equal scales, at most 1.
    double num = 0, den_a = 0, den_b = 0;
    auto add = [&](const std::vector<float>& x, const std::vector<float>& y) {
      GEOFP8_CHECK(x.size() == y.size(), "diag scale sizes differ: ", x.size(), " vs ", y.size());
      for (size_t i = 0; i < x.size(); ++i) {
        num += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
        den_a += double(x[i]) * x[i];
        den_b += double(y[i]) * y[i];
      }
    };
    add(a.row_scale, b.row_scale);
    add(a.col_scale, b.col_scale);
    const double den = std::sqrt(std::max(den_a, den_b));
    return den > 0 ? std::clamp(std::sqrt(num) / den, 0.0, 1.0) : 0.0;
  }
  if (a.k == 0) return 0.0;
  GEOFP8_CHECK(static_cast<int64_t>(a.U.size()) == a.m * a.k &&
                   static_cast<int64_t>(b.U.size()) == b.m * b.k &&
                   static_cast<int64_t>(a.V.size()) == a.n * a.k &&
                   static_cast<int64_t>(b.V.size()) == b.n * b.k,
               "SubspaceDrift: basis sizes do not match the shape");
  return std::max(SinTheta(a.U, b.U, a.m, a.k), SinTheta(a.V, b.V, a.n, a.k));
}

}  // namespace geofp8
