// geofp8-bench geometry: quality of geometry-aware quantization against Euclidean on a seeded
// anisotropic suite (band errors), and the cost of transform + inverse against same-run sgemm.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "bench/dump.h"
#include "bench/registry.h"
#include "kernels/codec/codec.h"
#include "kernels/codec/error_metrics.h"
#include "kernels/common/check.h"
#include "kernels/geometry/analysis.h"
#include "kernels/geometry/factor_sketch.h"
#include "kernels/geometry/fused.h"
#include "kernels/geometry/geometry.h"
#include "kernels/geometry/synthetic.h"

namespace geofp8::bench {
namespace {

constexpr const char* kProg = "geofp8-bench geometry";

struct Shape {
  int64_t m, n;
};

struct Args {
  std::string mode = "all";  // quality, cost, all
  bool large = false;        // add the 4096-wide shapes
  int threads = 1;           // OpenBLAS threads for everything in this run
  int reps = 5;              // timed repetitions per cost point (median reported)
  int rank = 16;             // k of the quality suite
  double drift = 0.3;        // basis rotation of the stale twin
  uint64_t seed = 1;
  std::vector<Shape> shapes;  // overrides the default shape list of the chosen mode
  std::vector<SyntheticFamily> families = {SyntheticFamily::kSpectral, SyntheticFamily::kKronecker,
                                           SyntheticFamily::kLowRankNoise};
  std::vector<double> decays = {0.5, 1.0, 1.5, 2.0};
  bool require_target = false;  // exit 1 if any quality case with fit >= 0.99 misses the target
  std::string grads;            // a geofp8-train --dump-grads step folder: real-gradient table only
  std::string grads_stale;      // an earlier step folder of the same run: the stale basis
};

[[noreturn]] void UsageError(const std::string& field, const std::string& problem,
                             const std::string& value) {
  bench::UsageError(kProg, field, problem, value);
}

double ParseDouble(const std::string& flag, const char* text) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text, &end);
  if (!*text || *end != '\0' || errno != 0 || !std::isfinite(v))
    UsageError(flag, "not a number", text);
  return v;
}

std::vector<Shape> ParseShapes(const char* text) {
  std::vector<Shape> out;
  std::string s = text;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    const std::string item = s.substr(pos, comma - pos);
    long long m = 0, n = 0;
    char tail = 0;
    if (std::sscanf(item.c_str(), "%lldx%lld%c", &m, &n, &tail) != 2 || m < 1 || n < 1 ||
        m > 16384 || n > 16384) {
      UsageError("--shapes", "expected MxN with 1 <= M, N <= 16384", item);
    }
    out.push_back({m, n});
    pos = comma + 1;
  }
  return out;
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  std::string shapes, families, decays;
  CLI::App app{
      "quality: families (spectral, kron, lowrank_noise) x decay p (0.5,1,1.5,2) x shapes "
      "(default 64x64, 256x1024, 1024x256, 512x512: the brute-force SVD and band projections of "
      "2048x2048 take minutes each on 2 cores, so --large adds 2048x2048 and 4096x4096); "
      "fp8_e4m3 (tensor and block 128 scaling) and nvfp4, each with the same scaling with and "
      "without geometry; stale basis = drifted twin (--drift).\n"
      "cost: apply + inverse for k in {8,16,32,64} vs sgemm m x n x 8k (same FLOPs) (default "
      "1024x1024, 2048x2048, 4096x1024; --large adds 4096x4096), and the fused codec path "
      "(fused.h) against ApplyGeometry + Encode + Decode + Invert",
      "geometry"};
  app.add_option("--mode", a.mode, "quality, cost or all")
      ->capture_default_str()
      ->check(CLI::IsMember({"quality", "cost", "all"}));
  app.add_flag("--large", a.large, "add the 2048- and 4096-wide shapes");
  app.add_option("--threads", a.threads, "OpenBLAS threads for everything in this run")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app.add_option("--reps", a.reps, "timed repetitions per cost point (median reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--rank", a.rank, "k of the quality suite")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--drift", a.drift, "basis rotation of the stale twin")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 10.0));
  app.add_option("--seed", a.seed, "seed")->capture_default_str()->check(CLI::Range(0, 1 << 30));
  app.add_option("--shapes", shapes, "MxN,MxN,... (overrides the mode's default shapes)");
  app.add_option("--families", families, "comma list of spectral, kron, lowrank_noise");
  app.add_option("--decays", decays, "comma list of spectral decays p, each in [0, 8]");
  app.add_flag("--require-target", a.require_target,
               "exit 1 if any quality case with fit >= 0.99 misses the target");
  app.add_option("--grads", a.grads,
                 "the quality table on the matrices of a `geofp8-train --dump-grads` step folder "
                 "(shapes.json + float32 files), instead of the synthetic suite");
  app.add_option("--grads-stale", a.grads_stale,
                 "an earlier step's folder of the same run: the stale basis (needs --grads)");
  if (int rc = ParseFlags(app, argc, argv); rc >= 0) std::exit(rc);
  if (!shapes.empty()) a.shapes = ParseShapes(shapes.c_str());
  if (app.count("--families") > 0) {
    a.families.clear();
    for (size_t pos = 0; pos <= families.size();) {
      const size_t comma = std::min(families.find(',', pos), families.size());
      const std::string name = families.substr(pos, comma - pos);
      const auto f = ParseSyntheticFamily(name);
      if (!f) UsageError("--families", "accepted: spectral, kron, lowrank_noise", name);
      a.families.push_back(*f);
      pos = comma + 1;
    }
  }
  if (app.count("--decays") > 0) {
    a.decays.clear();
    for (size_t pos = 0; pos <= decays.size();) {
      const size_t comma = std::min(decays.find(',', pos), decays.size());
      const std::string item = decays.substr(pos, comma - pos);
      const double p = ParseDouble("--decays", item.c_str());
      if (p < 0 || p > 8) UsageError("--decays", "each must be in [0, 8]", item);
      a.decays.push_back(p);
      pos = comma + 1;
    }
  }
  if (!a.grads_stale.empty() && a.grads.empty()) {
    UsageError("--grads-stale", "needs --grads", a.grads_stale);
  }
  return a;
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

