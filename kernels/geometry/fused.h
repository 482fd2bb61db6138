// The geometry transform fused with the codec: encode T(G) straight from G, and decode into
// T^-1(D), without writing T(G) to memory and reading it back (DESIGN.md sections 2 and 4).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kernels/codec/codec.h"
#include "kernels/geometry/geometry.h"

namespace geofp8 {

// One encode of a fused pass: elements [begin, end) of the transformed matrix (row-major,
// flattened) encoded with `options` into `out`, which holds EncodedBytes(options, end - begin)
// bytes. two_phase has one per destination rank (kernels/exchange/chunking.h ChunkOf), allgather
// one for the whole layer.
struct FusedEncodeTarget {
  size_t begin = 0, end = 0;
  CodecOptions options;
  std::span<uint8_t> out;
  EncodeStats stats;  // filled in: what this target's encode saw
};

// One encoded piece of a fused decode: `in` encodes elements [begin, end) of the matrix.
struct FusedDecodeSource {
  size_t begin = 0, end = 0;
  std::span<const uint8_t> in;
};

// Encodes T(G) into every target in one pass over G (m x n row-major, left unchanged). The bytes
// are identical to copying G, ApplyGeometry on the copy, then Encode of each target's range:
// both run the same row-tiled GEMMs (geometry::TileRows). Each tile of T(G) is encoded while it is
// in cache, for targets whose scales are block-local (fp8 with block or no scaling, mxfp8, bf16,
// fp32, nearest rounding). A target that needs the whole range first (fp8 tensor scaling, nvfp4's
// fp32 tensor scale, stochastic rounding whose random stream is indexed from the range start) is
// staged whole and encoded at its end: correct, but it saves nothing. Targets must not overlap
// and need not cover G. Throws geofp8::Error naming the field on bad targets or options.
void EncodeWithGeometry(const Geometry& geometry, std::span<const float> G,
                        std::span<FusedEncodeTarget> targets);

// Decodes the sources into `out` (m x n row-major) and applies T^-1, with the bytes of Decode of
// every source into its range followed by InvertGeometry(out). T^-1's correction needs U^T D and
// D V over the whole decoded matrix D before any row is final, so lowrank decodes each tile twice
// from the wire (1 byte per fp8 element, half for nvfp4): once for those reductions, once to
// finish it in cache, and D is never written out before the result. The sources must cover out
// exactly, without overlap, in any order.
void DecodeWithGeometry(const Geometry& geometry, std::span<const FusedDecodeSource> sources,
                        std::span<float> out);

namespace geometry {
// Decodes elements [first, first + out.size()) of one encoded tensor: what Decode gives for them.
void DecodeRange(std::span<const uint8_t> in, size_t first, std::span<float> out);
}  // namespace geometry

}  // namespace geofp8
