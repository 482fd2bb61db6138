// Raw element conversion: scale 1, no header, no scales, payload bytes only, in input order.
// This is what `geofp8-tool encode --scaling none --raw` writes, so an oracle can compare bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kernels/codec/codec.h"

namespace geofp8 {

// Bytes for n raw elements: 4n, 2n, n, or ceil(n/2) for nvfp4 (element 2i in the low nibble).
// mxfp8 converts raw as its E4M3 elements (one byte each).
size_t RawBytes(Format format, size_t n);

// Converts x with scale 1 under options.format/rounding (and the stochastic stream key of
// options); options.scaling and block are ignored. Non-finite inputs follow the codec's rule
// (fp8: NaN code, E5M2 keeps inf; bf16/fp32 keep them) and are counted; nvfp4 has no NaN code,
// so a non-finite input throws geofp8::Error naming its index. out must hold RawBytes bytes.
EncodeStats EncodeRaw(std::span<const float> x, const CodecOptions& options,
                      std::span<uint8_t> out);

// Inverse of EncodeRaw: out.size() elements from RawBytes(format, out.size()) bytes.
void DecodeRaw(std::span<const uint8_t> in, Format format, std::span<float> out);

}  // namespace geofp8
