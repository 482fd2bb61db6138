// Public API of the low-precision codec: encode a float32 tensor into a self-describing wire
// buffer, decode it back, and decode-and-accumulate (the reduction step of the exchange).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "kernels/codec/format.h"

namespace geofp8 {

// Options for one encode. Plain struct with defaults; validated by ValidateCodecOptions.
struct CodecOptions {
  Format format = Format::kFp8E4M3;
  // Ignored for mxfp8 (always per-32 E8M0) and nvfp4 (always per-16 E4M3 plus a tensor scale).
  Scaling scaling = Scaling::kBlock;
  // Elements per scale block when scaling == kBlock. Any value >= 1; 128 matches a warp of 4.
  uint32_t block = 128;
  Rounding rounding = Rounding::kNearest;
  // Stochastic rounding stream key. The same (seed, step, layer, rank) gives the same bits, so a
  // run is reproducible and ranks never share a stream.
  uint64_t seed = 0;
  uint64_t step = 0;
  uint32_t layer = 0;
  uint32_t rank = 0;
};

// Returns an empty string when the options are usable, else one line naming the field and value.
std::string ValidateCodecOptions(const CodecOptions& options);

// What one encode saw. Counts are over input elements.
struct EncodeStats {
  uint64_t nonfinite = 0;  // NaN or inf inputs; the encoded buffer carries a non-finite flag
  uint64_t saturated = 0;  // finite inputs whose scaled magnitude exceeded the format max
};

// Encoded layout (little-endian), version 1:
//   EncodedHeader | scales | payload
// scales: fp32 per block (kTensor: 1, kBlock: ceil(n/block), kNone: 0); mxfp8: 1 E8M0 byte per
// 32 elements; nvfp4: fp32 tensor scale then 1 E4M3 byte per 16 elements. payload: packed
// elements in input order; nvfp4 puts element 2i in the low nibble of byte i.
inline constexpr uint8_t kEncodedMagic = 0x47;  // 'G'
inline constexpr uint8_t kEncodedVersion = 1;

#pragma pack(push, 1)
struct EncodedHeader {
  uint8_t magic = kEncodedMagic;
  uint8_t version = kEncodedVersion;
  uint8_t format = 0;   // Format
  uint8_t scaling = 0;  // Scaling actually used (mxfp8/nvfp4 report kBlock)
  uint32_t block = 0;   // elements per scale block actually used (32 mxfp8, 16 nvfp4)
  uint64_t count = 0;   // element count
  uint8_t flags = 0;    // bit 0: input held a non-finite value
  uint8_t reserved[7] = {};
};
#pragma pack(pop)
static_assert(sizeof(EncodedHeader) == 24);
inline constexpr uint8_t kFlagNonFinite = 1;

// Byte counts of each part for n elements under these options.
size_t PayloadBytes(const CodecOptions& options, size_t n);
size_t ScaleBytes(const CodecOptions& options, size_t n);
size_t EncodedBytes(const CodecOptions& options, size_t n);  // header + scales + payload
// An upper bound on EncodedBytes(o, n) over every option set ValidateCodecOptions accepts: fp8
// with block 1 spends 4 scale bytes and 1 payload byte per element, the most of any format, and
// a tensor scale costs 4 bytes even when n is 0. Ranks that may disagree on the options but agree
// on n size their receives with it (the exchange's fingerprint round, algorithms.cc).
inline constexpr size_t MaxEncodedBytes(size_t n) { return sizeof(EncodedHeader) + 4 + 5 * n; }

// Encodes x[0..n) into out, which must hold EncodedBytes(options, n) bytes. Any alignment.
// Throws geofp8::Error on invalid options or a short output buffer.
EncodeStats Encode(std::span<const float> x, const CodecOptions& options, std::span<uint8_t> out);

// A parsed, validated view of an encoded buffer (no copies).
struct EncodedView {
  EncodedHeader header;
  std::span<const uint8_t> scales;
  std::span<const uint8_t> payload;
};
// Throws geofp8::Error naming the problem if the buffer is truncated or malformed.
EncodedView ParseEncoded(std::span<const uint8_t> in);

// Decodes into out (size == header.count). Non-finite inputs never come back finite: fp8 formats
// encode them as their NaN code; formats without one (nvfp4) poison the block scale, bf16/fp32
// keep them. Callers check header.flags & kFlagNonFinite to skip the step.
void Decode(std::span<const uint8_t> in, std::span<float> out);

// acc[i] += decode(in)[i]: the dequantize-and-sum step of the exchange, in one pass.
void DecodeAccumulate(std::span<const uint8_t> in, std::span<float> acc);

}  // namespace geofp8
