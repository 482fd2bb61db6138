// The AVX-512 fp8 encode, shared by the plain codec (codec_avx512.cc) and the rotated one
// (kernels/geometry/hadamard_avx512.cc): the per-lane conversion, the per-block scales 16 at a
// time, and the tile driver that makes blocks independent. Internal; every function here matches
// the scalar reference (element.h) bit for bit, and tests compare the paths.
#pragma once

// GCC 12's AVX-512 headers build their "undefined" vectors from a self-initialized variable,
// which -Wmaybe-uninitialized reports at every inlined use (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/codec/codec.h"
#include "kernels/codec/codec_internal.h"
#include "kernels/codec/element.h"

namespace geofp8::detail::avx512 {

#define GEOFP8_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))

// Sixteen finite scaled values -> sixteen codes, element::FloatToSmall's nearest rule by the
// float adder: with e = max(exponent of |y|, the smallest normal's), c = 2^(e + 23 - M) has an
// ulp of 2^(e - M), the element's quantum at |y| (normal or subnormal alike), and |y| < 2c, so
// |y| + c rounds |y| half-even to k quanta in one rounding: bits(|y| + c) - bits(c) = k, and the
// code is (e + B - 1) 2^M + k (k = 2^(M+1) carries into the next exponent, as it should).
// kCanSaturate clamps to the largest finite code and counts values above the format's max.
template <Format F, bool kCanSaturate>
GEOFP8_AVX512 inline __m512i Codes16(__m512 y, __m512i* saturated) {
  using P = Fp8Params<F>;
  constexpr int kMinNormalExp = (127 + 1 - P::B) << 23;
  constexpr int kCodeBias = (151 - P::M - P::B) << P::M;
  const __m512i u = _mm512_castps_si512(y);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  if constexpr (kCanSaturate) {
    const __mmask16 over =
        _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(int(element::FloatBits(P::kMax))));
    *saturated = _mm512_mask_sub_epi32(*saturated, over, *saturated, _mm512_set1_epi32(-1));
  }
  const __m512i c =
      _mm512_add_epi32(_mm512_max_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7F800000)),
                                        _mm512_set1_epi32(kMinNormalExp)),
                       _mm512_set1_epi32((23 - P::M) << 23));
  const __m512i sum =
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(c)));
  // (e + B - 1) 2^M: c's mantissa is zero, so c >> (23 - M) is its exponent field times 2^M.
  const __m512i exponent_part =
      _mm512_sub_epi32(_mm512_srli_epi32(c, 23 - P::M), _mm512_set1_epi32(kCodeBias));
  __m512i magnitude;
  if constexpr (kCanSaturate) {
    magnitude = _mm512_min_epi32(_mm512_add_epi32(_mm512_sub_epi32(sum, c), exponent_part),
                                 _mm512_set1_epi32(int(P::kMaxCode)));
  } else {
    // Only the low byte is kept (VPMOVDB truncates), and bits(c) is zero there, so
    // sum - c + exponent_part and sum + exponent_part agree in it: one subtraction fewer.
    magnitude = _mm512_add_epi32(sum, exponent_part);
  }
  // code = magnitude | (sign at kSignBit): 0xF8 is A | (B & C).
  return _mm512_ternarylogic_epi32(magnitude, _mm512_srli_epi32(u, 31 - P::kSignBit),
                                   _mm512_set1_epi32(1 << P::kSignBit), 0xF8);
}

// Codes16 packed to sixteen bytes (VPMOVDB keeps each lane's low byte).
template <Format F, bool kCanSaturate>
GEOFP8_AVX512 inline __m128i Convert16(__m512 y, __m512i* saturated) {
  return _mm512_cvtepi32_epi8(Codes16<F, kCanSaturate>(y, saturated));
}

