// geofp8-bench codec: encode / decode / decode-accumulate throughput per format and scaling,
// against memcpy measured in the same run with the same thread count. Medians over repetitions.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/registry.h"
#include "kernels/codec/codec.h"
#include "kernels/codec/codec_internal.h"
#include "kernels/common/cpu_features.h"
#include "kernels/geometry/hadamard.h"

namespace geofp8 {
namespace {

struct Config {
  Format format;
  Scaling scaling;
};

struct Row {
  Config config;
  int threads = 1;
  double memcpy_gbps = 0, encode_gbps = 0, decode_gbps = 0, decode_acc_gbps = 0;
  int hadamard_block = 0;         // --hadamard: the rotation block (the codec's scale block)
  double rotate_encode_gbps = 0;  // --hadamard: EncodeRotated, the same bytes counted as encode
  // --hadamard: HadamardForward alone, in place (4n read + 4n written), and its time over the
  // encode's: what the rotation adds when the two do not overlap.
  double rotate_gbps = 0;
  double rotate_over_encode = 0;
};

// Runs fn(t) on `threads` threads (t = 0 on the caller) and returns the wall time in seconds.
double TimeParallel(int threads, const std::function<void(int)>& fn) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(fn, t);
  fn(0);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

int RunCodecBench(int argc, char** argv) {
  CLI::App app{"geofp8-bench codec: codec throughput against same-run memcpy", "codec"};
  double size_mib = 64;
  int reps = 7;
  std::vector<int> thread_counts = {1, 2};
  std::vector<std::string> formats = {"fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4", "bf16", "fp32"};
  std::vector<std::string> scalings = {"block", "tensor", "none"};
  uint32_t block = 128;
  bool json = false;
  bool scalar = false;
  bool no_avx512 = false;
  bool hadamard = false;
  app.add_option("--size-mib", size_mib, "input size in MiB of float32")->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions per measurement (median)")
      ->capture_default_str();
  app.add_option("--threads", thread_counts, "thread counts")->capture_default_str();
  app.add_option("--formats", formats, "formats")->capture_default_str();
  app.add_option("--scalings", scalings, "fp8 scalings (others use their own)")
      ->capture_default_str();
  app.add_option("--block", block, "block size for block scaling")->capture_default_str();
  app.add_flag("--json", json, "machine-readable output");
  app.add_flag("--scalar", scalar, "force the scalar reference (no AVX2 or AVX-512)");
  app.add_flag("--no-avx512", no_avx512,
               "keep the AVX2 path where the CPU also has AVX-512 (fp8/mxfp8 block and nvfp4 "
               "encode, and rotate-and-encode, take AVX-512 when it is there)");
  app.add_flag("--hadamard", hadamard,
               "also time rotate-and-encode (block random Hadamard over the codec's scale block, "
               "or --block where the codec has none) against the same memcpy");
  if (int rc = bench::ParseFlags(app, argc, argv); rc >= 0) return rc;
  if (size_mib <= 0 || reps < 1 || block == 0) {
    std::fprintf(stderr, "geofp8-bench codec: error: size-mib, reps and block must be positive\n");
    return 2;
  }
  for (int t : thread_counts) {
    if (t < 1 || t > 256) {
      std::fprintf(stderr, "geofp8-bench codec: error: threads: must be in [1, 256] (%d)\n", t);
      return 2;
    }
  }
  std::vector<Config> configs;
  for (const auto& name : formats) {
    const auto f = ParseFormat(name);
    if (!f) {
      std::fprintf(stderr,
                   "geofp8-bench codec: error: formats: unknown format (%s); accepted: %s\n",
                   name.c_str(), std::string(AcceptedFormats()).c_str());
      return 2;
    }
    if (*f == Format::kFp8E4M3 || *f == Format::kFp8E5M2) {
      for (const auto& sname : scalings) {
        const auto s = ParseScaling(sname);
        if (!s) {
          std::fprintf(stderr, "geofp8-bench codec: error: scalings: unknown scaling (%s)\n",
                       sname.c_str());
          return 2;
        }
        configs.push_back({*f, *s});
      }
    } else {
      configs.push_back(
          {*f, *f == Format::kMxfp8 || *f == Format::kNvfp4 ? Scaling::kBlock : Scaling::kNone});
    }
  }
  detail::SetVectorizedEnabled(!scalar);
  detail::SetAvx512Enabled(!no_avx512);

  // Element count: a multiple of every block size in use times the largest thread count, so
  // each thread gets whole blocks and the split does not change the encoding.
  const int max_threads = *std::max_element(thread_counts.begin(), thread_counts.end());
  const size_t quantum = static_cast<size_t>(block) * 32 * max_threads;
  const size_t n =
      std::max(quantum, static_cast<size_t>(size_mib * 1024 * 1024 / 4) / quantum * quantum);
  std::vector<float> x(n);
  {
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0.f, 1e-3f);
    for (auto& v : x) v = d(rng);
  }
  std::vector<float> copy(n, 0.f), acc(n, 0.f);

