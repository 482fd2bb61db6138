// How a layer is cut into per-rank chunks for two_phase, and which codec options and random
// stream each encode uses. Both sides of the exchange (and the tests' reference) derive the same
// layout from these pure functions, so no sizes travel on the wire.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/codec/codec.h"
#include "kernels/exchange/policy.h"

namespace geofp8 {

struct ChunkRange {
  size_t begin = 0, end = 0;
  size_t size() const { return end - begin; }
};

// Chunk boundaries fall on multiples of the codec's scale block, so each requantized chunk is
// self-contained: its blocks are exactly the blocks a whole-tensor encode would use.
inline size_t ChunkAlignment(const CodecOptions& o) {
  switch (o.format) {
    case Format::kMxfp8:
      return 32;
    case Format::kNvfp4:
      return 16;
    case Format::kFp32:
    case Format::kBf16:
      return 1;
    default:
      return o.scaling == Scaling::kBlock ? std::max<uint32_t>(o.block, 1) : 1;
  }
}

// Chunk j of `parts` over n elements: whole blocks of `align`, split as evenly as possible.
inline ChunkRange ChunkOf(size_t n, size_t align, int parts, int j) {
  const size_t blocks = (n + align - 1) / align;
  const size_t b0 = blocks * static_cast<size_t>(j) / static_cast<size_t>(parts);
  const size_t b1 = blocks * static_cast<size_t>(j + 1) / static_cast<size_t>(parts);
  return {std::min(b0 * align, n), std::min(b1 * align, n)};
}

// Reduce-scatter's chunk j of `parts` over a layer of n elements in rows of `cols`: whole rows
// [j c, min((j + 1) c, rows)) with c = ceil(rows / parts), FSDP's dim-0 chunks (the last ones
// may be short or empty).
inline ChunkRange RowChunkOf(size_t n, size_t cols, int parts, int j) {
  cols = std::max<size_t>(cols, 1);
  const size_t rows = n / cols;
  const size_t c = (rows + static_cast<size_t>(parts) - 1) / static_cast<size_t>(parts);
  const size_t r0 = std::min(rows, c * static_cast<size_t>(j));
  const size_t r1 = std::min(rows, c * static_cast<size_t>(j + 1));
  return {r0 * cols, r1 * cols};
}

// Stochastic rounding streams: every (phase, chunk) of a rank gets its own seed so no two encodes
// in one step reuse random bits. Phase 1 is the first quantization, phase 2 the requantization.
inline uint64_t StreamSeed(uint64_t seed, uint32_t phase, uint32_t chunk) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (1 + (static_cast<uint64_t>(phase) << 32 | chunk));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The codec options for one encode of layer `layer`'s chunk `chunk` by rank `rank`.
inline CodecOptions LayerCodecOptions(const LayerPolicy& p, uint64_t seed, uint64_t step,
                                      uint32_t layer, uint32_t rank, uint32_t phase,
                                      uint32_t chunk) {
  CodecOptions o;
  o.format = p.format;
  o.scaling = p.scaling;
  o.block = p.block;
  o.rounding = p.rounding;
  o.seed = StreamSeed(seed, phase, chunk);
  o.step = step;
  o.layer = layer;
  o.rank = rank;
  return o;
}

}  // namespace geofp8
