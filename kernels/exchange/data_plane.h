// Where an exchange's floats live, and what runs the per-element work on them: the division by N,
// the geometry and the rotation, the encode, the decode and the sums. The algorithms
// (algorithms.cc) touch a gradient or a decoded value only through a DataPlane, and the encoded
// wire only through the plane and the Communicator: the plane says where the wire lives.
//   HostPlane: the floats and the wire are host memory and the work runs on the calling thread
//   (the CPU engine, unchanged: the same bits and the same passes as before planes existed).
//   StagedPlane: the floats are device memory behind a DeviceBackend (CUDA: cuda_backend.h), and
//   the codec runs on the device. Its wire is either
//     host memory (WireMemory::kHost, for a Communicator that takes host spans only: Gloo): each
//     encode's bytes are copied to the host wire, and each received block to the device before
//     its decode, 4-7x fewer bytes than the floats would be; or
//     device memory (WireMemory::kDevice, for one that TakesDeviceSpans: NCCL): the collectives
//     move the encoded bytes where they lie, and a two_phase, allgather or reduce-scatter run
//     makes the host wait for the device once, at its end, to read every rank's non-finite flags:
//     the flags travel in the wire and are kept on the device, and every size is known from the
//     layers' shapes and formats (EncodedBytes), so nothing is read back before. (After it, a
//     reduce-scatter's lowrank layers wait once each for their k x n shares of U^T D, which cross
//     to the host for their all-reduce, and once for their inverses; an Exchanger whose run
//     transformed a bf16 or fp16 layer in fp32 work memory waits once for its rounding back.)
//   Gradients may be fp32, bf16 or fp16 on either plane, with the same bits: a bf16 or fp16 one
//   is read straight into the division and encode and written back rounded, as on the host.
// One Exchanger, one plane: every rank of an exchange runs the same plane kind, so every rank
// computes the same bits (the CUDA codec is bit-identical to the host's; see codec_cuda.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/common/uninitialized.h"
#include "kernels/exchange/chunking.h"
#include "kernels/exchange/grad_span.h"
#include "kernels/exchange/policy.h"
#include "kernels/geometry/factor_sketch.h"
#include "kernels/geometry/geometry.h"

namespace geofp8 {

struct BucketLayer {
  uint32_t layer = 0;  // model layer index: part of the stochastic-rounding stream key
  LayerPolicy policy;  // format, scaling, block, rounding
  const Geometry* geometry = nullptr;  // applied to `in`, inverted on `out`; null: identity
  // This rank's contribution before the division, in its dtype (fp32, bf16 or fp16: read
  // straight into fp32 as it is divided). An fp32 one is clobbered (divided and transformed in
  // place) when the layer has a geometry or a rotation (Transformed); a bf16 or fp16 one is
  // divided into `work` for that instead, and left as it was. May be the same memory as `out`: a
  // group's inputs are all read before any of its outputs is written. Memory of the run's plane
  // (DataPlane::host_memory): on a device plane the span is a device pointer and a length.
  GradSpan in;
  // The reduced result in gradient coordinates (same size), summed in fp32 and rounded to its
  // dtype as it is written. A transformed layer's must be fp32 (the inverse runs in place).
  GradSpan out;
  // A transformed layer whose `in` is bf16 or fp16: fp32 memory of in.size() floats that it is
  // divided and transformed in (the plane's memory: DataPlane::WorkBuffer). Empty otherwise.
  std::span<float> work;
  // When not null and the layer has a lowrank geometry: filled by the inverse transform with what
  // it learnt of `out` (geometry.h InverseProducts), for the factor sketch that reads it next.
  // Host planes only.
  InverseProducts* products = nullptr;
  // Which bit of ExchangeBucketData's result reports a NaN or inf in this layer's input (< 64):
  // the exchanger gives each bucket of a coalesced exchange its own bit.
  uint32_t flag_bit = 0;
  // The block random Hadamard rotation after the geometry (0: none), with its signs' seed.
  uint32_t hadamard_block = 0;
  uint64_t hadamard_seed = 0;
  // Error feedback (LayerPolicy::error_feedback), each null or one float per element of `in`, in
  // the coordinates the codec sees: residual_in is added to this rank's input before its encode
  // and residual_out receives what that encode lost (input + residual - decoded); owner_in and
  // owner_out do the same for two_phase's requantization of the chunk this rank owns. Host
  // memory; host planes only.
  const float* residual_in = nullptr;
  float* residual_out = nullptr;
  const float* owner_in = nullptr;
  float* owner_out = nullptr;
  // Reduce-scatter (AlgorithmOptions::reduce_scatter): the layer is rows x `cols` row-major
  // (in.size() = rows * cols) and rank j owns rows [j c, min((j + 1) c, rows)), c = ceil(rows /
  // N), FSDP's dim-0 chunks; `out` is this rank's rows only (possibly none).
  int64_t cols = 1;
};

// Whether the layer is divided and transformed in place before its encode.
inline bool Transformed(const BucketLayer& l) { return l.geometry || l.hadamard_block; }

// The fp32 memory a transformed layer is divided and transformed in: `in` itself, or `work` when
// `in` is bf16 or fp16.
inline std::span<float> TransformSpan(const BucketLayer& l) {
  return l.in.fp32() ? l.in.f32() : l.work;
}

inline uint64_t FlagBit(const BucketLayer& l) { return uint64_t{1} << l.flag_bit; }

// out[i] = in[i] / divisor, the IEEE quotient every reference computes; in may be out. Returns
// whether in holds a NaN or inf. Host memory.
bool Divide(std::span<const float> in, float divisor, std::span<float> out);

// The per-element stages of an exchange over one kind of memory. One thread at a time: an
// algorithm calls it from its codec thread (or the calling thread when it runs inline).
class DataPlane {
 public:
  virtual ~DataPlane() = default;

