// CUDA kernels of the codec: encode, decode and decode-accumulate on device buffers.
// Entry points validate and pick a kernel; the per-element math is element.h's GEOFP8_HD code,
// so the CPU tests cover the kernels' arithmetic and the GPU test checks bit-identity.
#include <cuda_runtime.h>

#include <cstring>

#include "kernels/codec/codec_cuda.h"
#include "kernels/codec/codec_internal.h"
#include "kernels/codec/element.h"
#include "kernels/codec/warp.cuh"
#include "kernels/common/check.h"
#include "kernels/common/cuda_check.h"

namespace geofp8::cuda {
namespace {

namespace el = element;
using detail::Layout;

constexpr int kThreads = 256;

// Counters the kernels update: non-finite inputs, saturated inputs, finite tensor amax bits.
struct Counters {
  unsigned long long nonfinite;
  unsigned long long saturated;
  unsigned int amax_bits;
};

__device__ inline void StoreF32(uint8_t* p, float v) { memcpy(p, &v, 4); }
__device__ inline float LoadF32(const uint8_t* p) {
  float v;
  memcpy(&v, p, 4);
  return v;
}

__global__ void TensorAmaxKernel(const float* x, size_t n, Counters* c) {
  unsigned m = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    m = max(m, FiniteAbsBits(x[i]));
  }
  m = WarpMax(m);
  if ((threadIdx.x & 31) == 0 && m) atomicMax(&c->amax_bits, m);
}

// fp8 with fp32 scales. One warp per unit of `unit` elements: a scale block (kBlock), or a
// chunk sharing the tensor scale (kTensor) or scale 1 (kNone).
__global__ void EncodeFp8Kernel(const float* x, size_t n, bool e5m2, int scaling, size_t unit,
                                uint8_t* scales, uint8_t* payload, uint64_t key, bool stochastic,
                                Counters* c) {
  const size_t warp = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;
  const unsigned lane = threadIdx.x & 31;
  const size_t b0 = warp * unit;
  if (b0 >= n) return;  // whole warp leaves together
  const size_t b1 = min(n, b0 + unit);
  const float fmt_max = e5m2 ? 57344.f : 448.f;
  float scale = 1.f;
  if (scaling == static_cast<int>(Scaling::kBlock)) {
    unsigned m = 0;
    for (size_t i = b0 + lane; i < b1; i += 32) m = max(m, FiniteAbsBits(x[i]));
    scale = el::ScaleFromAmax(el::BitsFloat(WarpMax(m)), fmt_max);
    if (lane == 0) StoreF32(scales + 4 * warp, scale);
  } else if (scaling == static_cast<int>(Scaling::kTensor)) {
    scale = el::ScaleFromAmax(el::BitsFloat(c->amax_bits), fmt_max);
    if (warp == 0 && lane == 0) StoreF32(scales, scale);
  }
  for (size_t base = b0; base < b1; base += 32) {
    const size_t i = base + lane;
    bool sat = false, nonfinite = false;
    if (i < b1) {
      const float v = x[i];
      nonfinite = !el::IsFinite(v);
      const uint32_t r = stochastic ? el::RandomBits(key, i) : 0u;
      payload[i] = el::EncodeFp8Scaled(e5m2, v, scale, stochastic, r, &sat);
    }
    WarpCount(nonfinite, &c->nonfinite);
    WarpCount(sat, &c->saturated);
  }
}

// mxfp8: one warp per 32-element block, one element per lane.
__global__ void EncodeMxKernel(const float* x, size_t n, uint8_t* scales, uint8_t* payload,
                               uint64_t key, bool stochastic, Counters* c) {
  const size_t warp = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;
  const unsigned lane = threadIdx.x & 31;
  if (warp * 32 >= n) return;
  const size_t i = warp * 32 + lane;
  const bool valid = i < n;
  const float v = valid ? x[i] : 0.f;
  const uint8_t code = el::MxScaleCode(el::BitsFloat(WarpMax(FiniteAbsBits(v))));
  if (lane == 0) scales[warp] = code;
  bool sat = false;
  if (valid) {
    const uint32_t r = stochastic ? el::RandomBits(key, i) : 0u;
    payload[i] = el::EncodeMxElement(v, el::E8M0ToFloat(code), stochastic, r, &sat);
  }
  WarpCount(valid && !el::IsFinite(v), &c->nonfinite);
  WarpCount(sat, &c->saturated);
}

// nvfp4: 16 lanes per block (two blocks per warp), one element per lane; even lanes write a
// byte holding their element in the low nibble and the next element in the high nibble.
__global__ void EncodeNvKernel(const float* x, size_t n, uint8_t* scales, uint8_t* payload,
                               uint64_t key, bool stochastic, Counters* c) {
  const size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  const unsigned lane = threadIdx.x & 31;
  if ((t & ~size_t{31}) >= n) return;  // the warp's first element is past the end
  const size_t i = t;                  // element index; block = i / 16
  const bool valid = i < n;
  const float v = valid ? x[i] : 0.f;
  const float g = el::NvTensorScale(el::BitsFloat(c->amax_bits));
  if (t == 0) StoreF32(scales, g);
  // Reductions within each 16-lane half (xor offsets < 16 stay inside the half).
  unsigned m = FiniteAbsBits(v);
  for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(kFullWarp, m, o));
  const bool nonfinite = valid && !el::IsFinite(v);
  const unsigned ballot = __ballot_sync(kFullWarp, nonfinite);
  const bool block_bad = (ballot >> (lane & 16u)) & 0xFFFFu;
  uint8_t code = 0x7F;
  uint8_t e = 0;
  bool sat = false;
  if (!block_bad) {
    code = el::NvBlockScaleCode(el::BitsFloat(m), g);
    if (valid) {
      const uint32_t r = stochastic ? el::RandomBits(key, i) : 0u;
      e = el::EncodeNvElement(v, el::NvDenominator(code, g), stochastic, r, &sat);
    }
  }
  if ((lane & 15u) == 0 && valid) scales[4 + i / 16] = code;
  const unsigned hi = __shfl_down_sync(kFullWarp, static_cast<unsigned>(e), 1);
  if (valid && (lane & 1u) == 0) {
    payload[i / 2] = static_cast<uint8_t>(e | ((i + 1 < n ? hi : 0u) << 4));
  }
  WarpCount(nonfinite, &c->nonfinite);
  WarpCount(sat, &c->saturated);
}

