// Internal pieces of the codec shared by the scalar reference (codec.cc), the AVX2 path
// (codec_avx2.cc) and the CUDA kernels: the resolved layout of one encoded tensor.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/codec/codec.h"
#include "kernels/codec/element.h"

namespace geofp8::detail {

// What an encode actually does once format-specific rules are applied: fp32/bf16 never scale,
// mxfp8 always uses E8M0 per 32, nvfp4 E4M3 per 16 plus an fp32 tensor scale.
struct Layout {
  Format format = Format::kFp8E4M3;
  Scaling scaling = Scaling::kNone;
  uint32_t block = 0;  // elements per scale (0 unless scaling == kBlock)
  size_t count = 0;
  size_t num_blocks = 0;  // scale entries (kTensor: 1)
  size_t scale_bytes = 0;
  size_t payload_bytes = 0;
};

Layout MakeLayout(Format format, Scaling scaling, uint32_t block, size_t n);
Layout MakeLayout(const CodecOptions& options, size_t n);

// Checks a header (magic, version, enums, block consistency); returns the total encoded bytes it
// implies. Throws geofp8::Error naming the problem.
size_t ValidateHeader(const EncodedHeader& header);

// One fp8 element (scalar reference; the AVX2 path uses it for blocks with non-finite values).
template <Format F>
inline uint8_t EncodeFp8Element(float x, float scale, bool stochastic, uint32_t r,
                                uint64_t* saturated) {
  bool sat;
  const uint8_t code =
      element::EncodeFp8Scaled(F == Format::kFp8E5M2, x, scale, stochastic, r, &sat);
  *saturated += sat;
  return code;
}

// Vectorized fp8 paths (E4M3/E5M2 with fp32 scales, and mxfp8), nearest rounding; defined in
// codec_avx2.cc.
// Return false (doing nothing) when the processor lacks AVX2+FMA+F16C or the case is not
// covered, in which case the caller runs the scalar reference. Results are bit-identical.
bool CpuHasAvx2();
bool EncodeFp8Avx2(const float* x, const Layout& layout, uint8_t* scales, uint8_t* payload,
                   EncodeStats* stats);
// The AVX-512 encode of the whole blocks of an fp8 block-scaled (blocks 16, 32, 64, 128) or
// mxfp8 layout, nearest rounding, into the layout's scales and payload; codec_avx512.cc. Returns
// how many leading elements it encoded (a multiple of the block), 0 when it declines (no
// AVX-512, Avx512Enabled() false, or a case it does not cover). Bit-identical to the scalar path.
size_t EncodeWholeBlocksAvx512(const float* x, const Layout& layout, uint8_t* scales,
                               uint8_t* payload, EncodeStats* stats);
// The AVX-512 nvfp4 encode of a whole tensor (nearest rounding); codec_avx512.cc. False, having
// written nothing that counts, without AVX-512, when Avx512Enabled() is false, or when the tensor
// holds a non-finite value (the scalar path's case).
bool EncodeNvAvx512(const float* x, const Layout& layout, uint8_t* scales, uint8_t* payload,
                    EncodeStats* stats);
bool DecodeFp8Avx2(const Layout& layout, const uint8_t* scales, const uint8_t* payload, float* out,
                   bool accumulate);

// Runtime switch for tests and the bench: false forces the scalar reference everywhere.
void SetVectorizedEnabled(bool enabled);
bool VectorizedEnabled();
// Runtime switch for the AVX-512 paths (tests and the bench compare them with AVX2): false keeps
// AVX2 where both exist. Avx512Enabled() is false whenever VectorizedEnabled() is.
void SetAvx512Enabled(bool enabled);
bool Avx512Enabled();

}  // namespace geofp8::detail