  virtual std::string name() const = 0;  // "host", "cuda:0"
  // Whether BucketLayer::in/out are host memory, which the algorithms' baselines may then read
  // directly.
  virtual bool host_memory() const = 0;
  // "" if the plane runs everything `layer` asks for, else one line naming the field, for the
  // exchanger's validation.
  virtual std::string Unsupported(const BucketLayer& layer) const = 0;

  // In place on l.in: divides by `divisor` and applies the layer's transform (the geometry, then
  // the rotation). Notes a NaN or inf in l's flag bit.
  virtual void DivideTransform(const BucketLayer& l, float divisor) = 0;
  // Encodes elements c of l.in into the host buffer `out` (EncodedBytes(o, c.size()) bytes):
  // divided by `divisor` first unless the layer was transformed in place (DivideTransform), which
  // divided it already; noting a NaN or inf. With error feedback, encodes in + residual_in and
  // keeps what the encode lost in residual_out.
  virtual void EncodeChunk(const BucketLayer& l, ChunkRange c, float divisor, const CodecOptions& o,
                           std::span<uint8_t> out) = 0;
  // two_phase's owner: sums the decoded `parts` (host, encoded chunks c of every rank's l) in
  // order from zero, adds owner_in, encodes the sum into the host buffer `out` with `o` and keeps
  // what that lost in owner_out.
  virtual void SumRequantize(const BucketLayer& l, ChunkRange c,
                             std::span<const std::span<const uint8_t>> parts, const CodecOptions& o,
                             std::span<uint8_t> out) = 0;
  // l.out[c] = the decode of the host bytes `in`.
  virtual void Decode(const BucketLayer& l, ChunkRange c, std::span<const uint8_t> in) = 0;
  // l.out[c] = 0, then each part's decode added in order (allgather: every rank's copy).
  virtual void DecodeSum(const BucketLayer& l, ChunkRange c,
                         std::span<const std::span<const uint8_t>> parts) = 0;
  // In place on l.out: the rotation's inverse, then the geometry's (filling l.products).
  virtual void InvertTransform(const BucketLayer& l) = 0;
  // Reduce-scatter: the geometry's inverse on l.out (fp32), the layer's rows from `first_row` on
  // (geometry.h InvertGeometryRows; `w` the summed ShardColumnProducts, empty when none), and
  // this shard's share of those products (ShardColumnProducts into `w`). `w` is host memory on
  // every plane: the shares are all-reduced through the host.
  virtual void InvertRows(const BucketLayer& l, int64_t first_row, std::span<const float> w) = 0;
  virtual void ShardProducts(const BucketLayer& l, int64_t first_row, std::span<float> w) = 0;