__global__ void EncodeWideKernel(const float* x, size_t n, bool bf16, uint8_t* payload,
                                 uint64_t key, bool stochastic, Counters* c) {
  const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  bool nonfinite = false, sat = false;
  if (i < n) {
    const float v = x[i];
    const uint32_t a = el::FloatBits(v) & 0x7FFFFFFFu;
    nonfinite = a >= 0x7F800000u;
    if (bf16) {
      sat = !nonfinite && a > 0x7F7F0000u;
      const uint16_t h = el::FloatToBf16(v, stochastic, stochastic ? el::RandomBits(key, i) : 0u);
      payload[2 * i] = static_cast<uint8_t>(h);
      payload[2 * i + 1] = static_cast<uint8_t>(h >> 8);
    } else {
      StoreF32(payload + 4 * i, v);
    }
  }
  WarpCount(nonfinite, &c->nonfinite);
  WarpCount(sat, &c->saturated);
}

// One element per thread. Multiplications and additions use explicit _rn intrinsics so nvcc
// cannot contract them into FMAs: the results must match the CPU bit for bit.
__global__ void DecodeKernel(int format, int scaling, size_t block, const uint8_t* scales,
                             const uint8_t* payload, size_t n, float* out, bool accumulate) {
  const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = 0.f;
  switch (static_cast<Format>(format)) {
    case Format::kFp32:
      v = LoadF32(payload + 4 * i);
      break;
    case Format::kBf16:
      v = el::Bf16ToFloat(static_cast<uint16_t>(payload[2 * i] | (payload[2 * i + 1] << 8)));
      break;
    case Format::kFp8E4M3:
    case Format::kFp8E5M2: {
      v = static_cast<Format>(format) == Format::kFp8E4M3 ? el::E4M3ToFloat(payload[i])
                                                          : el::E5M2ToFloat(payload[i]);
      if (scaling == static_cast<int>(Scaling::kBlock)) {
        v = __fdiv_rn(v, LoadF32(scales + 4 * (i / block)));
      } else if (scaling == static_cast<int>(Scaling::kTensor)) {
        v = __fdiv_rn(v, LoadF32(scales));
      }
      break;
    }
    case Format::kMxfp8:
      v = __fmul_rn(el::E4M3ToFloat(payload[i]), el::E8M0ToFloat(scales[i / 32]));
      break;
    case Format::kNvfp4: {
      const float g = LoadF32(scales);
      const float den = __fmul_rn(el::E4M3ToFloat(scales[4 + i / 16]), g);
      v = __fmul_rn(el::E2M1ToFloat((payload[i / 2] >> (4 * (i & 1))) & 0xF), den);
      break;
    }
  }
  out[i] = accumulate ? __fadd_rn(out[i], v) : v;
}

