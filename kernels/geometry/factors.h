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

// Standard normals from a seed (splitmix64 + Box-Muller): identical on every rank and platform.
void SeededGaussian(uint64_t seed, std::span<float> out);

}  // namespace geofp8::geometry
