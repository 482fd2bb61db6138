// CUDA implementation of the geometry transform (geometry_cuda.h): the CPU path's three-GEMM
// rank-2k update on cuBLAS, and the diag scaling as an element kernel sharing geometry_math.h.
#include "kernels/geometry/geometry_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/common/check.h"
#include "kernels/geometry/factors.h"
#include "kernels/geometry/geometry_math.h"

#define GEOFP8_CUDA_CHECK(expr)                                                           \
  do {                                                                                    \
    const cudaError_t geofp8_err = (expr);                                                \
    GEOFP8_CHECK(geofp8_err == cudaSuccess, #expr, ": ", cudaGetErrorString(geofp8_err)); \
  } while (0)
#define GEOFP8_CUBLAS_CHECK(expr)                                                              \
  do {                                                                                         \
    const cublasStatus_t geofp8_st = (expr);                                                   \
    GEOFP8_CHECK(geofp8_st == CUBLAS_STATUS_SUCCESS, #expr, ": cublas status ",                \
                 static_cast<int>(geofp8_st));                                                 \
  } while (0)

namespace geofp8::cuda {
namespace {

// Row-major C (M x N) = alpha op(A) op(B) + beta C, through column-major cuBLAS: C^T = op(B)^T op(A)^T.
void RowMajorGemm(cublasHandle_t h, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                  float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                  float* C, int64_t ldc) {
  GEOFP8_CUBLAS_CHECK(cublasSgemm(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
                                  static_cast<int>(M), static_cast<int>(K), &alpha, B,
                                  static_cast<int>(ldb), A, static_cast<int>(lda), &beta, C,
                                  static_cast<int>(ldc)));
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

float* Upload(const std::vector<float>& host) {
  if (host.empty()) return nullptr;
  float* d = nullptr;
  GEOFP8_CUDA_CHECK(cudaMalloc(&d, host.size() * sizeof(float)));
  GEOFP8_CUDA_CHECK(cudaMemcpy(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
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
  const std::vector<float> fl = geometry::WhitenFactors(g, true), fr = geometry::WhitenFactors(g, false);
  core_[0] = Upload(geometry::SideCore(g.U, g.m, k, fl, false));
  core_[1] = Upload(geometry::SideCore(g.V, g.n, k, fr, false));
  core_[2] = Upload(geometry::SideCore(g.U, g.m, k, fl, true));
  core_[3] = Upload(geometry::SideCore(g.V, g.n, k, fr, true));
  const size_t floats = static_cast<size_t>(k * g.n + g.m * k + 3 * k * k + g.m * 2 * k + 2 * k * g.n);
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

void DeviceGeometry::Transform(float* dG, bool inverse, cudaStream_t stream, cublasContext* handle) {
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
  GEOFP8_CHECK(handle != nullptr, "DeviceGeometry: a cuBLAS handle is required for lowrank");
  cublasHandle_t h = handle;
  GEOFP8_CUBLAS_CHECK(cublasSetStream(h, stream));
  const int64_t k = host_.k, k2 = 2 * k;
  const float* ab = core_[inverse ? 2 : 0];
  const float* bb = core_[inverse ? 3 : 1];
  float* w = scratch_;             // k x n
  float* x = w + k * n;            // m x k
  float* c = x + m * k;            // k x k
  float* abc = c + k * k;          // k x k
  float* t = abc + k * k;          // k x k
  float* left = t + k * k;         // m x 2k
  float* right = left + m * k2;    // 2k x n
  // Same sequence as the CPU path (geometry.cc ApplyLowRank).
  RowMajorGemm(h, true, false, k, n, m, 1.f, u_, k, dG, n, 0.f, w, n);
  RowMajorGemm(h, false, false, m, k, n, 1.f, dG, n, v_, k, 0.f, x, k);
  RowMajorGemm(h, false, false, k, k, n, 1.f, w, n, v_, k, 0.f, c, k);
  RowMajorGemm(h, false, false, k, k, k, 1.f, ab, k, c, k, 0.f, abc, k);
  RowMajorGemm(h, false, false, k, k, k, 1.f, abc, k, bb, k, 0.f, t, k);
  GEOFP8_CUDA_CHECK(cudaMemcpy2DAsync(left, k2 * sizeof(float), u_, k * sizeof(float),
                                      k * sizeof(float), m, cudaMemcpyDeviceToDevice, stream));
  RowMajorGemm(h, false, false, m, k, k, 1.f, x, k, bb, k, 0.f, left + k, k2);
  RowMajorGemm(h, false, false, m, k, k, -1.f, u_, k, t, k, 1.f, left + k, k2);
  RowMajorGemm(h, false, false, k, n, k, 1.f, ab, k, w, n, 0.f, right, n);
  // right rows [k, 2k) = V^T: row-major V (n x k) is column-major k x n; transpose with geam.
  const float one = 1.f, zero = 0.f;
  // geam reads B (aliased to C here) even with beta = 0 on some versions: give it zeros, not NaNs.
  GEOFP8_CUDA_CHECK(cudaMemsetAsync(right + k * n, 0, k * n * sizeof(float), stream));
  GEOFP8_CUBLAS_CHECK(cublasSgeam(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                  static_cast<int>(k), &one, v_, static_cast<int>(k), &zero,
                                  right + k * n, static_cast<int>(n), right + k * n,
                                  static_cast<int>(n)));
  RowMajorGemm(h, false, false, m, n, k2, -1.f, left, k2, right, n, 1.f, dG, n);
}

}  // namespace geofp8::cuda
