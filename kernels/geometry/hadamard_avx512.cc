// AVX-512 rotate-and-encode (hadamard_avx512.h): each codec scale block is signed, rotated and
// reduced in registers, then scaled and converted by the codec's AVX-512 tile driver
// (kernels/codec/codec_avx512.h), so the rotated tensor never reaches memory beyond an 8 KiB
// tile. The operations are the reference's (signs, butterflies h = 1, 2, 4, ... in order, one
// multiply by 1/sqrt(b), then the codec's rule), so the bytes equal HadamardForward followed by
// Encode; tests compare the paths.

#include "kernels/geometry/hadamard_avx512.h"

#include <cmath>

#include "kernels/codec/codec_avx512.h"
#include "kernels/common/cpu_features.h"
#include "kernels/geometry/hadamard_math.h"

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593: see codec_avx512.h
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace geofp8::detail {
namespace {

using avx512::Rule;

// One butterfly stage inside each 16-lane vector: lane j pairs with lane j ^ h. The lower lane
// of a pair becomes a + c and the upper one a - c, as a fused multiply-add of the lane by +1 or
// -1 plus its partner: the product by +-1 is exact, so the single rounding is that of the add or
// subtract the reference does (signed zeros included; non-finite blocks take the reference path).
template <int H>
GEOFP8_AVX512 inline __m512 InVectorStage(__m512 v) {
  __m512 partner;
  __m512 sign;
  if constexpr (H == 1) {
    partner = _mm512_permute_ps(v, 0xB1);  // lanes 1,0,3,2 in each 128-bit quarter
    sign = _mm512_castsi512_ps(_mm512_set1_epi64(0xBF8000003F800000LL));
  } else if constexpr (H == 2) {
    partner = _mm512_permute_ps(v, 0x4E);  // lanes 2,3,0,1
    sign = _mm512_castsi512_ps(_mm512_setr_epi32(
        0x3F800000, 0x3F800000, int(0xBF800000), int(0xBF800000), 0x3F800000, 0x3F800000,
        int(0xBF800000), int(0xBF800000), 0x3F800000, 0x3F800000, int(0xBF800000), int(0xBF800000),
        0x3F800000, 0x3F800000, int(0xBF800000), int(0xBF800000)));
  } else if constexpr (H == 4) {
    partner = _mm512_shuffle_f32x4(v, v, 0xB1);  // 128-bit quarters 1,0,3,2
    sign = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
  } else {
    static_assert(H == 8);
    partner = _mm512_shuffle_f32x4(v, v, 0x4E);  // 256-bit halves swapped
    sign = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
  }
  return _mm512_fmadd_ps(v, sign, partner);
}

// Stages h = 16 H, 32 H, ... of V vectors (distance H in vectors), unrolled so they stay in
// registers.
template <int V, int H>
GEOFP8_AVX512 inline void CrossVectorStages(__m512* v) {
  if constexpr (H < V) {
#pragma GCC unroll 8
    for (int i = 0; i < V; i += 2 * H) {
#pragma GCC unroll 8
      for (int j = i; j < i + H; ++j) {
        const __m512 a = v[j], c = v[j + H];
        v[j] = _mm512_add_ps(a, c);
        v[j + H] = _mm512_sub_ps(a, c);
      }
    }
    CrossVectorStages<V, 2 * H>(v);
  }
}

// The tile driver's block source: codec blocks of CB elements rotated in blocks of RB.
template <int RB, int CB>
struct Rotation {
  uint64_t seed;
  float rot_scale = float(1.0 / std::sqrt(double(RB)));

  template <int K>
  GEOFP8_AVX512 void Prepare(const float* x, uint64_t first, float* out, uint32_t* amax) const {
    constexpr int V = K * CB / 16;  // vectors in the K blocks
    constexpr int RV = RB / 16;     // vectors per rotation block
    __m512 v[V];
    uint64_t word = 0;
#pragma GCC unroll 16
    for (int q = 0; q < V; ++q) {
      const uint64_t e = first + uint64_t(16 * q);
      if (q == 0 || (e & 63) == 0) word = hadamard::SignWord(seed, e >> 6);
      const __mmask16 neg = __mmask16(word >> (e & 63));
      const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(x + 16 * q));
      v[q] = _mm512_castsi512_ps(
          _mm512_mask_xor_epi32(bits, neg, bits, _mm512_set1_epi32(int(0x80000000u))));
      v[q] = InVectorStage<8>(InVectorStage<4>(InVectorStage<2>(InVectorStage<1>(v[q]))));
    }
#pragma GCC unroll 16
    for (int r = 0; r < V; r += RV) CrossVectorStages<RV, 1>(v + r);
    const __m512 rs = _mm512_set1_ps(rot_scale);
#pragma GCC unroll 16
    for (int b = 0; b < K; ++b) {
      // Two running maxima, to halve the reduction's dependency chain.
      __m512i m0 = _mm512_setzero_si512(), m1 = m0;
#pragma GCC unroll 8
      for (int q = b * CB / 16; q < (b + 1) * CB / 16; ++q) {
        v[q] = _mm512_mul_ps(v[q], rs);
        _mm512_store_ps(out + 16 * q, v[q]);
        if (q % 2) {
          m1 = avx512::MaxAbsBits(m1, v[q]);
        } else {
          m0 = avx512::MaxAbsBits(m0, v[q]);
        }
      }
      amax[b] = _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
    }
  }

  const float* Values(const float*, const float* buf) const { return buf; }

  void Reference(const float* x, uint64_t first, float* y) const {
    std::memcpy(y, x, CB * sizeof(float));
    for (int i = 0; i < CB; i += RB) hadamard::ForwardBlock(y + i, RB, seed, first + i, rot_scale);
  }
};

// The rotation block rb, tried from RB = 16 up to the codec block CB.
template <Format F, Rule R, int CB, int RB = 16>
bool DispatchRotation(int rb, const float* x, size_t n, uint64_t seed, uint8_t* scales,
                      uint8_t* payload, EncodeStats* st) {
  if constexpr (RB > CB) {
    return false;
  } else {
    if (rb != RB) return DispatchRotation<F, R, CB, 2 * RB>(rb, x, n, seed, scales, payload, st);
    avx512::EncodeTiles<F, R, CB>(x, n, Rotation<RB, CB>{seed}, scales, payload, st);
    return true;
  }
}

template <Format F>
bool DispatchCodecBlock(uint32_t cb, int rb, const float* x, size_t n, uint64_t seed,
                        uint8_t* scales, uint8_t* payload, EncodeStats* st) {
  switch (cb) {
    case 16:
      return DispatchRotation<F, Rule::kFp8Block, 16>(rb, x, n, seed, scales, payload, st);
    case 32:
      return DispatchRotation<F, Rule::kFp8Block, 32>(rb, x, n, seed, scales, payload, st);
    case 64:
      return DispatchRotation<F, Rule::kFp8Block, 64>(rb, x, n, seed, scales, payload, st);
    case 128:
      return DispatchRotation<F, Rule::kFp8Block, 128>(rb, x, n, seed, scales, payload, st);
  }
  return false;
}

}  // namespace

