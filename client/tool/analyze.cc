// geofp8-tool analyze: encode + decode a float32 file and print the quality metrics as JSON
// (kernels/codec/error_metrics.h); --out also writes the decoded float32 file. With --shape MxN
// it also reports band errors (kernels/geometry/analysis.h), optionally through a geometry.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>

#include "client/tool/tool_common.h"
#include "kernels/codec/error_metrics.h"
#include "kernels/geometry/analysis.h"
#include "kernels/geometry/geometry.h"
#include "kernels/geometry/hadamard.h"

namespace geofp8::tool {
namespace {

struct AnalyzeArgs {
  CodecFlags codec;
  std::string shape;              // "MxN": enables the band metrics
  std::string geometry = "none";  // none, diag, lowrank, hadamard, diag+hadamard, lowrank+hadamard
  int hadamard_block = 0;         // rotation block; 0: the codec's scale block (128 without one)
  int rank = 16;                  // k of lowrank, and the band parameter
  float alpha = 0.25f;            // whitening exponent
  std::string basis_from;         // estimate the geometry on this gradient instead of --in
};

std::string JsonNum(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os.precision(9);
  os << v;
  return os.str();
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void RunAnalyze(const AnalyzeArgs& a) {
  const CodecOptions o = ToOptions(a.codec);
  const std::optional<GeometryTransform> transform = ParseTransformName(a.geometry);
  if (!transform) {
    UsageError("geometry", "unknown geometry (" + a.geometry +
                               "); accepted: " + std::string(AcceptedTransformNames()));
  }
  const bool rotate = transform->hadamard;
  const std::optional<GeometryMode> mode = transform->geometry;
  int hblock = 0;
  if (rotate) {
    const uint32_t codec_block = CodecScaleBlock(o);
    hblock = a.hadamard_block ? a.hadamard_block : codec_block ? int(codec_block) : 128;
    if (std::string err = ValidateHadamardBlock(hblock, o); !err.empty()) {
      UsageError("hadamard-block", err.substr(err.find(": ") + 2));
    }
  } else if (a.hadamard_block) {
    UsageError("hadamard-block", "needs --geometry hadamard or G+hadamard (" + a.geometry + ")");
  }
  const uint64_t hseed = HadamardLayerSeed(a.codec.seed, 0);
  if (a.rank < 1) UsageError("rank", "must be at least 1 (" + std::to_string(a.rank) + ")");
  if (!(a.alpha >= 0.f && a.alpha <= 1.f)) {
    UsageError("alpha", "must be in [0, 1] (" + JsonNum(a.alpha) + ")");
  }
  std::vector<int64_t> dims;
  if (!a.shape.empty()) {
    dims = ParseShape(a.shape);
    if (dims.size() != 2) UsageError("shape", "expected a matrix MxN (" + a.shape + ")");
    // Past half the smaller side the low-rank geometry has no residual to flatten against and
    // the bands [k, 4k) and [4k, r/2) are empty: the analysis would silently measure nothing.
    if (2 * int64_t(a.rank) >= std::min(dims[0], dims[1])) {
      UsageError("rank", "must be below half of min(M, N) = " +
                             std::to_string(std::min(dims[0], dims[1]) / 2) + " for shape " +
                             a.shape + " (" + std::to_string(a.rank) + ")");
    }
  }
  if (*mode != GeometryMode::kNone && dims.empty()) {
    UsageError("geometry", "needs --shape MxN; 1-D tensors always use none (" + a.geometry + ")");
  }
  if (!a.basis_from.empty() && *mode == GeometryMode::kNone) {
    UsageError("basis-from", "needs --geometry diag or lowrank (" + a.basis_from + ")");
  }
  const std::vector<float> x = ReadFloats(a.codec.in);
  std::vector<float> decoded;
  if (dims.empty()) {
    std::vector<float> t = x;
    if (rotate) HadamardForward(t, hblock, hseed);
    CodecReport report = AnalyzeCodec(t, o, &decoded);
    if (rotate) {
      // The metrics of the result in the gradient's own coordinates.
      HadamardInverse(decoded, hblock, hseed);
      const auto saturated = static_cast<uint64_t>(
          std::llround(report.metrics.saturation_fraction * static_cast<double>(x.size())));
      report.metrics = ComputeErrorMetrics(x, decoded, saturated);
      std::string json = CodecReportJson(report);
      json.pop_back();
      std::printf("%s, \"geometry\": \"hadamard\", \"hadamard_block\": %d}\n", json.c_str(),
                  hblock);
    } else {
      std::printf("%s\n", CodecReportJson(report).c_str());
    }
    if (!a.codec.out.empty()) WriteFloats(a.codec.out, decoded);
    return;
  }
  CheckShape(dims, x.size(), a.shape);
  const int64_t m = dims[0], n = dims[1];
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) {
      UsageError("in", "band metrics need a finite gradient; element " + std::to_string(i) +
                           " is " + JsonNum(x[i]));
    }
  }
  // The geometry: estimated on --in, or on --basis-from (a stale basis, as in training).
  GeometryOptions go;
  go.mode = *mode;
  go.rank = a.rank;
  go.alpha = a.alpha;
  double estimate_seconds = 0;
  Geometry geo;
  if (*mode != GeometryMode::kNone) {
    std::vector<float> basis_src;
    if (!a.basis_from.empty()) {
      basis_src = ReadFloats(a.basis_from, "basis-from");
      CheckShape(dims, basis_src.size(), a.shape, "basis-from");
    }
    const RefreshResult rr = EstimateGeometry(basis_src.empty() ? x : basis_src, m, n, go, nullptr);
    geo = rr.geometry;
    estimate_seconds = rr.seconds;
  }
  std::vector<float> t = x;
  auto t0 = std::chrono::steady_clock::now();
  ApplyGeometry(geo, t);
  if (rotate) HadamardForward(t, hblock, hseed);
  double transform_seconds = SecondsSince(t0);
  CodecReport report = AnalyzeCodec(t, o, &decoded);
  t0 = std::chrono::steady_clock::now();
  if (rotate) HadamardInverse(decoded, hblock, hseed);
  InvertGeometry(geo, decoded);
  transform_seconds += SecondsSince(t0);
  // The issue-1 metrics of the final result against the original gradient.
  const auto saturated = static_cast<uint64_t>(
      std::llround(report.metrics.saturation_fraction * static_cast<double>(x.size())));
  report.metrics = ComputeErrorMetrics(x, decoded, saturated);
  const SpectralReference ref = ComputeSpectralReference(x, m, n);
  const BandErrors bands = ComputeBandErrors(ref, x, decoded, a.rank);
  // Residual-subspace error uses the layer's current basis: the geometry's for lowrank, else the
  // top-k singular vectors of --in, so the numbers are comparable across geometries.
  std::vector<float> u, v;
  int kb = 0;
  if (geo.mode == GeometryMode::kLowRank && !geo.is_identity()) {
    u = geo.U, v = geo.V, kb = geo.k;
  } else {
    kb = static_cast<int>(std::min<int64_t>(a.rank, ref.r));
    u.resize(static_cast<size_t>(m * kb));
    v.resize(static_cast<size_t>(n * kb));
    for (int64_t i = 0; i < m; ++i)
      for (int j = 0; j < kb; ++j) u[i * kb + j] = ref.U[i * ref.r + j];
    for (int64_t i = 0; i < n; ++i)
      for (int j = 0; j < kb; ++j) v[i * kb + j] = ref.V[i * ref.r + j];
  }
  const auto rse = ResidualSubspaceError(x, decoded, m, n, u, v, kb);
  std::string json = CodecReportJson(report);
  json.pop_back();  // reopen the object to append the geometry fields
  std::ostringstream os;
  os << json << ", \"shape\": [" << m << ", " << n << "], \"geometry\": \"" << a.geometry
     << "\", \"rank\": " << (geo.mode == GeometryMode::kLowRank ? geo.k : a.rank)
     << ", \"alpha\": " << JsonNum(a.alpha)
     << ", \"basis_from\": " << (a.basis_from.empty() ? "null" : "\"" + a.basis_from + "\"")
     << ", \"hadamard_block\": " << (rotate ? std::to_string(hblock) : "null")
     << ", \"band_errors\": [";
  for (size_t b = 0; b < bands.bands.size(); ++b) {
    const BandError& be = bands.bands[b];
    os << (b ? ", " : "") << "{\"begin\": " << be.begin << ", \"end\": " << be.end
       << ", \"error\": " << (be.defined ? JsonNum(be.error) : "null") << "}";
  }
  os << "], \"worst_band_error\": " << JsonNum(bands.worst_band_error)
     << ", \"residual_subspace_error\": " << (rse ? JsonNum(*rse) : "null")
     << ", \"transform_seconds\": " << JsonNum(transform_seconds)
     << ", \"estimate_seconds\": " << JsonNum(estimate_seconds) << "}";
  std::printf("%s\n", os.str().c_str());
  if (!a.codec.out.empty()) WriteFloats(a.codec.out, decoded);
}

}  // namespace

void AddAnalyzeCommand(CLI::App& app) {
  auto args = std::make_shared<AnalyzeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "analyze", "encode + decode, print JSON error metrics and sizes (--out: decoded floats)");
  AddCodecFlags(cmd, &args->codec, /*out_required=*/false);
  cmd->add_option("--shape", args->shape, "MxN: adds band errors and residual-subspace error");
  cmd->add_option("--geometry", args->geometry,
                  "none, diag, lowrank (need --shape), hadamard, diag+hadamard, lowrank+hadamard "
                  "(a block random Hadamard rotation after the geometry)")
      ->capture_default_str();
  cmd->add_option("--hadamard-block", args->hadamard_block,
                  "rotation block: a power of two dividing the codec's scale block (default: "
                  "that block, 128 without one)");
  cmd->add_option("--rank", args->rank, "k of lowrank, and the band parameter")
      ->capture_default_str();
  cmd->add_option("--alpha", args->alpha, "whitening exponent")->capture_default_str();
  cmd->add_option(
      "--basis-from", args->basis_from,
      "estimate the geometry on this float32 gradient (same shape) and apply it to --in");
  cmd->callback([args] { RunAnalyze(*args); });
}

}  // namespace geofp8::tool
