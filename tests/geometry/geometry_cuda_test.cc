// GPU tests of the geometry's CUDA path against the CPU reference (same signature, same math),
// over odd and round shapes. Labeled `gpu`; each test skips when no CUDA device is present.
#include "kernels/geometry/geometry_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <span>
#include <utility>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/geometry/geometry.h"
#include "kernels/geometry/geometry_math.h"
#include "kernels/geometry/synthetic.h"

namespace geofp8 {
namespace {

double RelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

class GeometryCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::HaveDevice()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cublasCreate(&handle_), CUBLAS_STATUS_SUCCESS);
  }
  void TearDown() override {
    if (handle_) cublasDestroy(handle_);
  }
  // Runs T or T^-1 on the device and returns the result.
  std::vector<float> OnDevice(const Geometry& g, const std::vector<float>& x, bool inverse) {
    float* d = nullptr;
    const size_t bytes = std::max<size_t>(1, x.size()) * sizeof(float);
    EXPECT_EQ(cudaMalloc(&d, bytes), cudaSuccess);
    if (!x.empty()) cudaMemcpy(d, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice);
    cuda::DeviceGeometry dg(g);
    if (inverse) {
      dg.Invert(d, nullptr, handle_);
    } else {
      dg.Apply(d, nullptr, handle_);
    }
    std::vector<float> out(x.size());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (!x.empty()) cudaMemcpy(out.data(), d, x.size() * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(d);
    return out;
  }
  cublasHandle_t handle_ = nullptr;
};

TEST_F(GeometryCudaTest, MatchesCpuReferenceOverShapesAndModes) {
  struct Shape {
    int64_t m, n;
  };
  for (Shape s : {Shape{1, 37}, Shape{37, 1}, Shape{5, 160}, Shape{217, 256}, Shape{512, 384}}) {
    const std::vector<float> g =
        MakeSyntheticGradient({SyntheticFamily::kSpectral, s.m, s.n, 1.5, 3, 0.0});
    for (GeometryMode mode : {GeometryMode::kNone, GeometryMode::kDiag, GeometryMode::kLowRank}) {
      GeometryOptions o;
      o.mode = mode;
      o.rank = 16;
      const Geometry geo = EstimateGeometry(g, s.m, s.n, o, nullptr).geometry;
      std::vector<float> cpu = g;
      ApplyGeometry(geo, cpu);
      const std::vector<float> gpu = OnDevice(geo, g, false);
      EXPECT_LT(RelDiff(gpu, cpu), 1e-5) << s.m << "x" << s.n << " " << GeometryModeName(mode);
      std::vector<float> cpu_inv = cpu;
      InvertGeometry(geo, cpu_inv);
      const std::vector<float> gpu_inv = OnDevice(geo, cpu, true);
      EXPECT_LT(RelDiff(gpu_inv, cpu_inv), 1e-4)
          << s.m << "x" << s.n << " " << GeometryModeName(mode);
      EXPECT_LT(RelDiff(gpu_inv, g), 1e-3) << "round trip on the device";
    }
  }
}

// EncodeFused: the fp8 block-scaled kernel's bytes equal the host rebuild of its math (the
// device's update factors, LowRankUpdateElement, the CPU codec), and every codec decodes to the
// CPU fused path's result within the format's step.
TEST_F(GeometryCudaTest, FusedEncodeMatchesItsHostReference) {
  struct Shape {
    int64_t m, n;
  };
  for (Shape s : {Shape{5, 160}, Shape{217, 256}, Shape{512, 384}}) {
    const std::vector<float> g =
        MakeSyntheticGradient({SyntheticFamily::kSpectral, s.m, s.n, 1.5, 3, 0.0});
    float* d_g = nullptr;
    ASSERT_EQ(cudaMalloc(&d_g, g.size() * sizeof(float)), cudaSuccess);
    cudaMemcpy(d_g, g.data(), g.size() * sizeof(float), cudaMemcpyHostToDevice);
    for (GeometryMode mode : {GeometryMode::kNone, GeometryMode::kDiag, GeometryMode::kLowRank}) {
      GeometryOptions go;
      go.mode = mode;
      go.rank = 16;
      const Geometry geo = EstimateGeometry(g, s.m, s.n, go, nullptr).geometry;
      cuda::DeviceGeometry dg(geo);
      // Host T(G) computed the kernel's way.
      std::vector<float> t = g;
      if (mode == GeometryMode::kLowRank) {
        std::vector<float> left, right;
        dg.DownloadUpdate(d_g, &left, &right, nullptr, handle_);
        const int k2 = 2 * geo.k;
        for (int64_t i = 0; i < s.m; ++i)
          for (int64_t j = 0; j < s.n; ++j)
            t[i * s.n + j] = geometry::LowRankUpdateElement(g[i * s.n + j], left.data() + i * k2,
                                                            right.data() + j, s.n, k2);
      } else {
        ApplyGeometry(geo, t);
      }
      for (Format f : {Format::kFp8E4M3, Format::kFp8E5M2, Format::kNvfp4}) {
        CodecOptions o;
        o.format = f;
        o.block = 96;
        const size_t total = g.size(), half = total / 2 / 96 * 96;
        std::vector<std::pair<size_t, size_t>> ranges = {{0, half}, {half, total}};
        std::vector<cuda::DeviceEncodeTarget> targets(2);
        std::vector<uint8_t*> d_out(2);
        for (int j = 0; j < 2; ++j) {
          const size_t bytes = EncodedBytes(o, ranges[j].second - ranges[j].first);
          ASSERT_EQ(cudaMalloc(&d_out[j], bytes), cudaSuccess);
          targets[j].begin = ranges[j].first;
          targets[j].end = ranges[j].second;
          targets[j].options = o;
          targets[j].out = d_out[j];
          targets[j].out_bytes = bytes;
        }
        dg.EncodeFused(d_g, targets, nullptr, handle_);
        for (int j = 0; j < 2; ++j) {
          const size_t count = ranges[j].second - ranges[j].first;
          std::vector<uint8_t> got(EncodedBytes(o, count)), want(got.size());
          cudaMemcpy(got.data(), d_out[j], got.size(), cudaMemcpyDeviceToHost);
          Encode(std::span<const float>(t).subspan(ranges[j].first, count), o, want);
          if (f != Format::kNvfp4) {  // the fused kernel: bit-identical to its host rebuild
            EXPECT_EQ(got, want) << s.m << "x" << s.n << " " << GeometryModeName(mode) << " chunk "
                                 << j;
          }
          std::vector<float> a(count), b(count);
          Decode(got, a);
          Decode(want, b);
          EXPECT_LT(RelDiff(a, b), f == Format::kNvfp4 ? 0.2 : 0.07)
              << s.m << "x" << s.n << " " << GeometryModeName(mode) << " " << FormatName(f);
          cudaFree(d_out[j]);
        }
      }
    }
    cudaFree(d_g);
  }
}

}  // namespace
}  // namespace geofp8

