// CPU implementations of the Llama ops in kernels/model/ops.h, for float and double.
// Every matrix product goes through cblas; the elementwise loops are written to vectorize.

#include "kernels/model/ops.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
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

std::string BlasCoreName() {
  const char* name = openblas_get_corename();
  return name ? name : "";
}

namespace {
// 0: SSE only, 1: AVX, 2: AVX2+FMA, 3: AVX-512 (F, CD, BW, DQ, VL: what SkylakeX kernels use).
int CpuVectorLevel() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl")) {
    return 3;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 2;
  if (__builtin_cpu_supports("avx")) return 1;
#endif
  return 0;
}

// The vector level of an OpenBLAS x86-64 core name (names of driver/others/dynamic.c).
int CoreVectorLevel(const std::string& core) {
  for (const char* n : {"SkylakeX", "Cooperlake", "SapphireRapids"}) {
    if (core == n) return 3;
  }
  for (const char* n : {"Haswell", "Zen", "Excavator"}) {
    if (core == n) return 2;
  }
  for (const char* n : {"Sandybridge", "Bulldozer", "Piledriver", "Steamroller"}) {
    if (core == n) return 1;
  }
  return 0;
}
}  // namespace

std::string PreferredBlasCore() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return "";
  const std::string core = BlasCoreName();
  if (core.empty()) return "";
  const int cpu = CpuVectorLevel();
  if (CoreVectorLevel(core) >= cpu) return "";
  return cpu == 3 ? "SkylakeX" : cpu == 2 ? "Haswell" : "Sandybridge";
}

void ReexecWithPreferredBlasCore(char** argv, std::string* warning) {
  warning->clear();
  const std::string core = PreferredBlasCore();
  if (core.empty()) return;
  setenv("OPENBLAS_CORETYPE", core.c_str(), 1);  // set now, so the new image cannot loop
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  execv(ec ? "/proc/self/exe" : self.c_str(), argv);
  *warning = "could not re-execute with OPENBLAS_CORETYPE=" + core +
             "; continuing with OpenBLAS core " + BlasCoreName();
}

namespace {
// Sum of term(0..n) in eight partial sums combined in a fixed order: the loop vectorizes without
// -ffast-math, and the result has the same bits on every x86-64 machine, which the ranks'
// bitwise agreement needs.
template <typename T, typename F>
T Reduce8(int n, F term) {
  T acc[8] = {};
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += term(j + k);
  }
  T sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; j < n; ++j) sum += term(j);
  return sum;
}

// max of x[0..n), n >= 1, in the same eight-lane layout.
template <typename T>
T MaxOf(const T* x, int n) {
  T mx = x[0];
  int j = 1;
  if (n >= 16) {
    T acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = x[k];
    for (j = 8; j + 8 <= n; j += 8) {
      for (int k = 0; k < 8; ++k) acc[k] = acc[k] < x[j + k] ? x[j + k] : acc[k];
    }
    for (int k = 0; k < 8; ++k) mx = mx < acc[k] ? acc[k] : mx;
  }
  for (; j < n; ++j) mx = mx < x[j] ? x[j] : mx;
  return mx;
}

// In place: row[0..n) = softmax(row[0..n)).
template <typename T>
void SoftmaxRow(T* row, int n) {
  const T mx = MaxOf(row, n);
  for (int j = 0; j < n; ++j) row[j] = Exp(row[j] - mx);
  const T inv = T(1) / Reduce8<T>(n, [&](int j) { return row[j]; });
  for (int j = 0; j < n; ++j) row[j] *= inv;
}
}  // namespace

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
    const T ss = Reduce8<T>(d, [&](int j) { return xr[j] * xr[j]; });
    const T r = T(1) / std::sqrt(ss / T(d) + eps);
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
    for (int j = 0; j < d; ++j) dgain[j] += dyr[j] * (xr[j] * r);
    const T mean = Reduce8<T>(d, [&](int j) { return dyr[j] * gain[j] * (xr[j] * r); }) / T(d);
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
                    bool accumulate_dx, bool accumulate_dw) {
  if (dW) {
    Gemm<T>(true, false, out, in, rows, T(1), dy, out, x, in, accumulate_dw ? T(1) : T(0), dW, in);
  }
  if (dx)
    Gemm<T>(false, false, rows, in, out, T(1), dy, out, W, in, accumulate_dx ? T(1) : T(0), dx, in);
}

template <typename T>
void RopeTable(int seq, int head_dim, T theta, T* cos, T* sin) {
  GEOFP8_CHECK(head_dim % 2 == 0, "rope needs an even head_dim, got ", head_dim);
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const T freq = RopeFrequency<T>(i, head_dim, theta);
    for (int pos = 0; pos < seq; ++pos) {
      const T angle = static_cast<T>(pos) * freq;
      cos[pos * half + i] = std::cos(angle);
      sin[pos * half + i] = std::sin(angle);
    }
  }
}