// max(m, |v|) as integers on the float bits: finite non-negative floats order like their bits, so
// the max is exact, and a NaN or infinite v leaves a lane at 0x7F800000 or above, which is how
// the callers detect a block holding a non-finite value. (VRANGEPS would save the AND but
// returns the other operand when one is a quiet NaN, hiding it.)
GEOFP8_AVX512 inline __m512i MaxAbsBits(__m512i m, __m512 v) {
  return _mm512_max_epu32(m,
                          _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF)));
}

// The per-block scale rules covered: fp8 with an fp32 scale per block, and mxfp8's E8M0.
enum class Rule { kFp8Block, kMx };

// element::ScaleFromAmax for 16 finite amaxes at once, operation for operation.
template <Format F>
GEOFP8_AVX512 inline __m512 ScalesFromAmax(__m512i amax_bits) {
  const __m512 amax = _mm512_castsi512_ps(amax_bits);
  const __m512 fmt_max = _mm512_set1_ps(Fp8Params<F>::kMax);
  const __m512 flt_max = _mm512_set1_ps(3.4028234663852886e38f);
  __m512 s = _mm512_div_ps(fmt_max, amax);
  s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, flt_max, _CMP_LE_OQ), flt_max, s);
  const __mmask16 over = _mm512_cmp_ps_mask(_mm512_mul_ps(amax, s), fmt_max, _CMP_GT_OQ);
  s = _mm512_castsi512_ps(_mm512_mask_sub_epi32(_mm512_castps_si512(s), over,
                                                _mm512_castps_si512(s), _mm512_set1_epi32(1)));
  const __mmask16 positive = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
  return _mm512_mask_blend_ps(positive, _mm512_set1_ps(1.f), s);
}

// element::MxScaleCode for 16 finite amaxes and the multiplier EncodeMx derives from each code
// (2^(127 - e) exactly, as a subnormal for the largest code). Lanes with a subnormal amax are
// left to the scalar rule: their mask bit is returned set.
GEOFP8_AVX512 inline __mmask16 MxScales(__m512i amax_bits, __m512i* codes, __m512* inv) {
  const __m512i biased = _mm512_srli_epi32(amax_bits, 23);
  __m512i code = _mm512_add_epi32(biased, _mm512_set1_epi32(-8));  // (biased - 127) - 8 + 127
  code = _mm512_min_epi32(_mm512_max_epi32(code, _mm512_setzero_si512()), _mm512_set1_epi32(254));
  const __mmask16 zero = _mm512_cmpeq_epi32_mask(amax_bits, _mm512_setzero_si512());
  code = _mm512_mask_blend_epi32(zero, code, _mm512_set1_epi32(127));
  *codes = code;
  const __m512i inv_bits = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(254), code), 23);
  *inv = _mm512_castsi512_ps(
      _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(code, _mm512_set1_epi32(254)), inv_bits,
                              _mm512_set1_epi32(0x00400000)));
  return _mm512_mask_cmpeq_epi32_mask(~zero, biased, _mm512_setzero_si512());
}

// The scalar rule for one block of CB values y (its amax over the finite ones), exactly as the
// codec's non-finite branch encodes it: the path for blocks holding a non-finite value.
template <Format F, Rule R>
inline void EncodeBlockScalar(const float* y, int cb, uint8_t* scale_out, uint8_t* payload,
                              EncodeStats* st) {
  float amax = 0.f;
  for (int i = 0; i < cb; ++i) {
    if (element::IsFinite(y[i]))
      amax = std::max(amax, element::AbsF(y[i]));
    else
      ++st->nonfinite;
  }
  float s;
  if constexpr (R == Rule::kFp8Block) {
    s = element::ScaleFromAmax(amax, Fp8Params<F>::kMax);
    std::memcpy(scale_out, &s, 4);
  } else {
    const uint8_t code = element::MxScaleCode(amax);
    *scale_out = code;
    s = MxInverseScale(code);
  }
  for (int i = 0; i < cb; ++i) {
    bool sat = false;
    payload[i] = element::EncodeFp8Scaled(F == Format::kFp8E5M2, y[i], s, false, 0, &sat);
    st->saturated += sat;
  }
}

