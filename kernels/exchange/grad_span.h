// A gradient in the dtype the framework holds it in (fp32, bf16 or fp16), as the exchange takes
// it: read with its division by N straight into fp32, and written back rounded to its dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kernels/common/check.h"
#include "kernels/common/hd.h"
#include "kernels/exchange/bf16.h"

namespace geofp8 {

enum class GradDtype : uint8_t {
  kFp32 = 0,
  kBf16 = 1,  // bfloat16: 8 exponent bits, 7 mantissa bits
  kFp16 = 2,  // IEEE binary16: 5 exponent bits, 10 mantissa bits
};

// "float32", "bfloat16", "float16" (torch's names); "unknown" for anything else.
std::string GradDtypeName(GradDtype dtype);
// The dtype GradDtypeName names; any other name is an error that lists them.
GradDtype GradDtypeNamed(std::string_view name);

// binary16 -> float, exactly. A NaN stays NaN, quieted, with its payload (as F16C's VCVTPH2PS).
GEOFP8_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t u;
  if (exp == 0x1Fu) {
    u = sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {
    // Subnormal: mant * 2^-24, normalized.
    int e = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --e;
    }
    u = sign | (static_cast<uint32_t>(e) << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> binary16, round to nearest even (subnormals included); beyond the largest finite half
// it becomes infinity, as IEEE rounding does. A NaN stays NaN, quieted, keeping the top of its
// payload (as F16C's VCVTPS2PH), so the vector path gives the same bits.
GEOFP8_HD uint16_t FloatToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (a >= 0x38800000u) {
    // Normal half: rebias, then round the 13 dropped bits to nearest even.
    const uint32_t t = a - (112u << 23);
    return static_cast<uint16_t>(sign | ((t + 0xFFFu + ((t >> 13) & 1u)) >> 13));
  }
  if (a < 0x33000000u) return sign;  // at or below half the smallest subnormal, 2^-25
  // Subnormal half: the value in units of 2^-24, rounded to nearest even.
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24 dropped bits
  const uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  uint32_t q = m >> shift;
  if (rest > half || (rest == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

// One element of a gradient of `dtype` (its 16 bits for bf16 and fp16) as a float, exactly.
GEOFP8_HD float LowpToFloat(uint16_t bits, GradDtype dtype) {
  return dtype == GradDtype::kBf16 ? Bf16ToFloat(bits) : HalfToFloat(bits);
}
// A float rounded to nearest even in bf16 or fp16.
GEOFP8_HD uint16_t FloatToLowp(float f, GradDtype dtype) {
  return dtype == GradDtype::kBf16 ? FloatToBf16(f) : FloatToHalf(f);
}

// `size` elements of `dtype` at `data`. Converts implicitly from std::span<float>, so fp32
// callers read as they did before dtypes existed.
struct GradSpan {
  void* data = nullptr;
  size_t count = 0;
  GradDtype dtype = GradDtype::kFp32;

  GradSpan() = default;
  GradSpan(std::span<float> s) : data(s.data()), count(s.size()) {}  // NOLINT: implicit
  // Any contiguous float range a std::span<float> takes (a std::vector<float>, an array).
  template <class R>
  requires(std::is_convertible_v<R&, std::span<float>> &&
           !std::is_same_v<std::remove_cv_t<R>, std::span<float>>) GradSpan(R& r)
      : GradSpan(std::span<float>(r)) {}  // NOLINT: implicit
  GradSpan(void* p, size_t n, GradDtype d) : data(p), count(n), dtype(d) {}

  size_t size() const { return count; }
  bool empty() const { return count == 0; }
  bool fp32() const { return dtype == GradDtype::kFp32; }
  size_t element_bytes() const { return fp32() ? 4 : 2; }
  size_t size_bytes() const { return count * element_bytes(); }
  GradSpan subspan(size_t offset, size_t n) const {
    GEOFP8_CHECK(offset + n <= count, "gradient span: [", offset, ", ", offset + n, ") is outside ",
                 count, " elements");
    return {static_cast<uint8_t*>(data) + offset * element_bytes(), n, dtype};
  }
  // The floats of an fp32 span; an error for the others.
  std::span<float> f32() const {
    GEOFP8_CHECK(fp32(), "gradient dtype: ", GradDtypeName(dtype), " where float32 is needed");
    return {static_cast<float*>(data), count};
  }
  std::span<uint16_t> bits16() const {
    GEOFP8_CHECK(!fp32(), "gradient dtype: float32 where bfloat16 or float16 is needed");
    return {static_cast<uint16_t*>(data), count};
  }
};

// One GradSpan per layer: an exchange call's gradients (or outputs). Also takes a list of fp32
// spans, so fp32 callers pass theirs unchanged.
class GradSpans : public std::vector<GradSpan> {
 public:
  using std::vector<GradSpan>::vector;
  GradSpans() = default;
  GradSpans(std::vector<GradSpan> v) : std::vector<GradSpan>(std::move(v)) {}  // NOLINT
  GradSpans(const std::vector<std::span<float>>& fp32)                         // NOLINT: implicit
      : std::vector<GradSpan>(fp32.begin(), fp32.end()) {}
};

// out[i] = float(in[i]) / divisor, the IEEE quotient (Divide in data_plane.h for fp32 input; the
// conversions are exact, so the bits are those of dividing the converted floats). Returns whether
// `in` holds a NaN or inf. out.size() == in.size(). Host memory.
bool LoadDivided(GradSpan in, float divisor, std::span<float> out);

// out[i] = in[i] rounded to nearest even in out's dtype (fp32: copied). Host memory.
void StoreRounded(std::span<const float> in, GradSpan out);

namespace detail {
// The scalar references of the two passes (F16C paths skipped), for tests.
bool LoadDividedScalarForTest(GradSpan in, float divisor, std::span<float> out);
void StoreRoundedScalarForTest(std::span<const float> in, GradSpan out);
}  // namespace detail

}  // namespace geofp8
