// AVX2 path of the fp8 codec (E4M3/E5M2, nearest rounding, none/tensor/block scaling), chosen at
// run time. Bit-identical to the scalar reference in codec.cc; tests compare the two.
#include <algorithm>
#include <cstring>

#include "kernels/codec/codec_internal.h"
#include "kernels/codec/element.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define GEOFP8_X86 1
#else
#define GEOFP8_X86 0
#endif

namespace geofp8::detail {

#if GEOFP8_X86

bool CpuHasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return has;
}

namespace {

#define GEOFP8_AVX2 __attribute__((target("avx2,fma,f16c")))

// Eight finite scaled values (bits u, magnitude bits a = u & 0x7FFFFFFF) -> eight codes in the
// low byte of each 32-bit lane. Same cases as element::FloatToSmall (nearest):
// - normal range: integer round-half-even on the float bits, with the exponent rebias folded
//   into the rounding addend. The result grows monotonically with a and exceeds kMaxCode exactly
//   when a is above the overflow threshold, so saturation is a min().
// - below the smallest normal: |y| * 2^(B+M-1) is exact and converting it to an integer with the
//   default round-to-nearest-even mode gives the subnormal code directly (0 at or below half the
//   smallest subnormal, 2^M = smallest normal code at the top of the range).
template <Format F, bool kCanSaturate>
GEOFP8_AVX2 inline __m256i ConvertFinite(__m256i u, __m256i a) {
  using P = Fp8Params<F>;
  constexpr int kShift = 23 - P::M;
  constexpr int kAddend = (1 << (kShift - 1)) - 1 - ((127 - P::B) << 23);
  const __m256i sign =
      _mm256_and_si256(_mm256_srli_epi32(u, 31 - P::kSignBit), _mm256_set1_epi32(1 << P::kSignBit));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, kShift), _mm256_set1_epi32(1));
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(kAddend)), lsb);
  __m256i normal = _mm256_srai_epi32(t, kShift);
  if constexpr (kCanSaturate) {
    normal = _mm256_min_epi32(normal, _mm256_set1_epi32(static_cast<int>(P::kMaxCode)));
  }
  const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(
      _mm256_castsi256_ps(a), _mm256_set1_ps(static_cast<float>(1u << (P::B + P::M - 1)))));
  const __m256i is_sub =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>((128 - P::B) << 23)), a);
  return _mm256_or_si256(_mm256_blendv_epi8(normal, sub, is_sub), sign);
}

// How far ahead EncodeRun prefetches its input (floats), 4 KiB: tuned on the dev VM (256..2048).
constexpr size_t kPrefetchFloats = 1024;

// Packs four vectors of 32-bit codes (each < 256) into 32 bytes in element order.
GEOFP8_AVX2 inline void Store32Codes(uint8_t* dst, __m256i r0, __m256i r1, __m256i r2, __m256i r3) {
  const __m256i p01 = _mm256_packus_epi32(r0, r1);
  const __m256i p23 = _mm256_packus_epi32(r2, r3);
  const __m256i b = _mm256_packus_epi16(p01, p23);
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
}

// Finite amax of x[0..n); returns false if any value is non-finite.
GEOFP8_AVX2 bool AmaxAllFinite(const float* x, size_t n, float* amax) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
  size_t i = 0;
  // Finite non-negative floats order like their bit patterns, so an integer max is exact.
  for (; i + 16 <= n; i += 16) {
    const __m256i a0 =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), abs_mask);
    const __m256i a1 =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8)), abs_mask);
    m0 = _mm256_max_epi32(m0, a0);
    m1 = _mm256_max_epi32(m1, a1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256i a0 =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), abs_mask);
    m0 = _mm256_max_epi32(m0, a0);
  }
  m0 = _mm256_max_epi32(m0, m1);
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m0), _mm256_extracti128_si256(m0, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  uint32_t best = static_cast<uint32_t>(_mm_cvtsi128_si32(h));
  for (; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    best = std::max(best, b & 0x7FFFFFFFu);
  }
  if (best >= 0x7F800000u) return false;
  *amax = element::BitsFloat(best);
  return true;
}

