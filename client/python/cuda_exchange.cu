// The CUDA/NCCL path of geofp8.torch (see cuda_exchange.h).
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <string>
#include <thread>

#include "client/python/cuda_exchange.h"
#include "kernels/codec/codec.h"
#include "kernels/codec/codec_cuda.h"
#include "kernels/common/check.h"
#include "kernels/common/cuda_check.h"
#include "kernels/exchange/chunking.h"

#define GEOFP8_NCCL_CHECK(expr)                                                           \
  do {                                                                                    \
    const ncclResult_t geofp8_res = (expr);                                               \
    GEOFP8_CHECK(geofp8_res == ncclSuccess, #expr, ": ", ncclGetErrorString(geofp8_res)); \
  } while (0)

namespace geofp8::python {

namespace {

constexpr unsigned kThreads = 256;

unsigned Blocks(size_t n) {
  const size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 ? (b ? b : 1) : 65535);
}

// y = x / divisor (IEEE division, as the CPU engine's Divide), noting any NaN or inf in x.
__global__ void DivideKernel(const float* x, float* y, size_t n, float divisor,
                             unsigned long long* nonfinite) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    if (!isfinite(v)) atomicOr(nonfinite, 1ull);
    y[i] = __fdiv_rn(v, divisor);
  }
}

// The control words max-reduced with every bucket: [0] the non-finite flag, [1] the fingerprint,
// [2] its complement. Every rank holds the same fingerprint iff max([1]) == ~max([2]).
constexpr int kControlWords = 3;

}  // namespace

struct CudaExchange::Impl {
  ncclComm_t comm = nullptr;
  int device = 0, rank = 0, size = 1;
  std::chrono::milliseconds timeout{};
  bool broken = false;
  uint8_t* mine = nullptr;  // this rank's encoded bucket
  size_t mine_cap = 0;
  uint8_t* all = nullptr;  // every rank's, rank order
  size_t all_cap = 0;
  float* divided = nullptr;  // one layer divided by N, to encode
  size_t divided_cap = 0;
  unsigned long long* control = nullptr;  // kControlWords

  template <typename T>
  void Reserve(T*& p, size_t& cap, size_t count) {
    if (count <= cap) return;
    if (p) GEOFP8_CUDA_CHECK(cudaFree(p));
    p = nullptr;
    GEOFP8_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), count * sizeof(T)));
    cap = count;
  }

  // Waits for `stream` against the timeout, aborting the communicator on an asynchronous NCCL
  // error or when it runs out.
  void Wait(cudaStream_t stream, const char* op) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) {
        broken = true;
        GEOFP8_FAIL("nccl ", op, " failed on rank ", rank, ": ", cudaGetErrorString(q));
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        broken = true;
        GEOFP8_FAIL("nccl ", op, " failed on rank ", rank, ": ", ncclGetErrorString(async));
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        broken = true;
        GEOFP8_FAIL("nccl ", op, " on rank ", rank, " timed out after ", timeout.count(), " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
};

CudaExchange::CudaExchange(Store& store, int rank, int size, int device,
                           std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>()) {
  GEOFP8_CHECK(size >= 1, "nccl: size must be >= 1 (", size, ")");
  GEOFP8_CHECK(rank >= 0 && rank < size, "nccl: rank must be in [0, ", size, ") (", rank, ")");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    (void)cudaGetLastError();
    devices = 0;
  }
  GEOFP8_CHECK(devices > 0, "device: no CUDA device visible on rank ", rank);
  const int dev = device >= 0 ? device : rank % devices;
  GEOFP8_CHECK(dev < devices, "device: cuda:", dev, " out of range (", devices, " devices)");
  GEOFP8_CUDA_CHECK(cudaSetDevice(dev));
  ncclUniqueId id;
  const std::string key = "nccl_unique_id";
  if (rank == 0) {
    GEOFP8_NCCL_CHECK(ncclGetUniqueId(&id));
    store.Set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                        reinterpret_cast<uint8_t*>(&id) + sizeof id));
  } else {
    const std::vector<uint8_t> bytes = store.Get(key, timeout);
    GEOFP8_CHECK(bytes.size() == sizeof id, "nccl: unique id under '", key, "' has ", bytes.size(),
                 " bytes, expected ", sizeof id);
    std::memcpy(&id, bytes.data(), sizeof id);
  }
  GEOFP8_NCCL_CHECK(ncclCommInitRank(&impl_->comm, size, id, rank));
  impl_->device = dev;
  impl_->rank = rank;
  impl_->size = size;
  impl_->timeout = timeout;
  GEOFP8_CUDA_CHECK(
      cudaMalloc(reinterpret_cast<void**>(&impl_->control), kControlWords * sizeof(uint64_t)));
}