  // Each repetition times memcpy, encode, decode and decode-accumulate back to back, so a
  // shared machine's drifting load hits the baseline and the codec alike; medians per column.
  std::vector<Row> rows;
  for (int threads : thread_counts) {
    const size_t per = n / threads;
    for (const Config& c : configs) {
      CodecOptions o;
      o.format = c.format;
      o.scaling = c.scaling;
      o.block = block;
      const size_t enc_bytes = EncodedBytes(o, per);
      std::vector<std::vector<uint8_t>> bufs(threads, std::vector<uint8_t>(enc_bytes, 0));
      const auto memcpy_fn = [&](int t) {
        std::memcpy(copy.data() + t * per, x.data() + t * per, per * 4);
      };
      const auto enc_fn = [&](int t) { Encode(std::span(x).subspan(t * per, per), o, bufs[t]); };
      const auto dec_fn = [&](int t) { Decode(bufs[t], std::span(copy).subspan(t * per, per)); };
      const auto dacc_fn = [&](int t) {
        DecodeAccumulate(bufs[t], std::span(acc).subspan(t * per, per));
      };
      const uint32_t scale_block = CodecScaleBlock(o);
      const int hb = hadamard ? int(scale_block ? scale_block : block) : 0;
      if (hb) {
        if (std::string err = ValidateHadamardBlock(hb, o); !err.empty()) {
          std::fprintf(stderr, "geofp8-bench codec: error: hadamard: %s: %s\n",
                       std::string(FormatName(c.format)).c_str(), err.c_str());
          return 2;
        }
      }
      const auto rot_fn = [&](int t) {
        // Each thread's range starts at a multiple of every block, so it rotates as a tensor.
        EncodeRotated(std::span(x).subspan(t * per, per), hb, 7, o, bufs[t]);
      };
      const auto rot_only_fn = [&](int t) {
        HadamardForward(std::span(copy).subspan(t * per, per), hb, 7);
      };
      std::vector<double> mem, enc, dec, dacc, rot, rot_only;
      for (int r = -1; r < reps; ++r) {  // r = -1: warm-up, not recorded
        const double m = TimeParallel(threads, memcpy_fn);
        const double e = TimeParallel(threads, enc_fn);
        const double d = TimeParallel(threads, dec_fn);
        const double a = TimeParallel(threads, dacc_fn);
        const double h = hb ? TimeParallel(threads, rot_fn) : 0;
        const double ro = hb ? TimeParallel(threads, rot_only_fn) : 0;
        if (r < 0) continue;
        mem.push_back(m), enc.push_back(e), dec.push_back(d), dacc.push_back(a), rot.push_back(h);
        rot_only.push_back(ro);
      }
      const double wire = static_cast<double>(enc_bytes) * threads;
      Row row;
      row.config = c;
      row.threads = threads;
      row.memcpy_gbps = 2.0 * n * 4 / Median(mem) / 1e9;
      row.encode_gbps = (4.0 * n + wire) / Median(enc) / 1e9;
      row.decode_gbps = (4.0 * n + wire) / Median(dec) / 1e9;
      row.decode_acc_gbps = (8.0 * n + wire) / Median(dacc) / 1e9;
      row.hadamard_block = hb;
      if (hb) {
        row.rotate_encode_gbps = (4.0 * n + wire) / Median(rot) / 1e9;
        row.rotate_gbps = 8.0 * n / Median(rot_only) / 1e9;
        row.rotate_over_encode = Median(rot_only) / Median(enc);
      }
      rows.push_back(row);
    }
  }