// Encodes the whole blocks x[0..n) (n a multiple of CB) in tiles of 2048 elements (8 KiB, in
// L1): first every block of the tile is prepared and reduced to its amax, then the tile's scales
// are computed 16 at a time, then its values converted. The passes make the blocks independent,
// so their latencies (the reduction, the division, a rotation's butterflies) overlap instead of
// adding up. `Source` provides the block values:
//   template <int K> void Prepare(const float* x, uint64_t first, float* buf, uint32_t* amax):
//       for K consecutive blocks (x[0..K CB), tensor elements from `first`), the bits of each
//       block's largest magnitude (>= 0x7F800000 when a value is not finite), leaving the values
//       where Values finds them. The driver asks for 16 vectors' worth at a time, so that blocks
//       too short to fill the out-of-order window on their own (a reduction and a division per
//       block) overlap;
//   const float* Values(const float* x, const float* buf): where they are (x itself or buf);
//   void Reference(const float* x, uint64_t first, float* y): the block's values by the scalar
//       reference, for a block holding a non-finite value.
// How far ahead the conversion pass requests input lines, one per vector converted: the next
// tile. The hardware prefetcher alone leaves the plain encode about 20% slower at 64 MiB on the
// dev VM; issuing them in the pass that has no loads of its own from memory spreads them out.
inline constexpr int kPrefetchBytes = 8192;

