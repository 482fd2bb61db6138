// CUDA implementation of the geometry transform (geometry_cuda.h): the CPU path's three-GEMM
// rank-2k update on cuBLAS, the diag scaling as an element kernel sharing geometry_math.h, and
// the update fused into fp8 quantization (EncodeFused).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/codec/codec_cuda.h"
#include "kernels/codec/element.h"
#include "kernels/codec/warp.cuh"
#include "kernels/common/check.h"
#include "kernels/common/cuda_check.h"
#include "kernels/geometry/factors.h"
#include "kernels/geometry/geometry_cuda.h"
#include "kernels/geometry/geometry_math.h"

#define GEOFP8_CUBLAS_CHECK(expr)                                               \
  do {                                                                          \
    const cublasStatus_t geofp8_st = (expr);                                    \
    GEOFP8_CHECK(geofp8_st == CUBLAS_STATUS_SUCCESS, #expr, ": cublas status ", \
                 static_cast<int>(geofp8_st));                                  \
  } while (0)

namespace geofp8::cuda {
namespace {

// Row-major C (M x N) = alpha op(A) op(B) + beta C, through column-major cuBLAS: C^T = op(B)^T
// op(A)^T.
void RowMajorGemm(cublasHandle_t h, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                  float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                  float* C, int64_t ldc) {
  GEOFP8_CUBLAS_CHECK(cublasSgemm(
      h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &alpha, B,
      static_cast<int>(ldb), A, static_cast<int>(lda), &beta, C, static_cast<int>(ldc)));
}

// The factors of the low-rank update that the whole-matrix transform and the shard's row inverse
// share (the CPU path's sequence, geometry.cc): from X (rows x k) and W (k x n), C = W V,
// t = Ab C Bb, left = [U | X Bb - U t] (rows x 2k, U the same rows of U) and right = [Ab W ; V^T]
// (2k x n).
void LowRankFactors(cublasHandle_t h, cudaStream_t stream, int64_t rows, int64_t k, int64_t n,
                    const float* u, const float* v, const float* ab, const float* bb,
                    const float* w, const float* x, float* c, float* abc, float* t, float* left,
                    float* right) {
  const int64_t k2 = 2 * k;
  RowMajorGemm(h, false, false, k, k, n, 1.f, w, n, v, k, 0.f, c, k);
  RowMajorGemm(h, false, false, k, k, k, 1.f, ab, k, c, k, 0.f, abc, k);
  RowMajorGemm(h, false, false, k, k, k, 1.f, abc, k, bb, k, 0.f, t, k);
  GEOFP8_CUDA_CHECK(cudaMemcpy2DAsync(left, k2 * sizeof(float), u, k * sizeof(float),
                                      k * sizeof(float), rows, cudaMemcpyDeviceToDevice, stream));
  RowMajorGemm(h, false, false, rows, k, k, 1.f, x, k, bb, k, 0.f, left + k, k2);
  RowMajorGemm(h, false, false, rows, k, k, -1.f, u, k, t, k, 1.f, left + k, k2);
  RowMajorGemm(h, false, false, k, n, k, 1.f, ab, k, w, n, 0.f, right, n);
  // right rows [k, 2k) = V^T: row-major V (n x k) is column-major k x n; transpose with geam.
  const float one = 1.f, zero = 0.f;
  // geam reads B (aliased to C here) even with beta = 0 on some versions: give it zeros, not NaNs.
  GEOFP8_CUDA_CHECK(cudaMemsetAsync(right + k * n, 0, k * n * sizeof(float), stream));
  GEOFP8_CUBLAS_CHECK(cublasSgeam(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                  static_cast<int>(k), &one, v, static_cast<int>(k), &zero,
                                  right + k * n, static_cast<int>(n), right + k * n,
                                  static_cast<int>(n)));
}

__global__ void DiagKernel(float* g, const float* row, const float* col, int64_t m, int64_t n,
                           bool inverse) {
  const int64_t total = m * n;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx / n, j = idx - i * n;
    g[idx] = inverse ? geometry::DiagInverse(g[idx], row[i], col[j])
                     : geometry::DiagForward(g[idx], row[i], col[j]);
  }
}

// ---- Fused transform + fp8 quantization (EncodeFused) ----

namespace el = element;

enum FusedMode : int { kFusedNone = 0, kFusedDiag = 1, kFusedLowRank = 2 };

// What element e of T(G) is made of.
struct FusedSource {
  const float* g;
  int64_t n;
  const float* left;   // lowrank: m x k2
  const float* right;  // lowrank: k2 x n
  int k2;
  const float* row;  // diag: m
  const float* col;  // diag: n
};

template <int kMode>
__device__ inline float TransformedElement(const FusedSource& s, size_t e) {
  const float g = s.g[e];
  if constexpr (kMode == kFusedNone) {
    return g;
  } else {
    const int64_t i = static_cast<int64_t>(e) / s.n, j = static_cast<int64_t>(e) - i * s.n;
    if constexpr (kMode == kFusedDiag) {
      return geometry::DiagForward(g, s.row[i], s.col[j]);
    } else {
      return geometry::LowRankUpdateElement(g, s.left + i * s.k2, s.right + j, s.n, s.k2);
    }
  }
}

// One warp per scale block of the chunk [begin, begin + count) of T(G). The block's elements are
// computed twice, for the amax and then to encode, rather than stored: the GPU has FLOPs to spare
// (2 k2 per element), and storing them is the memory pass this kernel exists to remove. Same
// element math as the codec's EncodeFp8Kernel (element.h), same layout as codec.h.
template <int kMode>
__global__ void FusedEncodeFp8Kernel(FusedSource s, size_t begin, size_t count, uint32_t block,
                                     bool e5m2, uint8_t* scales, uint8_t* payload, uint64_t key,
                                     bool stochastic, unsigned long long* counters) {
  const size_t warp = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;
  const unsigned lane = threadIdx.x & 31;
  const size_t b0 = warp * block;
  if (b0 >= count) return;  // whole warp leaves together
  const size_t b1 = min(count, b0 + block);
  unsigned m = 0;
  for (size_t i = b0 + lane; i < b1; i += 32) {
    m = max(m, FiniteAbsBits(TransformedElement<kMode>(s, begin + i)));
  }
  const float scale = el::ScaleFromAmax(el::BitsFloat(WarpMax(m)), e5m2 ? 57344.f : 448.f);
  if (lane == 0) memcpy(scales + 4 * warp, &scale, 4);
  for (size_t base = b0; base < b1; base += 32) {
    const size_t i = base + lane;
    bool sat = false, nonfinite = false;
    if (i < b1) {
      const float v = TransformedElement<kMode>(s, begin + i);
      nonfinite = !el::IsFinite(v);
      const uint32_t r = stochastic ? el::RandomBits(key, i) : 0u;
      payload[i] = el::EncodeFp8Scaled(e5m2, v, scale, stochastic, r, &sat);
    }
    WarpCount(nonfinite, &counters[0]);
    WarpCount(sat, &counters[1]);
  }
}

float* Upload(const std::vector<float>& host) {
  if (host.empty()) return nullptr;
  float* d = nullptr;
  GEOFP8_CUDA_CHECK(cudaMalloc(&d, host.size() * sizeof(float)));
  GEOFP8_CUDA_CHECK(
      cudaMemcpy(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

}  // namespace

bool HaveDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

DeviceGeometry::DeviceGeometry(const Geometry& g) : host_(g) {
  identity_ = g.is_identity();
  if (identity_) return;
  if (g.mode == GeometryMode::kDiag) {
    row_ = Upload(g.row_scale);
    col_ = Upload(g.col_scale);
    return;
  }
  const int k = g.k;
  if (k == 0 || g.m == 0 || g.n == 0) {
    identity_ = true;
    return;
  }
  u_ = Upload(g.U);
  v_ = Upload(g.V);
  const std::vector<float> fl = geometry::WhitenFactors(g, true),
                           fr = geometry::WhitenFactors(g, false);
  core_[0] = Upload(geometry::SideCore(g.U, g.m, k, fl, false));
  core_[1] = Upload(geometry::SideCore(g.V, g.n, k, fr, false));
  core_[2] = Upload(geometry::SideCore(g.U, g.m, k, fl, true));
  core_[3] = Upload(geometry::SideCore(g.V, g.n, k, fr, true));
  const size_t floats =
      static_cast<size_t>(k * g.n + g.m * k + 3 * k * k + g.m * 2 * k + 2 * k * g.n);
  GEOFP8_CUDA_CHECK(cudaMalloc(&scratch_, floats * sizeof(float)));
}

DeviceGeometry::~DeviceGeometry() {
  for (float* p : {u_, v_, core_[0], core_[1], core_[2], core_[3], row_, col_, scratch_}) {
    if (p) cudaFree(p);
  }
}

void DeviceGeometry::Apply(float* dG, cudaStream_t stream, cublasContext* handle) {
  Transform(dG, false, stream, handle);
}
void DeviceGeometry::Invert(float* dG, cudaStream_t stream, cublasContext* handle) {
  Transform(dG, true, stream, handle);
}

void DeviceGeometry::PrepareUpdate(const float* dG, bool inverse, cudaStream_t stream,
                                   cublasContext* handle) {
  GEOFP8_CHECK(handle != nullptr, "DeviceGeometry: a cuBLAS handle is required for lowrank");
  cublasHandle_t h = handle;
  GEOFP8_CUBLAS_CHECK(cublasSetStream(h, stream));
  const int64_t m = host_.m, n = host_.n;
  const int64_t k = host_.k, k2 = 2 * k;
  const float* ab = core_[inverse ? 2 : 0];
  const float* bb = core_[inverse ? 3 : 1];
  float* w = scratch_;           // k x n
  float* x = w + k * n;          // m x k
  float* c = x + m * k;          // k x k
  float* abc = c + k * k;        // k x k
  float* t = abc + k * k;        // k x k
  float* left = t + k * k;       // m x 2k
  float* right = left + m * k2;  // 2k x n
  // Same sequence as the CPU path (geometry.cc PrepareLowRank, without its row tiling).
  RowMajorGemm(h, true, false, k, n, m, 1.f, u_, k, dG, n, 0.f, w, n);
  RowMajorGemm(h, false, false, m, k, n, 1.f, dG, n, v_, k, 0.f, x, k);
  LowRankFactors(h, stream, m, k, n, u_, v_, ab, bb, w, x, c, abc, t, left, right);
}

void DeviceGeometry::Transform(float* dG, bool inverse, cudaStream_t stream,
                               cublasContext* handle) {
  if (identity_) return;
  const int64_t m = host_.m, n = host_.n;
  if (host_.mode == GeometryMode::kDiag) {
    if (m * n == 0) return;
    const int threads = 256;
    const int blocks = static_cast<int>(std::min<int64_t>((m * n + threads - 1) / threads, 65535));
    DiagKernel<<<blocks, threads, 0, stream>>>(dG, row_, col_, m, n, inverse);
    GEOFP8_CUDA_CHECK(cudaGetLastError());
    return;
  }
  PrepareUpdate(dG, inverse, stream, handle);
  const int64_t k = host_.k, k2 = 2 * k;
  const float* left = scratch_ + k * n + m * k + 3 * k * k;
  const float* right = left + m * k2;
  RowMajorGemm(handle, false, false, m, n, k2, -1.f, left, k2, right, n, 1.f, dG, n);
}

void DeviceGeometry::ShardProducts(int64_t r0, const float* rows, int64_t len, float* w,
                                   cudaStream_t stream, cublasContext* handle) {
  const int64_t k = ShardProductRows(host_), n = host_.n;
  if (k == 0 || identity_) return;
  GEOFP8_CHECK(r0 >= 0 && r0 + len <= host_.m, "shard products: rows [", r0, ", ", r0 + len,
               ") of a ", host_.m, "x", n, " geometry");
  if (len == 0) {
    GEOFP8_CUDA_CHECK(cudaMemsetAsync(w, 0, k * n * sizeof(float), stream));
    return;
  }
  GEOFP8_CHECK(handle != nullptr, "DeviceGeometry: a cuBLAS handle is required for lowrank");
  GEOFP8_CUBLAS_CHECK(cublasSetStream(handle, stream));
  RowMajorGemm(handle, true, false, k, n, len, 1.f, u_ + r0 * k, k, rows, n, 0.f, w, n);
}

void DeviceGeometry::InvertRows(int64_t r0, float* rows, int64_t len, const float* w,
                                cudaStream_t stream, cublasContext* handle) {
  if (identity_ || len == 0) return;
  const int64_t m = host_.m, n = host_.n;
  GEOFP8_CHECK(r0 >= 0 && r0 + len <= m, "shard inverse: rows [", r0, ", ", r0 + len, ") of a ", m,
               "x", n, " geometry");
  if (host_.mode == GeometryMode::kDiag) {
    const int threads = 256;
    const int blocks =
        static_cast<int>(std::min<int64_t>((len * n + threads - 1) / threads, 65535));
    DiagKernel<<<blocks, threads, 0, stream>>>(rows, row_ + r0, col_, len, n, true);
    GEOFP8_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const int64_t k = ShardProductRows(host_), k2 = 2 * k;
  if (k == 0) return;
  GEOFP8_CHECK(w != nullptr, "shard inverse: the summed shares of U^T D are required");
  GEOFP8_CHECK(handle != nullptr, "DeviceGeometry: a cuBLAS handle is required for lowrank");
  cublasHandle_t h = handle;
  GEOFP8_CUBLAS_CHECK(cublasSetStream(h, stream));
  const float* ab = core_[2];
  const float* bb = core_[3];
  // The scratch of a whole-layer transform, of which the shard uses its first len rows.
  float* x = scratch_ + k * n;   // len x k
  float* c = x + m * k;          // k x k
  float* abc = c + k * k;        // k x k
  float* t = abc + k * k;        // k x k
  float* left = t + k * k;       // len x 2k
  float* right = left + m * k2;  // 2k x n
  const float* u = u_ + r0 * k;
  // The CPU path's sequence (geometry.cc InvertGeometryRows): X = D_rows V, C = W V,
  // t = Ab C Bb, left = [U_rows | X Bb - U_rows t], right = [Ab W ; V^T], rows -= left right.
  RowMajorGemm(h, false, false, len, k, n, 1.f, rows, n, v_, k, 0.f, x, k);
  LowRankFactors(h, stream, len, k, n, u, v_, ab, bb, w, x, c, abc, t, left, right);
  RowMajorGemm(h, false, false, len, n, k2, -1.f, left, k2, right, n, 1.f, rows, n);
}

void DeviceGeometry::DownloadUpdate(const float* dG, std::vector<float>* left,
                                    std::vector<float>* right, cudaStream_t stream,
                                    cublasContext* handle) {
  GEOFP8_CHECK(!identity_ && host_.mode == GeometryMode::kLowRank,
               "DownloadUpdate: only a lowrank geometry has update factors");
  PrepareUpdate(dG, /*inverse=*/false, stream, handle);
  const int64_t m = host_.m, n = host_.n, k = host_.k, k2 = 2 * k;
  const float* d_left = scratch_ + k * n + m * k + 3 * k * k;
  left->resize(static_cast<size_t>(m * k2));
  right->resize(static_cast<size_t>(k2 * n));
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(left->data(), d_left, left->size() * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream));
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(right->data(), d_left + m * k2, right->size() * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream));
  GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void DeviceGeometry::EncodeFused(const float* dG, std::span<DeviceEncodeTarget> targets,
                                 cudaStream_t stream, cublasContext* handle) {
  const size_t total = static_cast<size_t>(host_.m * host_.n);
  for (size_t i = 0; i < targets.size(); ++i) {
    const DeviceEncodeTarget& t = targets[i];
    if (t.begin > t.end || t.end > total) {
      GEOFP8_FAIL("EncodeFused: targets[", i, "].begin/end: [", t.begin, ", ", t.end,
                  ") is not a range inside the ", total, " elements of G");
    }
    const std::string error = ValidateCodecOptions(t.options);
    if (!error.empty()) GEOFP8_FAIL("EncodeFused: targets[", i, "].options.", error);
    const size_t need = EncodedBytes(t.options, t.end - t.begin);
    if (t.out_bytes < need) {
      GEOFP8_FAIL("EncodeFused: targets[", i, "].out_bytes: ", t.out_bytes, " < ", need);
    }
  }
  const int mode = identity_                           ? kFusedNone
                   : host_.mode == GeometryMode::kDiag ? kFusedDiag
                                                       : kFusedLowRank;
  FusedSource src{dG, host_.n, nullptr, nullptr, 0, row_, col_};
  if (mode == kFusedLowRank) {
    PrepareUpdate(dG, /*inverse=*/false, stream, handle);
    const int64_t m = host_.m, n = host_.n, k = host_.k;
    src.left = scratch_ + k * n + m * k + 3 * k * k;
    src.right = src.left + m * 2 * k;
    src.k2 = static_cast<int>(2 * k);
  }
  float* transformed = nullptr;  // T(dG), only for codecs without a fused kernel
  unsigned long long* counters = nullptr;
  GEOFP8_CUDA_CHECK(
      cudaMallocAsync(reinterpret_cast<void**>(&counters), 2 * sizeof(*counters), stream));
  try {
    for (DeviceEncodeTarget& t : targets) {
      const size_t count = t.end - t.begin;
      const CodecOptions& o = t.options;
      const bool fp8 = o.format == Format::kFp8E4M3 || o.format == Format::kFp8E5M2;
      if (!(fp8 && o.scaling == Scaling::kBlock && count > 0)) {
        if (!transformed) {
          GEOFP8_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&transformed),
                                            std::max<size_t>(total, 1) * sizeof(float), stream));
          GEOFP8_CUDA_CHECK(cudaMemcpyAsync(transformed, dG, total * sizeof(float),
                                            cudaMemcpyDeviceToDevice, stream));
          Transform(transformed, /*inverse=*/false, stream, handle);
        }
        t.stats = Encode(transformed + t.begin, count, o, t.out, t.out_bytes, stream);
        continue;
      }
      GEOFP8_CUDA_CHECK(cudaMemsetAsync(counters, 0, 2 * sizeof(*counters), stream));
      const uint32_t block = o.block;
      const size_t blocks = (count + block - 1) / block;
      uint8_t* scales = t.out + sizeof(EncodedHeader);
      uint8_t* payload = scales + 4 * blocks;
      const bool e5m2 = o.format == Format::kFp8E5M2;
      const bool stochastic = o.rounding == Rounding::kStochastic;
      const uint64_t key = el::StreamKey(o.seed, o.step, o.layer, o.rank);
      constexpr int kThreads = 256;
      const unsigned grid = static_cast<unsigned>((blocks * 32 + kThreads - 1) / kThreads);
      switch (mode) {
        case kFusedNone:
          FusedEncodeFp8Kernel<kFusedNone><<<grid, kThreads, 0, stream>>>(
              src, t.begin, count, block, e5m2, scales, payload, key, stochastic, counters);
          break;
        case kFusedDiag:
          FusedEncodeFp8Kernel<kFusedDiag><<<grid, kThreads, 0, stream>>>(
              src, t.begin, count, block, e5m2, scales, payload, key, stochastic, counters);
          break;
        default:
          FusedEncodeFp8Kernel<kFusedLowRank><<<grid, kThreads, 0, stream>>>(
              src, t.begin, count, block, e5m2, scales, payload, key, stochastic, counters);
          break;
      }
      GEOFP8_CUDA_CHECK(cudaGetLastError());
      unsigned long long host_counters[2] = {0, 0};
      GEOFP8_CUDA_CHECK(cudaMemcpyAsync(host_counters, counters, sizeof(host_counters),
                                        cudaMemcpyDeviceToHost, stream));
      GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream));
      t.stats.nonfinite = host_counters[0];
      t.stats.saturated = host_counters[1];
      EncodedHeader header;
      header.format = static_cast<uint8_t>(o.format);
      header.scaling = static_cast<uint8_t>(Scaling::kBlock);
      header.block = block;
      header.count = count;
      header.flags = t.stats.nonfinite ? kFlagNonFinite : 0;
      GEOFP8_CUDA_CHECK(
          cudaMemcpyAsync(t.out, &header, sizeof(header), cudaMemcpyHostToDevice, stream));
      GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream));  // `header` lives on this stack frame
    }
  } catch (...) {
    cudaFreeAsync(counters, stream);
    if (transformed) cudaFreeAsync(transformed, stream);
    throw;
  }
  GEOFP8_CUDA_CHECK(cudaFreeAsync(counters, stream));
  if (transformed) GEOFP8_CUDA_CHECK(cudaFreeAsync(transformed, stream));
}

