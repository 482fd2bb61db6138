// The codec's entry points and scalar reference path: options validation, the wire layout,
// encode / decode / decode-accumulate for every format. The AVX2 path must match it bit for bit.
#include "kernels/codec/codec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <sstream>
#include <vector>

#include "kernels/codec/codec_internal.h"
#include "kernels/codec/element.h"
#include "kernels/codec/raw.h"
#include "kernels/common/check.h"

namespace geofp8 {
namespace detail {

Layout MakeLayout(Format format, Scaling scaling, uint32_t block, size_t n) {
  Layout l;
  l.format = format;
  l.count = n;
  switch (format) {
    case Format::kFp32:
    case Format::kBf16:
      l.scaling = Scaling::kNone;
      break;
    case Format::kFp8E4M3:
    case Format::kFp8E5M2:
      l.scaling = scaling;
      if (scaling == Scaling::kTensor) {
        l.num_blocks = 1;
      } else if (scaling == Scaling::kBlock) {
        l.block = block;
        l.num_blocks = block ? (n + block - 1) / block : 0;
      }
      l.scale_bytes = 4 * l.num_blocks;
      break;
    case Format::kMxfp8:
      l.scaling = Scaling::kBlock;
      l.block = 32;
      l.num_blocks = (n + 31) / 32;
      l.scale_bytes = l.num_blocks;
      break;
    case Format::kNvfp4:
      l.scaling = Scaling::kBlock;
      l.block = 16;
      l.num_blocks = (n + 15) / 16;
      l.scale_bytes = 4 + l.num_blocks;
      break;
  }
  const int bits = FormatBits(format);
  l.payload_bytes = bits == 4 ? (n + 1) / 2 : n * static_cast<size_t>(bits / 8);
  return l;
}

Layout MakeLayout(const CodecOptions& options, size_t n) {
  const std::string error = ValidateCodecOptions(options);
  GEOFP8_CHECK(error.empty(), error);
  return MakeLayout(options.format, options.scaling, options.block, n);
}

namespace {
std::atomic<bool> g_vectorized{true};
}
void SetVectorizedEnabled(bool enabled) { g_vectorized.store(enabled); }
bool VectorizedEnabled() { return g_vectorized.load(std::memory_order_relaxed); }
namespace {
std::atomic<bool> g_avx512{true};
}
void SetAvx512Enabled(bool enabled) { g_avx512.store(enabled); }
bool Avx512Enabled() { return VectorizedEnabled() && g_avx512.load(std::memory_order_relaxed); }

}  // namespace detail

using detail::Layout;
namespace el = element;

std::string ValidateCodecOptions(const CodecOptions& o) {
  std::ostringstream os;
  if (FormatName(o.format) == "unknown") {
    os << "format: unknown value " << static_cast<int>(o.format)
       << " (accepted: " << AcceptedFormats() << ")";
  } else if (ScalingName(o.scaling) == "unknown") {
    os << "scaling: unknown value " << static_cast<int>(o.scaling)
       << " (accepted: " << AcceptedScalings() << ")";
  } else if (RoundingName(o.rounding) == "unknown") {
    os << "rounding: unknown value " << static_cast<int>(o.rounding)
       << " (accepted: " << AcceptedRoundings() << ")";
  } else if (o.scaling == Scaling::kBlock && o.block == 0 &&
             (o.format == Format::kFp8E4M3 || o.format == Format::kFp8E5M2)) {
    os << "block: must be >= 1 for block scaling (0)";
  }
  return os.str();
}

size_t PayloadBytes(const CodecOptions& options, size_t n) {
  return detail::MakeLayout(options, n).payload_bytes;
}
size_t ScaleBytes(const CodecOptions& options, size_t n) {
  return detail::MakeLayout(options, n).scale_bytes;
}
size_t EncodedBytes(const CodecOptions& options, size_t n) {
  const Layout l = detail::MakeLayout(options, n);
  return sizeof(EncodedHeader) + l.scale_bytes + l.payload_bytes;
}

namespace {

inline void StoreF32(uint8_t* p, float v) { std::memcpy(p, &v, 4); }
inline float LoadF32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Finite amax of x[0..n) and the number of non-finite values.
inline float FiniteAmax(const float* x, size_t n, uint64_t* nonfinite) {
  float amax = 0.f;
  for (size_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (el::IsFinite(x[i])) {
      amax = std::max(amax, a);
    } else {
      ++*nonfinite;
    }
  }
  return amax;
}

template <Format F>
void EncodeFp8Scalar(const float* x, const Layout& l, const CodecOptions& o, uint8_t* scales,
                     uint8_t* payload, EncodeStats* st) {
  constexpr float kMax = F == Format::kFp8E5M2 ? 57344.f : 448.f;
  const bool stochastic = o.rounding == Rounding::kStochastic;
  const uint64_t key = el::StreamKey(o.seed, o.step, o.layer, o.rank);
  const size_t n = l.count;
  const size_t block = l.scaling == Scaling::kBlock ? l.block : std::max<size_t>(n, 1);
  for (size_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    const size_t len = std::min(block, n - b0);
    uint64_t nonfinite = 0;
    float scale = 1.f;
    if (l.scaling != Scaling::kNone) {
      scale = el::ScaleFromAmax(FiniteAmax(x + b0, len, &nonfinite), kMax);
      StoreF32(scales + 4 * bi, scale);
    }
    for (size_t i = b0; i < b0 + len; ++i) {
      const uint32_t r = stochastic ? el::RandomBits(key, i) : 0u;
      payload[i] = detail::EncodeFp8Element<F>(x[i], scale, stochastic, r, &st->saturated);
    }
  }
  if (l.scaling == Scaling::kTensor && n == 0) StoreF32(scales, 1.f);
  for (size_t i = 0; i < n; ++i) st->nonfinite += !el::IsFinite(x[i]);
}

void EncodeMxfp8(const float* x, const Layout& l, const CodecOptions& o, uint8_t* scales,
                 uint8_t* payload, EncodeStats* st) {
  const bool stochastic = o.rounding == Rounding::kStochastic;
  const uint64_t key = el::StreamKey(o.seed, o.step, o.layer, o.rank);
  for (size_t b0 = 0, bi = 0; b0 < l.count; b0 += 32, ++bi) {
    const size_t len = std::min<size_t>(32, l.count - b0);
    uint64_t nonfinite = 0;
    const uint8_t code = el::MxScaleCode(FiniteAmax(x + b0, len, &nonfinite));
    scales[bi] = code;
    st->nonfinite += nonfinite;
    const float X = el::E8M0ToFloat(code);
    for (size_t i = b0; i < b0 + len; ++i) {
      const uint32_t r = stochastic ? el::RandomBits(key, i) : 0u;
      bool sat;
      payload[i] = el::EncodeMxElement(x[i], X, stochastic, r, &sat);
      st->saturated += sat;
    }
  }
}

void EncodeNvfp4(const float* x, const Layout& l, const CodecOptions& o, uint8_t* scales,
                 uint8_t* payload, EncodeStats* st) {
  const bool stochastic = o.rounding == Rounding::kStochastic;
  const uint64_t key = el::StreamKey(o.seed, o.step, o.layer, o.rank);
  uint64_t ignored = 0;
  const float g = el::NvTensorScale(FiniteAmax(x, l.count, &ignored));
  StoreF32(scales, g);
  std::memset(payload, 0, l.payload_bytes);
  for (size_t b0 = 0, bi = 0; b0 < l.count; b0 += 16, ++bi) {
    const size_t len = std::min<size_t>(16, l.count - b0);
    uint64_t nonfinite = 0;
    const float amax = FiniteAmax(x + b0, len, &nonfinite);
    st->nonfinite += nonfinite;
    if (nonfinite) {
      scales[4 + bi] = 0x7F;  // NaN block scale: the whole block decodes as NaN
      continue;
    }
    const uint8_t code = el::NvBlockScaleCode(amax, g);
    scales[4 + bi] = code;
    const float den = el::NvDenominator(code, g);
    for (size_t i = b0; i < b0 + len; ++i) {
      const uint32_t r = stochastic ? el::RandomBits(key, i) : 0u;
      bool sat;
      const uint8_t e = el::EncodeNvElement(x[i], den, stochastic, r, &sat);
      st->saturated += sat;
      payload[i / 2] |= static_cast<uint8_t>(e << (4 * (i & 1)));
    }
  }
}

void EncodeBf16(const float* x, const Layout& l, const CodecOptions& o, uint8_t* payload,
                EncodeStats* st) {
  const bool stochastic = o.rounding == Rounding::kStochastic;
  const uint64_t key = el::StreamKey(o.seed, o.step, o.layer, o.rank);
  for (size_t i = 0; i < l.count; ++i) {
    const uint32_t a = el::FloatBits(x[i]) & 0x7FFFFFFFu;
    if (a >= 0x7F800000u)
      ++st->nonfinite;
    else if (a > 0x7F7F0000u)
      ++st->saturated;
    const uint16_t h = el::FloatToBf16(x[i], stochastic, stochastic ? el::RandomBits(key, i) : 0u);
    std::memcpy(payload + 2 * i, &h, 2);
  }
}

// 256-entry decode tables built from the shared element functions, so they are exact copies.
struct Tables {
  float e4m3[256], e5m2[256], e2m1[16];
  Tables() {
    for (int c = 0; c < 256; ++c) {
      e4m3[c] = el::E4M3ToFloat(static_cast<uint8_t>(c));
      e5m2[c] = el::E5M2ToFloat(static_cast<uint8_t>(c));
    }
    for (int c = 0; c < 16; ++c) e2m1[c] = el::E2M1ToFloat(static_cast<uint8_t>(c));
  }
};
const Tables& DecodeTables() {
  static const Tables tables;
  return tables;
}

template <bool kAcc>
inline void Put(float* out, size_t i, float v) {
  if constexpr (kAcc) {
    out[i] += v;
  } else {
    out[i] = v;
  }
}

template <bool kAcc>
void DecodeScalar(const Layout& l, const uint8_t* scales, const uint8_t* payload, float* out) {
  const Tables& t = DecodeTables();
  const size_t n = l.count;
  switch (l.format) {
    case Format::kFp32:
      for (size_t i = 0; i < n; ++i) Put<kAcc>(out, i, LoadF32(payload + 4 * i));
      return;
    case Format::kBf16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, payload + 2 * i, 2);
        Put<kAcc>(out, i, el::Bf16ToFloat(h));
      }
      return;
    case Format::kFp8E4M3:
    case Format::kFp8E5M2: {
      const float* table = l.format == Format::kFp8E4M3 ? t.e4m3 : t.e5m2;
      if (l.scaling == Scaling::kNone) {
        for (size_t i = 0; i < n; ++i) Put<kAcc>(out, i, table[payload[i]]);
        return;
      }
      const size_t block = l.scaling == Scaling::kBlock ? l.block : std::max<size_t>(n, 1);
      for (size_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
        const float scale = LoadF32(scales + 4 * bi);
        const size_t end = std::min(n, b0 + block);
        for (size_t i = b0; i < end; ++i) Put<kAcc>(out, i, table[payload[i]] / scale);
      }
      return;
    }
    case Format::kMxfp8:
      for (size_t i = 0; i < n; ++i) {
        Put<kAcc>(out, i, t.e4m3[payload[i]] * el::E8M0ToFloat(scales[i / 32]));
      }
      return;
    case Format::kNvfp4: {
      const float g = LoadF32(scales);
      for (size_t b0 = 0, bi = 0; b0 < n; b0 += 16, ++bi) {
        const float den = el::NvDenominator(scales[4 + bi], g);
        const size_t end = std::min(n, b0 + 16);
        for (size_t i = b0; i < end; ++i) {
          Put<kAcc>(out, i, t.e2m1[(payload[i / 2] >> (4 * (i & 1))) & 0xF] * den);
        }
      }
      return;
    }
  }
}