bool EncodeRotatedNvAvx512(const float* x, size_t n, int rb, uint64_t seed, const Layout& l,
                           uint8_t* scales, uint8_t* payload, EncodeStats* st) {
  if (!Avx512Enabled() || !CpuHasAvx512() || l.format != Format::kNvfp4 || rb != 16) return false;
  const size_t whole = n / 16 * 16;
  const Rotation<16, 16> rotation{seed};
  // The tensor scale needs the whole rotated tensor's amax: a first rotation pass that keeps only
  // the block maxima (rotating twice costs less than writing and reading the rotated copy).
  uint32_t amax = avx512::AmaxBits(x, whole, rotation);
  float tail[16];
  std::memcpy(tail, x + whole, (n - whole) * sizeof(float));
  hadamard::SignsOnly(tail, int(n - whole), seed, whole);  // the n % b tail is only signed
  for (size_t i = 0; i < n - whole; ++i) {
    amax = std::max(amax, element::FloatBits(tail[i]) & 0x7FFFFFFFu);
  }
  if (amax >= 0x7F800000u) return false;  // the reference path poisons the blocks concerned
  const float g = element::NvTensorScale(element::BitsFloat(amax));
  std::memcpy(scales, &g, 4);
  if (!avx512::EncodeNvTiles(x, whole, rotation, g, scales + 4, payload, st)) return false;
  if (whole < n) {
    EncodeNvPartialBlock(tail, n - whole, g, scales + 4 + whole / 16, payload + whole / 2, st);
  }
  return true;
}

bool EncodeRotatedAvx512(const float* x, size_t n, int rb, uint64_t seed, const Layout& l,
                         uint8_t* scales, uint8_t* payload, EncodeStats* st) {
  if (!Avx512Enabled() || !CpuHasAvx512() || l.block == 0 || n % l.block != 0) return false;
  switch (l.format) {
    case Format::kFp8E4M3:
      return l.scaling == Scaling::kBlock &&
             DispatchCodecBlock<Format::kFp8E4M3>(l.block, rb, x, n, seed, scales, payload, st);
    case Format::kFp8E5M2:
      return l.scaling == Scaling::kBlock &&
             DispatchCodecBlock<Format::kFp8E5M2>(l.block, rb, x, n, seed, scales, payload, st);
    case Format::kMxfp8:
      return DispatchRotation<Format::kFp8E4M3, Rule::kMx, 32>(rb, x, n, seed, scales, payload, st);
    default:
      return false;
  }
}

}  // namespace geofp8::detail
