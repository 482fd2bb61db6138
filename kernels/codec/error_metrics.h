// Quality metrics of a decoded tensor against its fp32 reference (DESIGN.md section 6), shared by
// `geofp8-tool analyze`, the geometry reports and the exchange probes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/codec/codec.h"

namespace geofp8 {

// Element-wise error of decoded vs reference. Norms are accumulated in double.
struct ErrorMetrics {
  size_t count = 0;            // elements compared
  double rel_fro_error = 0.0;  // ||decoded - reference||_F / ||reference||_F (0 if both are 0)
  double cosine = 1.0;         // <decoded, reference> / (|decoded| |reference|); 1 if both are 0
  double max_abs_error = 0.0;  // max |decoded - reference|
  double underflow_fraction = 0.0;  // nonzero finite inputs decoded to exactly 0, over nonzero ones
  double saturation_fraction = 0.0;  // inputs clipped to the format max, over all inputs
  uint64_t nonfinite_count = 0;      // non-finite inputs (left out of the norms above)
};

// Compares decoded to reference over the elements whose reference value is finite.
// `saturated` is the count an encode reported (EncodeStats::saturated).
// Throws geofp8::Error if the spans differ in length.
ErrorMetrics ComputeErrorMetrics(std::span<const float> reference, std::span<const float> decoded,
                                 uint64_t saturated = 0);

// One encode + decode of x with its metrics and wire sizes: what `geofp8-tool analyze` prints.
struct CodecReport {
  CodecOptions options;
  ErrorMetrics metrics;
  size_t header_bytes = 0;
  size_t scale_bytes = 0;
  size_t payload_bytes = 0;
  // fp32 bytes (4n) over payload + scale bytes: the per-element wire saving, header excluded.
  double compression_ratio = 0.0;
};

// Encodes and decodes x under options; fills *decoded (resized to x.size()) when non-null.
CodecReport AnalyzeCodec(std::span<const float> x, const CodecOptions& options,
                         std::vector<float>* decoded = nullptr);

// The report as one JSON object; scaling and block are the ones the encode used (keys: format,
// scaling, block, rounding, count, rel_fro_error, cosine, max_abs_error, underflow_fraction,
// saturation_fraction, nonfinite_count, header_bytes, scale_bytes, payload_bytes,
// compression_ratio).
std::string CodecReportJson(const CodecReport& report);

}  // namespace geofp8