Layout LayoutFromHeader(const EncodedHeader& h) {
  return detail::MakeLayout(static_cast<Format>(h.format), static_cast<Scaling>(h.scaling), h.block,
                            h.count);
}

template <bool kAcc>
void DecodeImpl(std::span<const uint8_t> in, std::span<float> out) {
  const EncodedView v = ParseEncoded(in);
  GEOFP8_CHECK(out.size() == v.header.count, "decode: output holds ", out.size(),
               " floats but the buffer encodes ", v.header.count);
  const Layout l = LayoutFromHeader(v.header);
  if (l.count == 0) return;
  if (detail::VectorizedEnabled() &&
      detail::DecodeFp8Avx2(l, v.scales.data(), v.payload.data(), out.data(), kAcc)) {
    return;
  }
  DecodeScalar<kAcc>(l, v.scales.data(), v.payload.data(), out.data());
}

}  // namespace

EncodeStats Encode(std::span<const float> x, const CodecOptions& options, std::span<uint8_t> out) {
  const Layout l = detail::MakeLayout(options, x.size());
  const size_t total = sizeof(EncodedHeader) + l.scale_bytes + l.payload_bytes;
  GEOFP8_CHECK(out.size() >= total, "encode: output buffer holds ", out.size(), " bytes, needs ",
               total);
  EncodedHeader h;
  h.format = static_cast<uint8_t>(l.format);
  h.scaling = static_cast<uint8_t>(l.scaling);
  h.block = l.block;
  h.count = x.size();
  uint8_t* scales = out.data() + sizeof(EncodedHeader);
  uint8_t* payload = scales + l.scale_bytes;
  EncodeStats st;
  const float* p = x.data();
  const bool vectorizable = l.format != Format::kFp32;
  if (vectorizable && options.rounding == Rounding::kNearest && detail::VectorizedEnabled() &&
      detail::EncodeFp8Avx2(p, l, scales, payload, &st)) {
    // done by the vectorized path
  } else {
    switch (l.format) {
      case Format::kFp32:
        if (l.count) std::memcpy(payload, p, 4 * l.count);
        for (size_t i = 0; i < l.count; ++i) st.nonfinite += !el::IsFinite(p[i]);
        break;
      case Format::kBf16:
        EncodeBf16(p, l, options, payload, &st);
        break;
      case Format::kFp8E4M3:
        EncodeFp8Scalar<Format::kFp8E4M3>(p, l, options, scales, payload, &st);
        break;
      case Format::kFp8E5M2:
        EncodeFp8Scalar<Format::kFp8E5M2>(p, l, options, scales, payload, &st);
        break;
      case Format::kMxfp8:
        EncodeMxfp8(p, l, options, scales, payload, &st);
        break;
      case Format::kNvfp4:
        EncodeNvfp4(p, l, options, scales, payload, &st);
        break;
    }
  }
  if (st.nonfinite) h.flags |= kFlagNonFinite;
  std::memcpy(out.data(), &h, sizeof(h));
  return st;
}

