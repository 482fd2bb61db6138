// CudaBackend (see cuda_backend.h).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/codec/codec_cuda.h"
#include "kernels/common/check.h"
#include "kernels/common/cuda_check.h"
#include "kernels/exchange/cuda_backend.h"
#include "kernels/geometry/factor_sketch.h"
#include "kernels/geometry/geometry_cuda.h"
#include "kernels/geometry/hadamard_cuda.h"

namespace geofp8::cuda {
namespace {

constexpr unsigned kThreads = 256;

unsigned Blocks(size_t n) {
  const size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 ? (b ? b : 1) : 65535);
}

// y = x / divisor with IEEE division, as the host's Divide (which multiplies by the exact
// reciprocal of a power of two: the same bits); ORs `bit` into *flags where x holds a NaN or inf.
__global__ void DivideKernel(const float* x, float* y, size_t n, float divisor,
                             unsigned long long bit, unsigned long long* flags) {
  bool bad = false;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    bad = bad || !isfinite(v);
    y[i] = __fdiv_rn(v, divisor);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flags, bit);
}

// The same from bf16 or fp16 bits, converted exactly by the host's own per-element code
// (grad_span.h LowpToFloat).
__global__ void DivideLowpKernel(const uint16_t* x, GradDtype dtype, float* y, size_t n,
                                 float divisor, unsigned long long bit, unsigned long long* flags) {
  bool bad = false;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const float v = LowpToFloat(x[i], dtype);
    bad = bad || !isfinite(v);
    y[i] = __fdiv_rn(v, divisor);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flags, bit);
}

// y = x rounded to nearest even in bf16 or fp16, as the host's StoreRounded (grad_span.h
// FloatToLowp, its scalar reference).
__global__ void RoundLowpKernel(const float* x, uint16_t* y, GradDtype dtype, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    y[i] = FloatToLowp(x[i], dtype);
  }
}

__global__ void FillKernel(float* x, size_t n, unsigned bits) {
  const float v = __uint_as_float(bits);
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    x[i] = v;
  }
}

cudaStream_t S(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

CudaBackend::CudaBackend(int device) : device_(device) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    (void)cudaGetLastError();
    devices = 0;
  }
  GEOFP8_CHECK(device >= 0 && device < devices, "device: cuda:", device, " does not exist (",
               devices, " CUDA devices visible)");
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  cudaStream_t s = nullptr;
  GEOFP8_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(S(stream_));
  geometries_.clear();
  if (cublas_) cublasDestroy(static_cast<cublasHandle_t>(cublas_));
  cudaStreamDestroy(S(stream_));
}

uintptr_t CudaBackend::RecordEvent(uintptr_t stream) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  cudaEvent_t e = nullptr;
  GEOFP8_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const cudaError_t rec = cudaEventRecord(e, reinterpret_cast<cudaStream_t>(stream));
  if (rec != cudaSuccess) cudaEventDestroy(e);
  GEOFP8_CUDA_CHECK(rec);
  return reinterpret_cast<uintptr_t>(e);
}

void CudaBackend::WaitForEvent(uintptr_t event) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  auto e = reinterpret_cast<cudaEvent_t>(event);
  const cudaError_t wait = cudaStreamWaitEvent(S(stream_), e, 0);
  cudaEventDestroy(e);  // released once the wait is satisfied
  GEOFP8_CUDA_CHECK(wait);
}

void CudaBackend::ReleaseEvent(uintptr_t event) noexcept {
  cudaSetDevice(device_);
  cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event));
}

void CudaBackend::CheckDeviceMemory(const void* p, const std::string& what) const {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) (void)cudaGetLastError();
  GEOFP8_CHECK(err == cudaSuccess && attr.type == cudaMemoryTypeDevice && attr.device == device_,
               what, ": not device memory of cuda:", device_,
               " (the device this rank's exchange runs on)");
}

void* CudaBackend::Allocate(size_t bytes) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  void* p = nullptr;
  GEOFP8_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
  return p;
}

void CudaBackend::Free(void* device) {
  cudaSetDevice(device_);
  cudaStreamSynchronize(S(stream_));  // no kernel of ours still reads or writes it
  ++host_syncs_;
  cudaFree(device);
}

void CudaBackend::ToHost(void* host, const void* device, size_t bytes) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, S(stream_)));
  ++host_syncs_;
  GEOFP8_CUDA_CHECK(cudaStreamSynchronize(S(stream_)));
}

void CudaBackend::Copy(void* dst, const void* src, size_t bytes) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  if (bytes) {
    GEOFP8_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, S(stream_)));
  }
}

void CudaBackend::Zero(void* device, size_t bytes) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  if (bytes) GEOFP8_CUDA_CHECK(cudaMemsetAsync(device, 0, bytes, S(stream_)));
}

void CudaBackend::ToDevice(void* device, const void* host, size_t bytes) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  // From pageable memory the call returns once the source is staged, so `host` may be reused.
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, S(stream_)));
}

void CudaBackend::Divide(const float* x, float* y, size_t n, float divisor, uint64_t bit,
                         uint64_t* flags) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  if (n == 0) return;
  DivideKernel<<<Blocks(n), kThreads, 0, S(stream_)>>>(
      x, y, n, divisor, bit, reinterpret_cast<unsigned long long*>(flags));
  GEOFP8_CUDA_CHECK(cudaGetLastError());
}

