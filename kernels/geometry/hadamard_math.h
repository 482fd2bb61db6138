// Per-block math of the block random Hadamard rotation, shared by the CPU path (hadamard.cc) and
// the CUDA kernel (hadamard_cuda.cu): the seeded signs and the Walsh-Hadamard butterfly.
#pragma once

#include <cstdint>

#include "kernels/common/hd.h"

namespace geofp8::hadamard {

// The 64 signs of elements [64 w, 64 w + 64) of a tensor under `seed`: bit i set means element
// 64 w + i is negated. splitmix64's finalizer of (seed, w): a pure function of both, so every
// rank draws the same signs without communicating.
GEOFP8_HD uint64_t SignWord(uint64_t seed, uint64_t w) {
  uint64_t z = seed ^ ((w + 1) * 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

GEOFP8_HD bool Negated(uint64_t seed, uint64_t index) {
  return (SignWord(seed, index >> 6) >> (index & 63)) & 1;
}

// In place, the unnormalized Walsh-Hadamard transform of x[0..b), b a power of two, in Sylvester
// order (H_ij = (-1)^popcount(i & j), so H = H^T and H H = b I): log2(b) stages of butterflies
// (a, c) -> (a + c, a - c).
GEOFP8_HD void Butterflies(float* x, int b) {
  for (int h = 1; h < b; h <<= 1) {
    for (int i = 0; i < b; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], c = x[j + h];
        x[j] = a + c;
        x[j + h] = a - c;
      }
    }
  }
}

// One block of the rotation, x[0..b) being elements [first, first + b) of the tensor:
// forward y = H D x * scale, inverse x = D H y * scale, scale = 1/sqrt(b) (orthonormal, so the
// inverse is the transpose). D negates by flipping the sign bit (exact, NaN included).
GEOFP8_HD void ForwardBlock(float* x, int b, uint64_t seed, uint64_t first, float scale) {
  for (int j = 0; j < b; ++j) {
    if (Negated(seed, first + j)) x[j] = -x[j];
  }
  Butterflies(x, b);
  for (int j = 0; j < b; ++j) x[j] *= scale;
}

GEOFP8_HD void InverseBlock(float* x, int b, uint64_t seed, uint64_t first, float scale) {
  Butterflies(x, b);
  for (int j = 0; j < b; ++j) {
    x[j] *= scale;
    if (Negated(seed, first + j)) x[j] = -x[j];
  }
}

// The elements after the last whole block (n % b of them) are only sign-flipped: still
// orthogonal, and the same map forward and back.
GEOFP8_HD void SignsOnly(float* x, int count, uint64_t seed, uint64_t first) {
  for (int j = 0; j < count; ++j) {
    if (Negated(seed, first + j)) x[j] = -x[j];
  }
}

}  // namespace geofp8::hadamard