size_t detail::ValidateHeader(const EncodedHeader& h) {
  GEOFP8_CHECK(h.magic == kEncodedMagic, "encoded buffer: bad magic byte (",
               static_cast<int>(h.magic), ")");
  GEOFP8_CHECK(h.version == kEncodedVersion, "encoded buffer: unsupported version (",
               static_cast<int>(h.version), ")");
  const Format f = static_cast<Format>(h.format);
  GEOFP8_CHECK(FormatName(f) != "unknown", "encoded buffer: unknown format (",
               static_cast<int>(h.format), ")");
  const Scaling s = static_cast<Scaling>(h.scaling);
  GEOFP8_CHECK(ScalingName(s) != "unknown", "encoded buffer: unknown scaling (",
               static_cast<int>(h.scaling), ")");
  GEOFP8_CHECK(h.count <= (uint64_t{1} << 60), "encoded buffer: implausible count (", h.count, ")");
  const Layout l = detail::MakeLayout(f, s, h.block, h.count);
  GEOFP8_CHECK(l.scaling == s && l.block == h.block, "encoded buffer: scaling ", ScalingName(s),
               " with block ", h.block, " is inconsistent with format ", FormatName(f));
  GEOFP8_CHECK(s != Scaling::kBlock || h.block > 0, "encoded buffer: block is 0");
  return sizeof(EncodedHeader) + l.scale_bytes + l.payload_bytes;
}