  auto speedup = [&](const Row& r) -> double {
    for (const Row& one : rows) {
      if (one.threads == 1 && one.config.format == r.config.format &&
          one.config.scaling == r.config.scaling) {
        return r.encode_gbps / one.encode_gbps;
      }
    }
    return 0;
  };
  const bool avx2 = !scalar && detail::CpuHasAvx2();
  const bool avx512 = avx2 && !no_avx512 && CpuHasAvx512();
  if (json) {
    std::printf(
        "{\"bench\": \"codec\", \"elements\": %zu, \"input_bytes\": %zu, \"reps\": %d, "
        "\"block\": %u, \"avx2\": %s, \"avx512\": %s, \"results\": [",
        n, n * 4, reps, block, avx2 ? "true" : "false", avx512 ? "true" : "false");
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::printf(
          "%s\n  {\"format\": \"%s\", \"scaling\": \"%s\", \"threads\": %d, "
          "\"memcpy_gbps\": %.3f, \"encode_gbps\": %.3f, \"decode_gbps\": %.3f, "
          "\"decode_acc_gbps\": %.3f, \"encode_vs_memcpy\": %.3f, "
          "\"decode_vs_memcpy\": %.3f, \"decode_acc_vs_memcpy\": %.3f, "
          "\"encode_speedup_vs_1_thread\": %.3f",
          i ? "," : "", std::string(FormatName(r.config.format)).c_str(),
          std::string(ScalingName(r.config.scaling)).c_str(), r.threads, r.memcpy_gbps,
          r.encode_gbps, r.decode_gbps, r.decode_acc_gbps, r.encode_gbps / r.memcpy_gbps,
          r.decode_gbps / r.memcpy_gbps, r.decode_acc_gbps / r.memcpy_gbps, speedup(r));
      if (r.hadamard_block) {
        std::printf(
            ", \"hadamard_block\": %d, \"rotate_encode_gbps\": %.3f, "
            "\"rotate_encode_vs_memcpy\": %.3f, \"rotate_gbps\": %.3f, "
            "\"rotate_time_over_encode_time\": %.3f",
            r.hadamard_block, r.rotate_encode_gbps, r.rotate_encode_gbps / r.memcpy_gbps,
            r.rotate_gbps, r.rotate_over_encode);
      }
      std::printf("}");
    }
    std::printf("\n]}\n");
    return 0;
  }
  std::printf("codec bench: %zu floats (%.1f MiB), block %u, median of %d, %s path\n", n,
              n * 4.0 / (1 << 20), block, reps,
              avx512 ? "AVX-512 (fp8/mxfp8 block and nvfp4 encode) and AVX2"
              : avx2 ? "AVX2"
                     : "scalar");
  std::printf(
      "GB/s count bytes read + written; ratios are against memcpy at the same thread "
      "count, measured in this run\n\n");
  std::printf("%-9s %-7s %3s %8s %8s %6s %8s %6s %8s %6s %8s", "format", "scaling", "thr", "memcpy",
              "encode", "ratio", "decode", "ratio", "dec+acc", "ratio", "enc x1thr");
  if (hadamard)
    std::printf(" %5s %8s %6s %8s %7s", "hblk", "rot+enc", "ratio", "rotate", "rot/enc");
  std::printf("\n");
  for (const Row& r : rows) {
    std::printf("%-9s %-7s %3d %8.2f %8.2f %6.2f %8.2f %6.2f %8.2f %6.2f %8.2f",
                std::string(FormatName(r.config.format)).c_str(),
                std::string(ScalingName(r.config.scaling)).c_str(), r.threads, r.memcpy_gbps,
                r.encode_gbps, r.encode_gbps / r.memcpy_gbps, r.decode_gbps,
                r.decode_gbps / r.memcpy_gbps, r.decode_acc_gbps, r.decode_acc_gbps / r.memcpy_gbps,
                speedup(r));
    if (hadamard) {
      std::printf(" %5d %8.2f %6.2f %8.2f %7.2f", r.hadamard_block, r.rotate_encode_gbps,
                  r.rotate_encode_gbps / r.memcpy_gbps, r.rotate_gbps, r.rotate_over_encode);
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace
}  // namespace geofp8

namespace {
int CodecBenchMain(int argc, char** argv) { return geofp8::RunCodecBench(argc, argv); }
}  // namespace
GEOFP8_REGISTER_BENCH("codec", "codec encode/decode GB/s per format vs same-run memcpy",
                      CodecBenchMain);