  // host[i] = in[i] / divisor, noting a NaN or inf in flag bit `bit` (the baselines' flatten).
  virtual void ReadDivided(GradSpan in, float divisor, uint32_t bit, std::span<float> host) = 0;
  // out = host, rounded to out's dtype (the baselines' unflatten).
  virtual void Write(std::span<const float> host, GradSpan out) = 0;
  // host = in in fp32, exactly (an exchanger's geometry refresh reads the averaged gradient).
  virtual void Read(GradSpan in, std::span<float> host) = 0;
  // out = x rounded to out's dtype (fp32: copied), both this plane's memory: an exchanger writes
  // a bf16 or fp16 layer's result back from its fp32 work memory. In stream order on a device
  // plane: Flush before the caller reads `out`.
  virtual void Round(std::span<const float> x, GradSpan out) = 0;
  // This plane's fp32 memory of n floats in slot `slot`, kept from run to run (an exchanger's
  // work memory for BucketLayer::work and a transformed bf16 or fp16 layer's fp32 result). Its
  // contents are undefined until written.
  virtual std::span<float> WorkBuffer(size_t slot, size_t n) = 0;
  // The factor sketch's access to the m x n gradient g (an exchanger's refresh): its products
  // where g lives, or over a host copy where the plane has none there. Never null.
  virtual std::unique_ptr<GradientProducts> Products(std::span<const float> g, int64_t m,
                                                     int64_t n) = 0;
  // The same over a copy of g taken now, which the products own: a deferred refresh's, run after
  // g's memory has moved on. Never null.
  virtual std::unique_ptr<GradientProducts> Snapshot(std::span<const float> g, int64_t m,
                                                     int64_t n) = 0;

  // The OR of the flag bits noted since the last call.
  virtual uint64_t TakeFlags() = 0;
  // Forgets the flag bits noted so far without reading them (a device plane: on the device).
  virtual void ClearFlags() { TakeFlags(); }
  // Returns once every output written so far is in place (device work done).
  virtual void Flush() = 0;

  // Whether the wire is in this plane's device memory (see the top of this file): the byte spans
  // EncodeChunk and SumRequantize write and Decode, DecodeSum and SumRequantize read are then
  // device memory from WireBuffer, and the flags move through the calls below. False: host memory.
  virtual bool device_wire() const { return false; }
  // The device wire's buffer `slot`, `bytes` long, kept from run to run so that a steady step
  // allocates nothing. Its contents are undefined until written.
  virtual std::span<uint8_t> WireBuffer(size_t slot, size_t bytes);
  // The device wire's flags: the bits noted since ClearFlags, written into the 8 wire bytes
  // `tail` on the device, unread; every rank's 8 bytes `tails` once received, kept on the device;
  // and their OR, once every output written so far is in place: the run's one host wait.
  virtual void WriteFlags(std::span<uint8_t> tail);
  virtual void KeepFlags(std::span<const std::span<const uint8_t>> tails);
  virtual uint64_t AgreedFlags();
};

// The host's plane: the CPU engine's passes, with buffers reused from call to call.
class HostPlane final : public DataPlane {
 public:
  std::string name() const override { return "host"; }
  bool host_memory() const override { return true; }
  std::string Unsupported(const BucketLayer&) const override { return ""; }
  void DivideTransform(const BucketLayer& l, float divisor) override;
  void EncodeChunk(const BucketLayer& l, ChunkRange c, float divisor, const CodecOptions& o,
                   std::span<uint8_t> out) override;
  void SumRequantize(const BucketLayer& l, ChunkRange c,
                     std::span<const std::span<const uint8_t>> parts, const CodecOptions& o,
                     std::span<uint8_t> out) override;
  void Decode(const BucketLayer& l, ChunkRange c, std::span<const uint8_t> in) override;
  void DecodeSum(const BucketLayer& l, ChunkRange c,
                 std::span<const std::span<const uint8_t>> parts) override;
  void InvertTransform(const BucketLayer& l) override;
  void InvertRows(const BucketLayer& l, int64_t first_row, std::span<const float> w) override;
  void ShardProducts(const BucketLayer& l, int64_t first_row, std::span<float> w) override;
  void ReadDivided(GradSpan in, float divisor, uint32_t bit, std::span<float> host) override;
  void Write(std::span<const float> host, GradSpan out) override;
  void Read(GradSpan in, std::span<float> host) override;
  void Round(std::span<const float> x, GradSpan out) override { StoreRounded(x, out); }
  std::span<float> WorkBuffer(size_t slot, size_t n) override;
  std::unique_ptr<GradientProducts> Products(std::span<const float> g, int64_t m,
                                             int64_t n) override {
    return std::make_unique<HostGradient>(g.data(), m, n);
  }
  std::unique_ptr<GradientProducts> Snapshot(std::span<const float> g, int64_t m,
                                             int64_t n) override;
  uint64_t TakeFlags() override;
  void Flush() override {}