// ---- DeviceGradient ----

namespace {

constexpr int kNormBlocks = 1024, kNormThreads = 256;

// partial[b] = sum of g[i]^2 over block b's elements, in double: each thread sums its strided
// elements in order, then a fixed tree over the block's threads. No atomics: the same g gives
// the same partials.
__global__ void SumSquaresKernel(const float* g, int64_t total, double* partial) {
  __shared__ double sums[kNormThreads];
  double acc = 0.0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const double v = g[i];
    acc += v * v;
  }
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kNormThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sums[0];
}

// The index of the first NaN or inf, or total: a min over blocks of each block's first.
__global__ void FirstNonFiniteKernel(const float* g, int64_t total, unsigned long long* first) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (!isfinite(g[i])) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

}  // namespace

DeviceGradient::DeviceGradient(const float* dG, int64_t m, int64_t n, cudaStream_t stream,
                               cublasContext* handle, bool owns)
    : dG_(dG), owns_(owns), m_(m), n_(n), stream_(stream), handle_(handle) {
  GEOFP8_CHECK(m > 0 && n > 0, "DeviceGradient: shape ", m, "x", n);
  GEOFP8_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&partial_), kNormBlocks * sizeof(double)));
}

DeviceGradient::~DeviceGradient() {
  cudaStreamSynchronize(stream_);
  cudaFree(scratch_);
  cudaFree(partial_);
  if (owns_) cudaFree(const_cast<float*>(dG_));
}

