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

void HostPlane::Read(GradSpan in, std::span<float> host) {
  if (in.fp32()) {
    std::copy(in.f32().begin(), in.f32().end(), host.begin());
  } else {
    LoadDivided(in, 1.f, host);  // exact: the conversion, and x / 1 is x
  }
}

std::span<float> HostPlane::WorkBuffer(size_t slot, size_t n) {
  while (work_.size() <= slot) work_.emplace_back();
  work_[slot].resize(n);
  return {work_[slot].data(), n};
}

std::unique_ptr<GradientProducts> HostPlane::Snapshot(std::span<const float> g, int64_t m,
                                                      int64_t n) {
  return std::make_unique<HostSnapshot>(std::vector<float>(g.begin(), g.end()), m, n);
}

uint64_t HostPlane::TakeFlags() { return std::exchange(flags_, 0); }

std::span<uint8_t> DataPlane::WireBuffer(size_t, size_t) {
  GEOFP8_FAIL("plane ", name(), ": its wire is host memory (no device wire buffers)");
}

void DataPlane::WriteFlags(std::span<uint8_t>) {
  GEOFP8_FAIL("plane ", name(), ": its wire is host memory (no device wire flags)");
}

void DataPlane::KeepFlags(std::span<const std::span<const uint8_t>>) {
  GEOFP8_FAIL("plane ", name(), ": its wire is host memory (no device wire flags)");
}

uint64_t DataPlane::AgreedFlags() {
  GEOFP8_FAIL("plane ", name(), ": its wire is host memory (no device wire flags)");
}

// ---- StagedPlane ----

StagedPlane::StagedPlane(DeviceBackend& device, WireMemory wire) : device_(device), wire_(wire) {
  flags_ = static_cast<uint64_t*>(device_.Allocate(sizeof(uint64_t)));
  device_.Zero(flags_, sizeof(uint64_t));
}

