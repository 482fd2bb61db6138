// geofp8-bench grad_dtype: the exchange's encode stage (the division by N and the encode, one
// HostPlane::EncodeChunk) from bf16 and fp16 gradients against the same stage from fp32, beside a
// same-run memcpy of the fp32 bytes and the codec's Encode alone of the divided fp32 values.
// Medians over repetitions, each timing every variant back to back.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/registry.h"
#include "kernels/codec/codec.h"
#include "kernels/codec/codec_internal.h"
#include "kernels/common/cpu_features.h"
#include "kernels/exchange/data_plane.h"
#include "kernels/exchange/grad_span.h"
#include "kernels/exchange/policy.h"

namespace geofp8 {
namespace {

double Seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

int RunGradDtypeBench(int argc, char** argv) {
  CLI::App app{"geofp8-bench grad_dtype: encode from bf16/fp16 gradients vs from fp32",
               "grad_dtype"};
  size_t elements = size_t{4} << 20;
  int reps = 15;
  int ranks = 2;
  uint32_t block = 128;
  std::vector<std::string> formats = {"fp8_e4m3", "nvfp4"};
  bool no_avx512 = false;
  app.add_option("--elements", elements, "gradient elements per encode")->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions (median)")->capture_default_str();
  app.add_option("--ranks", ranks, "N: the encode divides by it first, as the exchange does")
      ->capture_default_str();
  app.add_option("--block", block, "fp8 scale block (block scaling)")->capture_default_str();
  app.add_option("--formats", formats, "codec formats")->capture_default_str();
  app.add_flag("--no-avx512", no_avx512, "keep the codec's AVX2 path on a CPU with AVX-512");
  if (int rc = bench::ParseFlags(app, argc, argv); rc >= 0) return rc;
  if (elements == 0 || reps < 1 || ranks < 1 || block == 0) {
    std::fprintf(stderr,
                 "geofp8-bench grad_dtype: error: elements, reps, ranks and block must be "
                 "positive\n");
    return 2;
  }
  std::vector<Format> fs;
  for (const auto& name : formats) {
    const auto f = ParseFormat(name);
    if (!f) {
      std::fprintf(stderr, "geofp8-bench grad_dtype: error: --formats: unknown format (%s)\n",
                   name.c_str());
      return 2;
    }
    fs.push_back(*f);
  }
  detail::SetAvx512Enabled(!no_avx512);

  std::vector<float> f32(elements), copy(elements);
  std::vector<uint16_t> bf16(elements), fp16(elements);
  {
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0.f, 1e-3f);
    for (size_t i = 0; i < elements; ++i) {
      // One draw per element, rounded to each dtype, as a framework's gradient would be.
      f32[i] = d(rng);
      bf16[i] = FloatToBf16(f32[i]);
      fp16[i] = FloatToHalf(f32[i]);
    }
  }
  std::printf(
      "geofp8-bench grad_dtype: %zu elements, divided by %d, %d reps (median), rates in 10^9 "
      "elements/s; avx2 %s, avx512 %s\n",
      elements, ranks, reps, detail::CpuHasAvx2() ? "yes" : "no",
      detail::CpuHasAvx2() && !no_avx512 && CpuHasAvx512() ? "yes" : "no");
  std::printf("%-9s %12s %12s %12s %12s %12s %10s %10s %12s\n", "format", "memcpy", "codec only",
              "fp32", "bf16", "fp16", "bf16/fp32", "fp16/fp32", "bf16/codec");
  const float divisor = static_cast<float>(ranks);
  for (Format f : fs) {
    LayerPolicy p;
    p.format = f;
    p.scaling = Scaling::kBlock;
    p.block = block;
    const CodecOptions o = LayerCodecOptions(p, 0, 0, 0, 0, 1, 0);
    std::vector<uint8_t> out(EncodedBytes(o, elements));
    BucketLayer lf32, lbf16, lfp16;
    lf32.policy = lbf16.policy = lfp16.policy = p;
    lf32.in = std::span<float>(f32);
    lbf16.in = GradSpan(bf16.data(), elements, GradDtype::kBf16);
    lfp16.in = GradSpan(fp16.data(), elements, GradDtype::kFp16);
    HostPlane plane;
    const ChunkRange all{0, elements};
    std::vector<float> divided(elements);
    for (size_t i = 0; i < elements; ++i) divided[i] = f32[i] / divisor;
    std::vector<double> mem, codec, t32, tb, th;
    for (int r = -1; r < reps; ++r) {  // r = -1: warm-up (the plane's buffers), not recorded
      const double m =
          Seconds([&] { std::memcpy(copy.data(), f32.data(), elements * sizeof(float)); });
      const double e = Seconds([&] { Encode(divided, o, out); });
      const double a = Seconds([&] { plane.EncodeChunk(lf32, all, divisor, o, out); });
      const double b = Seconds([&] { plane.EncodeChunk(lbf16, all, divisor, o, out); });
      const double c = Seconds([&] { plane.EncodeChunk(lfp16, all, divisor, o, out); });
      if (r < 0) continue;
      mem.push_back(m), codec.push_back(e), t32.push_back(a), tb.push_back(b), th.push_back(c);
    }
    const double n = static_cast<double>(elements) / 1e9;
    std::printf("%-9s %12.3f %12.3f %12.3f %12.3f %12.3f %10.3f %10.3f %12.3f\n",
                std::string(FormatName(f)).c_str(), n / Median(mem), n / Median(codec),
                n / Median(t32), n / Median(tb), n / Median(th), Median(t32) / Median(tb),
                Median(t32) / Median(th), Median(codec) / Median(tb));
  }
  return 0;
}

}  // namespace
}  // namespace geofp8

namespace {
int GradDtypeBenchMain(int argc, char** argv) { return geofp8::RunGradDtypeBench(argc, argv); }
}  // namespace
GEOFP8_REGISTER_BENCH("grad_dtype",
                      "exchange encode from bf16/fp16 gradients vs from fp32 (rate ratio)",
                      GradDtypeBenchMain);
