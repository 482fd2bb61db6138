// Block random Hadamard rotation (see hadamard.h): the GEOFP8_HD reference per block, an AVX2
// fast Walsh-Hadamard transform with the same operations in the same order, and the rotation
// fused with the codec's encode tile by tile.

#include "kernels/geometry/hadamard.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <vector>

#include "kernels/codec/codec_internal.h"
#include "kernels/common/check.h"
#include "kernels/common/cpu_features.h"
#include "kernels/geometry/hadamard_avx512.h"
#include "kernels/geometry/hadamard_math.h"

namespace geofp8 {
namespace {

#define GEOFP8_AVX2_ONLY __attribute__((target("avx2")))

float BlockScale(int b) { return float(1.0 / std::sqrt(double(b))); }

// Negates lanes of v whose bit is set in the low 8 bits of `bits`.
GEOFP8_AVX2_ONLY inline __m256 ApplySigns(__m256 v, uint32_t bits) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set =
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(bits)), lane_bit), lane_bit);
  return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(set, 31)));
}

// Stages h = 1, 2, 4 inside one vector: lane j pairs with lane j ^ h; the lower lane of a pair
// takes a + c, the upper one a - c (its partner minus itself), exactly as Butterflies does.
GEOFP8_AVX2_ONLY inline __m256 InVectorStages(__m256 v) {
  __m256 p = _mm256_permute_ps(v, 0xB1);  // lanes 1,0,3,2
  v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xAA);
  p = _mm256_permute_ps(v, 0x4E);  // lanes 2,3,0,1
  v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xCC);
  p = _mm256_permute2f128_ps(v, v, 0x01);  // halves swapped
  return _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xF0);
}

// One block of b >= 8 elements starting at tensor element `first` (a multiple of b), from `in`
// to `out` (may alias): the operations of ForwardBlock/InverseBlock, lane for lane.
template <bool kInverse>
GEOFP8_AVX2_ONLY void BlockAvx2(const float* in, float* out, int b, uint64_t seed, uint64_t first,
                                float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  uint64_t word = 0;
  for (int j = 0; j < b; j += 8) {
    const uint64_t e = first + uint64_t(j);
    if ((e & 63) == 0 || j == 0) word = hadamard::SignWord(seed, e >> 6);
    __m256 v = _mm256_loadu_ps(in + j);
    if (!kInverse) v = ApplySigns(v, uint32_t(word >> (e & 63)) & 0xFF);
    _mm256_storeu_ps(out + j, InVectorStages(v));
  }
  for (int h = 8; h < b; h <<= 1) {
    for (int i = 0; i < b; i += 2 * h) {
      for (int j = i; j < i + h; j += 8) {
        const __m256 a = _mm256_loadu_ps(out + j), c = _mm256_loadu_ps(out + j + h);
        _mm256_storeu_ps(out + j, _mm256_add_ps(a, c));
        _mm256_storeu_ps(out + j + h, _mm256_sub_ps(a, c));
      }
    }
  }
  for (int j = 0; j < b; j += 8) {
    const uint64_t e = first + uint64_t(j);
    if ((e & 63) == 0 || j == 0) word = hadamard::SignWord(seed, e >> 6);
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(out + j), s);
    if (kInverse) v = ApplySigns(v, uint32_t(word >> (e & 63)) & 0xFF);
    _mm256_storeu_ps(out + j, v);
  }
}

// Stages h = 8 H, 16 H, ... of a block held as V vectors (distance H in vectors), unrolled at
// compile time so the block stays in registers.
template <int V, int H>
GEOFP8_AVX2_ONLY inline void CrossVectorStages(__m256* v) {
  if constexpr (H < V) {
#pragma GCC unroll 16
    for (int i = 0; i < V; i += 2 * H) {
#pragma GCC unroll 16
      for (int j = i; j < i + H; ++j) {
        const __m256 a = v[j], c = v[j + H];
        v[j] = _mm256_add_ps(a, c);
        v[j + H] = _mm256_sub_ps(a, c);
      }
    }
    CrossVectorStages<V, 2 * H>(v);
  }
}

