// The AVX-512 path of the fp8 block encode (E4M3/E5M2 with an fp32 scale per block of 16, 32, 64
// or 128, and mxfp8), chosen at run time ahead of the AVX2 one; see codec_avx512.h.
#include "kernels/codec/codec_avx512.h"

#include "kernels/codec/codec_internal.h"
#include "kernels/common/cpu_features.h"

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593: see codec_avx512.h
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace geofp8::detail {
namespace {

using avx512::Rule;

// The tile driver's block source for the plain encode: the values themselves.
template <int CB>
struct Identity {
  template <int K>
  GEOFP8_AVX512 void Prepare(const float* x, uint64_t, float*, uint32_t* amax) const {
#pragma GCC unroll 16
    for (int b = 0; b < K; ++b) {
      __m512i m = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int q = 0; q < CB / 16; ++q)
        m = avx512::MaxAbsBits(m, _mm512_loadu_ps(x + b * CB + 16 * q));
      amax[b] = _mm512_reduce_max_epu32(m);
    }
  }
  const float* Values(const float* x, const float*) const { return x; }
  void Reference(const float* x, uint64_t, float* y) const { std::memcpy(y, x, CB * 4); }
};

template <Format F, Rule R, int CB>
void Encode(const float* x, size_t n, uint8_t* scales, uint8_t* payload, EncodeStats* st) {
  avx512::EncodeTiles<F, R, CB>(x, n, Identity<CB>{}, scales, payload, st);
}

template <Format F>
bool EncodeFp8Block(uint32_t cb, const float* x, size_t n, uint8_t* scales, uint8_t* payload,
                    EncodeStats* st) {
  switch (cb) {
    case 16:
      return Encode<F, Rule::kFp8Block, 16>(x, n, scales, payload, st), true;
    case 32:
      return Encode<F, Rule::kFp8Block, 32>(x, n, scales, payload, st), true;
    case 64:
      return Encode<F, Rule::kFp8Block, 64>(x, n, scales, payload, st), true;
    case 128:
      return Encode<F, Rule::kFp8Block, 128>(x, n, scales, payload, st), true;
  }
  return false;
}

}  // namespace

bool EncodeNvAvx512(const float* x, const Layout& l, uint8_t* scales, uint8_t* payload,
                    EncodeStats* st) {
  if (!Avx512Enabled() || !CpuHasAvx512() || l.format != Format::kNvfp4) return false;
  const size_t n = l.count, whole = n / 16 * 16;
  uint32_t amax = avx512::AmaxBits(x, whole, Identity<16>{});
  for (size_t i = whole; i < n; ++i) amax = std::max(amax, element::FloatBits(x[i]) & 0x7FFFFFFFu);
  if (amax >= 0x7F800000u) return false;  // the scalar path poisons the blocks concerned
  const float g = element::NvTensorScale(element::BitsFloat(amax));
  std::memcpy(scales, &g, 4);
  if (!avx512::EncodeNvTiles(x, whole, Identity<16>{}, g, scales + 4, payload, st)) return false;
  if (whole < n) {
    EncodeNvPartialBlock(x + whole, n - whole, g, scales + 4 + whole / 16, payload + whole / 2, st);
  }
  return true;
}

size_t EncodeWholeBlocksAvx512(const float* x, const Layout& l, uint8_t* scales, uint8_t* payload,
                               EncodeStats* st) {
  if (!Avx512Enabled() || !CpuHasAvx512() || l.scaling != Scaling::kBlock || l.block == 0) {
    return 0;
  }
  const size_t whole = l.count / l.block * l.block;
  if (whole == 0) return 0;
  bool done = false;
  switch (l.format) {
    case Format::kFp8E4M3:
      done = EncodeFp8Block<Format::kFp8E4M3>(l.block, x, whole, scales, payload, st);
      break;
    case Format::kFp8E5M2:
      done = EncodeFp8Block<Format::kFp8E5M2>(l.block, x, whole, scales, payload, st);
      break;
    case Format::kMxfp8:
      Encode<Format::kFp8E4M3, Rule::kMx, 32>(x, whole, scales, payload, st);
      done = true;
      break;
    default:
      break;
  }
  return done ? whole : 0;
}

}  // namespace geofp8::detail
