// CUDA path of the geometry: the same T and T^-1 as ApplyGeometry/InvertGeometry on a device
// buffer, with cuBLAS thin GEMMs for lowrank and a GEOFP8_HD element kernel for diag.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/geometry/geometry.h"

// cuBLAS handle type without including cublas_v2.h in every consumer.
struct cublasContext;

namespace geofp8::cuda {

// True when a CUDA device is present (GPU tests skip otherwise).
bool HaveDevice();

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

  const Geometry& host() const { return host_; }

 private:
  void Transform(float* dG, bool inverse, cudaStream_t stream, cublasContext* handle);

  Geometry host_;
  bool identity_ = true;
  float* u_ = nullptr;       // m x k
  float* v_ = nullptr;       // n x k
  float* core_[4] = {};      // left fwd, right fwd, left inv, right inv (k x k each)
  float* row_ = nullptr;     // diag: m
  float* col_ = nullptr;     // diag: n
  float* scratch_ = nullptr;  // W (k x n), X (m x k), C, AbC, T (k x k), left (m x 2k), right (2k x n)
};

}  // namespace geofp8::cuda