template <Format F, Rule R, int CB, class Source>
GEOFP8_AVX512 void EncodeTiles(const float* x, size_t n, const Source& src, uint8_t* scales,
                               uint8_t* payload, EncodeStats* st) {
  static_assert(CB % 16 == 0 && CB <= 128);
  constexpr int kTileBlocks = 2048 / CB;  // a multiple of 16
  constexpr int kGroup = 256 / CB;        // blocks per Prepare: 16 vectors, 1 KiB
  constexpr bool kMx = R == Rule::kMx;
  constexpr size_t kScaleBytes = kMx ? 1 : 4;
  alignas(64) float buf[kTileBlocks * CB];
  alignas(64) uint32_t amax[kTileBlocks];
  alignas(64) float mult[kTileBlocks];
  __m512i saturated = _mm512_setzero_si512();  // per-lane counts
  for (size_t t0 = 0; t0 < n; t0 += size_t(kTileBlocks) * CB) {
    const size_t bi0 = t0 / CB;
    const int nb = int(std::min<size_t>(kTileBlocks, (n - t0) / CB));
    int j = 0;
    for (; j + kGroup <= nb; j += kGroup) {
      src.template Prepare<kGroup>(x + t0 + size_t(j) * CB, t0 + size_t(j) * CB, buf + j * CB,
                                   amax + j);
    }
    for (; j < nb; ++j) {
      src.template Prepare<1>(x + t0 + size_t(j) * CB, t0 + size_t(j) * CB, buf + j * CB, amax + j);
    }
    bool nonfinite = false;
    for (int j = 0; j < nb; j += 16) {
      const __mmask16 live = __mmask16((1u << std::min(16, nb - j)) - 1);
      const __m512i a = _mm512_maskz_load_epi32(live, amax + j);
      nonfinite |= _mm512_mask_cmpge_epu32_mask(live, a, _mm512_set1_epi32(0x7F800000)) != 0;
      if constexpr (kMx) {
        __m512i codes;
        __m512 inv;
        const __mmask16 subnormal = MxScales(a, &codes, &inv);
        _mm512_store_ps(mult + j, inv);
        _mm_mask_storeu_epi8(scales + bi0 + j, live, _mm512_cvtepi32_epi8(codes));
        for (unsigned m = subnormal & live; m; m &= m - 1) {  // rare: the scalar rule
          const int k = j + __builtin_ctz(m);
          const uint8_t code = element::MxScaleCode(element::BitsFloat(amax[k]));
          scales[bi0 + k] = code;
          mult[k] = MxInverseScale(code);
        }
      } else {
        const __m512 sc = ScalesFromAmax<F>(a);
        _mm512_store_ps(mult + j, sc);
        _mm512_mask_storeu_ps(scales + 4 * (bi0 + j), live, sc);
      }
    }
    const char* ahead = reinterpret_cast<const char*>(x + t0) + kPrefetchBytes;
    if (!nonfinite) {
      // All blocks finite: one flat loop over the tile's vectors.
      const float* v0 = src.Values(x + t0, buf);
      uint8_t* p0 = payload + t0;
      const int nv = nb * CB / 16;
#pragma GCC unroll 4
      for (int q = 0; q < nv; ++q) {
        _mm_prefetch(ahead + 64 * q, _MM_HINT_T0);
        const __m512 m = _mm512_set1_ps(mult[q / (CB / 16)]);
        const __m128i codes =
            Convert16<F, kMx>(_mm512_mul_ps(_mm512_loadu_ps(v0 + 16 * q), m), &saturated);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p0 + 16 * q), codes);
      }
      continue;
    }
    // Some block of the tile holds a non-finite value: the others as above, block by block, and
    // those by the scalar rule.
    for (int j = 0; j < nb; ++j) {
      if (amax[j] >= 0x7F800000u) continue;
      const __m512 m = _mm512_set1_ps(mult[j]);
      const float* v = src.Values(x + t0 + size_t(j) * CB, buf + j * CB);
      uint8_t* p = payload + t0 + size_t(j) * CB;
#pragma GCC unroll 8
      for (int q = 0; q < CB / 16; ++q) {
        _mm_prefetch(ahead + 4 * (j * CB + 16 * q), _MM_HINT_T0);
        // A scale from ScaleFromAmax cannot saturate (|x| s <= amax s <= max); the mx one can.
        const __m128i codes =
            Convert16<F, kMx>(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * q), m), &saturated);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 16 * q), codes);
      }
    }
    for (int j = 0; j < nb; ++j) {
      if (amax[j] < 0x7F800000u) continue;
      const size_t b0 = t0 + size_t(j) * CB;
      float y[CB];
      src.Reference(x + b0, b0, y);
      EncodeBlockScalar<F, R>(y, CB, scales + kScaleBytes * (bi0 + j), payload + b0, st);
    }
  }
  alignas(64) uint32_t lanes[16];
  _mm512_store_si512(lanes, saturated);
  for (uint32_t c : lanes) st->saturated += c;
}

// The largest magnitude's bits over the whole 16-element blocks x[0..n) as `src` prepares them
// (>= 0x7F800000 when a value is not finite).
template <class Source>
GEOFP8_AVX512 uint32_t AmaxBits(const float* x, size_t n, const Source& src) {
  alignas(64) float buf[256];
  alignas(64) uint32_t a[16];
  __m512i m = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    src.template Prepare<16>(x + i, i, buf, a);
    m = _mm512_max_epu32(m, _mm512_load_si512(a));
  }
  uint32_t best = _mm512_reduce_max_epu32(m);
  for (; i + 16 <= n; i += 16) {
    src.template Prepare<1>(x + i, i, buf, a);
    best = std::max(best, a[0]);
  }
  return best;
}

