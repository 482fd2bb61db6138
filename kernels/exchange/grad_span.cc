// The gradient dtypes' host passes (grad_span.h): bf16 and fp16 read into fp32 with the division
// by N, and fp32 rounded back. The fp16 ones use F16C where the CPU has it; the scalar functions
// of grad_span.h are their reference, bit for bit (GradSpan tests).
#include "kernels/exchange/grad_span.h"

#include <algorithm>
#include <cmath>

#include "kernels/exchange/data_plane.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define GEOFP8_GRAD_X86 1
#else
#define GEOFP8_GRAD_X86 0
#endif

namespace geofp8 {

std::string GradDtypeName(GradDtype dtype) {
  switch (dtype) {
    case GradDtype::kFp32:
      return "float32";
    case GradDtype::kBf16:
      return "bfloat16";
    case GradDtype::kFp16:
      return "float16";
  }
  return "unknown";
}

GradDtype GradDtypeNamed(std::string_view name) {
  for (GradDtype d : {GradDtype::kFp32, GradDtype::kBf16, GradDtype::kFp16}) {
    if (name == GradDtypeName(d)) return d;
  }
  GEOFP8_FAIL("gradient dtype: unknown value '", name, "' (accepted: float32, bfloat16, float16)");
}

namespace {

// As Divide (data_plane.cc): a power-of-two divisor multiplies by its exact reciprocal, which
// rounds the same real number.
bool PowerOfTwo(float divisor) {
  int exp = 0;
  return std::frexp(divisor, &exp) == 0.5f && exp > -125 && exp < 126;
}

#if defined(__SANITIZE_THREAD__)
#define GEOFP8_GRAD_CLONES
#else
#define GEOFP8_GRAD_CLONES __attribute__((target_clones("avx2", "default")))
#endif

// bf16 -> fp32 is a shift, and the loops are written so the compiler vectorizes them.
GEOFP8_GRAD_CLONES bool LoadDividedBf16(const uint16_t* x, size_t n, float divisor, float* y) {
  const bool pow2 = PowerOfTwo(divisor);
  const float inv = 1.f / divisor;
  uint32_t bad = 0;
  if (pow2) {
    for (size_t i = 0; i < n; ++i) {
      bad |= (x[i] & 0x7F80u) == 0x7F80u;
      y[i] = Bf16ToFloat(x[i]) * inv;
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      bad |= (x[i] & 0x7F80u) == 0x7F80u;
      y[i] = Bf16ToFloat(x[i]) / divisor;
    }
  }
  return bad != 0;
}

GEOFP8_GRAD_CLONES void StoreBf16(const float* x, size_t n, uint16_t* y) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    y[i] = static_cast<uint16_t>(nan ? (u >> 16) | 0x40u : rounded);
  }
}

bool LoadDividedHalfScalar(const uint16_t* x, size_t n, float divisor, float* y) {
  const bool pow2 = PowerOfTwo(divisor);
  const float inv = 1.f / divisor;
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    bad |= (x[i] & 0x7C00u) == 0x7C00u;
    const float v = HalfToFloat(x[i]);
    y[i] = pow2 ? v * inv : v / divisor;
  }
  return bad != 0;
}

void StoreHalfScalar(const float* x, size_t n, uint16_t* y) {
  for (size_t i = 0; i < n; ++i) y[i] = FloatToHalf(x[i]);
}

#if GEOFP8_GRAD_X86
bool CpuHasF16c() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return has;
}

#define GEOFP8_F16C __attribute__((target("avx2,f16c")))

GEOFP8_F16C bool LoadDividedHalfF16c(const uint16_t* x, size_t n, float divisor, float* y) {
  const bool pow2 = PowerOfTwo(divisor);
  const __m256 d = _mm256_set1_ps(pow2 ? 1.f / divisor : divisor);
  const __m128i exp_mask = _mm_set1_epi16(0x7C00);
  __m128i bad = _mm_setzero_si128();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, exp_mask), exp_mask));
    const __m256 v = _mm256_cvtph_ps(h);
    _mm256_storeu_ps(y + i, pow2 ? _mm256_mul_ps(v, d) : _mm256_div_ps(v, d));
  }
  const bool tail = LoadDividedHalfScalar(x + i, n - i, divisor, y + i);
  return tail || !_mm_testz_si128(bad, bad);
}

GEOFP8_F16C void StoreHalfF16c(const float* x, size_t n, uint16_t* y) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), h);
  }
  StoreHalfScalar(x + i, n - i, y + i);
}
#endif

}  // namespace

bool LoadDivided(GradSpan in, float divisor, std::span<float> out) {
  GEOFP8_CHECK(out.size() == in.size(), "load: ", in.size(), " elements into ", out.size());
  switch (in.dtype) {
    case GradDtype::kFp32:
      return Divide(in.f32(), divisor, out);
    case GradDtype::kBf16:
      return LoadDividedBf16(in.bits16().data(), in.size(), divisor, out.data());
    case GradDtype::kFp16:
#if GEOFP8_GRAD_X86
      if (CpuHasF16c())
        return LoadDividedHalfF16c(in.bits16().data(), in.size(), divisor, out.data());
#endif
      return LoadDividedHalfScalar(in.bits16().data(), in.size(), divisor, out.data());
  }
  GEOFP8_FAIL("gradient dtype: unknown value ", static_cast<int>(in.dtype),
              " (accepted: float32, bfloat16, float16)");
}

void StoreRounded(std::span<const float> in, GradSpan out) {
  GEOFP8_CHECK(out.size() == in.size(), "store: ", in.size(), " elements into ", out.size());
  switch (out.dtype) {
    case GradDtype::kFp32:
      std::copy(in.begin(), in.end(), out.f32().begin());
      return;
    case GradDtype::kBf16:
      StoreBf16(in.data(), in.size(), out.bits16().data());
      return;
    case GradDtype::kFp16:
#if GEOFP8_GRAD_X86
      if (CpuHasF16c()) {
        StoreHalfF16c(in.data(), in.size(), out.bits16().data());
        return;
      }
#endif
      StoreHalfScalar(in.data(), in.size(), out.bits16().data());
      return;
  }
  GEOFP8_FAIL("gradient dtype: unknown value ", static_cast<int>(out.dtype),
              " (accepted: float32, bfloat16, float16)");
}

namespace detail {
// The scalar references, for the tests that compare them with the F16C paths.
bool LoadDividedScalarForTest(GradSpan in, float divisor, std::span<float> out) {
  if (in.dtype == GradDtype::kFp16) {
    return LoadDividedHalfScalar(in.bits16().data(), in.size(), divisor, out.data());
  }
  return LoadDivided(in, divisor, out);
}
void StoreRoundedScalarForTest(std::span<const float> in, GradSpan out) {
  if (out.dtype == GradDtype::kFp16) {
    StoreHalfScalar(in.data(), in.size(), out.bits16().data());
    return;
  }
  StoreRounded(in, out);
}
}  // namespace detail

}  // namespace geofp8
