// geofp8-gpu-bench: the GPU figures of tests/gpu/run.sh (issue #28, item 5), each a ratio to a
// baseline measured in the same run on the same device, medians over --reps:
//   - codec encode and decode (cuda::Encode / cuda::Decode) against a device-to-device
//     cudaMemcpy, for fp8_e4m3 block 128 and nvfp4; GB/s count bytes read + written, as
//     `geofp8-bench codec` does on the host;
//   - the lowrank transform (DeviceGeometry::Apply + Invert) against a cuBLAS sgemm of the same
//     FLOPs (16 m n k, as `geofp8-bench geometry --mode cost` counts them on the host), at
//     4096x4096 and 4096x11008, k 8 and 32;
//   - the EMA sketch update of a 4096x4096 layer against that layer's transform (k 8): with its
//     products on the device (cuda::DeviceGradient, as the device plane runs a refresh), and
//     from a device-to-host copy of the gradient (as the instant estimator's owner reads it);
//   - a 4-rank exchange (fp8_e4m3 block 128, auto = two_phase) of 256 MiB of gradient per rank
//     in device memory (the device plane, kernels/exchange/data_plane.h, over the CUDA backend),
//     ranks as threads on one GPU over Gloo with host staging, against the same exchange of host
//     memory (the host plane), after checking that both give the same bits.
// Before timing anything it checks the device against the host, bit for bit: the encoded bytes
// of both codecs and their decoded floats on a 1 Mi-element slice. A mismatch prints MISMATCH
// and exits 1, so the prepared run fails loudly. Without a device it exits 77 (skipped).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/codec/codec_cuda.h"
#include "kernels/exchange/cuda_backend.h"
#include "kernels/exchange/exchanger.h"
#include "kernels/exchange/gloo_communicator.h"
#include "kernels/exchange/store.h"
#include "kernels/geometry/factor_sketch.h"
#include "kernels/geometry/geometry.h"
#include "kernels/geometry/geometry_cuda.h"