// Encodes n finite values with one scale; returns the saturated count (|x * scale| > max).
// With a scale from ScaleFromAmax (kCanSaturate false) |x| * scale <= amax * scale <= max, since
// rounded multiplication is monotonic, so nothing can saturate and the checks are skipped.
template <Format F, bool kCanSaturate>
GEOFP8_AVX2 uint64_t EncodeRun(const float* x, size_t n, float scale, uint8_t* out) {
  using P = Fp8Params<F>;
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i max_bits = _mm256_set1_epi32(static_cast<int>(element::FloatBits(P::kMax)));
  __m256i sat = _mm256_setzero_si256();  // per-lane counts (subtracting -1 per hit)
  uint64_t saturated = 0;
  size_t i = 0;
  auto one = [&](size_t k) GEOFP8_AVX2 {
    const __m256i u = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x + k), s));
    const __m256i a = _mm256_and_si256(u, abs_mask);
    if constexpr (kCanSaturate) sat = _mm256_sub_epi32(sat, _mm256_cmpgt_epi32(a, max_bits));
    return ConvertFinite<F, kCanSaturate>(u, a);
  };
  for (; i + 32 <= n; i += 32) {
    // Block scaling reads each block twice (amax, then convert); prefetching the next blocks
    // here lets their memory latency overlap this block's arithmetic. Prefetch never faults.
    _mm_prefetch(reinterpret_cast<const char*>(x + i + kPrefetchFloats), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(x + i + kPrefetchFloats + 16), _MM_HINT_T0);
    const __m256i r0 = one(i), r1 = one(i + 8), r2 = one(i + 16), r3 = one(i + 24);
    Store32Codes(out + i, r0, r1, r2, r3);
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sat);
  for (uint32_t c : lanes) saturated += c;
  for (; i < n; ++i) out[i] = EncodeFp8Element<F>(x[i], scale, false, 0, &saturated);
  return saturated;
}

template <Format F>
GEOFP8_AVX2 void EncodeFp8(const float* x, const Layout& l, uint8_t* scales, uint8_t* payload,
                           EncodeStats* st) {
  using P = Fp8Params<F>;
  const size_t n = l.count;
  const size_t block = l.scaling == Scaling::kBlock ? l.block : std::max<size_t>(n, 1);
  for (size_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    const size_t len = std::min(block, n - b0);
    float amax = 0.f;
    const bool finite = AmaxAllFinite(x + b0, len, &amax);
    float scale = 1.f;
    if (finite) {
      if (l.scaling != Scaling::kNone) {
        scale = element::ScaleFromAmax(amax, P::kMax);
        st->saturated += EncodeRun<F, false>(x + b0, len, scale, payload + b0);
      } else {
        st->saturated += EncodeRun<F, true>(x + b0, len, scale, payload + b0);
      }
    } else {
      // Rare: a non-finite value in this run. The scalar reference rule, element by element.
      float famax = 0.f;
      for (size_t i = b0; i < b0 + len; ++i) {
        if (element::IsFinite(x[i]))
          famax = std::max(famax, x[i] < 0 ? -x[i] : x[i]);
        else
          ++st->nonfinite;
      }
      if (l.scaling != Scaling::kNone) scale = element::ScaleFromAmax(famax, P::kMax);
      for (size_t i = b0; i < b0 + len; ++i) {
        payload[i] = EncodeFp8Element<F>(x[i], scale, false, 0, &st->saturated);
      }
    }
    if (l.scaling != Scaling::kNone) std::memcpy(scales + 4 * bi, &scale, 4);
  }
  if (l.scaling == Scaling::kTensor && n == 0) {
    const float one = 1.f;
    std::memcpy(scales, &one, 4);
  }
}

// Eight codes -> eight floats, as element::E4M3ToFloat / E5M2ToFloat.
template <Format F>
GEOFP8_AVX2 inline __m256 DecodeCodes(__m256i c) {
  using P = Fp8Params<F>;
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256i normal =
      _mm256_add_epi32(_mm256_slli_epi32(mag, 23 - P::M), _mm256_set1_epi32((127 - P::B) << 23));
  const __m256 sub = _mm256_mul_ps(
      _mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / static_cast<float>(1u << (P::B + P::M - 1))));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << P::M), mag);
  __m256i bits = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub), is_sub);
  if constexpr (F == Format::kFp8E4M3) {
    const __m256i nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), nan);
  } else {
    const __m256i inf = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7C));
    const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7C));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7F800000), inf);
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), nan);
  }
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}

