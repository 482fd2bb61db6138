// CPU implementations of the Llama ops in kernels/model/ops.h, for float and double.
// Loops are plain and row-major; every matrix product goes through cblas.

#include "kernels/model/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/common/check.h"

namespace geofp8::model {

template <>
void Gemm<float>(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template <>
void Gemm<double>(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda,
                  const double* B, int ldb, double beta, double* C, int ldc) {
  if (M == 0 || N == 0) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void SetBlasThreads(int threads) {
  GEOFP8_CHECK(threads >= 1, "blas threads must be >= 1, got ", threads);
  openblas_set_num_threads(threads);
}

template <typename T>
void EmbeddingForward(std::span<const int32_t> tokens, const T* table, int d, T* x) {
  for (size_t t = 0; t < tokens.size(); ++t) {
    std::copy(table + static_cast<int64_t>(tokens[t]) * d,
              table + static_cast<int64_t>(tokens[t] + 1) * d, x + t * d);
  }
}

template <typename T>
void EmbeddingBackward(std::span<const int32_t> tokens, const T* dx, int d, T* dtable) {
  for (size_t t = 0; t < tokens.size(); ++t) {
    T* row = dtable + static_cast<int64_t>(tokens[t]) * d;
    const T* g = dx + t * d;
    for (int j = 0; j < d; ++j) row[j] += g[j];
  }
}

template <typename T>
void RmsNormForward(const T* x, const T* gain, int rows, int d, T eps, T* y, T* inv_rms) {
  for (int t = 0; t < rows; ++t) {
    const T* xr = x + static_cast<int64_t>(t) * d;
    double ss = 0;
    for (int j = 0; j < d; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    T r = static_cast<T>(1.0 / std::sqrt(ss / d + static_cast<double>(eps)));
    inv_rms[t] = r;
    T* yr = y + static_cast<int64_t>(t) * d;
    for (int j = 0; j < d; ++j) yr[j] = xr[j] * r * gain[j];
  }
}

template <typename T>
void RmsNormBackward(const T* x, const T* gain, const T* inv_rms, const T* dy, int rows, int d,
                     T* dx, T* dgain) {
  for (int t = 0; t < rows; ++t) {
    const T* xr = x + static_cast<int64_t>(t) * d;
    const T* dyr = dy + static_cast<int64_t>(t) * d;
    T* dxr = dx + static_cast<int64_t>(t) * d;
    const T r = inv_rms[t];
    // With xhat = x r and g = dy * gain: dx = r (g - xhat mean(g xhat)).
    double dot = 0;
    for (int j = 0; j < d; ++j) {
      const T xhat = xr[j] * r;
      dot += static_cast<double>(dyr[j]) * gain[j] * xhat;
      dgain[j] += dyr[j] * xhat;
    }
    const T mean = static_cast<T>(dot / d);
    for (int j = 0; j < d; ++j) dxr[j] = r * (dyr[j] * gain[j] - xr[j] * r * mean);
  }
}

template <typename T>
void LinearForward(const T* x, const T* W, int rows, int in, int out, T* y) {
  Gemm<T>(false, true, rows, out, in, T(1), x, in, W, in, T(0), y, out);
}

template <typename T>
void LinearBackwardWeight(const T* x, const T* dy, int rows, int in, int out, T* dW) {
  Gemm<T>(true, false, out, in, rows, T(1), dy, out, x, in, T(1), dW, in);
}

template <typename T>
void LinearBackward(const T* x, const T* W, const T* dy, int rows, int in, int out, T* dx, T* dW,
                    bool accumulate_dx) {
  if (dW) LinearBackwardWeight(x, dy, rows, in, out, dW);
  if (dx) Gemm<T>(false, false, rows, in, out, T(1), dy, out, W, in, accumulate_dx ? T(1) : T(0),
                  dx, in);
}

namespace {
template <typename T>
void RopeRotate(T* x, int rows, int seq, int heads, int head_dim, T theta, T sign) {
  GEOFP8_CHECK(head_dim % 2 == 0, "rope needs an even head_dim, got ", head_dim);
  const int half = head_dim / 2;
  std::vector<T> freq(half);
  for (int i = 0; i < half; ++i) freq[i] = RopeFrequency<T>(i, head_dim, theta);
  const int width = heads * head_dim;
  for (int t = 0; t < rows; ++t) {
    const T pos = static_cast<T>(t % seq);
    for (int i = 0; i < half; ++i) {
      const T angle = pos * freq[i];
      const T c = std::cos(angle), s = sign * std::sin(angle);
      for (int h = 0; h < heads; ++h) {
        T* p = x + static_cast<int64_t>(t) * width + h * head_dim + 2 * i;
        const T a = p[0], b = p[1];
        p[0] = a * c - b * s;
        p[1] = a * s + b * c;
      }
    }
  }
}
}  // namespace

template <typename T>
void RopeForward(T* x, int rows, int seq, int heads, int head_dim, T theta) {
  RopeRotate(x, rows, seq, heads, head_dim, theta, T(1));
}

template <typename T>
void RopeBackward(T* dx, int rows, int seq, int heads, int head_dim, T theta) {
  RopeRotate(dx, rows, seq, heads, head_dim, theta, T(-1));
}

template <typename T>
void AttentionForward(const T* q, const T* k, const T* v, int batch, int seq, int heads,
                      int head_dim, T* probs, T* out) {
  const int width = heads * head_dim;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      const int64_t base = static_cast<int64_t>(b) * seq * width + h * head_dim;
      T* P = probs + (static_cast<int64_t>(b) * heads + h) * seq * seq;
      // S = Q K^T * scale, then a causal row softmax (entries above the diagonal are 0).
      Gemm<T>(false, true, seq, seq, head_dim, scale, q + base, width, k + base, width, T(0), P,
              seq);
      for (int i = 0; i < seq; ++i) {
        T* row = P + static_cast<int64_t>(i) * seq;
        T mx = row[0];
        for (int j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
        double sum = 0;
        for (int j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        const T inv = static_cast<T>(1.0 / sum);
        for (int j = 0; j <= i; ++j) row[j] *= inv;
        for (int j = i + 1; j < seq; ++j) row[j] = T(0);
      }
      Gemm<T>(false, false, seq, head_dim, seq, T(1), P, seq, v + base, width, T(0), out + base,
              width);
    }
  }
}

template <typename T>
void AttentionBackward(const T* q, const T* k, const T* v, const T* probs, const T* dout,
                       int batch, int seq, int heads, int head_dim, T* dq, T* dk, T* dv,
                       T* scratch) {
  const int width = heads * head_dim;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      const int64_t base = static_cast<int64_t>(b) * seq * width + h * head_dim;
      const T* P = probs + (static_cast<int64_t>(b) * heads + h) * seq * seq;
      // dV = P^T dO; dP = dO V^T; dS = P (dP - rowsum(dP P)); dQ = dS K s; dK = dS^T Q s.
      Gemm<T>(true, false, seq, head_dim, seq, T(1), P, seq, dout + base, width, T(0), dv + base,
              width);
      T* dS = scratch;
      Gemm<T>(false, true, seq, seq, head_dim, T(1), dout + base, width, v + base, width, T(0), dS,
              seq);
      for (int i = 0; i < seq; ++i) {
        T* row = dS + static_cast<int64_t>(i) * seq;
        const T* prow = P + static_cast<int64_t>(i) * seq;
        double dot = 0;
        for (int j = 0; j <= i; ++j) dot += static_cast<double>(row[j]) * prow[j];
        const T dt = static_cast<T>(dot);
        for (int j = 0; j <= i; ++j) row[j] = prow[j] * (row[j] - dt);
        for (int j = i + 1; j < seq; ++j) row[j] = T(0);
      }
      Gemm<T>(false, false, seq, head_dim, seq, scale, dS, seq, k + base, width, T(0), dq + base,
              width);
      Gemm<T>(true, false, seq, head_dim, seq, scale, dS, seq, q + base, width, T(0), dk + base,
              width);
    }
  }
}

template <typename T>
void SwiGluForward(const T* a, const T* b, int64_t n, T* h) {
  for (int64_t i = 0; i < n; ++i) h[i] = Silu(a[i]) * b[i];
}

template <typename T>
void SwiGluBackward(const T* a, const T* b, const T* dh, int64_t n, T* da, T* db) {
  for (int64_t i = 0; i < n; ++i) {
    da[i] = dh[i] * b[i] * SiluGrad(a[i]);
    db[i] = dh[i] * Silu(a[i]);
  }
}

template <typename T>
double CrossEntropy(const T* logits, std::span<const int32_t> targets, int vocab, T* dlogits) {
  const int64_t rows = static_cast<int64_t>(targets.size());
  if (rows == 0) return 0.0;
  double total = 0;
  const T inv_rows = static_cast<T>(1.0 / static_cast<double>(rows));
  for (int64_t t = 0; t < rows; ++t) {
    const T* row = logits + t * vocab;
    const int32_t y = targets[t];
    GEOFP8_CHECK(y >= 0 && y < vocab, "target ", y, " outside vocab ", vocab);
    T mx = row[0];
    for (int j = 1; j < vocab; ++j) mx = std::max(mx, row[j]);
    double sum = 0;
    for (int j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(row[j] - mx));
    const double lse = std::log(sum) + static_cast<double>(mx);
    total += lse - static_cast<double>(row[y]);
    if (dlogits) {
      T* drow = dlogits + t * vocab;
      for (int j = 0; j < vocab; ++j) {
        drow[j] = static_cast<T>(std::exp(static_cast<double>(row[j]) - lse)) * inv_rows;
      }
      drow[y] -= inv_rows;
    }
  }
  return total / static_cast<double>(rows);
}

#define GEOFP8_INSTANTIATE_OPS(T)                                                               \
  template void EmbeddingForward<T>(std::span<const int32_t>, const T*, int, T*);              \
  template void EmbeddingBackward<T>(std::span<const int32_t>, const T*, int, T*);             \
  template void RmsNormForward<T>(const T*, const T*, int, int, T, T*, T*);                    \
  template void RmsNormBackward<T>(const T*, const T*, const T*, const T*, int, int, T*, T*);  \
  template void LinearForward<T>(const T*, const T*, int, int, int, T*);                       \
  template void LinearBackward<T>(const T*, const T*, const T*, int, int, int, T*, T*, bool);  \
  template void LinearBackwardWeight<T>(const T*, const T*, int, int, int, T*);                \
  template void RopeForward<T>(T*, int, int, int, int, T);                                     \
  template void RopeBackward<T>(T*, int, int, int, int, T);                                    \
  template void AttentionForward<T>(const T*, const T*, const T*, int, int, int, int, T*, T*); \
  template void AttentionBackward<T>(const T*, const T*, const T*, const T*, const T*, int,    \
                                     int, int, int, T*, T*, T*, T*);                           \
  template void SwiGluForward<T>(const T*, const T*, int64_t, T*);                             \
  template void SwiGluBackward<T>(const T*, const T*, const T*, int64_t, T*, T*);              \
  template double CrossEntropy<T>(const T*, std::span<const int32_t>, int, T*);

GEOFP8_INSTANTIATE_OPS(float)
GEOFP8_INSTANTIATE_OPS(double)

}  // namespace geofp8::model
