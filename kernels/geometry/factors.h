// Helpers shared by the CPU and CUDA geometry paths: per-direction whitening factors of a
// geometry and the seeded Gaussian cold-start matrix. Not part of the exchange-facing contract.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/geometry/geometry.h"

namespace geofp8::geometry {

// f_i = min(1, (sigma_i^2 / delta)^-alpha) for the left (delta_L, m) or right (delta_R, n) side;
// all ones when that side has no residual dimension (k >= m or k >= n). See geometry_math.h.
std::vector<float> WhitenFactors(const Geometry& g, bool left);

// k x k core of one side's map I - Q core Q^T (row-major): diag(1 - f) forward; for the inverse,
// the exact inverse of that map for the float basis Q (Woodbury with M = Q^T Q in double).
// Shared by the CPU path and the CUDA path, which uploads it once per refresh.
std::vector<float> SideCore(const std::vector<float>& q, int64_t rows, int k,
                            const std::vector<float>& f, bool inverse);

// Standard normals from a seed (splitmix64 + Box-Muller): identical on every rank and platform.
void SeededGaussian(uint64_t seed, std::span<float> out);

}  // namespace geofp8::geometry
