// Scalar math of the geometry shared by the CPU path and the CUDA kernels: per-direction
// whitening factors, diag scales and their inverses. GEOFP8_HD so the CPU tests cover the kernels.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common/hd.h"

namespace geofp8::geometry {

// Largest energy ratio sigma_i^2 / delta the whitening honours. Beyond it the gradient is treated
// as if its bulk sat 1e8 below the top direction: this bounds the condition number of P_L, P_R
// (at alpha = 1/4, each side at most 100) so the inverse stays accurate to float round-off, and it
// makes exactly low-rank gradients (delta = 0) well defined instead of singular.
inline constexpr double kMaxEnergyRatio = 1e8;

// Whitening factor of one direction: min(1, (energy / delta)^-alpha), with the conventions that
// a direction without energy is left alone (1) and a zero bulk is replaced by energy_max /
// kMaxEnergyRatio. energy = sigma_i^2, energy_max = sigma_1^2. Never 0, never NaN.
GEOFP8_HD double WhitenFactor(double energy, double delta, double energy_max, double alpha) {
  if (!(energy > 0.0) || !(alpha > 0.0)) return 1.0;
  const double floor_delta = energy_max / kMaxEnergyRatio;
  const double d = delta > floor_delta ? delta : floor_delta;
  if (!(d > 0.0)) return 1.0;
  const double ratio = energy / d;
  if (ratio <= 1.0) return 1.0;
  return pow(ratio, -alpha);
}

// Coefficients of the rank-k update form of P = I - U diag(c) U^T: c_i = 1 - f_i for the forward
// map and c_i = 1 - 1/f_i for the inverse (U orthonormal, so P^-1 = I - U (I - F^-1) U^T).
GEOFP8_HD float ForwardCoefficient(float f) { return 1.0f - f; }
GEOFP8_HD float InverseCoefficient(float f) { return 1.0f - 1.0f / f; }

// Diag mode, element (i, j): forward multiplies by row_scale[i] * col_scale[j], inverse divides.
GEOFP8_HD float DiagForward(float x, float row_scale, float col_scale) {
  return x * (row_scale * col_scale);
}
GEOFP8_HD float DiagInverse(float x, float row_scale, float col_scale) {
  return x / (row_scale * col_scale);
}

// Element (i, j) of the lowrank map written as a rank-2k update, T(G) = G - left right (factors.h
// LowRankUpdate): g minus the dot product of left's row i (k2 values) with right's column j
// (stride ld). The fused CUDA encode computes T(G) this way, element by element, instead of
// storing it. Accumulated in index order with one rounding per step (fmaf) so host and device
// agree bit for bit; OpenBLAS and cuBLAS block the sum differently, within float round-off.
GEOFP8_HD float LowRankUpdateElement(float g, const float* left_row, const float* right_col,
                                     int64_t ld, int k2) {
  float acc = 0.0f;
  for (int p = 0; p < k2; ++p) acc = fmaf(left_row[p], right_col[p * ld], acc);
  return g - acc;
}

}  // namespace geofp8::geometry