 private:
  // dst[k] = x[k] - Decode(encoded)[k]: what an encode of x lost.
  void Lost(std::span<const uint8_t> encoded, std::span<const float> x, float* dst);

  uint64_t flags_ = 0;
  UninitializedVector<float> divided_;           // one chunk of input, divided, to encode
  UninitializedVector<float> feedback_;          // error feedback: input + residual
  UninitializedVector<float> feedback_decoded_;  // error feedback: what its encode decodes to
  UninitializedVector<float> acc_;               // two_phase: the sum of this rank's chunk
  UninitializedVector<float> decoded_;  // a bf16 or fp16 output's chunk, in fp32 until rounded
  std::deque<UninitializedVector<float>> work_;  // WorkBuffer's slots
};

// What a StagedPlane needs of a device: memory, copies and the per-element kernels, each in the
// order issued (one stream). Pointers named `device` or taken as device floats are the backend's
// memory; `host` ones are host memory. Errors throw geofp8::Error naming the operation.
class DeviceBackend {
 public:
  // How many times a call has made the host wait for the device (ToHost, Synchronize, and the
  // waits inside any other call), counted by each backend: the tests and the device check count
  // a step's (0 inside a device-wire run's pipeline).
  uint64_t host_syncs() const { return host_syncs_.load(); }

