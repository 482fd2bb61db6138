// HostPlane and StagedPlane (see data_plane.h).
#include "kernels/exchange/data_plane.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "kernels/common/check.h"
#include "kernels/geometry/hadamard.h"

namespace geofp8 {

// One pass, vectorized (this library is built with -O3), in an AVX2 clone where the CPU has it.
// For a power-of-two divisor (N = 2, 4, 8, ...) it multiplies by the exact reciprocal instead:
// both round the same real number, so the bits are the same. ThreadSanitizer builds get the
// default clone only: their instrumented ifunc resolver would run before the sanitizer runtime
// is up.
#if defined(__SANITIZE_THREAD__)
#define GEOFP8_DIVIDE_CLONES
#else
#define GEOFP8_DIVIDE_CLONES __attribute__((target_clones("avx2", "default")))
#endif
GEOFP8_DIVIDE_CLONES bool Divide(std::span<const float> in, float divisor, std::span<float> out) {
  const float* x = in.data();
  float* y = out.data();
  const size_t n = in.size();
  int exp = 0;
  const bool pow2 = std::frexp(divisor, &exp) == 0.5f && exp > -125 && exp < 126;
  const float inv = 1.f / divisor;
  uint32_t bad = 0;
  if (pow2) {
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &x[i], 4);
      bad |= (bits & 0x7f800000u) == 0x7f800000u;
      y[i] = x[i] * inv;
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &x[i], 4);
      bad |= (bits & 0x7f800000u) == 0x7f800000u;
      y[i] = x[i] / divisor;
    }
  }
  return bad != 0;
}

// ---- HostPlane ----

void HostPlane::DivideTransform(const BucketLayer& l, float divisor) {
  // A bf16 or fp16 gradient is read straight into its fp32 work memory as it is divided.
  const std::span<float> x = TransformSpan(l);
  GEOFP8_CHECK(x.size() == l.in.size(), "layer ", l.layer, ": a ", GradDtypeName(l.in.dtype),
               " gradient with a transform needs fp32 work memory of ", l.in.size(),
               " floats (has ", x.size(), ")");
  if (LoadDivided(l.in, divisor, x)) flags_ |= FlagBit(l);
  if (l.geometry) ApplyGeometry(*l.geometry, x);
  if (l.hadamard_block) HadamardForward(x, int(l.hadamard_block), l.hadamard_seed);
}

void HostPlane::EncodeChunk(const BucketLayer& l, ChunkRange c, float divisor,
                            const CodecOptions& o, std::span<uint8_t> out) {
  // A transformed layer was divided in place as a whole; the others are divided here, chunk by
  // chunk into a buffer that stays in cache for the encode, so the gradient is read once.
  // A bf16 or fp16 one is converted in that same pass: no fp32 copy of the layer.
  std::span<const float> x;
  if (Transformed(l)) {
    x = TransformSpan(l).subspan(c.begin, c.size());
  } else {
    divided_.resize(c.size());
    if (LoadDivided(l.in.subspan(c.begin, c.size()), divisor, divided_)) flags_ |= FlagBit(l);
    x = divided_;
  }
  if (!l.residual_out) {
    Encode(x, o, out);
    return;
  }
  feedback_.resize(c.size());
  if (l.residual_in) {
    for (size_t k = 0; k < c.size(); ++k) feedback_[k] = x[k] + l.residual_in[c.begin + k];
  } else {
    std::copy(x.begin(), x.end(), feedback_.begin());
  }
  Encode(feedback_, o, out);
  Lost(out, feedback_, l.residual_out + c.begin);
}

void HostPlane::Lost(std::span<const uint8_t> encoded, std::span<const float> x, float* dst) {
  feedback_decoded_.resize(x.size());
  geofp8::Decode(encoded, feedback_decoded_);
  for (size_t k = 0; k < x.size(); ++k) dst[k] = x[k] - feedback_decoded_[k];
}

void HostPlane::SumRequantize(const BucketLayer& l, ChunkRange c,
                              std::span<const std::span<const uint8_t>> parts,
                              const CodecOptions& o, std::span<uint8_t> out) {
  acc_.assign(c.size(), 0.f);
  for (const auto& part : parts) DecodeAccumulate(part, acc_);
  // Error feedback: the owner adds what its last requantization of this chunk lost.
  if (l.owner_in) {
    for (size_t k = 0; k < acc_.size(); ++k) acc_[k] += l.owner_in[c.begin + k];
  }
  Encode(acc_, o, out);
  if (l.owner_out) Lost(out, acc_, l.owner_out + c.begin);
}