StagedPlane::~StagedPlane() {
  for (Scratch* s : {&divided_, &encoded_, &received_, &acc_, &decoded_, &shares_, &kept_flags_}) {
    if (s->p) device_.Free(s->p);
  }
  for (auto* buffers : {&wire_buffers_, &work_buffers_}) {
    for (Scratch& s : *buffers) {
      if (s.p) device_.Free(s.p);
    }
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
  if (device_wire()) return in.data();
  auto* d = static_cast<uint8_t*>(Reserve(s, in.size()));
  device_.ToDevice(d, in.data(), in.size());
  return d;
}

uint8_t* StagedPlane::EncodeTarget(std::span<uint8_t> out) {
  if (device_wire()) return out.data();
  return static_cast<uint8_t*>(Reserve(encoded_, out.size()));
}

void StagedPlane::Done(std::span<uint8_t> out, const uint8_t* encoded) {
  if (!device_wire()) device_.ToHost(out.data(), encoded, out.size());
}

std::string StagedPlane::Unsupported(const BucketLayer& l) const {
  if (l.policy.error_feedback) {
    return "error_feedback: not available on device memory (" + device_.name() +
           ") yet; turn it off for this layer or exchange host tensors";
  }
  return "";
}

void StagedPlane::DivideInto(const BucketLayer& l, GradSpan in, float divisor, float* y) {
  if (in.fp32()) {
    device_.Divide(in.f32().data(), y, in.size(), divisor, FlagBit(l), flags_);
  } else {
    device_.DivideLowp(in.bits16().data(), in.dtype, y, in.size(), divisor, FlagBit(l), flags_);
  }
}

void StagedPlane::DivideTransform(const BucketLayer& l, float divisor) {
  // A bf16 or fp16 gradient is read straight into its fp32 work memory as it is divided.
  const std::span<float> x = TransformSpan(l);
  GEOFP8_CHECK(x.size() == l.in.size(), "layer ", l.layer, ": a ", GradDtypeName(l.in.dtype),
               " gradient with a transform needs fp32 work memory of ", l.in.size(),
               " floats (has ", x.size(), ")");
  DivideInto(l, l.in, divisor, x.data());
  if (Transformed(l)) device_.Transform(l, x.data(), /*inverse=*/false);
}

void StagedPlane::EncodeChunk(const BucketLayer& l, ChunkRange c, float divisor,
                              const CodecOptions& o, std::span<uint8_t> out) {
  GEOFP8_CHECK(!l.residual_out, "layer ", l.layer, ": ", Unsupported(l));
  // As on the host: a transformed layer was divided as a whole; the others chunk by chunk, a
  // bf16 or fp16 one converted in that pass.
  const float* x = nullptr;
  if (Transformed(l)) {
    x = TransformSpan(l).data() + c.begin;
  } else {
    auto* d = static_cast<float*>(Reserve(divided_, c.size() * sizeof(float)));
    DivideInto(l, l.in.subspan(c.begin, c.size()), divisor, d);
    x = d;
  }
  uint8_t* e = EncodeTarget(out);
  device_.Encode(x, c.size(), o, e, out.size());
  Done(out, e);
}

void StagedPlane::SumRequantize(const BucketLayer& l, ChunkRange c,
                                std::span<const std::span<const uint8_t>> parts,
                                const CodecOptions& o, std::span<uint8_t> out) {
  GEOFP8_CHECK(!l.owner_in && !l.owner_out, "layer ", l.layer, ": ", Unsupported(l));
  auto* acc = static_cast<float*>(Reserve(acc_, c.size() * sizeof(float)));
  device_.Fill(acc, c.size(), 0u);
  for (const auto& part : parts) {
    device_.Decode(Stage(received_, part), part.size(), o, acc, c.size(), /*accumulate=*/true);
  }
  uint8_t* e = EncodeTarget(out);
  device_.Encode(acc, c.size(), o, e, out.size());
  Done(out, e);
}

// The layout of a layer's encoded chunks: its policy's format, scaling and block (the seeds and
// stream keys do not change it).
static CodecOptions WireLayout(const BucketLayer& l) {
  return LayerCodecOptions(l.policy, 0, 0, 0, 0, 0, 0);
}

void StagedPlane::Decode(const BucketLayer& l, ChunkRange c, std::span<const uint8_t> in) {
  // A bf16 or fp16 output: decoded into fp32 scratch, then rounded into place.
  const GradSpan out = l.out.subspan(c.begin, c.size());
  float* x = out.fp32() ? out.f32().data()
                        : static_cast<float*>(Reserve(decoded_, c.size() * sizeof(float)));
  device_.Decode(Stage(received_, in), in.size(), WireLayout(l), x, c.size(),
                 /*accumulate=*/false);
  if (!out.fp32()) device_.RoundLowp(x, out.bits16().data(), out.dtype, c.size());
}

void StagedPlane::DecodeSum(const BucketLayer& l, ChunkRange c,
                            std::span<const std::span<const uint8_t>> parts) {
  // A bf16 or fp16 output is summed in fp32 and rounded once, at the end.
  const GradSpan out = l.out.subspan(c.begin, c.size());
  float* acc = out.fp32() ? out.f32().data()
                          : static_cast<float*>(Reserve(decoded_, c.size() * sizeof(float)));
  device_.Fill(acc, c.size(), 0u);
  const CodecOptions o = WireLayout(l);
  for (const auto& part : parts) {
    device_.Decode(Stage(received_, part), part.size(), o, acc, c.size(), /*accumulate=*/true);
  }
  if (!out.fp32()) device_.RoundLowp(acc, out.bits16().data(), out.dtype, c.size());
}

void StagedPlane::InvertTransform(const BucketLayer& l) {
  if (Transformed(l)) device_.Transform(l, l.out.f32().data(), /*inverse=*/true);
}

void StagedPlane::ShardProducts(const BucketLayer& l, int64_t first_row, std::span<float> w) {
  if (!l.geometry || w.empty()) return;
  if (l.out.empty()) {  // no rows here: a share of zeros, as ShardColumnProducts gives
    std::fill(w.begin(), w.end(), 0.f);
    return;
  }
  // On the device; only the k x n share crosses to the host, for the all-reduce.
  auto* d = static_cast<float*>(Reserve(shares_, w.size_bytes()));
  const std::span<float> rows = l.out.f32();
  device_.ShardProducts(l, first_row, rows.data(), rows.size(), d);
  device_.ToHost(w.data(), d, w.size_bytes());
}

void StagedPlane::InvertRows(const BucketLayer& l, int64_t first_row, std::span<const float> w) {
  if (!l.geometry || l.geometry->is_identity() || l.out.empty()) return;
  float* d = nullptr;
  if (!w.empty()) {
    d = static_cast<float*>(Reserve(shares_, w.size_bytes()));
    device_.ToDevice(d, w.data(), w.size_bytes());
  }
  const std::span<float> rows = l.out.f32();
  device_.InvertRows(l, first_row, rows.data(), rows.size(), d);
}

std::span<const uint16_t> StagedPlane::LowpToHost(GradSpan in) {
  staging_.resize(in.size());
  device_.ToHost(staging_.data(), in.data, in.size_bytes());
  return staging_;
}

void StagedPlane::ReadDivided(GradSpan in, float divisor, uint32_t bit, std::span<float> host) {
  // Read to the host as it is and divided there by the host's own code: the host plane's bits.
  bool bad = false;
  if (in.fp32()) {
    device_.ToHost(host.data(), in.f32().data(), in.size_bytes());
    bad = geofp8::Divide(host, divisor, host);
  } else {
    const std::span<const uint16_t> bits = LowpToHost(in);
    bad = LoadDivided(GradSpan(const_cast<uint16_t*>(bits.data()), bits.size(), in.dtype), divisor,
                      host);
  }
  if (bad) host_flags_ |= uint64_t{1} << bit;
}

void StagedPlane::Write(std::span<const float> host, GradSpan out) {
  if (out.fp32()) {
    device_.ToDevice(out.f32().data(), host.data(), host.size_bytes());
    return;
  }
  staging_.resize(host.size());
  StoreRounded(host, GradSpan(staging_.data(), staging_.size(), out.dtype));
  device_.ToDevice(out.data, staging_.data(), out.size_bytes());
}

void StagedPlane::Read(GradSpan in, std::span<float> host) {
  if (in.fp32()) {
    device_.ToHost(host.data(), in.f32().data(), in.size_bytes());
    return;
  }
  const std::span<const uint16_t> bits = LowpToHost(in);
  LoadDivided(GradSpan(const_cast<uint16_t*>(bits.data()), bits.size(), in.dtype), 1.f, host);
}

void StagedPlane::Round(std::span<const float> x, GradSpan out) {
  GEOFP8_CHECK(x.size() == out.size(), "round: ", x.size(), " elements into ", out.size());
  if (out.fp32()) {
    device_.Copy(out.data, x.data(), x.size_bytes());
  } else {
    device_.RoundLowp(x.data(), out.bits16().data(), out.dtype, x.size());
  }
}

std::span<float> StagedPlane::WorkBuffer(size_t slot, size_t n) {
  if (work_buffers_.size() <= slot) work_buffers_.resize(slot + 1);
  return {static_cast<float*>(Reserve(work_buffers_[slot], n * sizeof(float))), n};
}

uint64_t StagedPlane::TakeFlags() {
  uint64_t word = 0;
  device_.ToHost(&word, flags_, sizeof word);  // after every kernel issued before it
  if (word) device_.Zero(flags_, sizeof word);
  return word | std::exchange(host_flags_, 0);
}

void StagedPlane::ClearFlags() {
  device_.Zero(flags_, sizeof(uint64_t));
  host_flags_ = 0;
  kept_ = 0;
}

std::span<uint8_t> StagedPlane::WireBuffer(size_t slot, size_t bytes) {
  GEOFP8_CHECK(device_wire(), "plane ", name(), ": its wire is host memory (WireMemory::kHost)");
  if (wire_buffers_.size() <= slot) wire_buffers_.resize(slot + 1);
  return {static_cast<uint8_t*>(Reserve(wire_buffers_[slot], bytes)), bytes};
}

void StagedPlane::WriteFlags(std::span<uint8_t> tail) {
  GEOFP8_CHECK(device_wire() && tail.size() == sizeof(uint64_t), "plane ", name(),
               ": flags go into 8 bytes of a device wire (", tail.size(), " bytes, wire ",
               device_wire() ? "device" : "host", ")");
  device_.Copy(tail.data(), flags_, sizeof(uint64_t));
}

void StagedPlane::KeepFlags(std::span<const std::span<const uint8_t>> tails) {
  GEOFP8_CHECK(device_wire(), "plane ", name(), ": its wire is host memory (WireMemory::kHost)");
  auto* kept = static_cast<uint8_t*>(Reserve(kept_flags_, tails.size() * sizeof(uint64_t)));
  for (size_t j = 0; j < tails.size(); ++j) {
    GEOFP8_CHECK(tails[j].size() == sizeof(uint64_t), "plane ", name(), ": rank ", j,
                 "'s flags are ", tails[j].size(), " bytes, not 8");
    device_.Copy(kept + j * sizeof(uint64_t), tails[j].data(), sizeof(uint64_t));
  }
  kept_ = tails.size();
}

uint64_t StagedPlane::AgreedFlags() {
  if (kept_ == 0) {
    device_.Synchronize();
    return 0;
  }
  // After every kernel and collective issued before it: the run's one wait for the device.
  std::vector<uint64_t> words(kept_);
  device_.ToHost(words.data(), kept_flags_.p, kept_ * sizeof(uint64_t));
  uint64_t any = 0;
  for (uint64_t w : words) any |= w;
  return any;
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
