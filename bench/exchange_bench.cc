// geofp8-bench exchange: times each exchange algorithm on one gradient buffer across N ranks
// (threads over Gloo TCP on 127.0.0.1, or one process per rank for bench/netem.sh) and prints
// medians, bytes on the wire, bus bandwidth and the ratio to a same-run fp32 Gloo all-reduce.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/ranks.h"
#include "bench/registry.h"
#include "kernels/common/check.h"
#include "kernels/exchange/exchanger.h"
#include "kernels/exchange/gloo_communicator.h"
#include "kernels/exchange/store.h"
#include "kernels/model/ops.h"

namespace geofp8::bench {
namespace {

constexpr const char* kProg = "geofp8-bench exchange";

struct Variant {
  std::string label;
  Algorithm algorithm = Algorithm::kFp32;
  LayerPolicy policy;
};

struct Args {
  int ranks = 4;
  double mib = 64;
  int iters = 5;
  int warmup = 1;
  int64_t cols = 1024;  // layers are rows x cols matrices of at most 4 MiB
  int geometry_rank = 16;
  double timeout_s = 300;
  double bucket_mib = 25;  // ExchangeOptions::bucket_cap_bytes
  double segment_mib = 1;  // ExchangeOptions::segment_bytes
  int channels = 2;        // GlooOptions::channels
  int helper_nice = ExchangeOptions().helper_nice;
  std::string trace_dir;  // --trace: one Chrome trace JSON per variant and rank
  int blas_threads = 1;   // OpenBLAS threads per process (the geometry's GEMMs)
  int loop_nice = 0;      // GlooOptions::loop_nice
  std::string variants =
      "fp32,bf16,two_phase:fp8_e4m3,allgather:fp8_e4m3,two_phase:nvfp4,"
      "two_phase:fp8_e4m3:lowrank";
  // Process mode: this process is rank `rank`, rendezvousing through a shared directory.
  ProcessMode process{-1, "", "127.0.0.1", "bench"};
};

[[noreturn]] void UsageError(const std::string& field, const std::string& problem,
                             const std::string& value) {
  bench::UsageError(kProg, field, problem, value);
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  CLI::App app{"compressed gradient all-reduce: time, wire bytes, busbw vs fp32", "exchange"};
  app.add_option("--ranks", a.ranks, "ranks")->capture_default_str();
  app.add_option("--mib", a.mib, "gradient MiB (fp32) per rank")->capture_default_str();
  app.add_option("--iters", a.iters, "timed steps per variant")->capture_default_str();
  app.add_option("--warmup", a.warmup, "untimed steps first")->capture_default_str();
  app.add_option("--cols", a.cols, "columns of every layer (rows x cols, at most 4 MiB)")
      ->capture_default_str();
  app.add_option("--geometry-rank", a.geometry_rank, "k of the lowrank variants")
      ->capture_default_str();
  app.add_option("--timeout-s", a.timeout_s, "collective timeout")->capture_default_str();
  app.add_option("--variants", a.variants,
                 "comma list of fp32, bf16, ALGO:FORMAT[:lowrank|:diag] with ALGO two_phase or "
                 "allgather")
      ->capture_default_str();
  app.add_option("--bucket-mib", a.bucket_mib, "bucket cap (ExchangeOptions::bucket_cap_bytes)")
      ->capture_default_str();
  app.add_option("--segment-mib", a.segment_mib, "pipeline segment (ExchangeOptions)")
      ->capture_default_str();
  app.add_option("--channels", a.channels,
                 "Gloo connection meshes per rank: 2 lets two_phase overlap its all-gathers with "
                 "its next all-to-alls on a side channel; 1 runs them in turn")
      ->capture_default_str();
  app.add_option("--helper-nice", a.helper_nice,
                 "niceness added to the pipeline's codec thread, 0-19")
      ->capture_default_str();
  app.add_option("--loop-nice", a.loop_nice, "niceness added to Gloo's event-loop thread, 0-19")
      ->capture_default_str();
  app.add_option("--trace", a.trace_dir,
                 "write DIR/VARIANT.rankR.json, a Chrome trace (ui.perfetto.dev) of every "
                 "step's collectives and codec stages per lane");
  app.add_option("--blas-threads", a.blas_threads,
                 "OpenBLAS threads for the geometry's GEMMs (1: the ranks already share the "
                 "cores; more, from several rank threads at once, is many times slower)")
      ->capture_default_str();
  AddProcessModeFlags(app, a.process);
  if (int rc = ParseFlags(app, argc, argv); rc >= 0) std::exit(rc);
  if (a.ranks < 1) UsageError("--ranks", "must be >= 1", std::to_string(a.ranks));
  if (!(a.mib > 0)) UsageError("--mib", "must be positive", std::to_string(a.mib));
  if (a.iters < 1) UsageError("--iters", "must be >= 1", std::to_string(a.iters));
  if (a.warmup < 0) UsageError("--warmup", "must be >= 0", std::to_string(a.warmup));
  if (a.cols < 1) UsageError("--cols", "must be >= 1", std::to_string(a.cols));
  if (a.geometry_rank < 1)
    UsageError("--geometry-rank", "must be >= 1", std::to_string(a.geometry_rank));
  if (!(a.timeout_s > 0))
    UsageError("--timeout-s", "must be positive", std::to_string(a.timeout_s));
  if (!(a.bucket_mib > 0))
    UsageError("--bucket-mib", "must be positive", std::to_string(a.bucket_mib));
  if (!(a.segment_mib > 0))
    UsageError("--segment-mib", "must be positive", std::to_string(a.segment_mib));
  if (a.channels != 1 && a.channels != 2)
    UsageError("--channels", "must be 1 or 2", std::to_string(a.channels));
  if (a.blas_threads < 1)
    UsageError("--blas-threads", "must be >= 1", std::to_string(a.blas_threads));
  if (a.loop_nice < 0 || a.loop_nice > 19) {
    UsageError("--loop-nice", "must be in [0, 19]", std::to_string(a.loop_nice));
  }
  if (a.helper_nice < 0 || a.helper_nice > 19) {
    UsageError("--helper-nice", "must be in [0, 19]", std::to_string(a.helper_nice));
  }
  if (!a.trace_dir.empty() && !std::filesystem::is_directory(a.trace_dir)) {
    UsageError("--trace", "not a directory", a.trace_dir);
  }
  if (a.process.rank >= a.ranks)
    UsageError("--rank", "must be < --ranks", std::to_string(a.process.rank));
  if (a.process.rank >= 0 && a.process.store_dir.empty())
    UsageError("--store-dir", "required with --rank", "empty");
  return a;
}

std::vector<Variant> ParseVariants(const Args& a) {
  std::vector<Variant> out;
  size_t start = 0;
  const std::string& s = a.variants;
  while (start <= s.size()) {
    const size_t comma = std::min(s.find(',', start), s.size());
    const std::string item = s.substr(start, comma - start);
    start = comma + 1;
    if (item.empty()) continue;
    std::vector<std::string> parts;
    for (size_t p = 0; p <= item.size();) {
      const size_t colon = std::min(item.find(':', p), item.size());
      parts.push_back(item.substr(p, colon - p));
      p = colon + 1;
    }
    Variant v;
    v.label = item;
    const auto algo = ParseAlgorithm(parts[0]);
    if (!algo || *algo == Algorithm::kNative) {
      UsageError("--variants",
                 std::string("unknown algorithm, accepted: fp32, bf16, two_phase, allgather"),
                 parts[0]);
    }
    v.algorithm = *algo;
    if (v.algorithm == Algorithm::kTwoPhase || v.algorithm == Algorithm::kAllGather) {
      if (parts.size() < 2) UsageError("--variants", "needs ALGO:FORMAT", item);
      const auto fmt = ParseFormat(parts[1]);
      if (!fmt) {
        UsageError("--variants", "unknown format, accepted: " + std::string(AcceptedFormats()),
                   parts[1]);
      }
      v.policy.format = *fmt;
      if (parts.size() >= 3) {
        const auto g = ParseGeometryMode(parts[2]);
        if (!g) {
          UsageError("--variants",
                     "unknown geometry, accepted: " + std::string(AcceptedGeometryModes()),
                     parts[2]);
        }
        v.policy.geometry = *g;
        v.policy.rank = a.geometry_rank;
      }
      if (parts.size() > 3) UsageError("--variants", "too many fields", item);
    } else if (parts.size() > 1) {
      UsageError("--variants", "baselines take no format", item);
    }
    out.push_back(v);
  }
  if (out.empty()) UsageError("--variants", "empty list", a.variants);
  return out;
}

// Layer shapes covering `mib` MiB of fp32: rows x cols matrices of at most 4 MiB.
std::vector<LayerSpec> MakeLayers(const Args& a) {
  int64_t remaining = static_cast<int64_t>(a.mib * (1 << 20) / 4);
  const int64_t rows_per_layer = std::max<int64_t>(1, (int64_t{1} << 20) / a.cols);
  std::vector<LayerSpec> layers;
  while (remaining > 0) {
    const int64_t rows = std::min(rows_per_layer, (remaining + a.cols - 1) / a.cols);
    LayerSpec l;
    l.name = "layer" + std::to_string(layers.size());
    l.rows = rows;
    l.cols = std::min(a.cols, remaining);
    if (rows > 1) l.cols = a.cols;
    layers.push_back(l);
    remaining -= l.rows * l.cols;
  }
  return layers;
}

// A gradient with a few strong directions plus noise, different on every rank.
std::vector<float> MakeGradient(const LayerSpec& l, int rank, uint32_t layer) {
  std::vector<float> g(l.count());
  for (int64_t i = 0; i < l.rows; ++i) {
    for (int64_t j = 0; j < l.cols; ++j) {
      uint64_t z = (static_cast<uint64_t>(rank) << 56) ^ (static_cast<uint64_t>(layer) << 40) ^
                   static_cast<uint64_t>(i * l.cols + j);
      z = (z ^ (z >> 33)) * 0xff51afd7ed558ccdull;
      z ^= z >> 33;
      const float noise = static_cast<float>(z >> 40) / 16777216.0f - 0.5f;
      g[i * l.cols + j] = 4.0f * std::sin(0.01f * i + rank) * std::cos(0.013f * j) +
                          1.0f * std::cos(0.05f * i) * std::sin(0.07f * j + layer) + 0.05f * noise;
    }
  }
  return g;
}

struct Row {
  std::string label;
  double median_ms = 0;
  double wire_mib = 0;
  double rel_err = 0;
};

// Runs every variant on this rank; rank 0 gets the rows.
std::vector<Row> RunRank(Communicator& comm, const Args& a, const std::vector<Variant>& variants) {
  const auto base_layers = MakeLayers(a);
  std::vector<std::vector<float>> input(base_layers.size());
  for (size_t l = 0; l < base_layers.size(); ++l)
    input[l] = MakeGradient(base_layers[l], comm.rank(), l);
  std::vector<std::vector<float>> work = input;
  std::vector<std::vector<float>> fp32_result;
  std::vector<Row> rows;
  for (const Variant& v : variants) {
    auto layers = base_layers;
    std::vector<RefreshSchedule> schedule;
    for (size_t l = 0; l < layers.size(); ++l) {
      layers[l].policy = v.policy;
      // Owners spread over ranks; one refresh at step 0, active from step 1.
      schedule.push_back({static_cast<int>(l % comm.size()), 1 << 30, 0});
    }
    ExchangeOptions options;
    options.algorithm = v.algorithm;
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
    options.bucket_cap_bytes = static_cast<size_t>(a.bucket_mib * (1 << 20));
    options.segment_bytes = static_cast<size_t>(a.segment_mib * (1 << 20));
    options.helper_nice = a.helper_nice;
    ExchangeTrace trace;
    if (!a.trace_dir.empty()) options.trace = &trace;
    const bool geometry = v.policy.geometry != GeometryMode::kNone;
    Exchanger ex(comm, layers, options, geometry ? schedule : std::vector<RefreshSchedule>{});
    const int warmup = geometry ? std::max(a.warmup, 2) : a.warmup;
    std::vector<double> times;
    uint64_t wire = 0;
    for (int it = 0; it < warmup + a.iters; ++it) {
      for (size_t l = 0; l < work.size(); ++l)
        std::copy(input[l].begin(), input[l].end(), work[l].begin());
      std::vector<std::span<float>> grads(work.begin(), work.end());
      comm.Barrier();
      const auto t0 = std::chrono::steady_clock::now();
      const StepResult r = ex.Exchange(it, grads);
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      // The step takes as long as its slowest rank.
      const double slowest = comm.MaxReduce(static_cast<uint32_t>(std::min(us, 4e9)));
      if (it >= warmup) {
        times.push_back(slowest / 1000.0);
        wire = r.bytes_sent;
      }
    }
    if (options.trace) {
      std::string name = v.label;
      std::replace(name.begin(), name.end(), ':', '_');
      trace.WriteChromeJson(
          a.trace_dir + "/" + name + ".rank" + std::to_string(comm.rank()) + ".json", comm.rank());
    }
    if (v.algorithm == Algorithm::kFp32 && fp32_result.empty()) fp32_result = work;
    Row row;
    row.label = v.label;
    std::sort(times.begin(), times.end());
    row.median_ms = times[times.size() / 2];
    row.wire_mib = wire / double(1 << 20);
    if (!fp32_result.empty()) {
      double err = 0, norm = 0;
      for (size_t l = 0; l < work.size(); ++l) {
        for (size_t i = 0; i < work[l].size(); ++i) {
          const double d = work[l][i] - fp32_result[l][i];
          err += d * d;
          norm += static_cast<double>(fp32_result[l][i]) * fp32_result[l][i];
        }
      }
      row.rel_err = norm > 0 ? std::sqrt(err / norm) : 0;
    } else {
      row.rel_err = -1;
    }
    rows.push_back(row);
  }
  return rows;
}

void Print(const Args& a, const std::vector<Row>& rows, bool processes) {
  const auto layers = MakeLayers(a);
  const double bytes = a.mib * (1 << 20);
  std::printf(
      "exchange: %d ranks (%s, gloo tcp, %d channel%s), %.1f MiB fp32 per rank in %zu layers of up "
      "to %lldx%lld, "
      "buckets of %.0f MiB, median of %d iters, OpenBLAS core %s, %d thread%s\n",
      a.ranks, processes ? "processes" : "threads", a.channels, a.channels == 1 ? "" : "s", a.mib,
      layers.size(), static_cast<long long>(layers[0].rows), static_cast<long long>(layers[0].cols),
      a.bucket_mib, a.iters, model::BlasCoreName().c_str(), a.blas_threads,
      a.blas_threads == 1 ? "" : "s");
  double fp32_ms = 0;
  for (const auto& r : rows) {
    if (r.label == "fp32") fp32_ms = r.median_ms;
  }
  std::printf("%-30s %10s %14s %11s %9s %10s\n", "variant", "time_ms", "wire_MiB/rank",
              "busbw_GB/s", "vs_fp32", "rel_err");
  for (const auto& r : rows) {
    const double algbw = bytes / (r.median_ms / 1000.0) / 1e9;
    const double busbw = algbw * 2.0 * (a.ranks - 1) / a.ranks;
    char ratio[32] = "n/a", err[32] = "n/a";
    if (fp32_ms > 0) std::snprintf(ratio, sizeof ratio, "%.3f", r.median_ms / fp32_ms);
    if (r.rel_err >= 0) std::snprintf(err, sizeof err, "%.2e", r.rel_err);
    std::printf("%-30s %10.2f %14.2f %11.3f %9s %10s\n", r.label.c_str(), r.median_ms, r.wire_mib,
                busbw, ratio, err);
  }
  if (fp32_ms == 0) std::printf("(add fp32 to --variants for the ratio column)\n");
}

int RunExchangeBench(int argc, char** argv) {
  const Args a = ParseArgs(argc, argv);
  model::SetBlasThreads(a.blas_threads);
  auto variants = ParseVariants(a);
  // fp32 first: it is the baseline for both the ratio and the error column.
  std::stable_partition(variants.begin(), variants.end(),
                        [](const Variant& v) { return v.algorithm == Algorithm::kFp32; });
  GlooOptions go;
  go.hostname = a.process.hostname;
  go.prefix = a.process.prefix;
  go.channels = a.channels;
  go.loop_nice = a.loop_nice;
  go.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  return RunRanks<Row>(
      kProg, a.ranks, a.process.rank, a.process.store_dir, go,
      [&](Communicator& comm) { return RunRank(comm, a, variants); },
      [&](const std::vector<Row>& rows, bool processes) { Print(a, rows, processes); });
}

}  // namespace

GEOFP8_REGISTER_BENCH("exchange", "compressed gradient all-reduce: time, wire bytes, busbw vs fp32",
                      RunExchangeBench);

}  // namespace geofp8::bench