// BlockAvx2 for a block of B <= 128 elements held in registers from load to store: the same
// operations in the same order, without the intermediate stores between stages.
template <int B, bool kInverse>
GEOFP8_AVX2_ONLY void BlockInRegisters(const float* in, float* out, uint64_t seed, uint64_t first,
                                       float scale) {
  constexpr int V = B / 8;
  uint64_t words[(B + 63) / 64];
#pragma GCC unroll 2
  for (int w = 0; w < (B + 63) / 64; ++w) words[w] = hadamard::SignWord(seed, (first >> 6) + w);
  auto bits = [&](int q) {
    const uint64_t e = first + uint64_t(8 * q);
    return uint32_t(words[(e >> 6) - (first >> 6)] >> (e & 63)) & 0xFF;
  };
  __m256 v[V];
#pragma GCC unroll 16
  for (int q = 0; q < V; ++q) {
    v[q] = _mm256_loadu_ps(in + 8 * q);
    if (!kInverse) v[q] = ApplySigns(v[q], bits(q));
    v[q] = InVectorStages(v[q]);
  }
  CrossVectorStages<V, 1>(v);
  const __m256 s = _mm256_set1_ps(scale);
#pragma GCC unroll 16
  for (int q = 0; q < V; ++q) {
    __m256 r = _mm256_mul_ps(v[q], s);
    if (kInverse) r = ApplySigns(r, bits(q));
    _mm256_storeu_ps(out + 8 * q, r);
  }
}

// One block of b >= 8 elements: in registers up to 128, through memory beyond.
template <bool kInverse>
GEOFP8_AVX2_ONLY void AnyBlockAvx2(const float* in, float* out, int b, uint64_t seed,
                                   uint64_t first, float scale) {
  switch (b) {
    case 8:
      return BlockInRegisters<8, kInverse>(in, out, seed, first, scale);
    case 16:
      return BlockInRegisters<16, kInverse>(in, out, seed, first, scale);
    case 32:
      return BlockInRegisters<32, kInverse>(in, out, seed, first, scale);
    case 64:
      return BlockInRegisters<64, kInverse>(in, out, seed, first, scale);
    case 128:
      return BlockInRegisters<128, kInverse>(in, out, seed, first, scale);
    default:
      return BlockAvx2<kInverse>(in, out, b, seed, first, scale);
  }
}

void CheckArgs(size_t n, int block, uint64_t first) {
  GEOFP8_CHECK(block >= 2 && block <= kMaxHadamardBlock && (block & (block - 1)) == 0,
               "hadamard_block: must be a power of two in [2, ", kMaxHadamardBlock, "] (", block,
               ")");
  GEOFP8_CHECK(first % uint64_t(block) == 0, "hadamard: first element ", first,
               " is not a multiple of the block (", block, ")");
  (void)n;
}

// Rotates in[0..n) (tensor elements [first, first + n)) into out (may alias in).
template <bool kInverse>
void Rotate(const float* in, float* out, size_t n, int block, uint64_t seed, uint64_t first,
            bool reference) {
  CheckArgs(n, block, first);
  if (in != out && n) std::memcpy(out, in, n * sizeof(float));
  const float scale = BlockScale(block);
  const size_t whole = n / size_t(block) * size_t(block);
  const bool avx2 = !reference && block >= 8 && CpuHasAvx2();
  for (size_t i = 0; i < whole; i += size_t(block)) {
    if (avx2) {
      AnyBlockAvx2<kInverse>(out + i, out + i, block, seed, first + i, scale);
    } else if (kInverse) {
      hadamard::InverseBlock(out + i, block, seed, first + i, scale);
    } else {
      hadamard::ForwardBlock(out + i, block, seed, first + i, scale);
    }
  }
  hadamard::SignsOnly(out + whole, int(n - whole), seed, first + whole);
}

}  // namespace

uint64_t HadamardLayerSeed(uint64_t run_seed, uint32_t layer) {
  // A distinct constant keeps the signs independent of the rounding streams of the same seed.
  return hadamard::SignWord(run_seed ^ 0x48414441u, layer);
}

uint32_t CodecScaleBlock(const CodecOptions& o) {
  const detail::Layout l = detail::MakeLayout(o, 0);
  return l.scaling == Scaling::kBlock ? l.block : 0;
}

std::string ValidateHadamardBlock(int block, const CodecOptions& options) {
  std::ostringstream os;
  if (block < 2 || block > kMaxHadamardBlock || (block & (block - 1)) != 0) {
    os << "hadamard_block: must be a power of two in [2, " << kMaxHadamardBlock << "] (" << block
       << ")";
  } else if (const uint32_t cb = CodecScaleBlock(options); cb != 0 && cb % uint32_t(block) != 0) {
    os << "hadamard_block: must divide the codec's scale block " << cb << " (" << block << ")";
  }
  return os.str();
}

void HadamardForward(std::span<float> x, int block, uint64_t seed, uint64_t first, bool reference) {
  Rotate<false>(x.data(), x.data(), x.size(), block, seed, first, reference);
}