  virtual ~DeviceBackend() = default;
  virtual std::string name() const = 0;  // "cuda:0"
  virtual void* Allocate(size_t bytes) = 0;
  virtual void Free(void* device) = 0;
  // Returns once `host` holds the bytes.
  virtual void ToHost(void* host, const void* device, size_t bytes) = 0;
  // `host` may be reused as soon as this returns.
  virtual void ToDevice(void* device, const void* host, size_t bytes) = 0;
  // Device to device, and zeroes, in stream order: the device wire's flags, with no host wait.
  virtual void Copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void Zero(void* device, size_t bytes) = 0;
  // y = x / divisor (IEEE, as Divide; x may be y); ORs `bit` into the device word *flags if x
  // holds a NaN or inf.
  virtual void Divide(const float* x, float* y, size_t n, float divisor, uint64_t bit,
                      uint64_t* flags) = 0;
  // The same from a bf16 or fp16 gradient (`dtype`): y[i] = LowpToFloat(x[i]) / divisor, the
  // conversion exact (grad_span.h, shared with the host's LoadDivided), into fp32 memory y.
  virtual void DivideLowp(const uint16_t* x, GradDtype dtype, float* y, size_t n, float divisor,
                          uint64_t bit, uint64_t* flags) = 0;
  // y[i] = FloatToLowp(x[i], dtype): rounded to nearest even in bf16 or fp16, as the host's
  // StoreRounded.
  virtual void RoundLowp(const float* x, uint16_t* y, GradDtype dtype, size_t n) = 0;
  // The codec (codec.h) from device floats into device bytes, and back (accumulate: out +=).
  // Neither waits for the device: the decode takes the layout from `o` (the options, or any
  // with the same format, scaling and block, of the encode that wrote `in`), not the header.
  virtual void Encode(const float* x, size_t n, const CodecOptions& o, uint8_t* out,
                      size_t bytes) = 0;
  virtual void Decode(const uint8_t* in, size_t bytes, const CodecOptions& o, float* out, size_t n,
                      bool accumulate) = 0;
  // x[i] = the float with bits `bits`.
  virtual void Fill(float* x, size_t n, uint32_t bits) = 0;
  // The layer's geometry and rotation on its whole device buffer x (l.in or l.out), forward
  // (geometry, then rotation) or inverse (rotation's, then geometry's).
  virtual void Transform(const BucketLayer& l, float* x, bool inverse) = 0;
  // Reduce-scatter (DataPlane::ShardProducts and InvertRows) on the device rows x of layer l,
  // `n` floats from row `first_row` on: w (device, ShardProductRows x l.cols) = this shard's
  // share of U^T D; and the geometry's inverse of those rows in place, with w the summed shares
  // (device; null when ShardProductRows is 0).
  virtual void ShardProducts(const BucketLayer& l, int64_t first_row, const float* x, size_t n,
                             float* w) = 0;
  virtual void InvertRows(const BucketLayer& l, int64_t first_row, float* x, size_t n,
                          const float* w) = 0;
  // Returns once everything issued is done.
  virtual void Synchronize() = 0;
  // The factor sketch's products over the m x n device gradient g (DataPlane::Products); null:
  // none, the plane reads the gradient to the host instead.
  virtual std::unique_ptr<GradientProducts> Products(const float* g, int64_t m, int64_t n) {
    (void)g, (void)m, (void)n;
    return nullptr;
  }
  // Products over a device copy of g made now, owning it; null: none (the plane copies g to the
  // host instead).
  virtual std::unique_ptr<GradientProducts> Snapshot(const float* g, int64_t m, int64_t n) {
    (void)g, (void)m, (void)n;
    return nullptr;
  }

 protected:
  std::atomic<uint64_t> host_syncs_{0};
};

// A HostGradient over a copy of G that it owns (HostPlane::Snapshot, and a device plane's
// fallback).
class HostSnapshot final : public GradientProducts {
 public:
  HostSnapshot(std::vector<float> g, int64_t m, int64_t n)
      : copy_(std::move(g)), g_(copy_.data(), m, n) {}
  double ProductAndNorm(const float* x, int ldx, float* y) override {
    return g_.ProductAndNorm(x, ldx, y);
  }
  void TransposeProduct(const float* q, int c, float* bt) override {
    g_.TransposeProduct(q, c, bt);
  }
  int64_t FindNonFinite() override { return g_.FindNonFinite(); }
  const float* host_data() const override { return copy_.data(); }

 private:
  std::vector<float> copy_;
  HostGradient g_;
};

// Where a StagedPlane's wire lives (see the top of this file).
enum class WireMemory { kHost, kDevice };

// A plane over a DeviceBackend's memory, its wire staged through host memory for the
// Communicator or kept in device memory (`wire`). Error feedback is not run on it yet
// (Unsupported says so). bf16 and fp16 gradients: read into the division (DivideLowp) chunk by
// chunk, or into the exchanger's fp32 work memory (WorkBuffer) for a transform, and decoded
// outputs rounded into them (RoundLowp) through one chunk of fp32 scratch: no fp32 copy of a
// bucket. Reduce-scatter: the owner's rows are summed into `out` on the device and the row-local
// inverse runs there (DeviceBackend::InvertRows); a lowrank layer's k x n shares of U^T D are
// computed on the device (DeviceBackend::ShardProducts) and cross to the host only for their
// all-reduce.
class StagedPlane final : public DataPlane {
 public:
  explicit StagedPlane(DeviceBackend& device, WireMemory wire = WireMemory::kHost);
  ~StagedPlane() override;
  StagedPlane(const StagedPlane&) = delete;
  StagedPlane& operator=(const StagedPlane&) = delete;