void CudaBackend::DivideLowp(const uint16_t* x, GradDtype dtype, float* y, size_t n, float divisor,
                             uint64_t bit, uint64_t* flags) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  if (n == 0) return;
  DivideLowpKernel<<<Blocks(n), kThreads, 0, S(stream_)>>>(
      x, dtype, y, n, divisor, bit, reinterpret_cast<unsigned long long*>(flags));
  GEOFP8_CUDA_CHECK(cudaGetLastError());
}

void CudaBackend::RoundLowp(const float* x, uint16_t* y, GradDtype dtype, size_t n) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  if (n == 0) return;
  RoundLowpKernel<<<Blocks(n), kThreads, 0, S(stream_)>>>(x, y, dtype, n);
  GEOFP8_CUDA_CHECK(cudaGetLastError());
}

void CudaBackend::Encode(const float* x, size_t n, const CodecOptions& o, uint8_t* out,
                         size_t bytes) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  cuda::EncodeAsync(x, n, o, out, bytes, stream_);
}

void CudaBackend::Decode(const uint8_t* in, size_t bytes, const CodecOptions& o, float* out,
                         size_t n, bool accumulate) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  cuda::DecodeAs(in, bytes, o, out, n, accumulate, stream_);
}

void CudaBackend::Fill(float* x, size_t n, uint32_t bits) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  if (n == 0) return;
  FillKernel<<<Blocks(n), kThreads, 0, S(stream_)>>>(x, n, bits);
  GEOFP8_CUDA_CHECK(cudaGetLastError());
}

DeviceGeometry& CudaBackend::GeometryOf(const BucketLayer& l) {
  // Uploaded once per geometry: a refresh changes the version, an import may change the factors.
  const uint64_t digest = GeometryDigest(*l.geometry);
  Uploaded& u = geometries_[l.layer];
  if (!u.geometry || u.digest != digest) {
    ++host_syncs_;
    GEOFP8_CUDA_CHECK(cudaStreamSynchronize(S(stream_)));  // the old one may be in use
    u.geometry = std::make_unique<DeviceGeometry>(*l.geometry);
    u.digest = digest;
  }
  return *u.geometry;
}

void* CudaBackend::Cublas() {
  if (!cublas_) {
    cublasHandle_t h = nullptr;
    GEOFP8_CHECK(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS, "cuBLAS: cublasCreate failed on ",
                 name());
    cublasSetStream(h, S(stream_));
    cublas_ = h;
  }
  return cublas_;
}

std::unique_ptr<GradientProducts> CudaBackend::Products(const float* g, int64_t m, int64_t n) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  return std::make_unique<DeviceGradient>(g, m, n, S(stream_),
                                          reinterpret_cast<cublasContext*>(Cublas()));
}

std::unique_ptr<GradientProducts> CudaBackend::Snapshot(const float* g, int64_t m, int64_t n) {
  const size_t bytes = size_t(m) * size_t(n) * sizeof(float);
  auto* copy = static_cast<float*>(Allocate(bytes));
  const cudaError_t err = cudaMemcpyAsync(copy, g, bytes, cudaMemcpyDeviceToDevice, S(stream_));
  if (err != cudaSuccess) Free(copy);
  GEOFP8_CUDA_CHECK(err);
  return std::make_unique<DeviceGradient>(copy, m, n, S(stream_),
                                          reinterpret_cast<cublasContext*>(Cublas()),
                                          /*owns=*/true);
}

void CudaBackend::Transform(const BucketLayer& l, float* x, bool inverse) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  const size_t n = l.in.size();
  auto* handle = l.geometry && !l.geometry->is_identity()
                     ? reinterpret_cast<cublasContext*>(Cublas())
                     : nullptr;
  if (!inverse) {
    if (l.geometry && !l.geometry->is_identity()) GeometryOf(l).Apply(x, S(stream_), handle);
    if (l.hadamard_block) {
      HadamardForwardDevice(x, n, int(l.hadamard_block), l.hadamard_seed, 0, S(stream_));
    }
  } else {
    if (l.hadamard_block) {
      HadamardInverseDevice(x, n, int(l.hadamard_block), l.hadamard_seed, 0, S(stream_));
    }
    if (l.geometry && !l.geometry->is_identity()) GeometryOf(l).Invert(x, S(stream_), handle);
  }
}

void CudaBackend::ShardProducts(const BucketLayer& l, int64_t first_row, const float* x, size_t n,
                                float* w) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  if (!l.geometry || l.geometry->is_identity()) return;
  const int64_t rows = static_cast<int64_t>(n) / std::max<int64_t>(l.cols, 1);
  GeometryOf(l).ShardProducts(first_row, x, rows, w, S(stream_),
                              reinterpret_cast<cublasContext*>(Cublas()));
}

void CudaBackend::InvertRows(const BucketLayer& l, int64_t first_row, float* x, size_t n,
                             const float* w) {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  if (!l.geometry || l.geometry->is_identity() || n == 0) return;
  const int64_t rows = static_cast<int64_t>(n) / std::max<int64_t>(l.cols, 1);
  auto* handle = l.geometry->mode == GeometryMode::kLowRank
                     ? reinterpret_cast<cublasContext*>(Cublas())
                     : nullptr;
  GeometryOf(l).InvertRows(first_row, x, rows, w, S(stream_), handle);
}

void CudaBackend::Synchronize() {
  GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  ++host_syncs_;
  GEOFP8_CUDA_CHECK(cudaStreamSynchronize(S(stream_)));
}

}  // namespace geofp8::cuda