EncodedView ParseEncoded(std::span<const uint8_t> in) {
  GEOFP8_CHECK(in.size() >= sizeof(EncodedHeader), "encoded buffer: truncated header (", in.size(),
               " bytes, need ", sizeof(EncodedHeader), ")");
  EncodedView v;
  std::memcpy(&v.header, in.data(), sizeof(EncodedHeader));
  const size_t need = detail::ValidateHeader(v.header);
  GEOFP8_CHECK(in.size() >= need, "encoded buffer: truncated (", in.size(), " bytes, need ", need,
               ")");
  const Layout l = LayoutFromHeader(v.header);
  v.scales = in.subspan(sizeof(EncodedHeader), l.scale_bytes);
  v.payload = in.subspan(sizeof(EncodedHeader) + l.scale_bytes, l.payload_bytes);
  return v;
}

void Decode(std::span<const uint8_t> in, std::span<float> out) { DecodeImpl<false>(in, out); }

void DecodeAccumulate(std::span<const uint8_t> in, std::span<float> acc) {
  DecodeImpl<true>(in, acc);
}

}  // namespace geofp8

// ---------------------------------------------------------------------------------------------
// Raw conversion (kernels/codec/raw.h).

namespace geofp8 {

size_t RawBytes(Format format, size_t n) {
  const int bits = FormatBits(format);
  GEOFP8_CHECK(bits > 0, "format: unknown value ", static_cast<int>(format),
               " (accepted: ", AcceptedFormats(), ")");
  return bits == 4 ? (n + 1) / 2 : n * static_cast<size_t>(bits / 8);
}

EncodeStats EncodeRaw(std::span<const float> x, const CodecOptions& options,
                      std::span<uint8_t> out) {
  const size_t need = RawBytes(options.format, x.size());
  GEOFP8_CHECK(out.size() >= need, "encode raw: output holds ", out.size(), " bytes, needs ", need);
  EncodeStats st;
  if (options.format != Format::kNvfp4) {
    CodecOptions o = options;
    o.scaling = Scaling::kNone;
    if (o.format == Format::kMxfp8) o.format = Format::kFp8E4M3;
    std::vector<uint8_t> buf(EncodedBytes(o, x.size()));
    st = Encode(x, o, buf);
    if (need) std::memcpy(out.data(), buf.data() + sizeof(EncodedHeader), need);
    return st;
  }
  const bool stochastic = options.rounding == Rounding::kStochastic;
  const uint64_t key = el::StreamKey(options.seed, options.step, options.layer, options.rank);
  std::memset(out.data(), 0, need);
  for (size_t i = 0; i < x.size(); ++i) {
    GEOFP8_CHECK(el::IsFinite(x[i]), "encode raw: input[", i, "] is non-finite (", x[i],
                 ") and nvfp4 has no NaN code");
    if (std::fabs(x[i]) > 6.f) ++st.saturated;
    const uint8_t e = el::FloatToE2M1(x[i], stochastic, stochastic ? el::RandomBits(key, i) : 0u);
    out[i / 2] |= static_cast<uint8_t>(e << (4 * (i & 1)));
  }
  return st;
}

void DecodeRaw(std::span<const uint8_t> in, Format format, std::span<float> out) {
  const size_t need = RawBytes(format, out.size());
  GEOFP8_CHECK(in.size() == need, "decode raw: ", in.size(), " bytes do not hold ", out.size(), " ",
               FormatName(format), " elements (need ", need, ")");
  const Tables& t = DecodeTables();
  for (size_t i = 0; i < out.size(); ++i) {
    switch (format) {
      case Format::kFp32:
        out[i] = LoadF32(in.data() + 4 * i);
        break;
      case Format::kBf16: {
        uint16_t h;
        std::memcpy(&h, in.data() + 2 * i, 2);
        out[i] = el::Bf16ToFloat(h);
        break;
      }
      case Format::kFp8E4M3:
      case Format::kMxfp8:
        out[i] = t.e4m3[in[i]];
        break;
      case Format::kFp8E5M2:
        out[i] = t.e5m2[in[i]];
        break;
      case Format::kNvfp4:
        out[i] = t.e2m1[(in[i / 2] >> (4 * (i & 1))) & 0xF];
        break;
    }
  }
}

}  // namespace geofp8