// nvfp4 (element.h's rule) for the whole 16-element blocks x[0..n) of a tensor whose finite
// tensor scale g is known, from the same block sources as EncodeTiles (CB = 16): per block the
// E4M3 scale code of amax / (6 g) (16 blocks at a time, by Codes16), den = E4M3ToFloat(code) g,
// and the elements E2M1(x / den) with the scalar path's IEEE division, two per byte. Returns
// false, having written garbage, if a block holds a non-finite value: callers check the tensor
// first, so that does not happen.
template <class Source>
GEOFP8_AVX512 bool EncodeNvTiles(const float* x, size_t n, const Source& src, float g,
                                 uint8_t* codes_out, uint8_t* payload, EncodeStats* st) {
  constexpr int kTileBlocks = 128;  // 2048 elements
  alignas(64) float buf[kTileBlocks * 16];
  alignas(64) uint32_t amax[kTileBlocks];
  alignas(64) float den[kTileBlocks];
  const __m512 six_g = _mm512_set1_ps(6.f * g);
  const __m512 gv = _mm512_set1_ps(g);
  __m512i saturated = _mm512_setzero_si512();
  __m512i unused = _mm512_setzero_si512();  // block codes cannot saturate the count that matters
  for (size_t t0 = 0; t0 < n; t0 += size_t(kTileBlocks) * 16) {
    const size_t bi0 = t0 / 16;
    const int nb = int(std::min<size_t>(kTileBlocks, (n - t0) / 16));
    int j = 0;
    for (; j + 16 <= nb; j += 16) {
      src.template Prepare<16>(x + t0 + size_t(j) * 16, t0 + size_t(j) * 16, buf + j * 16,
                               amax + j);
    }
    for (; j < nb; ++j) {
      src.template Prepare<1>(x + t0 + size_t(j) * 16, t0 + size_t(j) * 16, buf + j * 16, amax + j);
    }
    for (j = 0; j < nb; j += 16) {
      const __mmask16 live = __mmask16((1u << std::min(16, nb - j)) - 1);
      const __m512i a = _mm512_maskz_load_epi32(live, amax + j);
      if (_mm512_mask_cmpge_epu32_mask(live, a, _mm512_set1_epi32(0x7F800000))) return false;
      // NvBlockScaleCode: E4M3 of amax / (6 g) (nearest; above 464 saturates to 0x7E, which the
      // clamp gives), and 0x38 (1.0) for a code of zero magnitude.
      __m512i code =
          Codes16<Format::kFp8E4M3, true>(_mm512_div_ps(_mm512_castsi512_ps(a), six_g), &unused);
      code = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(code, _mm512_setzero_si512()), code,
                                     _mm512_set1_epi32(0x38));
      _mm_mask_storeu_epi8(codes_out + bi0 + j, live, _mm512_cvtepi32_epi8(code));
      // E4M3ToFloat (codes 1..0x7E, sign clear): mag * 2^-9 below 8, else the bits directly.
      const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(code), _mm512_set1_ps(0.001953125f));
      const __m512 normal = _mm512_castsi512_ps(
          _mm512_add_epi32(_mm512_slli_epi32(code, 20), _mm512_set1_epi32(120 << 23)));
      const __m512 scale =
          _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(code, _mm512_set1_epi32(8)), normal, sub);
      _mm512_store_ps(den + j, _mm512_mul_ps(scale, gv));
    }
    const float* v = src.Values(x + t0, buf);
    uint8_t* p = payload + t0 / 2;
    const char* ahead = reinterpret_cast<const char*>(x + t0) + kPrefetchBytes;
#pragma GCC unroll 4
    for (j = 0; j < nb; ++j) {
      _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
      const __m512 y = _mm512_div_ps(_mm512_loadu_ps(v + 16 * j), _mm512_set1_ps(den[j]));
      const __m512i c = Codes16<Format::kNvfp4, true>(y, &saturated);
      // Lanes 2i and 2i+1 -> one byte, the even element in the low nibble: OR each 64-bit lane
      // with itself shifted down by 28, then keep each 64-bit lane's low byte.
      const __m512i pairs = _mm512_or_si512(c, _mm512_srli_epi64(c, 28));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(p + 8 * j), _mm512_cvtepi64_epi8(pairs));
    }
  }
  alignas(64) uint32_t lanes[16];
  _mm512_store_si512(lanes, saturated);
  for (uint32_t c : lanes) st->saturated += c;
  return true;
}

}  // namespace geofp8::detail::avx512

#pragma GCC diagnostic pop
