// Seeded anisotropic test gradients for the geometry bench and tests: Kronecker-structured,
// exact power-law spectra and low-rank-plus-noise, each with an optional drifted (stale) twin.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace geofp8 {

enum class SyntheticFamily : uint8_t {
  kSpectral = 0,      // G = Q_L diag(i^-p) Q_R^T, Haar-random orthonormal factors
  kKronecker = 1,     // G = Q_L diag(i^-p/2) Z diag(j^-p/2) Q_R^T, Z Gaussian (covariance L (x) R)
  kLowRankNoise = 2,  // rank-32 part with spectrum i^-p plus Gaussian noise at 0.1 sigma_32
};
std::string_view SyntheticFamilyName(SyntheticFamily f);  // "spectral", "kron", "lowrank_noise"
std::optional<SyntheticFamily> ParseSyntheticFamily(std::string_view name);

struct SyntheticSpec {
  SyntheticFamily family = SyntheticFamily::kSpectral;
  int64_t m = 256, n = 256;
  double decay = 1.0;  // p: spectrum ~ i^-p
  uint64_t seed = 1;
  // 0: the gradient itself. > 0: its drifted twin (an earlier step's gradient), whose singular
  // bases are Q + drift * Gaussian / sqrt(rows), re-orthonormalized; same spectrum and content.
  double drift = 0.0;
};

// Row-major m x n float32 gradient, normalized to ||G||_F = 1. Deterministic in the spec.
// Uses the calling thread's BLAS; O(m n min(m,n)) (kron: O(m n (m+n))).
std::vector<float> MakeSyntheticGradient(const SyntheticSpec& spec);

}  // namespace geofp8