// kScale: 0 none, 1 divide by scale (fp8 fp32 scales), 2 multiply by it (mxfp8 X = 2^k).
template <Format F, bool kAcc, int kScale>
GEOFP8_AVX2 void DecodeRun(const uint8_t* in, size_t n, float scale, float* out) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    int64_t eight;
    std::memcpy(&eight, in + i, 8);
    __m256 v = DecodeCodes<F>(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight)));
    if constexpr (kScale == 1) v = _mm256_div_ps(v, s);
    if constexpr (kScale == 2) v = _mm256_mul_ps(v, s);
    if constexpr (kAcc) v = _mm256_add_ps(_mm256_loadu_ps(out + i), v);
    _mm256_storeu_ps(out + i, v);
  }
  for (; i < n; ++i) {
    float v = F == Format::kFp8E4M3 ? element::E4M3ToFloat(in[i]) : element::E5M2ToFloat(in[i]);
    if constexpr (kScale == 1) v = v / scale;
    if constexpr (kScale == 2) v = v * scale;
    if constexpr (kAcc) {
      out[i] += v;
    } else {
      out[i] = v;
    }
  }
}

template <Format F, bool kAcc>
GEOFP8_AVX2 void DecodeFp8(const Layout& l, const uint8_t* scales, const uint8_t* payload,
                           float* out) {
  const size_t n = l.count;
  if (l.scaling == Scaling::kNone) {
    DecodeRun<F, kAcc, 0>(payload, n, 1.f, out);
    return;
  }
  const size_t block = l.scaling == Scaling::kBlock ? l.block : n;
  for (size_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    float scale;
    std::memcpy(&scale, scales + 4 * bi, 4);
    DecodeRun<F, kAcc, 1>(payload + b0, std::min(block, n - b0), scale, out + b0);
  }
}

// mxfp8: E4M3 elements of x / X with X = 2^k from the block's E8M0 code. Multiplying by the exact
// power of two 1/X rounds the same real number x * 2^-k as the scalar path's division, so the
// codes are identical.
GEOFP8_AVX2 void EncodeMx(const float* x, const Layout& l, uint8_t* scales, uint8_t* payload,
                          EncodeStats* st) {
  const size_t n = l.count;
  for (size_t b0 = 0, bi = 0; b0 < n; b0 += 32, ++bi) {
    const size_t len = std::min<size_t>(32, n - b0);
    float amax = 0.f;
    const bool finite = AmaxAllFinite(x + b0, len, &amax);
    if (!finite) {
      amax = 0.f;
      for (size_t i = b0; i < b0 + len; ++i) {
        if (element::IsFinite(x[i]))
          amax = std::max(amax, element::AbsF(x[i]));
        else
          ++st->nonfinite;
      }
    }
    const uint8_t code = element::MxScaleCode(amax);
    scales[bi] = code;
    const float inv = MxInverseScale(code);
    if (finite) {
      st->saturated += EncodeRun<Format::kFp8E4M3, true>(x + b0, len, inv, payload + b0);
    } else {
      for (size_t i = b0; i < b0 + len; ++i) {
        payload[i] = EncodeFp8Element<Format::kFp8E4M3>(x[i], inv, false, 0, &st->saturated);
      }
    }
  }
}

template <bool kAcc>
GEOFP8_AVX2 void DecodeMx(const Layout& l, const uint8_t* scales, const uint8_t* payload,
                          float* out) {
  for (size_t b0 = 0, bi = 0; b0 < l.count; b0 += 32, ++bi) {
    DecodeRun<Format::kFp8E4M3, kAcc, 2>(payload + b0, std::min<size_t>(32, l.count - b0),
                                         element::E8M0ToFloat(scales[bi]), out + b0);
  }
}

