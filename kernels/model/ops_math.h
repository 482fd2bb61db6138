// Per-element math of the model ops (SiLU, rotary angles), shared by the CPU path and a future
// CUDA path: GEOFP8_HD functions that compile under g++ and nvcc alike.
#pragma once

#include <cmath>

#include "kernels/common/hd.h"

namespace geofp8::model {

template <typename T>
GEOFP8_HD T SigmoidOf(T a) {
  return T(1) / (T(1) + std::exp(-a));
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