// ---------------------------------------------------------------------------------------------
// Quality

struct Candidate {
  double worst = 0, rel_fro = 0;
};

Candidate Evaluate(const SpectralReference& ref, const std::vector<float>& g, const Geometry* geo,
                   const CodecOptions& codec, int64_t k) {
  std::vector<float> x = g, decoded;
  if (geo) ApplyGeometry(*geo, x);
  AnalyzeCodec(x, codec, &decoded);
  if (geo) InvertGeometry(*geo, decoded);
  Candidate c;
  c.worst = ComputeBandErrors(ref, g, decoded, k).worst_band_error;
  c.rel_fro = RelFroError(g, decoded);
  return c;
}

struct CodecCase {
  const char* label;
  CodecOptions options;
};

std::vector<CodecCase> QualityCodecs() {
  CodecOptions tensor;
  tensor.format = Format::kFp8E4M3;
  tensor.scaling = Scaling::kTensor;
  CodecOptions block;
  block.format = Format::kFp8E4M3;
  block.scaling = Scaling::kBlock;
  block.block = 128;
  CodecOptions nvfp4;
  nvfp4.format = Format::kNvfp4;
  return {{"fp8_e4m3, tensor scaling", tensor},
          {"fp8_e4m3, block(128) scaling", block},
          {"nvfp4 (E4M3 per 16 + fp32 tensor scale)", nvfp4}};
}

// Least-squares slope of -log sigma_i against log(i+1) over the top half of the spectrum (the
// bottom half of steep spectra sits at float32 round-off): the decay exponent the target is about.
double FittedDecay(const std::vector<double>& sigma) {
  const size_t half = std::max<size_t>(2, sigma.size() / 2);
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  int cnt = 0;
  for (size_t i = 0; i < std::min(half, sigma.size()); ++i) {
    if (!(sigma[i] > 0)) break;
    const double x = std::log(double(i + 1)), y = std::log(sigma[i]);
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
    ++cnt;
  }
  if (cnt < 2) return 0;
  return -(cnt * sxy - sx * sy) / (cnt * sxx - sx * sx);
}

// Best worst_band_error gain any transform that leaves the directions beyond k untouched can
// reach, roughly: the quantization noise follows the energy of what the transform leaves, which is
// at least the tail ||G - G_k||_F, while Euclidean noise follows ||G||_F.
double TailBound(const std::vector<double>& sigma, int64_t k) {
  double total = 0, tail = 0;
  for (size_t i = 0; i < sigma.size(); ++i) {
    total += sigma[i] * sigma[i];
    if (static_cast<int64_t>(i) >= k) tail += sigma[i] * sigma[i];
  }
  return tail > 0 ? std::sqrt(total / tail) : std::numeric_limits<double>::infinity();
}