// nvfp4 (rule in element.h): tensor amax, then per 16-element block an E4M3 scale code, elements
// E2M1(x / den) with the same IEEE division as the scalar path, two per byte. Returns false
// (writing nothing) if the tensor holds a non-finite value: the scalar path handles that case.
GEOFP8_AVX2 bool EncodeNv(const float* x, const Layout& l, uint8_t* scales, uint8_t* payload,
                          EncodeStats* st) {
  const size_t n = l.count;
  float amax_t = 0.f;
  if (!AmaxAllFinite(x, n, &amax_t)) return false;
  const float g = element::NvTensorScale(amax_t);
  std::memcpy(scales, &g, 4);
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i six = _mm256_set1_epi32(static_cast<int>(element::FloatBits(6.f)));
  const __m128i nibble_pairs = _mm_set1_epi16(0x1001);  // byte0 * 1 + byte1 * 16
  __m256i sat = _mm256_setzero_si256();
  size_t b0 = 0, bi = 0;
  for (; b0 + 16 <= n; b0 += 16, ++bi) {
    float amax = 0.f;
    AmaxAllFinite(x + b0, 16, &amax);
    const uint8_t code = element::NvBlockScaleCode(amax, g);
    scales[4 + bi] = code;
    const __m256 den = _mm256_set1_ps(element::NvDenominator(code, g));
    const __m256i u0 = _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(x + b0), den));
    const __m256i u1 = _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(x + b0 + 8), den));
    const __m256i a0 = _mm256_and_si256(u0, abs_mask), a1 = _mm256_and_si256(u1, abs_mask);
    sat = _mm256_sub_epi32(sat, _mm256_cmpgt_epi32(a0, six));
    sat = _mm256_sub_epi32(sat, _mm256_cmpgt_epi32(a1, six));
    const __m256i c0 = ConvertFinite<Format::kNvfp4, true>(u0, a0);
    const __m256i c1 = ConvertFinite<Format::kNvfp4, true>(u1, a1);
    // 16 codes -> 16 bytes in element order -> 8 bytes of nibble pairs.
    const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_setzero_si256());
    const __m128i bytes = _mm256_castsi256_si128(
        _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 3, 6, 7)));
    const __m128i pairs = _mm_maddubs_epi16(bytes, nibble_pairs);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(payload + bi * 8), _mm_packus_epi16(pairs, pairs));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sat);
  for (uint32_t c : lanes) st->saturated += c;
  if (b0 < n) EncodeNvPartialBlock(x + b0, n - b0, g, scales + 4 + bi, payload + b0 / 2, st);
  return true;
}

// bf16, round-to-nearest-even on the float bits, finite values saturating at 0x7F7F, as
// element::FloatToBf16. Chunks holding a non-finite value take the scalar rule.
GEOFP8_AVX2 void EncodeBf16(const float* x, const Layout& l, uint8_t* payload, EncodeStats* st) {
  const size_t n = l.count;
  constexpr size_t kChunk = 256;
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i bf16_max = _mm256_set1_epi32(0x7F7F0000);
  __m256i sat = _mm256_setzero_si256();
  for (size_t c0 = 0; c0 < n; c0 += kChunk) {
    const size_t len = std::min(kChunk, n - c0);
    float unused;
    if (len < kChunk || !AmaxAllFinite(x + c0, len, &unused)) {
      for (size_t i = c0; i < c0 + len; ++i) {
        const uint32_t a = element::FloatBits(x[i]) & 0x7FFFFFFFu;
        if (a >= 0x7F800000u)
          ++st->nonfinite;
        else if (a > 0x7F7F0000u)
          ++st->saturated;
        const uint16_t h = element::FloatToBf16(x[i]);
        std::memcpy(payload + 2 * i, &h, 2);
      }
      continue;
    }
    for (size_t i = c0; i < c0 + len; i += 16) {
      __m256i r[2];
      for (int k = 0; k < 2; ++k) {
        const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8 * k));
        const __m256i a = _mm256_and_si256(u, abs_mask);
        sat = _mm256_sub_epi32(sat, _mm256_cmpgt_epi32(a, bf16_max));
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 16), _mm256_set1_epi32(1));
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7FFF)), lsb);
        const __m256i mag = _mm256_min_epi32(_mm256_srli_epi32(t, 16), _mm256_set1_epi32(0x7F7F));
        const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000));
        r[k] = _mm256_or_si256(mag, sign);
      }
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(payload + 2 * i), packed);
    }
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sat);
  for (uint32_t c : lanes) st->saturated += c;
}

// nvfp4 decode: 8 payload bytes -> 16 nibble codes in element order -> E2M1 values * den, as
// the scalar path (table value times the fp32 denominator, one rounding).
GEOFP8_AVX2 inline __m256 DecodeE2M1(__m256i c) {
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x8)), 28);
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 22), _mm256_set1_epi32(126 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0.5f));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), mag);
  const __m256i bits = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub), is_sub);
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}

