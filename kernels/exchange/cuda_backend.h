// The CUDA DeviceBackend of the exchange engine's StagedPlane (data_plane.h): the codec kernels
// of kernels/codec/codec_cuda.h, the geometry of kernels/geometry/geometry_cuda.h (cuBLAS) and
// the rotation of hadamard_cuda.h, on one stream of one device. With it an Exchanger averages
// gradients that live in device memory over any Communicator (NCCL, or Gloo through host
// memory), through the same algorithms, fingerprints, timeouts and abort as on the host.
//
// Bits: the codec and the rotation are bit-identical to the host's (shared GEOFP8_HD math); the
// lowrank geometry's products run on cuBLAS, whose sums differ from OpenBLAS's in round-off, so
// every rank of an exchange must use this backend (the plane kind is the same on every rank,
// and the geometries themselves, estimated on the host from a host copy of the identical
// averaged gradient, are checked by the fingerprint's digest). cuBLAS documents bit-wise
// reproducible GEMM results for one toolkit on GPUs of the same architecture and SM count (its
// "Results reproducibility" section; one stream per handle, as here), so ranks on identical
// GPUs agree bit for bit.
//
// Compiled when the build has CUDA and cuBLAS (geofp8_exchange_cuda); this header has no CUDA
// types.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "kernels/exchange/data_plane.h"

namespace geofp8::cuda {

class DeviceGeometry;

class CudaBackend final : public DeviceBackend {
 public:
  // On CUDA device `device` (>= 0), on a stream of its own. Throws geofp8::Error naming the
  // device if it does not exist.
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return "cuda:" + std::to_string(device_); }
  int device() const { return device_; }
  // This backend's stream (a cudaStream_t as an integer), which NCCL's byte collectives order
  // with when they move its memory (NcclOptions::stream).
  uintptr_t stream() const { return reinterpret_cast<uintptr_t>(stream_); }

  // An event (cudaEvent_t as an integer) recorded now on `stream` (a cudaStream_t as an integer;
  // 0: the legacy default stream), after the backward kernels that wrote a bucket, say; and a
  // wait for it on this backend's stream, which then starts nothing before that work is done.
  // WaitForEvent destroys the event. Either may be called from any thread.
  uintptr_t RecordEvent(uintptr_t stream);
  void WaitForEvent(uintptr_t event);
  // Destroys an event of RecordEvent that will not be waited for. Never throws.
  void ReleaseEvent(uintptr_t event) noexcept;
  // Throws geofp8::Error naming `what` unless p points into device memory of this device.
  void CheckDeviceMemory(const void* p, const std::string& what) const;

  void* Allocate(size_t bytes) override;
  void Free(void* device) override;
  void ToHost(void* host, const void* device, size_t bytes) override;
  void ToDevice(void* device, const void* host, size_t bytes) override;
  void Copy(void* dst, const void* src, size_t bytes) override;
  void Zero(void* device, size_t bytes) override;
  void Divide(const float* x, float* y, size_t n, float divisor, uint64_t bit,
              uint64_t* flags) override;
  void DivideLowp(const uint16_t* x, GradDtype dtype, float* y, size_t n, float divisor,
                  uint64_t bit, uint64_t* flags) override;
  void RoundLowp(const float* x, uint16_t* y, GradDtype dtype, size_t n) override;
  void Encode(const float* x, size_t n, const CodecOptions& o, uint8_t* out, size_t bytes) override;
  void Decode(const uint8_t* in, size_t bytes, const CodecOptions& o, float* out, size_t n,
              bool accumulate) override;
  void Fill(float* x, size_t n, uint32_t bits) override;
  void Transform(const BucketLayer& l, float* x, bool inverse) override;
  // DeviceGeometry::ShardProducts and InvertRows (cuBLAS for lowrank, the diag element kernel).
  void ShardProducts(const BucketLayer& l, int64_t first_row, const float* x, size_t n,
                     float* w) override;
  void InvertRows(const BucketLayer& l, int64_t first_row, float* x, size_t n,
                  const float* w) override;
  void Synchronize() override;
  // cuda::DeviceGradient (geometry_cuda.h) on this backend's stream.
  std::unique_ptr<GradientProducts> Products(const float* g, int64_t m, int64_t n) override;
  // The same over a device copy of g (device-to-device, on the stream), freed with it
  // (DeviceGradient's `owns`).
  std::unique_ptr<GradientProducts> Snapshot(const float* g, int64_t m, int64_t n) override;

 private:
  struct Uploaded {
    uint64_t digest = 0;
    std::unique_ptr<DeviceGeometry> geometry;
  };
  DeviceGeometry& GeometryOf(const BucketLayer& l);
  void* Cublas();  // cublasHandle_t on stream_, created on first use

  int device_ = 0;
  void* stream_ = nullptr;  // cudaStream_t
  void* cublas_ = nullptr;  // cublasHandle_t, created with the first lowrank transform
  std::map<uint32_t, Uploaded> geometries_;  // by BucketLayer::layer
};

}  // namespace geofp8::cuda