void HostPlane::Decode(const BucketLayer& l, ChunkRange c, std::span<const uint8_t> in) {
  const GradSpan out = l.out.subspan(c.begin, c.size());
  if (out.fp32()) {
    geofp8::Decode(in, out.f32());
    return;
  }
  decoded_.resize(c.size());
  geofp8::Decode(in, decoded_);
  StoreRounded(decoded_, out);
}

void HostPlane::DecodeSum(const BucketLayer& l, ChunkRange c,
                          std::span<const std::span<const uint8_t>> parts) {
  // A bf16 or fp16 output is summed in fp32 and rounded once, at the end.
  const GradSpan out = l.out.subspan(c.begin, c.size());
  std::span<float> acc = out.fp32() ? out.f32() : std::span<float>();
  if (!out.fp32()) {
    decoded_.resize(c.size());
    acc = decoded_;
  }
  std::fill(acc.begin(), acc.end(), 0.f);
  for (const auto& part : parts) DecodeAccumulate(part, acc);
  if (!out.fp32()) StoreRounded(acc, out);
}

void HostPlane::InvertTransform(const BucketLayer& l) {
  if (!Transformed(l)) return;
  const std::span<float> out = l.out.f32();
  if (l.hadamard_block) HadamardInverse(out, int(l.hadamard_block), l.hadamard_seed);
  if (l.geometry) InvertGeometry(*l.geometry, out, l.products);
}

void DataPlane::InvertRows(const BucketLayer& l, int64_t, std::span<const float>) {
  GEOFP8_FAIL("layer ", l.layer, ": reduce-scatter runs on host memory only (plane ", name(), ")");
}

void DataPlane::ShardProducts(const BucketLayer& l, int64_t, std::span<float>) {
  GEOFP8_FAIL("layer ", l.layer, ": reduce-scatter runs on host memory only (plane ", name(), ")");
}

void HostPlane::InvertRows(const BucketLayer& l, int64_t first_row, std::span<const float> w) {
  if (l.geometry) InvertGeometryRows(*l.geometry, first_row, l.out.f32(), w);
}

void HostPlane::ShardProducts(const BucketLayer& l, int64_t first_row, std::span<float> w) {
  if (l.geometry) ShardColumnProducts(*l.geometry, first_row, l.out.f32(), w);
}

void HostPlane::ReadDivided(GradSpan in, float divisor, uint32_t bit, std::span<float> host) {
  if (LoadDivided(in, divisor, host)) flags_ |= uint64_t{1} << bit;
}

void HostPlane::Write(std::span<const float> host, GradSpan out) { StoreRounded(host, out); }

void HostPlane::Read(std::span<const float> in, std::span<float> host) {
  std::copy(in.begin(), in.end(), host.begin());
}

std::unique_ptr<GradientProducts> HostPlane::Snapshot(std::span<const float> g, int64_t m,
                                                      int64_t n) {
  return std::make_unique<HostSnapshot>(std::vector<float>(g.begin(), g.end()), m, n);
}

uint64_t HostPlane::TakeFlags() { return std::exchange(flags_, 0); }

// ---- StagedPlane ----

StagedPlane::StagedPlane(DeviceBackend& device) : device_(device) {
  flags_ = static_cast<uint64_t*>(device_.Allocate(sizeof(uint64_t)));
  const uint64_t zero = 0;
  device_.ToDevice(flags_, &zero, sizeof zero);
}

StagedPlane::~StagedPlane() {
  for (Scratch* s : {&divided_, &encoded_, &received_, &acc_}) {
    if (s->p) device_.Free(s->p);
  }
  device_.Free(flags_);
}

void* StagedPlane::Reserve(Scratch& s, size_t bytes) {
  if (bytes <= s.bytes && s.p) return s.p;
  if (s.p) device_.Free(s.p);
  s.p = nullptr;
  s.bytes = 0;
  // Grow by half again, so a bucket of slowly varying chunks settles on one allocation.
  const size_t want = std::max(bytes + bytes / 2, size_t{256});
  s.p = device_.Allocate(want);
  s.bytes = want;
  return s.p;
}

const uint8_t* StagedPlane::Stage(Scratch& s, std::span<const uint8_t> in) {
  auto* d = static_cast<uint8_t*>(Reserve(s, in.size()));
  device_.ToDevice(d, in.data(), in.size());
  return d;
}

std::string StagedPlane::Unsupported(const BucketLayer& l) const {
  if (!l.in.fp32() || !l.out.fp32()) {
    return "gradient dtype: " + GradDtypeName(l.in.fp32() ? l.out.dtype : l.in.dtype) +
           " is not available on device memory (" + device_.name() +
           ") yet; exchange float32 device tensors or host tensors";
  }
  if (l.policy.error_feedback) {
    return "error_feedback: not available on device memory (" + device_.name() +
           ") yet; turn it off for this layer or exchange host tensors";
  }
  return "";
}