struct QualityRow {
  std::string matrix;
  std::string p;  // generator parameter, "-" for real gradients
  double fitted = 0, drift = 0, bound = 0;
  bool has_stale = true, has_diag = true;
  Candidate euclid, fresh, stale, diag;
};

// One matrix under every codec: Euclidean, fresh, and (when given) stale and diag geometries.
void EvaluateMatrix(const std::string& name, const std::string& p, const std::vector<float>& g,
                    int64_t m, int64_t n, const RefreshResult& fresh, const Geometry* stale,
                    const Geometry* diag, int k, const std::vector<CodecCase>& codecs,
                    std::vector<std::vector<QualityRow>>& rows) {
  const SpectralReference ref = ComputeSpectralReference(g, m, n);
  for (size_t c = 0; c < codecs.size(); ++c) {
    QualityRow r;
    r.matrix = name;
    r.p = p;
    r.fitted = FittedDecay(ref.sigma);
    r.bound = TailBound(ref.sigma, k);
    r.drift = fresh.drift;
    r.has_stale = stale != nullptr;
    r.has_diag = diag != nullptr;
    r.euclid = Evaluate(ref, g, nullptr, codecs[c].options, k);
    r.fresh = Evaluate(ref, g, &fresh.geometry, codecs[c].options, k);
    if (stale) r.stale = Evaluate(ref, g, stale, codecs[c].options, k);
    if (diag) r.diag = Evaluate(ref, g, diag, codecs[c].options, k);
    rows[c].push_back(r);
  }
}

std::string Fmt(const char* f, double v) {
  char b[48];
  std::snprintf(b, sizeof(b), f, v);
  return b;
}

// Gains with one decimal, and two significant digits below 1 (a stale basis can lose 50x).
std::string Gain(double g) { return g < 1 ? Fmt("%.2g", g) : Fmt("%.1f", g); }

// Prints one table per codec; counts the (fresh|stale) cases with fit >= 0.99 meeting the target.
void PrintQualityTables(const std::vector<CodecCase>& codecs,
                        const std::vector<std::vector<QualityRow>>& rows, int* met,
                        int* applicable) {
  for (size_t c = 0; c < codecs.size(); ++c) {
    std::printf("#### %s\n\n", codecs[c].label);
    std::printf(
        "| matrix | p | fit | bound | drift | euclid worst | fresh worst | stale worst | diag "
        "worst "
        "| gain fresh | gain stale | gain diag | euclid rel_fro | fro fresh | fro stale | target "
        "|\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const QualityRow& r : rows[c]) {
      const double gf = r.euclid.worst / std::max(r.fresh.worst, 1e-300);
      const double gs = r.euclid.worst / std::max(r.stale.worst, 1e-300);
      const double gd = r.euclid.worst / std::max(r.diag.worst, 1e-300);
      const double ff = r.fresh.rel_fro / std::max(r.euclid.rel_fro, 1e-300);
      const double fs = r.stale.rel_fro / std::max(r.euclid.rel_fro, 1e-300);
      std::string target = "n/a";
      if (r.fitted >= 0.99) {
        const bool ok_f = gf >= 3 && ff <= 1.1, ok_s = gs >= 3 && fs <= 1.1;
        target = ok_f ? "yes" : "NO";
        *applicable += 1;
        *met += ok_f;
        if (r.has_stale) {
          target += std::string("/") + (ok_s ? "yes" : "NO");
          *applicable += 1;
          *met += ok_s;
        }
      }
      const std::string dash = "-";
      std::printf(
          "| %s | %s | %.2f | %.3g | %s | %.3g | %.3g | %s | %s | %s | %s | %s | %.3g | %.2f | %s "
          "| %s |\n",
          r.matrix.c_str(), r.p.c_str(), r.fitted, r.bound,
          r.has_stale ? Fmt("%.3f", r.drift).c_str() : "-", r.euclid.worst, r.fresh.worst,
          r.has_stale ? Fmt("%.3g", r.stale.worst).c_str() : "-",
          r.has_diag ? Fmt("%.3g", r.diag.worst).c_str() : "-", Gain(gf).c_str(),
          r.has_stale ? Gain(gs).c_str() : "-", r.has_diag ? Gain(gd).c_str() : "-",
          r.euclid.rel_fro, ff, r.has_stale ? Fmt("%.2f", fs).c_str() : "-", target.c_str());
    }
    std::printf("\n");
  }
}

