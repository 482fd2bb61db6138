// The factor sketch's products over a gradient whose rows are spread over the ranks as a
// reduce-scatter leaves them, so that a sharded layer refreshes its geometry without the whole.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/exchange/communicator.h"
#include "kernels/geometry/factor_sketch.h"

namespace geofp8 {

// GradientProducts (factor_sketch.h) over an m x n gradient G of which this rank holds rows
// RowChunkOf(m n, n, N, r) (FSDP's dim-0 chunk, chunking.h). Each product is computed over this
// rank's rows and combined with one collective whose result is the same on every rank, so
// UpdateFactorSketch over it derives the same sketch, bit for bit, on every rank, as it must
// (the fingerprint's geometry digest checks it):
//   ProductAndNorm: Y = G X is row-local; one all-gather of every rank's rows of Y and its part
//   of ||G||^2 (summed in rank order), (N-1)/N m ldx 4 bytes sent per rank.
//   TransposeProduct: G^T Q = sum over ranks of G_r^T Q_r, one fp32 all-reduce of n c floats,
//   2 (N-1)/N n c 4 bytes.
//   FindNonFinite: one all-gather of each rank's first index.
// So every call is a collective: every rank must make the same calls in the same order, which
// UpdateFactorSketch does given the same sketch and shape. The products agree with those over
// the whole G to float summation order (the rows' partial sums are added in rank order).
class ShardedGradient final : public GradientProducts {
 public:
  // `rows`: this rank's rows, row-major fp32 host memory, alive while the products are used.
  ShardedGradient(Communicator& comm, std::span<const float> rows, int64_t m, int64_t n);
  // Over rows it owns (a copy taken by the caller).
  ShardedGradient(Communicator& comm, std::vector<float> rows, int64_t m, int64_t n)
      : ShardedGradient(comm, std::span<const float>(rows), m, n) {
    own_ = std::move(rows);  // moving a vector keeps its buffer, so rows_ still points at it
  }

  double ProductAndNorm(const float* x, int ldx, float* y) override;
  void TransposeProduct(const float* q, int c, float* bt) override;
  int64_t FindNonFinite() override;

 private:
  Communicator& comm_;
  std::span<const float> rows_;
  int64_t m_, n_;
  std::vector<int64_t> first_row_;  // per rank, and m at the end
  std::vector<uint8_t> send_, recv_;
  std::vector<float> own_;  // the rows, when the products own them
};

}  // namespace geofp8