float* DeviceGradient::Scratch(size_t floats) {
  if (floats > scratch_floats_) {
    GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaFree(scratch_);
    scratch_ = nullptr;
    GEOFP8_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scratch_), floats * sizeof(float)));
    scratch_floats_ = floats;
  }
  return scratch_;
}

cublasContext* DeviceGradient::Handle() {
  GEOFP8_CHECK(cublasSetStream(handle_, stream_) == CUBLAS_STATUS_SUCCESS,
               "cublasSetStream failed");
  return handle_;
}

double DeviceGradient::ProductAndNorm(const float* x, int ldx, float* y) {
  cublasHandle_t h = Handle();
  const size_t nx = size_t(n_) * ldx, ny = size_t(m_) * ldx;
  float* dx = Scratch(nx + ny);
  float* dy = dx + nx;
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(dx, x, nx * sizeof(float), cudaMemcpyHostToDevice, stream_));
  // Y (m x ldx) = G (m x n) X (n x ldx), row-major.
  RowMajorGemm(h, false, false, m_, ldx, n_, 1.f, dG_, n_, dx, ldx, 0.f, dy, ldx);
  SumSquaresKernel<<<kNormBlocks, kNormThreads, 0, stream_>>>(dG_, m_ * n_, partial_);
  GEOFP8_CUDA_CHECK(cudaGetLastError());
  std::vector<double> partial(kNormBlocks);
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(y, dy, ny * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(partial.data(), partial_, kNormBlocks * sizeof(double),
                                    cudaMemcpyDeviceToHost, stream_));
  GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  double g2 = 0.0;
  for (double p : partial) g2 += p;
  return g2;
}

