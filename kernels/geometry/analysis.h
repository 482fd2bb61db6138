// Offline quality metrics of a decoded gradient (DESIGN.md section 6): band errors over singular
// index ranges of the true gradient, and the cheap online residual-subspace error.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "kernels/geometry/geometry.h"

namespace geofp8 {

// The SVD of the true gradient G (m x n), computed once and reused for every decoded candidate.
// Singular vectors are kept in float (they only project errors); singular values in double.
struct SpectralReference {
  int64_t m = 0, n = 0, r = 0;  // r = min(m, n)
  std::vector<float> U;         // m x r, row-major
  std::vector<float> V;         // n x r, row-major
  std::vector<double> sigma;    // r, descending
};

// Brute-force thin SVD in double (LAPACK dgesdd). O(m n r): seconds at 2048x2048 on 2 cores.
// Throws geofp8::Error if G holds a non-finite value.
SpectralReference ComputeSpectralReference(std::span<const float> G, int64_t m, int64_t n);

struct BandError {
  int64_t begin = 0, end = 0;  // singular indices [begin, end)
  bool defined = false;        // false when the band holds < 1e-12 of G's energy (only round-off)
  double error = 0.0;          // ||U_b^T E V_b||_F / ||U_b^T G V_b||_F when defined
};

struct BandErrors {
  // Always four bands: [0,k), [k,4k), [4k,r/2), [r/2,r). Edges are clipped to [0, r/2] (the
  // first three) so the last band is always the weakest half; a band may therefore be empty.
  std::vector<BandError> bands;
  double worst_band_error = 0.0;  // max over defined bands; 0 if none is defined
};

// Band edges for rank r and band parameter k (the geometry's rank).
std::vector<int64_t> BandEdges(int64_t r, int64_t k);

// Band errors of G_hat against the reference of G, with E = G_hat - G.
BandErrors ComputeBandErrors(const SpectralReference& ref, std::span<const float> G,
                             std::span<const float> G_hat, int64_t k);

// ||(I-UU^T) E (I-VV^T)||_F / ||(I-UU^T) G (I-VV^T)||_F with U (m x k), V (n x k) orthonormal
// columns of a lowrank geometry (k = 0 means no projection). nullopt when the denominator is 0.
std::optional<double> ResidualSubspaceError(std::span<const float> G, std::span<const float> G_hat,
                                            int64_t m, int64_t n, std::span<const float> U,
                                            std::span<const float> V, int k);

// ||G_hat - G||_F / ||G||_F accumulated in double; 0 when both are 0, 1 when only G is 0.
double RelFroError(std::span<const float> G, std::span<const float> G_hat);

}  // namespace geofp8
