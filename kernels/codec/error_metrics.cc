// Quality metrics of a decoded tensor against its fp32 reference, and the encode+decode report
// behind `geofp8-tool analyze`.
#include "kernels/codec/error_metrics.h"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "kernels/codec/codec_internal.h"
#include "kernels/common/check.h"

namespace geofp8 {

ErrorMetrics ComputeErrorMetrics(std::span<const float> reference, std::span<const float> decoded,
                                 uint64_t saturated) {
  GEOFP8_CHECK(reference.size() == decoded.size(), "error metrics: reference has ",
               reference.size(), " elements, decoded has ", decoded.size());
  ErrorMetrics m;
  m.count = reference.size();
  double err2 = 0, ref2 = 0, dec2 = 0, dot = 0, max_abs = 0;
  uint64_t nonzero = 0, underflow = 0;
  for (size_t i = 0; i < reference.size(); ++i) {
    const double r = reference[i];
    if (!std::isfinite(r)) {
      ++m.nonfinite_count;
      continue;
    }
    const double d = decoded[i];
    const double e = d - r;
    err2 += e * e;
    ref2 += r * r;
    dec2 += d * d;
    dot += d * r;
    // NaN-propagating max: a non-finite decode of a finite input must show up.
    if (!(std::fabs(e) <= max_abs)) max_abs = std::fabs(e);
    if (r != 0) {
      ++nonzero;
      underflow += d == 0;
    }
  }
  m.rel_fro_error = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  m.cosine = (ref2 > 0 && dec2 > 0) ? dot / std::sqrt(ref2 * dec2) : (ref2 == dec2 ? 1.0 : 0.0);
  m.max_abs_error = max_abs;
  m.underflow_fraction = nonzero ? static_cast<double>(underflow) / nonzero : 0.0;
  m.saturation_fraction = m.count ? static_cast<double>(saturated) / m.count : 0.0;
  return m;
}

CodecReport AnalyzeCodec(std::span<const float> x, const CodecOptions& options,
                         std::vector<float>* decoded) {
  std::vector<uint8_t> buf(EncodedBytes(options, x.size()));
  const EncodeStats st = Encode(x, options, buf);
  std::vector<float> local;
  std::vector<float>& out = decoded ? *decoded : local;
  out.assign(x.size(), 0.f);
  Decode(buf, out);
  CodecReport rep;
  rep.options = options;
  rep.metrics = ComputeErrorMetrics(x, out, st.saturated);
  rep.header_bytes = sizeof(EncodedHeader);
  rep.scale_bytes = ScaleBytes(options, x.size());
  rep.payload_bytes = PayloadBytes(options, x.size());
  const size_t wire = rep.scale_bytes + rep.payload_bytes;
  rep.compression_ratio = wire ? 4.0 * x.size() / wire : 0.0;
  return rep;
}

namespace {
std::string Num(double v) {
  if (!std::isfinite(v)) return "null";  // JSON has no NaN/inf
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}
}  // namespace

std::string CodecReportJson(const CodecReport& r) {
  std::ostringstream os;
  const ErrorMetrics& m = r.metrics;
  // Report what the encode actually used (mxfp8: block 32, nvfp4: 16, fp32/bf16: no scaling).
  const detail::Layout l = detail::MakeLayout(r.options, 0);
  os << "{\"format\": \"" << FormatName(r.options.format) << "\", \"scaling\": \""
     << ScalingName(l.scaling) << "\", \"block\": " << l.block << ", \"rounding\": \""
     << RoundingName(r.options.rounding) << "\", \"count\": " << m.count
     << ", \"rel_fro_error\": " << Num(m.rel_fro_error) << ", \"cosine\": " << Num(m.cosine)
     << ", \"max_abs_error\": " << Num(m.max_abs_error)
     << ", \"underflow_fraction\": " << Num(m.underflow_fraction)
     << ", \"saturation_fraction\": " << Num(m.saturation_fraction)
     << ", \"nonfinite_count\": " << m.nonfinite_count << ", \"header_bytes\": " << r.header_bytes
     << ", \"scale_bytes\": " << r.scale_bytes << ", \"payload_bytes\": " << r.payload_bytes
     << ", \"compression_ratio\": " << Num(r.compression_ratio) << "}";
  return os.str();
}

}  // namespace geofp8