void StagedPlane::DivideTransform(const BucketLayer& l, float divisor) {
  float* x = l.in.f32().data();
  device_.Divide(x, x, l.in.size(), divisor, FlagBit(l), flags_);
  if (Transformed(l)) device_.Transform(l, x, /*inverse=*/false);
}

void StagedPlane::EncodeChunk(const BucketLayer& l, ChunkRange c, float divisor,
                              const CodecOptions& o, std::span<uint8_t> out) {
  GEOFP8_CHECK(!l.residual_out, "layer ", l.layer, ": ", Unsupported(l));
  const float* x = l.in.f32().data() + c.begin;
  if (!Transformed(l)) {
    auto* d = static_cast<float*>(Reserve(divided_, c.size() * sizeof(float)));
    device_.Divide(x, d, c.size(), divisor, FlagBit(l), flags_);
    x = d;
  }
  auto* e = static_cast<uint8_t*>(Reserve(encoded_, out.size()));
  device_.Encode(x, c.size(), o, e, out.size());
  device_.ToHost(out.data(), e, out.size());
}

void StagedPlane::SumRequantize(const BucketLayer& l, ChunkRange c,
                                std::span<const std::span<const uint8_t>> parts,
                                const CodecOptions& o, std::span<uint8_t> out) {
  GEOFP8_CHECK(!l.owner_in && !l.owner_out, "layer ", l.layer, ": ", Unsupported(l));
  auto* acc = static_cast<float*>(Reserve(acc_, c.size() * sizeof(float)));
  device_.Fill(acc, c.size(), 0u);
  for (const auto& part : parts) {
    device_.Decode(Stage(received_, part), part.size(), acc, c.size(), /*accumulate=*/true);
  }
  auto* e = static_cast<uint8_t*>(Reserve(encoded_, out.size()));
  device_.Encode(acc, c.size(), o, e, out.size());
  device_.ToHost(out.data(), e, out.size());
}

void StagedPlane::Decode(const BucketLayer& l, ChunkRange c, std::span<const uint8_t> in) {
  device_.Decode(Stage(received_, in), in.size(), l.out.f32().data() + c.begin, c.size(),
                 /*accumulate=*/false);
}

void StagedPlane::DecodeSum(const BucketLayer& l, ChunkRange c,
                            std::span<const std::span<const uint8_t>> parts) {
  float* out = l.out.f32().data() + c.begin;
  device_.Fill(out, c.size(), 0u);
  for (const auto& part : parts) {
    device_.Decode(Stage(received_, part), part.size(), out, c.size(), /*accumulate=*/true);
  }
}

void StagedPlane::InvertTransform(const BucketLayer& l) {
  if (Transformed(l)) device_.Transform(l, l.out.f32().data(), /*inverse=*/true);
}

void StagedPlane::ReadDivided(GradSpan in, float divisor, uint32_t bit, std::span<float> host) {
  device_.ToHost(host.data(), in.f32().data(), in.size_bytes());
  if (geofp8::Divide(host, divisor, host)) host_flags_ |= uint64_t{1} << bit;
}

void StagedPlane::Write(std::span<const float> host, GradSpan out) {
  device_.ToDevice(out.f32().data(), host.data(), host.size_bytes());
}

void StagedPlane::Read(std::span<const float> in, std::span<float> host) {
  device_.ToHost(host.data(), in.data(), in.size_bytes());
}

uint64_t StagedPlane::TakeFlags() {
  uint64_t word = 0;
  device_.ToHost(&word, flags_, sizeof word);  // after every kernel issued before it
  const uint64_t zero = 0;
  if (word) device_.ToDevice(flags_, &zero, sizeof zero);
  return word | std::exchange(host_flags_, 0);
}

std::unique_ptr<GradientProducts> StagedPlane::Products(std::span<const float> g, int64_t m,
                                                        int64_t n) {
  if (auto on_device = device_.Products(g.data(), m, n)) return on_device;
  return HostCopy(g, m, n);
}

std::unique_ptr<GradientProducts> StagedPlane::Snapshot(std::span<const float> g, int64_t m,
                                                        int64_t n) {
  if (auto on_device = device_.Snapshot(g.data(), m, n)) return on_device;
  return HostCopy(g, m, n);
}

std::unique_ptr<GradientProducts> StagedPlane::HostCopy(std::span<const float> g, int64_t m,
                                                        int64_t n) {
  std::vector<float> host(g.size());
  device_.ToHost(host.data(), g.data(), g.size_bytes());
  return std::make_unique<HostSnapshot>(std::move(host), m, n);
}

void StagedPlane::Flush() { device_.Synchronize(); }

}  // namespace geofp8