unsigned Grid(size_t threads) {
  const size_t g = (threads + kThreads - 1) / kThreads;
  GEOFP8_CHECK(g <= 0x7FFFFFFFu, "CUDA grid too large (", g, " blocks)");
  return static_cast<unsigned>(g);
}

}  // namespace

bool DeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

namespace {

// Writes the header of an EncodeAsync: `h` with the non-finite flag its kernels counted.
__global__ void HeaderKernel(EncodedHeader h, const Counters* c, uint8_t* out) {
  h.flags = c->nonfinite ? kFlagNonFinite : 0;
  const auto* bytes = reinterpret_cast<const uint8_t*>(&h);
  for (size_t i = 0; i < sizeof h; ++i) out[i] = bytes[i];  // `out` may be unaligned
}

// The encode's kernels on `stream`, into counters of its own (returned, stream-ordered memory):
// everything but the header.
Counters* LaunchEncode(const float* x, size_t n, const CodecOptions& options, uint8_t* out,
                       size_t out_bytes, cudaStream_t stream) {
  const Layout l = detail::MakeLayout(options, n);
  const size_t total = sizeof(EncodedHeader) + l.scale_bytes + l.payload_bytes;
  GEOFP8_CHECK(out_bytes >= total, "cuda encode: output buffer holds ", out_bytes, " bytes, needs ",
               total);
  uint8_t* scales = out + sizeof(EncodedHeader);
  uint8_t* payload = scales + l.scale_bytes;
  const bool stochastic = options.rounding == Rounding::kStochastic;
  const uint64_t key = el::StreamKey(options.seed, options.step, options.layer, options.rank);

  Counters* c = nullptr;
  GEOFP8_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&c), sizeof(Counters), stream));
  GEOFP8_CUDA_CHECK(cudaMemsetAsync(c, 0, sizeof(Counters), stream));
  const bool need_amax = l.format == Format::kNvfp4 ||
                         ((l.format == Format::kFp8E4M3 || l.format == Format::kFp8E5M2) &&
                          l.scaling == Scaling::kTensor);
  if (need_amax && n) {
    TensorAmaxKernel<<<std::min(Grid(n), 1024u), kThreads, 0, stream>>>(x, n, c);
  }
  switch (l.format) {
    case Format::kFp32:
    case Format::kBf16:
      if (n) {
        EncodeWideKernel<<<Grid(n), kThreads, 0, stream>>>(x, n, l.format == Format::kBf16, payload,
                                                           key, stochastic, c);
      }
      break;
    case Format::kFp8E4M3:
    case Format::kFp8E5M2: {
      const size_t unit = l.scaling == Scaling::kBlock ? l.block : 4096;
      const size_t warps = (n + unit - 1) / unit;
      if (warps) {
        EncodeFp8Kernel<<<Grid(warps * 32), kThreads, 0, stream>>>(
            x, n, l.format == Format::kFp8E5M2, static_cast<int>(l.scaling), unit, scales, payload,
            key, stochastic, c);
      } else if (l.scaling == Scaling::kTensor) {
        static const float kOne = 1.f;
        GEOFP8_CUDA_CHECK(cudaMemcpyAsync(scales, &kOne, 4, cudaMemcpyHostToDevice, stream));
      }
      break;
    }
    case Format::kMxfp8:
      if (n) {
        EncodeMxKernel<<<Grid(l.num_blocks * 32), kThreads, 0, stream>>>(x, n, scales, payload, key,
                                                                         stochastic, c);
      }
      break;
    case Format::kNvfp4:
      if (n) {
        EncodeNvKernel<<<Grid(l.num_blocks * 16), kThreads, 0, stream>>>(x, n, scales, payload, key,
                                                                         stochastic, c);
      } else {
        static const float kOne = 1.f;
        GEOFP8_CUDA_CHECK(cudaMemcpyAsync(scales, &kOne, 4, cudaMemcpyHostToDevice, stream));
      }
      break;
  }
  GEOFP8_CUDA_CHECK(cudaGetLastError());
  return c;
}