namespace geofp8 {
namespace {

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "geofp8-gpu-bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Seconds of fn() on the device (default stream), median of reps after one warm-up.
template <class Fn>
double TimeDevice(int reps, Fn fn) {
  cudaEvent_t a, b;
  Check(cudaEventCreate(&a), "cudaEventCreate");
  Check(cudaEventCreate(&b), "cudaEventCreate");
  fn();
  Check(cudaDeviceSynchronize(), "warm-up");
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    Check(cudaEventRecord(a), "cudaEventRecord");
    fn();
    Check(cudaEventRecord(b), "cudaEventRecord");
    Check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    t.push_back(ms / 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return Median(t);
}

std::vector<float> Gaussian(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  return x;
}

CodecOptions Fp8Block() {
  CodecOptions o;
  o.format = Format::kFp8E4M3;
  o.scaling = Scaling::kBlock;
  o.block = 128;
  return o;
}
CodecOptions Nvfp4() {
  CodecOptions o;
  o.format = Format::kNvfp4;
  return o;
}

// Device against host, bit for bit: encoded bytes, then decoded floats. Returns false on any
// difference and says where.
bool SameAsHost(const char* name, const CodecOptions& o, const std::vector<float>& x) {
  const size_t n = x.size(), bytes = EncodedBytes(o, n);
  std::vector<uint8_t> host(bytes), dev(bytes);
  Encode(x, o, host);
  std::vector<float> host_dec(n), dev_dec(n);
  Decode(host, host_dec);
  float* dx = nullptr;
  float* dy = nullptr;
  uint8_t* denc = nullptr;
  Check(cudaMalloc(&dx, n * 4), "cudaMalloc");
  Check(cudaMalloc(&dy, n * 4), "cudaMalloc");
  Check(cudaMalloc(&denc, bytes), "cudaMalloc");
  Check(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice), "upload");
  cuda::Encode(dx, n, o, denc, bytes);
  cuda::Decode(denc, bytes, dy, n);
  Check(cudaDeviceSynchronize(), "check");
  Check(cudaMemcpy(dev.data(), denc, bytes, cudaMemcpyDeviceToHost), "download");
  Check(cudaMemcpy(dev_dec.data(), dy, n * 4, cudaMemcpyDeviceToHost), "download");
  cudaFree(dx);
  cudaFree(dy);
  cudaFree(denc);
  for (size_t i = 0; i < bytes; ++i) {
    if (host[i] != dev[i]) {
      std::printf("MISMATCH %s: encoded byte %zu of %zu: host 0x%02x, device 0x%02x\n", name, i,
                  bytes, host[i], dev[i]);
      return false;
    }
  }
  if (std::memcmp(host_dec.data(), dev_dec.data(), n * 4) != 0) {
    for (size_t i = 0; i < n; ++i) {
      if (std::memcmp(&host_dec[i], &dev_dec[i], 4) != 0) {
        std::printf("MISMATCH %s: decoded element %zu: host %.9g, device %.9g\n", name, i,
                    host_dec[i], dev_dec[i]);
        break;
      }
    }
    return false;
  }
  std::printf("check %s: device encode and decode equal the host's, bit for bit (%zu elements)\n",
              name, n);
  return true;
}

// Seconds of fn() on the host clock, median of reps after one warm-up.
template <class Fn>
double TimeHost(int reps, Fn fn) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  return Median(t);
}

// The 4-rank exchange of device memory against host memory (see the top). Returns false on a
// mismatch of the two planes' bits.
bool ExchangeBench(int reps, size_t floats_per_rank) {
  const int N = 4;
  const int64_t rows = 4096, cols = 1024;
  const size_t L = std::max<size_t>(1, floats_per_rank / size_t(rows * cols));
  std::vector<LayerSpec> layers;
  for (size_t l = 0; l < L; ++l) {
    LayerSpec s;
    s.name = "w" + std::to_string(l);
    s.rows = rows;
    s.cols = cols;
    s.policy.format = Format::kFp8E4M3;
    s.policy.scaling = Scaling::kBlock;
    s.policy.block = 128;
    layers.push_back(s);
  }
  const size_t per = size_t(rows * cols);
  std::vector<double> seconds[2];                // [device][rank]: median seconds
  std::vector<std::vector<float>> first(2 * N);  // layer 0 after the last rep, per plane and rank
  bool ok = true;
  for (int device = 0; device < 2; ++device) {
    MemoryStore store;
    seconds[device].assign(N, 0.0);
    std::vector<std::thread> threads;
    for (int r = 0; r < N; ++r) {
      threads.emplace_back([&, r] {
        try {
          GlooOptions go;
          go.prefix = device ? "bench-device" : "bench-host";
          auto comm = CreateGlooCommunicator(store, r, N, go);
          std::vector<float> host(per * L);
          for (size_t i = 0; i < host.size(); ++i) {
            host[i] = float(std::ldexp(double((i * 2654435761u + r * 97) % 2001) - 1000.0, -14));
          }
          std::unique_ptr<cuda::CudaBackend> backend;
          std::unique_ptr<StagedPlane> plane;
          float* dev = nullptr;
          ExchangeOptions o;
          o.algorithm = Algorithm::kAuto;
          if (device) {
            backend = std::make_unique<cuda::CudaBackend>(0);
            plane = std::make_unique<StagedPlane>(*backend);
            o.plane = plane.get();
            dev = static_cast<float*>(backend->Allocate(host.size() * 4));
          }
          Exchanger ex(*comm, layers, o);
          std::vector<std::span<float>> grads;
          std::vector<float> work(device ? 0 : host.size());  // host memory's exchanged copy
          float* base = device ? dev : work.data();
          for (size_t l = 0; l < L; ++l) grads.emplace_back(base + l * per, per);
          uint64_t step = 0;
          auto one = [&] {
            // Fresh inputs every rep (the exchange overwrites them), not timed apart.
            if (device) {
              backend->ToDevice(dev, host.data(), host.size() * 4);
              backend->Synchronize();
            } else {
              std::copy(host.begin(), host.end(), work.begin());
            }
            return ex.Exchange(step++, grads).seconds;
          };
          std::vector<double> t;
          for (int k = 0; k <= reps; ++k) {
            const double s = one();
            if (k > 0) t.push_back(s);  // the first is the warm-up
          }
          seconds[device][r] = Median(t);
          first[device * N + r].resize(per);
          if (device) {
            backend->ToHost(first[device * N + r].data(), dev, per * 4);
            backend->Free(dev);
          } else {
            std::copy_n(work.begin(), per, first[device * N + r].begin());
          }
        } catch (const std::exception& e) {
          std::fprintf(stderr, "geofp8-gpu-bench: exchange rank %d (%s memory): %s\n", r,
                       device ? "device" : "host", e.what());
          ok = false;
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  if (!ok) return false;
  for (int r = 0; r < N; ++r) {
    if (std::memcmp(first[r].data(), first[N + r].data(), per * 4) != 0) {
      std::printf("MISMATCH: rank %d's exchanged layer 0 differs between host and device memory\n",
                  r);
      return false;
    }
  }
  const double th = Median(seconds[0]), td = Median(seconds[1]);
  std::printf(
      "\n4-rank exchange, fp8_e4m3 block 128 (auto: two_phase), %zu layers of %lldx%lld "
      "(%.0f MiB per rank), ranks as threads over Gloo (loopback TCP), same bits on both:\n"
      "| memory | s per exchange (median) | device / host |\n|---|---|---|\n"
      "| host (host plane) | %.3f | 1 |\n| device (device plane, staged) | %.3f | %.3f |\n",
      L, static_cast<long long>(rows), static_cast<long long>(cols),
      double(per * L) * 4 / (1 << 20), th, td, td / th);
  return true;
}

int Run(int reps, size_t codec_elems, size_t exchange_floats) {
  if (!cuda::HaveDevice()) {
    std::printf("geofp8-gpu-bench: no CUDA device: skipped\n");
    return 77;
  }
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s, %d SMs, %.0f GiB\n", prop.name, prop.multiProcessorCount,
              double(prop.totalGlobalMem) / (1ull << 30));

  bool same = true;
  const std::vector<float> slice = Gaussian(size_t(1) << 20, 7, 1e-3f);
  same &= SameAsHost("fp8_e4m3 block 128", Fp8Block(), slice);
  same &= SameAsHost("nvfp4", Nvfp4(), slice);
  if (!same) return 1;

  // Codec against device memcpy.
  const size_t n = codec_elems;
  float* dx = nullptr;
  float* dy = nullptr;
  uint8_t* denc = nullptr;
  Check(cudaMalloc(&dx, n * 4), "cudaMalloc");
  Check(cudaMalloc(&dy, n * 4), "cudaMalloc");
  Check(cudaMalloc(&denc, MaxEncodedBytes(n)), "cudaMalloc");
  {
    const std::vector<float> x = Gaussian(n, 1, 1e-3f);
    Check(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice), "upload");
  }
  const double t_copy = TimeDevice(reps, [&] {
    Check(cudaMemcpyAsync(dy, dx, n * 4, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
  });
  const double copy_gbps = 2.0 * n * 4 / t_copy / 1e9;
  std::printf("\n%zu floats (%.0f MiB); device memcpy D2D %.1f GB/s (read + write)\n\n", n,
              n * 4.0 / (1 << 20), copy_gbps);
  std::printf("| codec | encode GB/s | encode / memcpy | decode GB/s | decode / memcpy |\n");
  std::printf("|---|---|---|---|---|\n");
  for (const auto& [name, o] :
       {std::pair<const char*, CodecOptions>{"fp8_e4m3 block 128", Fp8Block()},
        std::pair<const char*, CodecOptions>{"nvfp4", Nvfp4()}}) {
    const size_t bytes = EncodedBytes(o, n);
    const double te = TimeDevice(reps, [&] { cuda::Encode(dx, n, o, denc, bytes); });
    const double td = TimeDevice(reps, [&] { cuda::Decode(denc, bytes, dy, n); });
    const double moved = double(n) * 4 + double(bytes);
    std::printf("| %s | %.1f | %.3f | %.1f | %.3f |\n", name, moved / te / 1e9,
                moved / te / 1e9 / copy_gbps, moved / td / 1e9, moved / td / 1e9 / copy_gbps);
  }
  cudaFree(dx);
  cudaFree(dy);
  cudaFree(denc);

  // The lowrank transform against an sgemm of the same FLOPs.
  cublasHandle_t handle = nullptr;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "geofp8-gpu-bench: cublasCreate failed\n");
    return 1;
  }
  std::printf(
      "\n| shape | k | apply + inverse ms | sgemm of 16 m n k FLOPs, ms | sgemm / transform |\n");
  std::printf("|---|---|---|---|---|\n");
  for (const auto& [m, cols] : {std::pair<int64_t, int64_t>{4096, 4096}, {4096, 11008}}) {
    const std::vector<float> g = Gaussian(size_t(m * cols), 3, 1e-3f);
    float* dg = nullptr;
    Check(cudaMalloc(&dg, size_t(m * cols) * 4), "cudaMalloc");
    Check(cudaMemcpy(dg, g.data(), size_t(m * cols) * 4, cudaMemcpyHostToDevice), "upload");
    for (int k : {8, 32}) {
      GeometryOptions go;
      go.mode = GeometryMode::kLowRank;
      go.rank = k;
      const Geometry geo = EstimateGeometry(g, m, cols, go, nullptr).geometry;
      cuda::DeviceGeometry dev(geo);
      const double tt = TimeDevice(reps, [&] {
        dev.Apply(dg, nullptr, handle);
        dev.Invert(dg, nullptr, handle);
      });
      // C (m x cols) = A (m x 8k) B (8k x cols): 2 m cols 8k = 16 m n k FLOPs.
      const int kk = 8 * k;
      float *a = nullptr, *b = nullptr, *c = nullptr;
      Check(cudaMalloc(&a, size_t(m) * kk * 4), "cudaMalloc");
      Check(cudaMalloc(&b, size_t(kk) * cols * 4), "cudaMalloc");
      Check(cudaMalloc(&c, size_t(m) * cols * 4), "cudaMalloc");
      Check(cudaMemset(a, 0, size_t(m) * kk * 4), "cudaMemset");
      Check(cudaMemset(b, 0, size_t(kk) * cols * 4), "cudaMemset");
      const float one = 1.f, zero = 0.f;
      const double ts = TimeDevice(reps, [&] {
        cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, int(cols), int(m), kk, &one, b, int(cols), a,
                    kk, &zero, c, int(cols));
      });
      cudaFree(a);
      cudaFree(b);
      cudaFree(c);
      std::printf("| %lldx%lld | %d | %.3f | %.3f | %.3f |\n", static_cast<long long>(m),
                  static_cast<long long>(cols), k, tt * 1e3, ts * 1e3, ts / tt);
    }
    cudaFree(dg);
  }
  // The EMA sketch update of a 4096x4096 layer, as the device plane runs it (a device-to-host
  // copy of the averaged gradient, then the host's update), against the transform (k 8).
  {
    const int64_t m = 4096, cols = 4096;
    const int k = 8;
    const std::vector<float> g = Gaussian(size_t(m * cols), 5, 1e-3f);
    float* dg = nullptr;
    Check(cudaMalloc(&dg, size_t(m * cols) * 4), "cudaMalloc");
    Check(cudaMemcpy(dg, g.data(), size_t(m * cols) * 4, cudaMemcpyHostToDevice), "upload");
    GeometryOptions go;
    go.mode = GeometryMode::kLowRank;
    go.rank = k;
    cuda::DeviceGeometry dev(EstimateGeometry(g, m, cols, go, nullptr).geometry);
    const double tt = TimeDevice(reps, [&] {
      dev.Apply(dg, nullptr, handle);
      dev.Invert(dg, nullptr, handle);
    });
    std::vector<float> host(size_t(m * cols));
    FactorSketch sketch;
    FactorSketchOptions so;
    so.width = k;
    const int sreps = std::max(3, reps / 4);
    const double tc = TimeHost(sreps, [&] {
      Check(cudaMemcpy(host.data(), dg, host.size() * 4, cudaMemcpyDeviceToHost), "download");
    });
    const double tu = TimeHost(sreps, [&] {
      Check(cudaMemcpy(host.data(), dg, host.size() * 4, cudaMemcpyDeviceToHost), "download");
      UpdateFactorSketch(sketch, host, m, cols, k, so, nullptr);
    });
    FactorSketch on_device;
    cuda::DeviceGradient products(dg, m, cols, nullptr, reinterpret_cast<cublasContext*>(handle));
    const double tp =
        TimeHost(sreps, [&] { UpdateFactorSketch(on_device, products, m, cols, k, so, nullptr); });
    std::printf(
        "\n| 4096x4096, k 8 | ms | / transform |\n|---|---|---|\n"
        "| transform (apply + inverse, device) | %.3f | 1 |\n"
        "| sketch update, products on the device | %.3f | %.2f |\n"
        "| sketch update, D2H copy + host update | %.3f | %.2f |\n"
        "| of which the D2H copy | %.3f | %.2f |\n",
        tt * 1e3, tp * 1e3, tp / tt, tu * 1e3, tu / tt, tc * 1e3, tc / tt);
    cudaFree(dg);
  }
  cublasDestroy(handle);
  if (!ExchangeBench(std::max(3, reps / 5), exchange_floats)) return 1;
  return 0;
}

}  // namespace
}  // namespace geofp8

int main(int argc, char** argv) {
  int reps = 20;
  size_t elems = size_t(64) << 20;  // 256 MiB of floats
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
      if (reps < 1) {
        std::fprintf(stderr, "geofp8-gpu-bench: --reps: must be >= 1 (%s)\n", argv[i]);
        return 2;
      }
    } else if (a == "--mib" && i + 1 < argc) {
      const long mib = std::atol(argv[++i]);
      if (mib < 1 || mib > 16384) {
        std::fprintf(stderr, "geofp8-gpu-bench: --mib: must be in [1, 16384] (%s)\n", argv[i]);
        return 2;
      }
      elems = size_t(mib) << 18;
    } else {
      std::fprintf(stderr,
                   "usage: geofp8-gpu-bench [--reps N] [--mib M]\n"
                   "geofp8-gpu-bench: unknown argument '%s'\n",
                   a.c_str());
      return 2;
    }
  }
  return geofp8::Run(reps, elems, elems);
}