template <bool kAcc>
GEOFP8_AVX2 void DecodeNv(const Layout& l, const uint8_t* scales, const uint8_t* payload,
                          float* out) {
  const size_t n = l.count;
  float g;
  std::memcpy(&g, scales, 4);
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  size_t b0 = 0, bi = 0;
  for (; b0 + 16 <= n; b0 += 16, ++bi) {
    const __m256 den = _mm256_set1_ps(element::NvDenominator(scales[4 + bi], g));
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(payload + bi * 8));
    const __m128i lo = _mm_and_si128(bytes, low_mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
    const __m128i codes = _mm_unpacklo_epi8(lo, hi);  // element 2i from the low nibble
    __m256 v0 = _mm256_mul_ps(DecodeE2M1(_mm256_cvtepu8_epi32(codes)), den);
    __m256 v1 = _mm256_mul_ps(DecodeE2M1(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8))), den);
    if constexpr (kAcc) {
      v0 = _mm256_add_ps(_mm256_loadu_ps(out + b0), v0);
      v1 = _mm256_add_ps(_mm256_loadu_ps(out + b0 + 8), v1);
    }
    _mm256_storeu_ps(out + b0, v0);
    _mm256_storeu_ps(out + b0 + 8, v1);
  }
  if (b0 < n) {
    const float den = element::NvDenominator(scales[4 + bi], g);
    for (size_t i = b0; i < n; ++i) {
      const float v = element::E2M1ToFloat((payload[i / 2] >> (4 * (i & 1))) & 0xF) * den;
      if constexpr (kAcc) {
        out[i] += v;
      } else {
        out[i] = v;
      }
    }
  }
}

}  // namespace

bool EncodeFp8Avx2(const float* x, const Layout& l, uint8_t* scales, uint8_t* payload,
                   EncodeStats* st) {
  if (!CpuHasAvx2()) return false;
  // Whole blocks by the AVX-512 path where it runs, the last partial block here.
  if (const size_t done = EncodeWholeBlocksAvx512(x, l, scales, payload, st); done) {
    if (done == l.count) return true;
    const Layout tail = MakeLayout(l.format, l.scaling, l.block, l.count - done);
    const size_t scale_bytes = l.format == Format::kMxfp8 ? 1 : 4;
    return EncodeFp8Avx2(x + done, tail, scales + done / l.block * scale_bytes, payload + done, st);
  }
  if (l.format == Format::kFp8E4M3) {
    EncodeFp8<Format::kFp8E4M3>(x, l, scales, payload, st);
  } else if (l.format == Format::kFp8E5M2) {
    EncodeFp8<Format::kFp8E5M2>(x, l, scales, payload, st);
  } else if (l.format == Format::kMxfp8) {
    EncodeMx(x, l, scales, payload, st);
  } else if (l.format == Format::kNvfp4) {
    if (EncodeNvAvx512(x, l, scales, payload, st)) return true;
    return EncodeNv(x, l, scales, payload, st);
  } else if (l.format == Format::kBf16) {
    EncodeBf16(x, l, payload, st);
  } else {
    return false;
  }
  return true;
}

bool DecodeFp8Avx2(const Layout& l, const uint8_t* scales, const uint8_t* payload, float* out,
                   bool accumulate) {
  if (!CpuHasAvx2()) return false;
  if (l.format == Format::kFp8E4M3) {
    accumulate ? DecodeFp8<Format::kFp8E4M3, true>(l, scales, payload, out)
               : DecodeFp8<Format::kFp8E4M3, false>(l, scales, payload, out);
  } else if (l.format == Format::kFp8E5M2) {
    accumulate ? DecodeFp8<Format::kFp8E5M2, true>(l, scales, payload, out)
               : DecodeFp8<Format::kFp8E5M2, false>(l, scales, payload, out);
  } else if (l.format == Format::kMxfp8) {
    accumulate ? DecodeMx<true>(l, scales, payload, out) : DecodeMx<false>(l, scales, payload, out);
  } else if (l.format == Format::kNvfp4) {
    accumulate ? DecodeNv<true>(l, scales, payload, out) : DecodeNv<false>(l, scales, payload, out);
  } else {
    return false;
  }
  return true;
}

#else  // not x86: the scalar reference is the only CPU path

bool CpuHasAvx2() { return false; }
bool EncodeFp8Avx2(const float*, const Layout&, uint8_t*, uint8_t*, EncodeStats*) { return false; }
bool DecodeFp8Avx2(const Layout&, const uint8_t*, const uint8_t*, float*, bool) { return false; }

#endif

}  // namespace geofp8::detail