  std::string name() const override { return device_.name(); }
  bool host_memory() const override { return false; }
  std::string Unsupported(const BucketLayer& layer) const override;
  void DivideTransform(const BucketLayer& l, float divisor) override;
  void EncodeChunk(const BucketLayer& l, ChunkRange c, float divisor, const CodecOptions& o,
                   std::span<uint8_t> out) override;
  void SumRequantize(const BucketLayer& l, ChunkRange c,
                     std::span<const std::span<const uint8_t>> parts, const CodecOptions& o,
                     std::span<uint8_t> out) override;
  void Decode(const BucketLayer& l, ChunkRange c, std::span<const uint8_t> in) override;
  void DecodeSum(const BucketLayer& l, ChunkRange c,
                 std::span<const std::span<const uint8_t>> parts) override;
  void InvertTransform(const BucketLayer& l) override;
  void InvertRows(const BucketLayer& l, int64_t first_row, std::span<const float> w) override;
  void ShardProducts(const BucketLayer& l, int64_t first_row, std::span<float> w) override;
  void ReadDivided(GradSpan in, float divisor, uint32_t bit, std::span<float> host) override;
  void Write(std::span<const float> host, GradSpan out) override;
  void Read(GradSpan in, std::span<float> host) override;
  void Round(std::span<const float> x, GradSpan out) override;
  std::span<float> WorkBuffer(size_t slot, size_t n) override;
  std::unique_ptr<GradientProducts> Products(std::span<const float> g, int64_t m,
                                             int64_t n) override;
  std::unique_ptr<GradientProducts> Snapshot(std::span<const float> g, int64_t m,
                                             int64_t n) override;
  uint64_t TakeFlags() override;
  void ClearFlags() override;
  void Flush() override;
  bool device_wire() const override { return wire_ == WireMemory::kDevice; }
  std::span<uint8_t> WireBuffer(size_t slot, size_t bytes) override;
  void WriteFlags(std::span<uint8_t> tail) override;
  void KeepFlags(std::span<const std::span<const uint8_t>> tails) override;
  uint64_t AgreedFlags() override;

  DeviceBackend& device() { return device_; }

 private:
  // A grow-only device buffer.
  struct Scratch {
    void* p = nullptr;
    size_t bytes = 0;
  };
  void* Reserve(Scratch& s, size_t bytes);
  // Products over a host copy of the device gradient g (no device products).
  std::unique_ptr<GradientProducts> HostCopy(std::span<const float> g, int64_t m, int64_t n);
  // The bytes `in` where the device can read them: the device copy of host bytes in scratch `s`,
  // or `in` itself on a device wire.
  const uint8_t* Stage(Scratch& s, std::span<const uint8_t> in);
  // The encoded bytes `out` of an encode: written in place on a device wire; else into scratch
  // and copied to the host by Done.
  uint8_t* EncodeTarget(std::span<uint8_t> out);
  void Done(std::span<uint8_t> out, const uint8_t* encoded);
  // y = in / divisor in fp32 device memory, whatever in's dtype, noting a NaN or inf in l's bit.
  void DivideInto(const BucketLayer& l, GradSpan in, float divisor, float* y);
  // A gradient's bf16 or fp16 bits in host staging_ (ReadDivided and Read).
  std::span<const uint16_t> LowpToHost(GradSpan in);

  DeviceBackend& device_;
  const WireMemory wire_;
  // The flag bits noted since TakeFlags: by the device's kernels in a device word, and by
  // ReadDivided's host pass.
  uint64_t* flags_ = nullptr;
  uint64_t host_flags_ = 0;
  Scratch divided_, encoded_, received_, acc_;
  // A bf16 or fp16 output's decoded chunk in fp32 until it is rounded; reduce-scatter's shares
  // of U^T D.
  Scratch decoded_, shares_;
  // WorkBuffer's slots.
  std::vector<Scratch> work_buffers_;
  // Host bits of a bf16 or fp16 gradient (ReadDivided, Write, Read).
  std::vector<uint16_t> staging_;
  // The device wire: its buffers by slot, and every rank's flags (KeepFlags), `kept_` words.
  std::vector<Scratch> wire_buffers_;
  Scratch kept_flags_;
  size_t kept_ = 0;
};

}  // namespace geofp8
