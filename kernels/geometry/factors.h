// Helpers shared by the CPU and CUDA geometry paths: per-direction whitening factors of a
// geometry and the seeded Gaussian cold-start matrix. Not part of the exchange-facing contract.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <new>
#include <span>
#include <utility>
#include <vector>

#include "kernels/common/uninitialized.h"
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

// ---- Row-tiled transform engine, shared by ApplyGeometry/InvertGeometry (in place) and the
// fused codec paths (fused.h), so both sum in the same order and give the same bits.

// Bytes of G per row tile: well inside the 2 MiB per-core L2 of the development machine, so a tile
// stays in cache between the GEMM that finishes it and the codec that consumes it.
inline constexpr size_t kTileBytes = 512 * 1024;
// Rows per tile for an m x n matrix (at least 1, at most m).
int64_t TileRows(int64_t m, int64_t n);

// Hands out rows [r0, r1) of the input (row-major, leading dimension n): either a pointer into
// memory that holds them, or `scratch` (room for TileRows(m, n) rows) after filling it.
using RowSource = std::function<const float*(int64_t r0, int64_t r1, float* scratch)>;

using FloatBuffer = UninitializedVector<float>;

// The lowrank map of one input as a rank-2k update: T(G) = G - left right.
struct LowRankUpdate {
  bool identity = true;  // every whitening factor is 1 (or k = 0): nothing to do
  int64_t n = 0;
  int k2 = 0;         // 2k
  FloatBuffer left;   // m x 2k: [U | X Bb - U Ab C Bb]
  FloatBuffer right;  // 2k x n: [Ab W ; V^T]
  // W = U^T G (k x n) and X = G V (m x k) of the input, in this thread's scratch: valid until the
  // next PrepareLowRank on the same thread.
  const float* w = nullptr;
  const float* x = nullptr;
};

// Pass 1: reduces W = U^T G and X = G V over row tiles (TileRows) read from `rows_of`, in row
// order, and forms the update for T (inverse = false) or T^-1 (inverse = true).
LowRankUpdate PrepareLowRank(const Geometry& g, bool inverse, const RowSource& rows_of);
// Pass 2 on rows [r0, r1), held at `rows` (leading dimension n): rows -= left[r0:r1] right.
void UpdateRows(const LowRankUpdate& u, int64_t r0, int64_t r1, float* rows);

// Diag mode on rows [r0, r1): out = in scaled (inverse: unscaled); in may equal out.
void CheckDiag(const Geometry& g);
void DiagRows(const Geometry& g, int64_t r0, int64_t r1, const float* in, float* out, bool inverse);

// Standard normals from a seed (splitmix64 + Box-Muller): identical on every rank and platform.
void SeededGaussian(uint64_t seed, std::span<float> out);

}  // namespace geofp8::geometry
