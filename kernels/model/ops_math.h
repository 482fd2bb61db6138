// Per-element math of the model ops (SiLU, rotary angles), shared by the CPU path and a future
// CUDA path: GEOFP8_HD functions that compile under g++ and nvcc alike.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/common/hd.h"

namespace geofp8::model {

// exp(x) in float without a libm call, so loops over it vectorize: x = n ln2 + r with
// |r| <= ln2/2 (ln2 split in two so n ln2 is exact), exp(r) by its degree-7 Taylor polynomial
// (truncation < 2e-9 relative), 2^n written into the exponent bits. Within a few ulp of std::exp
// on [-87, 88]. Outside: 0 below -87 (std::exp would give a value under 2^-125), exp(88) above 88
// (the model only exponentiates x - max <= 0 and -a in sigmoid, where this is harmless), and NaN
// for NaN.
GEOFP8_HD float ExpF32(float x) {
  // A NaN compares false and lands on -87, so n below always fits the exponent field.
  float xc = x > -87.f ? x : -87.f;
  xc = xc < 88.f ? xc : 88.f;
  // Round-to-nearest of xc / ln2 by the 1.5 * 2^23 shift (exact for |xc / ln2| < 2^22).
  const float shift = 12582912.f;
  const float n = (xc * 1.44269504088896341f + shift) - shift;
  float r = xc - n * 0.693145751953125f;  // ln2, high 15 bits: n * it is exact
  r = r - n * 1.42860682030941723e-06f;   // ln2, the rest
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127)
                        << 23;  // n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const float y = p * scale;  // computed unconditionally, so the selects below if-convert
  const float flushed = x < -87.f ? 0.f : y;
  return x == x ? flushed : x;
}

// Exp of the model ops: the vectorizable float version for training, libm's for the double
// finite-difference tests.
GEOFP8_HD float Exp(float x) { return ExpF32(x); }
GEOFP8_HD double Exp(double x) { return std::exp(x); }

template <typename T>
GEOFP8_HD T SigmoidOf(T a) {
  return T(1) / (T(1) + Exp(-a));
}

// silu(a) = a * sigmoid(a); d silu / da = s * (1 + a * (1 - s)).
template <typename T>
GEOFP8_HD T Silu(T a) {
  return a * SigmoidOf(a);
}
template <typename T>
GEOFP8_HD T SiluGrad(T a) {
  T s = SigmoidOf(a);
  return s * (T(1) + a * (T(1) - s));
}

// Rotary frequency of pair i in a head of size head_dim: theta^(-2i/head_dim).
template <typename T>
GEOFP8_HD T RopeFrequency(int i, int head_dim, T theta) {
  return std::pow(theta, -T(2 * i) / T(head_dim));
}

}  // namespace geofp8::model
