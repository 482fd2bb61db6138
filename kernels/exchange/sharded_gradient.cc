// ShardedGradient (see sharded_gradient.h).
#include "kernels/exchange/sharded_gradient.h"

#include <cblas.h>

#include <cmath>
#include <cstring>

#include "kernels/common/check.h"
#include "kernels/exchange/chunking.h"
#include "kernels/geometry/thin_product.h"

namespace geofp8 {

ShardedGradient::ShardedGradient(Communicator& comm, std::span<const float> rows, int64_t m,
                                 int64_t n)
    : comm_(comm), rows_(rows), m_(m), n_(n) {
  const int size = comm.size();
  const size_t count = static_cast<size_t>(m * n);
  for (int r = 0; r < size; ++r) {
    first_row_.push_back(
        static_cast<int64_t>(RowChunkOf(count, static_cast<size_t>(n), size, r).begin) / n);
  }
  first_row_.push_back(m);
  const int64_t mine = first_row_[comm.rank() + 1] - first_row_[comm.rank()];
  GEOFP8_CHECK(static_cast<int64_t>(rows.size()) == mine * n, "sharded gradient: rank ",
               comm.rank(), " holds ", rows.size(), " elements, its rows of ", m, "x", n, " are ",
               mine * n);
}

double ShardedGradient::ProductAndNorm(const float* x, int ldx, float* y) {
  const int size = comm_.size(), rank = comm_.rank();
  const int64_t r0 = first_row_[rank], rows = first_row_[rank + 1] - r0;
  // This rank's rows of Y, straight into y, then its part of the norm behind them on the wire.
  double part = 0.0;
  if (rows > 0) part = geometry::ThinProductAndNorm(rows_.data(), rows, n_, x, ldx, y + r0 * ldx);
  const size_t row_bytes = static_cast<size_t>(ldx) * sizeof(float);
  send_.resize(static_cast<size_t>(rows) * row_bytes + sizeof part);
  if (rows > 0) std::memcpy(send_.data(), y + r0 * ldx, static_cast<size_t>(rows) * row_bytes);
  std::memcpy(send_.data() + static_cast<size_t>(rows) * row_bytes, &part, sizeof part);
  std::vector<size_t> counts(size);
  size_t total = 0;
  for (int r = 0; r < size; ++r) {
    counts[r] = static_cast<size_t>(first_row_[r + 1] - first_row_[r]) * row_bytes + sizeof part;
    total += counts[r];
  }
  recv_.resize(total);
  comm_.AllGatherV(send_, recv_, counts);
  double norm2 = 0.0;
  size_t at = 0;
  for (int r = 0; r < size; ++r) {
    const size_t bytes = counts[r] - sizeof part;
    if (bytes) std::memcpy(y + first_row_[r] * ldx, recv_.data() + at, bytes);
    double p;
    std::memcpy(&p, recv_.data() + at + bytes, sizeof p);
    norm2 += p;  // in rank order: the same sum on every rank
    at += counts[r];
  }
  return norm2;
}

void ShardedGradient::TransposeProduct(const float* q, int c, float* bt) {
  const int rank = comm_.rank();
  const int64_t r0 = first_row_[rank], rows = first_row_[rank + 1] - r0;
  // B^T = G_r^T Q_r: the rows row-major are their transpose column-major (leading dimension n);
  // Q is column-major m x c, so this rank's rows start at q + r0 with leading dimension m.
  if (rows > 0 && c > 0) {
    cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(n_), c,
                static_cast<int>(rows), 1.f, rows_.data(), static_cast<int>(n_), q + r0,
                static_cast<int>(m_), 0.f, bt, static_cast<int>(n_));
  } else {
    std::memset(bt, 0, sizeof(float) * static_cast<size_t>(n_) * static_cast<size_t>(c));
  }
  comm_.AllReduceSum({bt, static_cast<size_t>(n_) * static_cast<size_t>(c)});
}

int64_t ShardedGradient::FindNonFinite() {
  const int size = comm_.size(), rank = comm_.rank();
  int64_t mine = -1;
  for (size_t i = 0; i < rows_.size(); ++i) {
    if (!std::isfinite(rows_[i])) {
      mine = first_row_[rank] * n_ + static_cast<int64_t>(i);
      break;
    }
  }
  std::vector<int64_t> all(size);
  comm_.AllGatherV({reinterpret_cast<const uint8_t*>(&mine), sizeof mine},
                   {reinterpret_cast<uint8_t*>(all.data()), all.size() * sizeof mine},
                   std::vector<size_t>(size, sizeof mine));
  for (int64_t i : all) {
    if (i >= 0) return i;
  }
  return -1;
}

}  // namespace geofp8