void HadamardInverse(std::span<float> x, int block, uint64_t seed, uint64_t first, bool reference) {
  Rotate<true>(x.data(), x.data(), x.size(), block, seed, first, reference);
}

EncodeStats EncodeRotated(std::span<const float> x, int block, uint64_t seed,
                          const CodecOptions& options, std::span<uint8_t> out) {
  const std::string err = ValidateHadamardBlock(block, options);
  GEOFP8_CHECK(err.empty(), err);
  const detail::Layout l = detail::MakeLayout(options, x.size());
  const bool block_local = (((l.format == Format::kFp8E4M3 || l.format == Format::kFp8E5M2) &&
                             l.scaling == Scaling::kBlock) ||
                            l.format == Format::kMxfp8) &&
                           options.rounding == Rounding::kNearest && detail::VectorizedEnabled() &&
                           CpuHasAvx2();
  const size_t total = sizeof(EncodedHeader) + l.scale_bytes + l.payload_bytes;
  GEOFP8_CHECK(out.size() >= total, "encode: output buffer holds ", out.size(), " bytes, needs ",
               total);
  auto write_header = [&](const EncodeStats& st) {
    EncodedHeader h;
    h.format = static_cast<uint8_t>(l.format);
    h.scaling = static_cast<uint8_t>(l.scaling);
    h.block = l.block;
    h.count = x.size();
    if (st.nonfinite) h.flags |= kFlagNonFinite;
    std::memcpy(out.data(), &h, sizeof(h));
    return st;
  };
  if (l.format == Format::kNvfp4 && options.rounding == Rounding::kNearest &&
      detail::VectorizedEnabled()) {
    uint8_t* scales = out.data() + sizeof(EncodedHeader);
    EncodeStats st;
    if (detail::EncodeRotatedNvAvx512(x.data(), x.size(), block, seed, l, scales,
                                      scales + l.scale_bytes, &st)) {
      return write_header(st);
    }
  }
  if (!block_local) {
    std::vector<float> copy(x.begin(), x.end());
    HadamardForward(copy, block, seed);
    return Encode(copy, options, out);
  }
  // Tiles of whole codec blocks (each a whole number of rotation blocks), 32 KiB of floats: the
  // rotated tile is encoded while it is in L1/L2.
  const size_t tile = size_t(l.block) * std::max<size_t>(1, 8192 / l.block);
  uint8_t* scales = out.data() + sizeof(EncodedHeader);
  uint8_t* payload = scales + l.scale_bytes;
  EncodeStats st;
  const float scale = BlockScale(block);
  // Whole codec blocks in registers where the CPU has AVX-512; the rest (or everything, where it
  // declines) in tiles.
  size_t start = 0;
  if (const size_t whole = x.size() / l.block * l.block;
      whole && detail::EncodeRotatedAvx512(x.data(), whole, block, seed, l, scales, payload, &st)) {
    start = whole;
  }
  std::vector<float> buf(start < x.size() ? tile : 0);
  for (size_t t0 = start; t0 < x.size(); t0 += tile) {
    const size_t len = std::min(tile, x.size() - t0);
    const size_t whole = len / size_t(block) * size_t(block);
    for (size_t i = 0; i < whole; i += size_t(block)) {
      if (block >= 8) {
        AnyBlockAvx2<false>(x.data() + t0 + i, buf.data() + i, block, seed, t0 + i, scale);
      } else {
        std::memcpy(buf.data() + i, x.data() + t0 + i, size_t(block) * sizeof(float));
        hadamard::ForwardBlock(buf.data() + i, block, seed, t0 + i, scale);
      }
    }
    std::memcpy(buf.data() + whole, x.data() + t0 + whole, (len - whole) * sizeof(float));
    hadamard::SignsOnly(buf.data() + whole, int(len - whole), seed, t0 + whole);
    // The options were validated above; the unvalidated overload costs no string formatting.
    const detail::Layout sub = detail::MakeLayout(l.format, l.scaling, l.block, len);
    const detail::Layout before = detail::MakeLayout(l.format, l.scaling, l.block, t0);
    EncodeStats ts;
    GEOFP8_CHECK(detail::EncodeFp8Avx2(buf.data(), sub, scales + before.scale_bytes,
                                       payload + before.payload_bytes, &ts),
                 "encode: the vectorized path refused a block-local format");
    st.nonfinite += ts.nonfinite;
    st.saturated += ts.saturated;
  }
  return write_header(st);
}

}  // namespace geofp8