template <typename T>
void RopeApply(T* x, int rows, int seq, int heads, int head_dim, const T* cos, const T* sin,
               bool inverse) {
  GEOFP8_CHECK(head_dim % 2 == 0, "rope needs an even head_dim, got ", head_dim);
  const int half = head_dim / 2, width = heads * head_dim;
  const T sign = inverse ? T(-1) : T(1);
  for (int t = 0; t < rows; ++t) {
    const T* c = cos + (t % seq) * half;
    const T* sn = sin + (t % seq) * half;
    for (int h = 0; h < heads; ++h) {
      T* p = x + static_cast<int64_t>(t) * width + h * head_dim;
      for (int i = 0; i < half; ++i) {
        const T a = p[2 * i], b = p[2 * i + 1], s = sign * sn[i];
        p[2 * i] = a * c[i] - b * s;
        p[2 * i + 1] = a * s + b * c[i];
      }
    }
  }
}

namespace {
template <typename T>
void RopeRotate(T* x, int rows, int seq, int heads, int head_dim, T theta, bool inverse) {
  GEOFP8_CHECK(head_dim % 2 == 0, "rope needs an even head_dim, got ", head_dim);
  std::vector<T> cos(size_t(seq) * (head_dim / 2)), sin(cos.size());
  RopeTable(seq, head_dim, theta, cos.data(), sin.data());
  RopeApply(x, rows, seq, heads, head_dim, cos.data(), sin.data(), inverse);
}
}  // namespace

template <typename T>
void RopeForward(T* x, int rows, int seq, int heads, int head_dim, T theta) {
  RopeRotate(x, rows, seq, heads, head_dim, theta, false);
}

template <typename T>
void RopeBackward(T* dx, int rows, int seq, int heads, int head_dim, T theta) {
  RopeRotate(dx, rows, seq, heads, head_dim, theta, true);
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
        SoftmaxRow(row, i + 1);
        std::fill(row + i + 1, row + seq, T(0));
      }
      Gemm<T>(false, false, seq, head_dim, seq, T(1), P, seq, v + base, width, T(0), out + base,
              width);
    }
  }
}

template <typename T>
void AttentionBackward(const T* q, const T* k, const T* v, const T* probs, const T* dout, int batch,
                       int seq, int heads, int head_dim, T* dq, T* dk, T* dv, T* scratch) {
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
        const T dt = Reduce8<T>(i + 1, [&](int j) { return row[j] * prow[j]; });
        for (int j = 0; j <= i; ++j) row[j] = prow[j] * (row[j] - dt);
        std::fill(row + i + 1, row + seq, T(0));
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
    const T s = SigmoidOf(a[i]);  // silu = a s, silu' = s (1 + a (1 - s))
    da[i] = dh[i] * b[i] * (s * (T(1) + a[i] * (T(1) - s)));
    db[i] = dh[i] * (a[i] * s);
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
    const T mx = MaxOf(row, vocab);
    T sum;
    if (dlogits) {
      // softmax * inv_rows, minus inv_rows at the target.
      T* drow = dlogits + t * vocab;
      for (int j = 0; j < vocab; ++j) drow[j] = Exp(row[j] - mx);
      sum = Reduce8<T>(vocab, [&](int j) { return drow[j]; });
      const T scale = inv_rows / sum;
      for (int j = 0; j < vocab; ++j) drow[j] *= scale;
      drow[y] -= inv_rows;
    } else {
      sum = Reduce8<T>(vocab, [&](int j) { return Exp(row[j] - mx); });
    }
    total +=
        std::log(static_cast<double>(sum)) + static_cast<double>(mx) - static_cast<double>(row[y]);
  }
  return total / static_cast<double>(rows);
}

#define GEOFP8_INSTANTIATE_OPS(T)                                                                \
  template void EmbeddingForward<T>(std::span<const int32_t>, const T*, int, T*);                \
  template void EmbeddingBackward<T>(std::span<const int32_t>, const T*, int, T*);               \
  template void RmsNormForward<T>(const T*, const T*, int, int, T, T*, T*);                      \
  template void RmsNormBackward<T>(const T*, const T*, const T*, const T*, int, int, T*, T*);    \
  template void LinearForward<T>(const T*, const T*, int, int, int, T*);                         \
  template void LinearBackward<T>(const T*, const T*, const T*, int, int, int, T*, T*, bool,     \
                                  bool);                                                         \
  template void LinearBackwardWeight<T>(const T*, const T*, int, int, int, T*);                  \
  template void RopeForward<T>(T*, int, int, int, int, T);                                       \
  template void RopeBackward<T>(T*, int, int, int, int, T);                                      \
  template void RopeTable<T>(int, int, T, T*, T*);                                               \
  template void RopeApply<T>(T*, int, int, int, int, const T*, const T*, bool);                  \
  template void AttentionForward<T>(const T*, const T*, const T*, int, int, int, int, T*, T*);   \
  template void AttentionBackward<T>(const T*, const T*, const T*, const T*, const T*, int, int, \
                                     int, int, T*, T*, T*, T*);                                  \
  template void SwiGluForward<T>(const T*, const T*, int64_t, T*);                               \
  template void SwiGluBackward<T>(const T*, const T*, const T*, int64_t, T*, T*);                \
  template double CrossEntropy<T>(const T*, std::span<const int32_t>, int, T*);

GEOFP8_INSTANTIATE_OPS(float)
GEOFP8_INSTANTIATE_OPS(double)

}  // namespace geofp8::model