CudaExchange::~CudaExchange() {
  Impl& m = *impl_;
  cudaSetDevice(m.device);
  if (m.comm) {
    if (m.broken) {
      ncclCommAbort(m.comm);
    } else {
      ncclCommDestroy(m.comm);
    }
  }
  cudaFree(m.mine);
  cudaFree(m.all);
  cudaFree(m.divided);
  cudaFree(m.control);
}

int CudaExchange::device() const { return impl_->device; }

CudaResult CudaExchange::Exchange(uint64_t step, uint64_t seed, uint64_t fingerprint,
                                  Algorithm algorithm, uintptr_t bucket_ptr, int64_t numel,
                                  const std::vector<CudaLayer>& layers, uintptr_t stream_handle) {
  Impl& m = *impl_;
  const auto start = std::chrono::steady_clock::now();
  GEOFP8_CHECK(!m.broken, "nccl on rank ", m.rank,
               ": communicator is broken by an earlier failure");
  GEOFP8_CHECK(algorithm == Algorithm::kAuto || algorithm == Algorithm::kTwoPhase ||
                   algorithm == Algorithm::kAllGather || algorithm == Algorithm::kFp32,
               "exchange.algorithm: ", AlgorithmName(algorithm),
               " is not available on CUDA tensors (accepted there: auto, two_phase and allgather, "
               "which all run as allgather, and fp32)");
  GEOFP8_CHECK(numel >= 0 && !layers.empty(), "exchange: ", layers.size(),
               " layers in a bucket of ", numel, " floats");
  GEOFP8_CUDA_CHECK(cudaSetDevice(m.device));
  float* bucket = reinterpret_cast<float*>(bucket_ptr);
  cudaPointerAttributes attr{};
  GEOFP8_CUDA_CHECK(cudaPointerGetAttributes(&attr, bucket));
  GEOFP8_CHECK(attr.type == cudaMemoryTypeDevice && attr.device == m.device,
               "device: the bucket is not device memory of cuda:", m.device,
               " (the device this rank's NCCL communicator uses)");
  for (const CudaLayer& l : layers) {
    GEOFP8_CHECK(l.offset >= 0 && l.count >= 0 && l.offset + l.count <= numel, "exchange: layer ",
                 l.id, " at offset ", l.offset, " + ", l.count, " is outside the bucket of ", numel,
                 " floats");
  }
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const float divisor = static_cast<float>(m.size);
  const uint64_t n = static_cast<uint64_t>(m.size);
  CudaResult result;
  uint64_t host_control[kControlWords] = {0, fingerprint, ~fingerprint};
  GEOFP8_CUDA_CHECK(cudaMemsetAsync(m.control, 0, sizeof(uint64_t), stream));

  if (algorithm == Algorithm::kFp32) {
    // Divide in place (the CPU baseline divides as it flattens), then one sum.
    for (const CudaLayer& l : layers) {
      if (l.count == 0) continue;
      DivideKernel<<<Blocks(l.count), kThreads, 0, stream>>>(
          bucket + l.offset, bucket + l.offset, static_cast<size_t>(l.count), divisor, m.control);
    }
    GEOFP8_CUDA_CHECK(cudaGetLastError());
    GEOFP8_CUDA_CHECK(cudaMemcpyAsync(m.control + 1, host_control + 1, 2 * sizeof(uint64_t),
                                      cudaMemcpyHostToDevice, stream));
    try {
      GEOFP8_NCCL_CHECK(ncclGroupStart());
      GEOFP8_NCCL_CHECK(ncclAllReduce(bucket, bucket, static_cast<size_t>(numel), ncclFloat32,
                                      ncclSum, m.comm, stream));
      GEOFP8_NCCL_CHECK(
          ncclAllReduce(m.control, m.control, kControlWords, ncclUint64, ncclMax, m.comm, stream));
      GEOFP8_NCCL_CHECK(ncclGroupEnd());
    } catch (const Error&) {
      m.broken = true;
      throw;
    }
    result.bytes_sent = 2 * (n - 1) * (static_cast<uint64_t>(numel) * 4 + kControlWords * 8) / n;
  } else {
    // allgather: encode every layer once, divided by N.
    std::vector<size_t> bytes(layers.size());
    size_t total = 0;
    int64_t longest = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
      const CodecOptions o = LayerCodecOptions(layers[i].policy, seed, step, layers[i].id,
                                               static_cast<uint32_t>(m.rank), 1, 0);
      const std::string bad = ValidateCodecOptions(o);
      GEOFP8_CHECK(bad.empty(), "policy of layer ", layers[i].id, ": ", bad);
      bytes[i] = EncodedBytes(o, static_cast<size_t>(layers[i].count));
      total += bytes[i];
      longest = std::max(longest, layers[i].count);
    }
    m.Reserve(m.mine, m.mine_cap, total);
    m.Reserve(m.all, m.all_cap, total * m.size);
    m.Reserve(m.divided, m.divided_cap, static_cast<size_t>(std::max<int64_t>(longest, 1)));
    size_t off = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
      const CudaLayer& l = layers[i];
      if (l.count) {
        DivideKernel<<<Blocks(l.count), kThreads, 0, stream>>>(
            bucket + l.offset, m.divided, static_cast<size_t>(l.count), divisor, m.control);
        GEOFP8_CUDA_CHECK(cudaGetLastError());
      }
      const CodecOptions o =
          LayerCodecOptions(l.policy, seed, step, l.id, static_cast<uint32_t>(m.rank), 1, 0);
      // Synchronizes the stream (it returns the encode's counters).
      const EncodeStats st =
          cuda::Encode(m.divided, static_cast<size_t>(l.count), o, m.mine + off, bytes[i], stream);
      if (st.nonfinite) host_control[0] = 1;
      off += bytes[i];
    }
    GEOFP8_CUDA_CHECK(cudaMemcpyAsync(m.control, host_control, sizeof host_control,
                                      cudaMemcpyHostToDevice, stream));
    try {
      GEOFP8_NCCL_CHECK(ncclGroupStart());
      GEOFP8_NCCL_CHECK(ncclAllGather(m.mine, m.all, total, ncclUint8, m.comm, stream));
      GEOFP8_NCCL_CHECK(
          ncclAllReduce(m.control, m.control, kControlWords, ncclUint64, ncclMax, m.comm, stream));
      GEOFP8_NCCL_CHECK(ncclGroupEnd());
    } catch (const Error&) {
      m.broken = true;
      throw;
    }
    result.bytes_sent = (n - 1) * total + 2 * (n - 1) * kControlWords * 8 / n;
    m.Wait(stream, "allgather");
    uint64_t agreed[kControlWords];
    GEOFP8_CUDA_CHECK(
        cudaMemcpyAsync(agreed, m.control, sizeof agreed, cudaMemcpyDeviceToHost, stream));
    GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream));
    GEOFP8_CHECK(agreed[1] == ~agreed[2], "fingerprint: the ranks disagree on step ", step,
                 ", the policy version or the bucket's layers (rank ", m.rank, ")");
    result.skipped = agreed[0] != 0;
    if (!result.skipped) {
      // Every rank sums the same bytes in rank order: identical bits everywhere.
      off = 0;
      for (size_t i = 0; i < layers.size(); ++i) {
        const CudaLayer& l = layers[i];
        float* out = bucket + l.offset;
        GEOFP8_CUDA_CHECK(cudaMemsetAsync(out, 0, l.count * sizeof(float), stream));
        for (int src = 0; src < m.size; ++src) {
          cuda::Decode(m.all + src * total + off, bytes[i], out, static_cast<size_t>(l.count),
                       /*accumulate=*/true, stream);
        }
        off += bytes[i];
      }
    }
  }
  m.Wait(stream, algorithm == Algorithm::kFp32 ? "allreduce fp32" : "decode");
  if (algorithm == Algorithm::kFp32) {
    uint64_t agreed[kControlWords];
    GEOFP8_CUDA_CHECK(
        cudaMemcpyAsync(agreed, m.control, sizeof agreed, cudaMemcpyDeviceToHost, stream));
    GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream));
    GEOFP8_CHECK(agreed[1] == ~agreed[2], "fingerprint: the ranks disagree on step ", step,
                 ", the policy version or the bucket's layers (rank ", m.rank, ")");
    result.skipped = agreed[0] != 0;
  }
  if (result.skipped) {
    // Every layer NaN (all-ones bits), so a GradScaler or finiteness check skips the step.
    for (const CudaLayer& l : layers) {
      GEOFP8_CUDA_CHECK(cudaMemsetAsync(bucket + l.offset, 0xFF, l.count * sizeof(float), stream));
    }
    GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

uint64_t CudaExchange::MinOverRanks(uint64_t value, uintptr_t stream_handle) {
  Impl& m = *impl_;
  GEOFP8_CHECK(!m.broken, "nccl on rank ", m.rank,
               ": communicator is broken by an earlier failure");
  GEOFP8_CUDA_CHECK(cudaSetDevice(m.device));
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  // The control words' last slot: Exchange rewrites all of them before every use.
  unsigned long long* word = m.control + (kControlWords - 1);
  GEOFP8_CUDA_CHECK(
      cudaMemcpyAsync(word, &value, sizeof(uint64_t), cudaMemcpyHostToDevice, stream));
  try {
    GEOFP8_NCCL_CHECK(ncclAllReduce(word, word, 1, ncclUint64, ncclMin, m.comm, stream));
  } catch (const Error&) {
    m.broken = true;
    throw;
  }
  m.Wait(stream, "agree_min");
  uint64_t agreed = 0;
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(&agreed, word, sizeof agreed, cudaMemcpyDeviceToHost, stream));
  GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream));
  return agreed;
}

}  // namespace geofp8::python