namespace geofp8 {
namespace {

// The factor sketch's products over a device gradient (cuda::DeviceGradient) against the host's
// (HostGradient) on the same G: within the float products' round-off (n resp. m terms), the norm
// within double round-off, the same bits on a second call, a NaN found at its index, and a whole
// sketch update within round-off of the host's.
TEST_F(GeometryCudaTest, DeviceGradientProductsMatchTheHost) {
  const int64_t m = 300, n = 257;
  std::vector<float> g(size_t(m * n));
  for (size_t i = 0; i < g.size(); ++i) g[i] = float(std::sin(0.37 * double(i)) * (1 + i % 7));
  float* dg = nullptr;
  ASSERT_EQ(cudaMalloc(&dg, g.size() * 4), cudaSuccess);
  cudaMemcpy(dg, g.data(), g.size() * 4, cudaMemcpyHostToDevice);
  cuda::DeviceGradient dev(dg, m, n, nullptr, reinterpret_cast<cublasContext*>(handle_));
  HostGradient host(g.data(), m, n);
  const int ldx = 16;
  std::vector<float> x(size_t(n) * ldx), yd(size_t(m) * ldx), yh(size_t(m) * ldx), y2(yd.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(std::cos(0.11 * double(i)));
  const double nd = dev.ProductAndNorm(x.data(), ldx, yd.data());
  const double nh = host.ProductAndNorm(x.data(), ldx, yh.data());
  EXPECT_NEAR(nd, nh, 6e-8 * double(n) * nh);   // float-sized, whichever way the host sums
  EXPECT_LT(RelDiff(yd, yh), 16.0 * n * 6e-8);  // n-term float sums, some cancellation
  EXPECT_EQ(dev.ProductAndNorm(x.data(), ldx, y2.data()), nd);  // a fixed-order reduction
  EXPECT_EQ(y2, yd);
  const int c = 8;
  std::vector<float> q(size_t(m) * c), bd(size_t(n) * c), bh(size_t(n) * c);
  for (size_t i = 0; i < q.size(); ++i) q[i] = float(std::sin(0.05 * double(i)));
  dev.TransposeProduct(q.data(), c, bd.data());
  host.TransposeProduct(q.data(), c, bh.data());
  EXPECT_LT(RelDiff(bd, bh), 16.0 * m * 6e-8);
  EXPECT_EQ(dev.FindNonFinite(), -1);
  FactorSketch sd, sh;
  FactorSketchOptions o;
  o.width = 8;
  UpdateFactorSketch(sd, dev, m, n, 8, o);
  UpdateFactorSketch(sh, g, m, n, 8, o);
  EXPECT_NEAR(sd.energy, sh.energy, 1e-5 * sh.energy);
  for (int i = 0; i < 8; ++i) {
    EXPECT_NEAR(sd.left_energy[i], sh.left_energy[i], 1e-4 * sh.left_energy[0]) << i;
  }
  const float nan = std::nanf("");
  cudaMemcpy(dg + 1234, &nan, 4, cudaMemcpyHostToDevice);
  EXPECT_EQ(dev.FindNonFinite(), 1234);
  cudaFree(dg);
}

}  // namespace
}  // namespace geofp8
