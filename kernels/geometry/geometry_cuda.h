// CUDA path of the geometry: the same T and T^-1 as ApplyGeometry/InvertGeometry on a device
// buffer, with cuBLAS thin GEMMs for lowrank and a GEOFP8_HD element kernel for diag, and the
// device counterpart of EncodeWithGeometry (fused.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "kernels/codec/codec.h"
#include "kernels/geometry/factor_sketch.h"
#include "kernels/geometry/geometry.h"

// cuBLAS handle type without including cublas_v2.h in every consumer.
struct cublasContext;

namespace geofp8::cuda {

// True when a CUDA device is present (GPU tests skip otherwise).
bool HaveDevice();

// One encode of a fused device pass: elements [begin, end) of T(G) (row-major, flattened) encoded
// with `options` into the device buffer `out` of out_bytes >= EncodedBytes(options, end - begin).
struct DeviceEncodeTarget {
  size_t begin = 0, end = 0;
  CodecOptions options;
  uint8_t* out = nullptr;
  size_t out_bytes = 0;
  EncodeStats stats;  // filled in
};

// A geometry uploaded to the device once per refresh: bases, the forward and inverse k x k cores
// (computed on the host by the CPU path's code, geometry::SideCore), diag scales, and scratch for
// one transform at a time. Not thread-safe; use one per stream.
class DeviceGeometry {
 public:
  explicit DeviceGeometry(const Geometry& g);
  ~DeviceGeometry();
  DeviceGeometry(const DeviceGeometry&) = delete;
  DeviceGeometry& operator=(const DeviceGeometry&) = delete;

  // In place on dG (m x n row-major, device memory), ordered on `stream`.
  void Apply(float* dG, cudaStream_t stream, cublasContext* handle);
  void Invert(float* dG, cudaStream_t stream, cublasContext* handle);

  // EncodeWithGeometry on the device: T(dG) encoded into every target, dG left unchanged. For
  // fp8 (e4m3, e5m2) with block scaling, the last step of T (the rank-2k update, or the diag
  // scaling) runs inside the quantization kernel, one warp per scale block, so T(dG) is never
  // written to memory. Other codecs transform a scratch copy and call cuda::Encode. The wire
  // bytes equal the host reference of the kernel's math (geometry_math.h LowRankUpdateElement
  // with the device's update factors); against the CPU path they differ within float round-off
  // of T, since cuBLAS and OpenBLAS sum in other orders: every rank must use the same path.
  // Synchronizes `stream` to read the stats.
  void EncodeFused(const float* dG, std::span<DeviceEncodeTarget> targets, cudaStream_t stream,
                   cublasContext* handle);

  // A reduce-scatter's row-local pieces (geometry.h ShardColumnProducts and InvertGeometryRows)
  // on `len` rows of the layer from row r0 (row-major, n columns, device memory), ordered on
  // `stream`: w (device, ShardProductRows x n) = U[r0 .., :]^T rows, this shard's share of
  // W = U^T D (zeros for no rows); and T^-1 in place on the rows, w the sum of every shard's
  // share (lowrank; unused by diag, whose inverse is row-local). The same GEMM sequence as the
  // CPU path, on cuBLAS (its round-off, as Invert's).
  void ShardProducts(int64_t r0, const float* rows, int64_t len, float* w, cudaStream_t stream,
                     cublasContext* handle);
  void InvertRows(int64_t r0, float* rows, int64_t len, const float* w, cudaStream_t stream,
                  cublasContext* handle);

  // The device's rank-2k update factors of T (left m x 2k, right 2k x n, row-major) for dG, as
  // EncodeFused uses them; for tests that rebuild its output on the host. Lowrank only.
  void DownloadUpdate(const float* dG, std::vector<float>* left, std::vector<float>* right,
                      cudaStream_t stream, cublasContext* handle);

  const Geometry& host() const { return host_; }

 private:
  void Transform(float* dG, bool inverse, cudaStream_t stream, cublasContext* handle);
  // Stage A of lowrank: fills the scratch's left and right factors for dG (read only).
  void PrepareUpdate(const float* dG, bool inverse, cudaStream_t stream, cublasContext* handle);

  Geometry host_;
  bool identity_ = true;
  float* u_ = nullptr;    // m x k
  float* v_ = nullptr;    // n x k
  float* core_[4] = {};   // left fwd, right fwd, left inv, right inv (k x k each)
  float* row_ = nullptr;  // diag: m
  float* col_ = nullptr;  // diag: n
  float* scratch_ =
      nullptr;  // W (k x n), X (m x k), C, AbC, T (k x k), left (m x 2k), right (2k x n)
};

// G in device memory (row-major m x n at dG) for the factor sketch's update (factor_sketch.h):
// both thin products run on the device with cuBLAS, and only their thin operands and results
// cross to the host, (m + n) c floats for c columns instead of G's m n. ||G||^2 is a fixed-order
// reduction (per-block sums of squares in double, then summed on the host in block order), so
// one dG gives the same bits on every run and every rank of one GPU model. Ordered on `stream`;
// each call returns with its results on the host. Not thread-safe. `owns`: dG is a cudaMalloc'd
// copy (a deferred refresh's snapshot) that the destructor frees.
class DeviceGradient final : public GradientProducts {
 public:
  DeviceGradient(const float* dG, int64_t m, int64_t n, cudaStream_t stream, cublasContext* handle,
                 bool owns = false);
  ~DeviceGradient() override;
  DeviceGradient(const DeviceGradient&) = delete;
  DeviceGradient& operator=(const DeviceGradient&) = delete;

  double ProductAndNorm(const float* x, int ldx, float* y) override;
  void TransposeProduct(const float* q, int c, float* bt) override;
  int64_t FindNonFinite() override;

 private:
  float* Scratch(size_t floats);  // device: operand then result, grown as needed
  cublasContext* Handle();        // the handle, set to stream_

  const float* dG_;
  bool owns_;
  int64_t m_, n_;
  cudaStream_t stream_;
  cublasContext* handle_;
  float* scratch_ = nullptr;
  size_t scratch_floats_ = 0;
  double* partial_ = nullptr;  // kNormBlocks sums of squares
};

}  // namespace geofp8::cuda