const char* kBoundNote =
    "bound = ||G||_F / ||G - G_k||_F from the exact SVD: roughly the largest worst-band gain a "
    "transform that leaves the directions beyond k untouched can reach; where it is below 3 the "
    "target is out of reach at this k.\n";

int RunQuality(const Args& a) {
  std::vector<Shape> shapes = a.shapes;
  if (shapes.empty()) {
    shapes = {{64, 64}, {256, 1024}, {1024, 256}, {512, 512}};
    if (a.large) {
      shapes.push_back({2048, 2048});
      shapes.push_back({4096, 4096});
    }
  }
  const std::vector<CodecCase> codecs = QualityCodecs();
  std::vector<std::vector<QualityRow>> rows(codecs.size());
  const auto t_start = std::chrono::steady_clock::now();
  for (const Shape& s : shapes) {
    for (SyntheticFamily fam : a.families) {
      for (double p : a.decays) {
        SyntheticSpec spec{fam, s.m, s.n, p, a.seed, 0.0};
        const std::vector<float> g = MakeSyntheticGradient(spec);
        spec.drift = a.drift;
        const std::vector<float> g_prev = MakeSyntheticGradient(spec);
        GeometryOptions lo;
        lo.mode = GeometryMode::kLowRank;
        lo.rank = a.rank;
        lo.seed = a.seed;
        lo.power_iters = 4;  // the stale basis stands for a long warm-started history
        const Geometry stale = EstimateGeometry(g_prev, s.m, s.n, lo, nullptr).geometry;
        lo.power_iters = 1;  // one refresh, warm-started from the stale basis
        const RefreshResult fresh = EstimateGeometry(g, s.m, s.n, lo, &stale);
        GeometryOptions dg;
        dg.mode = GeometryMode::kDiag;
        const Geometry diag = EstimateGeometry(g_prev, s.m, s.n, dg, nullptr).geometry;
        char name[96];
        std::snprintf(name, sizeof(name), "%s %lldx%lld",
                      std::string(SyntheticFamilyName(fam)).c_str(), static_cast<long long>(s.m),
                      static_cast<long long>(s.n));
        EvaluateMatrix(name, Fmt("%.1f", p), g, s.m, s.n, fresh, &stale, &diag, a.rank, codecs,
                       rows);
        std::fprintf(stderr, "  [%6.1fs] %s p=%.1f done\n", Seconds(t_start), name, p);
      }
    }
  }
  std::printf(
      "### Quality: worst_band_error and rel_fro_error, lowrank k=%d (alpha 0.25), seed %llu\n\n",
      a.rank, static_cast<unsigned long long>(a.seed));
  std::printf(
      "gain = euclid worst_band_error / geometry worst_band_error; fro = geometry rel_fro / "
      "euclid rel_fro.\nfresh: refreshed on this gradient (q=1, warm from stale); stale: "
      "estimated on the drifted twin (drift --drift %.2f; `drift` column = measured "
      "subspace distance stale->fresh); diag: estimated on the twin.\n"
      "p = generator parameter; fit = fitted decay exponent of the singular values (top half).\n"
      "%s"
      "target (fit >= 0.99, i.e. decay at least i^-1 within the fit's round-off): gain >= 3 and "
      "fro <= 1.1, shown for fresh/stale.\n\n",
      a.drift, kBoundNote);
  int met = 0, applicable = 0;
  PrintQualityTables(codecs, rows, &met, &applicable);
  std::printf(
      "target met on %d of %d (matrix, format, fresh|stale) cases with fit >= 0.99; quality "
      "suite took %.1f s\n\n",
      met, applicable, Seconds(t_start));
  if (a.require_target && met != applicable) {
    std::fprintf(stderr, "%s: error: --require-target: %d case(s) missed the target\n", kProg,
                 applicable - met);
    return 1;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Real gradients: a `geofp8-train --dump-grads` step folder (shapes.json + raw float32 files).

int RunGrads(const Args& a) {
  const std::vector<DumpedLayer> layers = ReadDump(kProg, a.grads, "--grads");
  std::vector<DumpedLayer> stale_layers;
  if (!a.grads_stale.empty()) stale_layers = ReadDump(kProg, a.grads_stale, "--grads-stale");
  const std::vector<CodecCase> codecs = QualityCodecs();
  std::vector<std::vector<QualityRow>> rows(codecs.size());
  const auto t_start = std::chrono::steady_clock::now();
  int skipped = 0;
  for (const DumpedLayer& l : layers) {
    if (l.rows < 2 || l.cols < 2) {  // 1-D tensors always use geometry none
      ++skipped;
      continue;
    }
    const std::vector<float> g =
        ReadMatrix(kProg, a.grads, l.name, l.avg, l.rows, l.cols, "--grads");
    GeometryOptions lo;
    lo.mode = GeometryMode::kLowRank;
    lo.rank = a.rank;
    lo.seed = a.seed;
    std::optional<Geometry> stale;
    RefreshResult fresh;
    if (!stale_layers.empty()) {
      auto it = std::find_if(stale_layers.begin(), stale_layers.end(),
                             [&](const DumpedLayer& s) { return s.name == l.name; });
      if (it == stale_layers.end() || it->rows != l.rows || it->cols != l.cols) {
        UsageError("--grads-stale",
                   "no layer " + l.name + " of shape " + std::to_string(l.rows) + "x" +
                       std::to_string(l.cols),
                   a.grads_stale);
      }
      const std::vector<float> g_prev =
          ReadMatrix(kProg, a.grads_stale, it->name, it->avg, it->rows, it->cols, "--grads-stale");
      lo.power_iters = 4;  // the earlier step's basis, as a warm-started history would leave it
      stale = EstimateGeometry(g_prev, l.rows, l.cols, lo, nullptr).geometry;
      lo.power_iters = 1;  // one refresh on this step, warm from it
      fresh = EstimateGeometry(g, l.rows, l.cols, lo, &*stale);
    } else {
      lo.power_iters = 4;  // no history: a cold estimate with as many iterations
      fresh = EstimateGeometry(g, l.rows, l.cols, lo, nullptr);
    }
    GeometryOptions dg;
    dg.mode = GeometryMode::kDiag;
    const Geometry diag = EstimateGeometry(g, l.rows, l.cols, dg, nullptr).geometry;
    const std::string name = l.name + " " + std::to_string(l.rows) + "x" + std::to_string(l.cols);
    EvaluateMatrix(name, "-", g, l.rows, l.cols, fresh, stale ? &*stale : nullptr, &diag, a.rank,
                   codecs, rows);
    std::fprintf(stderr, "  [%6.1fs] %s done\n", Seconds(t_start), name.c_str());
  }
  std::printf("### Real gradients: %s, lowrank k=%d (alpha 0.25)\n\n", a.grads.c_str(), a.rank);
  std::printf(
      "Averaged gradients from `geofp8-train --dump-grads`; %d 1-D layer(s) skipped (always "
      "geometry none).\nfresh: %s; stale: %s; diag: estimated on this gradient.\n%s"
      "Same columns and target as the synthetic suite (gain >= 3 and fro <= 1.1 where fit >= "
      "0.99).\n\n",
      skipped,
      stale_layers.empty() ? "cold estimate on this gradient (q=4)"
                           : "one q=1 refresh on this gradient, warm from the stale basis",
      stale_layers.empty() ? "none given (--grads-stale)"
                           : ("estimated (q=4) on the same layer in " + a.grads_stale +
                              "; `drift` = measured subspace distance stale->fresh")
                                 .c_str(),
      kBoundNote);
  int met = 0, applicable = 0;
  PrintQualityTables(codecs, rows, &met, &applicable);
  std::printf(
      "target met on %d of %d (layer, format, fresh|stale) cases with fit >= 0.99; took %.1f s\n\n",
      met, applicable, Seconds(t_start));
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Cost

// The ema estimator's per-step cost (factor_sketch.h, default options at k = 8) against the
// transform it feeds and an sgemm with the FLOPs of its two products over G.
void RunSketchCost(const Args& a, const std::vector<Shape>& shapes) {
  const FactorSketchOptions so;  // width 8, probes 4 every 4th update: G X has 8 or 12 columns
  const int cx = so.width + so.probes, ca = so.width + cx;
  std::printf(
      "### Cost of the ema estimator: one FactorSketch update (width %d, probes %d every %d "
      "updates; the mean over that cycle, and a probing update alone) vs apply + inverse at "
      "k = 8 and sgemm m x n x %d (the FLOPs of a probing update's two products over G), %d "
      "BLAS thread(s), median of %d interleaved reps\n\n",
      so.width, so.probes, so.probe_every, cx + ca, a.threads, a.reps);
  std::printf(
      "| shape | sketch update ms (cycle mean) | probing update ms | with the inverse's products "
      "ms (cycle mean) | apply+inverse ms | sgemm ms | update / sgemm | update / transform | "
      "state held KiB | scratch KiB |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    const int64_t m = s.m, n = s.n;
    const std::vector<float> g =
        MakeSyntheticGradient({SyntheticFamily::kSpectral, m, n, 1.0, a.seed, 0});
    FactorSketch sketch;
    for (int i = 0; i < 2; ++i) UpdateFactorSketch(sketch, g, m, n, 8, so);  // warm: held basis
    SketchGeometryOptions go;
    const Geometry geo = GeometryFromSketch(sketch, go, 1);
    const int64_t kk = cx + ca;
    std::vector<float> A(size_t(m * kk), 0.5f), B(size_t(kk * n), 0.25f), C(size_t(m * n));
    std::vector<float> x(g.size());
    std::vector<double> tu, tp, tt, tg, tkp, tku;
    InverseProducts known;
    for (int r = 0; r <= a.reps; ++r) {
      // A probing update (the update count a multiple of probe_every), then a plain one.
      FactorSketch copy = sketch;
      copy.updates = uint64_t(so.probe_every) * 2;
      auto t0 = std::chrono::steady_clock::now();
      UpdateFactorSketch(copy, g, m, n, 8, so);
      if (r) tp.push_back(Seconds(t0));
      copy = sketch;
      copy.updates = uint64_t(so.probe_every) * 2 + 1;
      t0 = std::chrono::steady_clock::now();
      UpdateFactorSketch(copy, g, m, n, 8, so);
      if (r) tu.push_back(Seconds(t0));
      std::copy(g.begin(), g.end(), x.begin());
      t0 = std::chrono::steady_clock::now();
      ApplyGeometry(geo, x);
      InvertGeometry(geo, x, &known);  // as the exchange runs it before a refresh
      if (r) tt.push_back(Seconds(t0));
      // The same two updates taking G V, U^T G and ||G||^2 from that inverse, as the exchange's
      // refresh does when the geometry in force came from the sketch's last update.
      for (const int plus : {0, 1}) {
        copy = sketch;
        copy.updates = uint64_t(so.probe_every) * 2 + plus;
        t0 = std::chrono::steady_clock::now();
        const bool used = UpdateFactorSketch(copy, x, m, n, 8, so, &known);
        if (r) (plus ? tku : tkp).push_back(Seconds(t0));
        GEOFP8_CHECK(used, "sketch cost: the inverse's products were not taken");
      }
      t0 = std::chrono::steady_clock::now();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, kk, 1.f, A.data(), kk, B.data(),
                  n, 0.f, C.data(), n);
      if (r) tg.push_back(Seconds(t0));
    }
    const double probing = Median(tp), t = Median(tt), gm = Median(tg);
    const double u = (probing + (so.probe_every - 1) * Median(tu)) / so.probe_every;
    const double uk = (Median(tkp) + (so.probe_every - 1) * Median(tku)) / so.probe_every;
    const double held = double((m + n) * sketch.width) * 4 + 2.0 * sketch.width * 8;
    // x, y (padded to whole 8-float registers), qf, bf in float; q, bd, z, e, rot in double
    // (factor_sketch.cc Scratch), plus the copy of its input that OrthonormalizeInPlace keeps for
    // the Householder fallback.
    const double cz = sketch.width + ca, ldx = (cx + 7) / 8 * 8;
    const double scratch = 4.0 * (n * ldx + m * ldx + m * ca + double(ca) * n) +
                           8.0 * (m * ca + double(ca) * n + n * cz + cz * ca +
                                  std::max(m, n) * sketch.width + std::max(double(m) * ca, n * cz));
    std::printf("| %lldx%lld | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %.0f |\n",
                static_cast<long long>(m), static_cast<long long>(n), u * 1e3, probing * 1e3,
                uk * 1e3, t * 1e3, gm * 1e3, u / gm, u / t, held / 1024, scratch / 1024);
    std::fflush(stdout);
  }
  std::printf("\n");
}

int RunCost(const Args& a) {
  std::vector<Shape> shapes = a.shapes;
  if (shapes.empty()) {
    shapes = {{1024, 1024}, {2048, 2048}, {4096, 1024}};
    if (a.large) shapes.push_back({4096, 4096});
  }
  std::printf(
      "### Cost: apply + inverse vs sgemm of the same FLOPs (16 m n k), %d BLAS thread(s), "
      "median of %d interleaved reps\n\n",
      a.threads, a.reps);
  std::printf(
      "unfused = ApplyGeometry in place, Encode of 4 block-aligned chunks (fp8_e4m3 block 128, "
      "as two_phase at 4 ranks), Decode of the 4 chunks, InvertGeometry in place; fused = "
      "EncodeWithGeometry + DecodeWithGeometry (kernels/geometry/fused.h) on the same "
      "chunks, checked bit-identical to unfused.\n\n");
  std::printf(
      "| shape | k | apply+inverse ns/elem | GFLOP/s | sgemm m x n x 8k GFLOP/s | ratio to sgemm "
      "| refresh q=1 ms | fp8 enc+dec ns/elem | transform / codec | unfused ns/elem "
      "| fused ns/elem | fused / unfused |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    const int64_t m = s.m, n = s.n, elems = m * n;
    const std::vector<float> g =
        MakeSyntheticGradient({SyntheticFamily::kSpectral, m, n, 1.0, a.seed, 0});
    // Codec baseline: fp8_e4m3 block(128) encode + decode of the same matrix.
    CodecOptions co;
    std::vector<uint8_t> wire(EncodedBytes(co, g.size()));
    std::vector<float> dec(g.size());
    std::vector<double> tc;
    for (int r = 0; r <= a.reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      Encode(g, co, wire);
      Decode(wire, dec);
      if (r) tc.push_back(Seconds(t0));
    }
    const double codec_ns = Median(tc) * 1e9 / elems;
    // The chunks of two_phase at 4 ranks: block-aligned, near even (kernels/exchange/chunking.h).
    constexpr int kChunks = 4;
    std::vector<std::pair<size_t, size_t>> chunks;
    {
      const size_t blocks = (g.size() + co.block - 1) / co.block;
      for (int j = 0; j < kChunks; ++j) {
        chunks.push_back({std::min(g.size(), blocks * j / kChunks * co.block),
                          std::min(g.size(), blocks * (j + 1) / kChunks * co.block)});
      }
    }
    auto row = [&](const std::string& label, const Geometry& geo, double flops, double refresh_ms) {
      // Transform and its sgemm baseline are timed interleaved, rep by rep, so a load change on
      // a shared machine hits both alike and the ratio stays meaningful.
      const bool lowrank = geo.mode == GeometryMode::kLowRank;
      const int64_t kk =
          lowrank ? 8 * geo.k : 0;  // C (m x n) = A (m x 8k) B (8k x n): 16 m n k FLOP
      std::vector<float> A(static_cast<size_t>(m * kk), 0.5f),
          B(static_cast<size_t>(kk * n), 0.25f), C(lowrank ? static_cast<size_t>(m * n) : 0);
      std::vector<float> x(g.size()), y_u(g.size()), y_f(g.size());
      std::vector<std::vector<uint8_t>> wire_u(kChunks), wire_f(kChunks);
      std::vector<FusedEncodeTarget> targets(kChunks);
      std::vector<FusedDecodeSource> sources(kChunks);
      for (int j = 0; j < kChunks; ++j) {
        const size_t len = chunks[j].second - chunks[j].first;
        wire_u[j].resize(EncodedBytes(co, len));
        wire_f[j].resize(EncodedBytes(co, len));
        targets[j].begin = sources[j].begin = chunks[j].first;
        targets[j].end = sources[j].end = chunks[j].second;
        targets[j].options = co;
        targets[j].out = wire_f[j];
        sources[j].in = wire_f[j];
      }
      std::vector<double> tt, tg, tu, tf;
      for (int r = 0; r <= a.reps; ++r) {
        std::copy(g.begin(), g.end(), x.begin());
        auto t0 = std::chrono::steady_clock::now();
        ApplyGeometry(geo, x);
        InvertGeometry(geo, x);
        if (r) tt.push_back(Seconds(t0));
        if (lowrank) {
          t0 = std::chrono::steady_clock::now();
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, kk, 1.f, A.data(), kk,
                      B.data(), n, 0.f, C.data(), n);
          if (r) tg.push_back(Seconds(t0));
        }
        std::copy(g.begin(), g.end(), x.begin());
        t0 = std::chrono::steady_clock::now();
        ApplyGeometry(geo, x);
        for (int j = 0; j < kChunks; ++j) {
          Encode(std::span<const float>(x).subspan(chunks[j].first,
                                                   chunks[j].second - chunks[j].first),
                 co, wire_u[j]);
        }
        for (int j = 0; j < kChunks; ++j) {
          Decode(wire_u[j], std::span<float>(y_u).subspan(chunks[j].first,
                                                          chunks[j].second - chunks[j].first));
        }
        InvertGeometry(geo, y_u);
        if (r) tu.push_back(Seconds(t0));
        t0 = std::chrono::steady_clock::now();
        EncodeWithGeometry(geo, g, targets);
        DecodeWithGeometry(geo, sources, y_f);
        if (r) tf.push_back(Seconds(t0));
        if (r == 0 && (wire_u != wire_f ||
                       std::memcmp(y_u.data(), y_f.data(), y_u.size() * sizeof(float)) != 0)) {
          GEOFP8_FAIL("fused and unfused paths differ for ", m, "x", n, " geometry ", label);
        }
      }
      const double t = Median(tt);
      std::string gemm = "-", ratio = "-";
      if (lowrank) {
        const double tgm = Median(tg);
        char b1[32], b2[32];
        std::snprintf(b1, sizeof(b1), "%.1f", flops / tgm * 1e-9);
        std::snprintf(b2, sizeof(b2), "%.2f", tgm / t);
        gemm = b1;
        ratio = b2;
      }
      char gf[32];
      std::snprintf(gf, sizeof(gf), "%.1f", flops > 0 ? flops / t * 1e-9 : 0.0);
      const double tun = Median(tu), tfu = Median(tf);
      std::printf(
          "| %lldx%lld | %s | %.2f | %s | %s | %s | %.1f | %.2f | %.2f | %.2f | %.2f | %.2f |\n",
          static_cast<long long>(m), static_cast<long long>(n), label.c_str(), t * 1e9 / elems,
          flops > 0 ? gf : "-", gemm.c_str(), ratio.c_str(), refresh_ms, codec_ns,
          t * 1e9 / elems / codec_ns, tun * 1e9 / elems, tfu * 1e9 / elems, tfu / tun);
      std::fflush(stdout);
    };
    for (int k : {8, 16, 32, 64}) {
      GeometryOptions o;
      o.rank = k;
      o.seed = a.seed;
      Geometry geo = EstimateGeometry(g, m, n, o, nullptr).geometry;
      std::vector<double> tr;
      for (int r = 0; r < a.reps; ++r) tr.push_back(EstimateGeometry(g, m, n, o, &geo).seconds);
      row(std::to_string(k), geo, 16.0 * m * n * k, Median(tr) * 1e3);
    }
    GeometryOptions d;
    d.mode = GeometryMode::kDiag;
    const Geometry diag = EstimateGeometry(g, m, n, d, nullptr).geometry;
    std::vector<double> tr;
    for (int r = 0; r < a.reps; ++r) tr.push_back(EstimateGeometry(g, m, n, d, nullptr).seconds);
    row("diag", diag, 0, Median(tr) * 1e3);
  }
  std::printf("\n");
  RunSketchCost(a, shapes);
  return 0;
}

int RunGeometryBench(int argc, char** argv) {
  const Args a = ParseArgs(argc, argv);
  openblas_set_num_threads(a.threads);
  try {
    if (!a.grads.empty()) return RunGrads(a);
    if (a.mode == "cost" || a.mode == "all") RunCost(a);
    if (a.mode == "quality" || a.mode == "all") return RunQuality(a);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", kProg, e.what());
    return 1;
  }
  return 0;
}

}  // namespace

GEOFP8_REGISTER_BENCH("geometry",
                      "geometry transform: band-error quality vs Euclidean, cost vs sgemm",
                      RunGeometryBench);

}  // namespace geofp8::bench