EncodedHeader HeaderOf(const CodecOptions& options, size_t n) {
  const Layout l = detail::MakeLayout(options, n);
  EncodedHeader h;
  h.format = static_cast<uint8_t>(l.format);
  h.scaling = static_cast<uint8_t>(l.scaling);
  h.block = l.block;
  h.count = n;
  return h;
}

}  // namespace

EncodeStats Encode(const float* x, size_t n, const CodecOptions& options, uint8_t* out,
                   size_t out_bytes, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  Counters* c = LaunchEncode(x, n, options, out, out_bytes, stream);
  Counters host{};
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(&host, c, sizeof(Counters), cudaMemcpyDeviceToHost, stream));
  GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream));
  GEOFP8_CUDA_CHECK(cudaFreeAsync(c, stream));

  EncodedHeader h = HeaderOf(options, n);
  h.flags = host.nonfinite ? kFlagNonFinite : 0;
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(out, &h, sizeof(h), cudaMemcpyHostToDevice, stream));
  GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream));  // h lives on this stack frame
  EncodeStats st;
  st.nonfinite = host.nonfinite;
  st.saturated = host.saturated;
  return st;
}

void EncodeAsync(const float* x, size_t n, const CodecOptions& options, uint8_t* out,
                 size_t out_bytes, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  Counters* c = LaunchEncode(x, n, options, out, out_bytes, stream);
  HeaderKernel<<<1, 1, 0, stream>>>(HeaderOf(options, n), c, out);
  GEOFP8_CUDA_CHECK(cudaGetLastError());
  GEOFP8_CUDA_CHECK(cudaFreeAsync(c, stream));
}

void DecodeAs(const uint8_t* in, size_t in_bytes, const CodecOptions& options, float* out, size_t n,
              bool accumulate, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const Layout l = detail::MakeLayout(options, n);
  const size_t need = sizeof(EncodedHeader) + l.scale_bytes + l.payload_bytes;
  GEOFP8_CHECK(in_bytes >= need, "cuda decode: truncated buffer (", in_bytes, " bytes, need ", need,
               ")");
  if (n == 0) return;
  const uint8_t* scales = in + sizeof(EncodedHeader);
  DecodeKernel<<<Grid(n), kThreads, 0, stream>>>(
      static_cast<int>(l.format), static_cast<int>(l.scaling), l.block ? l.block : 1, scales,
      scales + l.scale_bytes, n, out, accumulate);
  GEOFP8_CUDA_CHECK(cudaGetLastError());
}

void Decode(const uint8_t* in, size_t in_bytes, float* out, size_t n, bool accumulate,
            void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  GEOFP8_CHECK(in_bytes >= sizeof(EncodedHeader), "cuda decode: truncated header (", in_bytes,
               " bytes)");
  EncodedHeader h;
  GEOFP8_CUDA_CHECK(cudaMemcpyAsync(&h, in, sizeof(h), cudaMemcpyDeviceToHost, stream));
  GEOFP8_CUDA_CHECK(cudaStreamSynchronize(stream));
  const size_t need = detail::ValidateHeader(h);
  const Layout l = detail::MakeLayout(static_cast<Format>(h.format),
                                      static_cast<Scaling>(h.scaling), h.block, h.count);
  GEOFP8_CHECK(in_bytes >= need, "cuda decode: truncated buffer (", in_bytes, " bytes, need ", need,
               ")");
  GEOFP8_CHECK(n == h.count, "cuda decode: output holds ", n, " floats but the buffer encodes ",
               h.count);
  if (n == 0) return;
  const uint8_t* scales = in + sizeof(EncodedHeader);
  DecodeKernel<<<Grid(n), kThreads, 0, stream>>>(h.format, h.scaling, l.block ? l.block : 1, scales,
                                                 scales + l.scale_bytes, n, out, accumulate);
  GEOFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace geofp8::cuda
