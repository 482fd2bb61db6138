// CUDA codec against the CPU path (ctest label gpu; skips without a device): identical encoded
// bytes and stats, identical decode and decode-accumulate bits, over shapes 0, 1, 5x160, 217x256.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/codec/codec_cuda.h"
#include "kernels/codec/element.h"
#include "kernels/common/check.h"

namespace geofp8 {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

template <typename T>
struct DeviceBuffer {
  explicit DeviceBuffer(size_t count) : n(count) {
    if (cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  T* ptr = nullptr;
  size_t n;
};

std::vector<float> Data(size_t n, uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  std::uniform_int_distribution<int> e(-20, 20);
  std::vector<float> x(n);
  for (auto& v : x) v = std::ldexp(g(rng), e(rng) / 4);
  if (specials && n > 100) {
    x[7] = std::numeric_limits<float>::quiet_NaN();
    x[40] = std::numeric_limits<float>::infinity();
    x[99] = -std::numeric_limits<float>::infinity();
    x[50] = 0.f;
    x[51] = -0.f;
    x[60] = 1e-44f;
  }
  return x;
}

std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    b[i] = std::isnan(v[i]) ? 0x7FC00000u : element::FloatBits(v[i]);
  }
  return b;
}

TEST(CodecGpu, MatchesCpuBitForBit) {
  if (!cuda::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const size_t shapes[] = {0, 1, 5 * 160, 217 * 256};
  const Format formats[] = {Format::kFp32,    Format::kBf16,  Format::kFp8E4M3,
                            Format::kFp8E5M2, Format::kMxfp8, Format::kNvfp4};
  for (size_t n : shapes) {
    for (bool specials : {false, true}) {
      const std::vector<float> x = Data(n, static_cast<uint32_t>(n + specials), specials);
      DeviceBuffer<float> dx(n), dy(n);
      ASSERT_TRUE(dx.ptr && dy.ptr);
      CUDA_OK(cudaMemcpy(dx.ptr, x.data(), n * 4, cudaMemcpyHostToDevice));
      for (Format f : formats) {
        for (Scaling s : {Scaling::kNone, Scaling::kTensor, Scaling::kBlock}) {
          for (uint32_t block : {32u, 128u, 100u}) {
            for (Rounding r : {Rounding::kNearest, Rounding::kStochastic}) {
              CodecOptions o;
              o.format = f;
              o.scaling = s;
              o.block = block;
              o.rounding = r;
              o.seed = 3;
              o.step = 4;
              o.layer = 5;
              o.rank = 6;
              const std::string where =
                  std::string(FormatName(f)) + "/" + std::string(ScalingName(s)) + "/" +
                  std::string(RoundingName(r)) + " block " + std::to_string(block) + " n " +
                  std::to_string(n) + (specials ? " specials" : "");
              const size_t bytes = EncodedBytes(o, n);
              std::vector<uint8_t> cpu(bytes);
              const EncodeStats cs = Encode(x, o, cpu);
              DeviceBuffer<uint8_t> denc(bytes);
              ASSERT_TRUE(denc.ptr);
              const EncodeStats gs = cuda::Encode(dx.ptr, n, o, denc.ptr, bytes);
              std::vector<uint8_t> gpu(bytes);
              CUDA_OK(cudaMemcpy(gpu.data(), denc.ptr, bytes, cudaMemcpyDeviceToHost));
              ASSERT_EQ(gpu, cpu) << where;
              ASSERT_EQ(gs.nonfinite, cs.nonfinite) << where;
              ASSERT_EQ(gs.saturated, cs.saturated) << where;
              // Decode and decode-accumulate the (identical) buffer on both sides.
              std::vector<float> want(n), got(n);
              Decode(cpu, want);
              cuda::Decode(denc.ptr, bytes, dy.ptr, n, false);
              CUDA_OK(cudaMemcpy(got.data(), dy.ptr, n * 4, cudaMemcpyDeviceToHost));
              ASSERT_EQ(Bits(got), Bits(want)) << where << " decode";
              std::vector<float> acc(n);
              for (size_t i = 0; i < n; ++i) acc[i] = 0.3f * static_cast<float>(i % 17) - 2.f;
              CUDA_OK(cudaMemcpy(dy.ptr, acc.data(), n * 4, cudaMemcpyHostToDevice));
              DecodeAccumulate(cpu, acc);
              cuda::Decode(denc.ptr, bytes, dy.ptr, n, true);
              CUDA_OK(cudaMemcpy(got.data(), dy.ptr, n * 4, cudaMemcpyDeviceToHost));
              ASSERT_EQ(Bits(got), Bits(acc)) << where << " decode-accumulate";
              if (f != Format::kFp8E4M3 && f != Format::kFp8E5M2) break;  // block unused
            }
            if (s != Scaling::kBlock) break;
          }
        }
      }
    }
  }
}

TEST(CodecGpu, RejectsMalformedBuffers) {
  if (!cuda::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::vector<float> x(64, 1.f);
  CodecOptions o;
  const size_t bytes = EncodedBytes(o, x.size());
  std::vector<uint8_t> enc(bytes);
  Encode(x, o, enc);
  enc[0] = 0;  // bad magic
  DeviceBuffer<uint8_t> d(bytes);
  DeviceBuffer<float> y(64);
  ASSERT_EQ(cudaMemcpy(d.ptr, enc.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_THROW(cuda::Decode(d.ptr, bytes, y.ptr, 64), Error);
  EXPECT_THROW(cuda::Decode(d.ptr, 10, y.ptr, 64), Error);
  enc[0] = kEncodedMagic;
  ASSERT_EQ(cudaMemcpy(d.ptr, enc.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_THROW(cuda::Decode(d.ptr, bytes, y.ptr, 63), Error);
  EXPECT_THROW(cuda::Decode(d.ptr, bytes - 1, y.ptr, 64), Error);
  EXPECT_THROW(cuda::Encode(nullptr, 64, o, d.ptr, bytes - 1), Error);
}

}  // namespace
}  // namespace geofp8