void DeviceGradient::TransposeProduct(const float* q, int c, float* bt) {
  cublasHandle_t h = Handle();
  const size_t nq = size_t(m_) * c, nb = size_t(n_) * c;
  float* dq = Scratch(nq + nb);
  float* db = dq + nq;
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(dq, q, nq * sizeof(float), cudaMemcpyHostToDevice, stream_));
  // B^T (n x c, column-major) is B = Q^T G (c x n) row-major, and Q (m x c, column-major) is
  // Q^T (c x m) row-major.
  RowMajorGemm(h, false, false, c, n_, m_, 1.f, dq, m_, dG_, n_, 0.f, db, n_);
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(bt, db, nb * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

int64_t DeviceGradient::FindNonFinite() {
  const int64_t total = m_ * n_;
  unsigned long long* d = reinterpret_cast<unsigned long long*>(partial_);
  const unsigned long long init = static_cast<unsigned long long>(total);
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(d, &init, sizeof init, cudaMemcpyHostToDevice, stream_));
  FirstNonFiniteKernel<<<kNormBlocks, kNormThreads, 0, stream_>>>(dG_, total, d);
  GEOFP8_CUDA_CHECK(cudaGetLastError());
  unsigned long long first = init;
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(&first, d, sizeof first, cudaMemcpyDeviceToHost, stream_));
  GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return first < init ? static_cast<int64_t>(first) : -1;
}

}  // namespace geofp8::cuda
