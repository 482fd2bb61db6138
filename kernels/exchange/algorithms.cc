// two_phase, allgather, native and the fp32/bf16 baselines over one bucket (see algorithms.h).
// two_phase: quantize every layer's chunk j for rank j, all-to-all, rank j decodes and sums its
// chunks in rank order in fp32, requantizes, all-gather, everyone decodes every chunk. allgather:
// quantize once, all-gather, everyone sums every rank's copy in rank order. Both are pipelined
// over groups of layers: a helper thread does the codec and geometry work of the neighbouring
// groups while the collectives run in one fixed order per channel on every rank, on the calling
// thread, plus a second thread for the communicator's side channel when it has one.
#include "kernels/exchange/algorithms.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "kernels/codec/codec.h"
#include "kernels/common/check.h"
#include "kernels/exchange/bf16.h"
#include "kernels/exchange/chunking.h"
#include "kernels/exchange/priority.h"
#include "kernels/geometry/hadamard.h"

namespace geofp8 {
namespace {

// Whether this run's check rides in its data (AlgorithmOptions::check_record) rather than a
// round of its own (before_data): asked for by the caller and possible on this backend. Not on a
// device wire, whose records the host would have to read back mid-run.
bool FusedCheck(const Communicator& comm, const AlgorithmOptions& ao) {
  return !ao.check_record.empty() && comm.SupportsBoundedReceive() &&
         !(ao.plane && ao.plane->device_wire());
}

// The check as a round of its own, where the caller gave one.
void RunBeforeData(const AlgorithmOptions& ao) {
  if (!ao.before_data) return;
  TraceScope span(ao.trace, "fingerprints", ExchangeTrace::kMainLane, ao.step);
  ao.before_data();
}

// After a fused check's ExchangeBounded: recv[j] starts with rank j's record (ours included).
// Returns if every record equals ours; otherwise every rank holds the same records and is here
// too, so every rank runs the diagnosis, whose collectives then match, and throws.
void CompareRecords(const AlgorithmOptions& ao, std::span<const std::span<uint8_t>> recv) {
  bool agree = true;
  for (const auto& r : recv) {
    agree = agree && std::equal(ao.check_record.begin(), ao.check_record.end(), r.begin());
  }
  if (agree) return;
  if (ao.diagnose) ao.diagnose();
  GEOFP8_FAIL("exchange: the ranks' fingerprint records differ (step ", ao.step, ")");
}

// The fused check of a run that moves no pipelined data (the fp32/bf16/native baselines, or no
// layers): a round of its own, still through ExchangeBounded, as a peer that runs two_phase or
// allgather here (a diverged policy) sends its first data round. Each receive is sized to take
// that: the record, MaxEncodedBytes of every layer of the run and the flags. `staging` is scratch.
void CheckRecordsOnly(Communicator& comm, const AlgorithmOptions& ao,
                      std::span<const BucketLayer> layers, UninitializedVector<uint8_t>& staging) {
  TraceScope span(ao.trace, "fingerprints", ExchangeTrace::kMainLane, ao.step);
  const int n = comm.size(), r = comm.rank();
  size_t cap = ao.check_record.size() + sizeof(uint64_t);
  for (const auto& l : layers) cap += MaxEncodedBytes(l.in.size());
  staging.resize(cap * n);
  std::vector<std::span<const uint8_t>> send(n, std::span<const uint8_t>(ao.check_record));
  std::vector<std::span<uint8_t>> recv(n);
  for (int j = 0; j < n; ++j) recv[j] = std::span(staging).subspan(j * cap, cap);
  comm.ExchangeBounded(send, recv);
  std::copy(ao.check_record.begin(), ao.check_record.end(), recv[r].begin());
  CompareRecords(ao, recv);
}

// Runs the run's check when no pipeline carries it: fused (a round of its own through
// ExchangeBounded) where the caller asked for it and the backend can, else before_data.
void CheckBeforeData(Communicator& comm, const AlgorithmOptions& ao,
                     std::span<const BucketLayer> layers, ExchangeWorkspace& ws) {
  if (!FusedCheck(comm, ao)) {
    RunBeforeData(ao);
    return;
  }
  // Group 0's send buffer: the baselines and an empty run use no pipeline buffers.
  if (ws.bytes.empty()) ws.bytes.resize(1);
  CheckRecordsOnly(comm, ao, layers, ws.bytes[0]);
}

// The OR over ranks of every rank's flags: one all-gather of 8 bytes (the baselines; two_phase and
// allgather carry the flags in their last data collective instead).
uint64_t AgreeFlags(Communicator& comm, uint64_t mine) {
  const int n = comm.size();
  std::vector<uint64_t> all(n, 0);
  comm.AllGatherV({reinterpret_cast<const uint8_t*>(&mine), 8},
                  {reinterpret_cast<uint8_t*>(all.data()), all.size() * 8},
                  std::vector<size_t>(n, 8));
  uint64_t any = 0;
  for (uint64_t f : all) any |= f;
  return any;
}

// The baselines reduce the whole bucket as one flat host buffer, as DDP does, dividing as they
// copy. Returns the flag bits of layers whose input holds a NaN or inf.
uint64_t Flatten(DataPlane& plane, std::span<const BucketLayer> layers, float divisor,
                 UninitializedVector<float>& flat) {
  size_t total = 0;
  for (const auto& l : layers) total += l.in.size();
  flat.resize(total);
  size_t off = 0;
  for (const auto& l : layers) {
    // Transformed layers were divided (and transformed) in place already.
    plane.ReadDivided(Transformed(l) ? GradSpan(TransformSpan(l)) : l.in,
                      Transformed(l) ? 1.f : divisor, l.flag_bit,
                      std::span(flat).subspan(off, l.in.size()));
    off += l.in.size();
  }
  return plane.TakeFlags();
}

void Unflatten(DataPlane& plane, std::span<const float> flat, std::span<const BucketLayer> layers) {
  size_t off = 0;
  for (const auto& l : layers) {
    plane.Write(flat.subspan(off, l.out.size()), l.out);
    off += l.out.size();
  }
}

uint64_t RunFp32(Communicator& comm, DataPlane& plane, std::span<const BucketLayer> layers,
                 float divisor, ExchangeWorkspace& ws) {
  const uint64_t bad = Flatten(plane, layers, divisor, ws.flat);
  comm.AllReduceSum(ws.flat);
  Unflatten(plane, ws.flat, layers);
  return bad;
}

// x summed over ranks with bf16 on the wire: each value rounded to bf16 (nearest even), summed
// as AllReduceSumBf16 sums, and read back into x; `bits` is the wire's scratch.
template <typename Bits>
void AllReduceSumAsBf16(Communicator& comm, std::span<float> x, Bits& bits) {
  bits.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) bits[i] = FloatToBf16(x[i]);
  comm.AllReduceSumBf16(std::span<uint16_t>(bits.data(), x.size()));
  for (size_t i = 0; i < x.size(); ++i) x[i] = Bf16ToFloat(bits[i]);
}

uint64_t RunBf16(Communicator& comm, DataPlane& plane, std::span<const BucketLayer> layers,
                 float divisor, ExchangeWorkspace& ws) {
  size_t total = 0;
  for (const auto& l : layers) total += l.in.size();
  auto& flat = ws.flat_bf16;
  flat.resize(total);
  uint64_t bad = 0;
  bool lowp = false;  // some layer is bf16 or fp16: read and written through the plane
  for (const auto& l : layers) lowp = lowp || !l.in.fp32() || !l.out.fp32();
  if (!plane.host_memory() || lowp) {
    // Device memory: the divided floats through a host copy, then the same conversions.
    bad = Flatten(plane, layers, divisor, ws.flat);
    AllReduceSumAsBf16(comm, ws.flat, flat);
    Unflatten(plane, ws.flat, layers);
    return bad;
  }
  size_t off = 0;
  for (const auto& l : layers) {
    const float d = Transformed(l) ? 1.f : divisor;  // transformed layers were divided in place
    uint32_t layer_bad = 0;
    for (float v : l.in.f32()) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      layer_bad |= (bits & 0x7f800000u) == 0x7f800000u;
      flat[off++] = FloatToBf16(v / d);
    }
    if (layer_bad) bad |= FlagBit(l);
  }
  comm.AllReduceSumBf16(flat);
  off = 0;
  for (const auto& l : layers) {
    for (float& v : l.out.f32()) v = Bf16ToFloat(flat[off++]);
  }
  return bad;
}

// Flattens the bucket, hands it to the backend's FP8 all-reduce, copies back.
uint64_t RunNative(Communicator& comm, DataPlane& plane, std::span<const BucketLayer> layers,
                   float divisor, ExchangeWorkspace& ws) {
  if (!comm.HasNativeFp8()) comm.AllReduceSumNativeFp8({});  // throws the backend's message
  const uint64_t bad = Flatten(plane, layers, divisor, ws.flat);
  comm.AllReduceSumNativeFp8(ws.flat);
  Unflatten(plane, ws.flat, layers);
  return bad;
}

// ---- two_phase and allgather, pipelined over groups of layers ----

// The wire layout of one group of layers. two_phase: within the group's all-to-all block for
// destination j, layers follow each other in bucket order, and the all-gather block of rank j has
// the same layout. allgather: rank j's all-gather block holds its whole encoded layers in order.
struct Group {
  size_t first = 0, last = 0;       // layers [first, last)
  std::vector<size_t> counts;       // bytes of chunk j of all the group's layers
  std::vector<size_t> dest_offset;  // offset of destination j's block in the send buffer
  size_t total = 0;                 // sum of counts
  // The flags ride in the last group's first collective (two_phase's all-to-all, allgather's
  // all-gather): `tail` (8) bytes after each block on the wire, 0 for the other groups.
  size_t tail = 0;
  size_t WireCount(int j) const { return counts[j] + tail; }
  size_t WireOffset(int j) const { return dest_offset[j] + j * tail; }  // block j, tails included
  // Group 0 of a fused run (AlgorithmOptions::check_record): every message of its first
  // collective starts with `prefix` bytes of record, and the receives land in staging slots of
  // `slot` bytes each, rank j's message at j * slot. 0 for the other groups and runs.
  size_t prefix = 0, slot = 0;
  // two_phase: where destination j's block starts in the send buffer (after its record).
  size_t SendOffset(int j) const { return WireOffset(j) + (j + 1) * prefix; }
  // The wire (ExchangeWorkspace's buffers, or a device wire's), sized when the pipeline is built
  // and each fully written before it is read: send and recv, two_phase's all-to-all; mine and
  // all, the all-gather (allgather's first collective).
  std::span<uint8_t> send, recv, mine, all;
};

class Pipeline {
 public:
  Pipeline(Communicator& comm, const AlgorithmOptions& ao, std::span<const BucketLayer> layers,
           bool two_phase, ExchangeWorkspace& ws)
      : comm_(comm),
        ao_(ao),
        layers_(layers),
        two_phase_(two_phase || ao.reduce_scatter),
        rs_(ao.reduce_scatter),
        n_(comm.size()),
        r_(comm.rank()),
        fused_(FusedCheck(comm, ao)),
        plane_(ao.plane ? *ao.plane : ws.host),
        device_wire_(plane_.device_wire()) {
    const size_t L = layers.size();
    chunk_.assign(L, std::vector<ChunkRange>(n_));
    bytes_.assign(L, std::vector<size_t>(n_));
    for (size_t i = 0; i < L; ++i) {
      const CodecOptions o = Options(i, r_, 1, 0);
      for (int j = 0; j < n_; ++j) {
        // allgather: every rank's "chunk" is its whole layer.
        // reduce-scatter: FSDP's dim-0 chunks.
        chunk_[i][j] = rs_         ? RowChunkOf(layers[i].in.size(), layers[i].cols, n_, j)
                       : two_phase ? ChunkOf(layers[i].in.size(), ChunkAlignment(o), n_, j)
                                   : ChunkRange{0, layers[i].in.size()};
        // Encoded sizes depend only on the policy and chunk length: every rank knows them all.
        bytes_[i][j] = EncodedBytes(o, chunk_[i][j].size());
      }
    }
    const size_t cap = std::max<size_t>(ao.segment_bytes, 1);
    for (size_t i = 0; i < L;) {
      Group g;
      g.first = i;
      size_t fp32 = 0;
      do {
        fp32 += layers[i].in.size() * sizeof(float);
        ++i;
      } while (i < L && fp32 + layers[i].in.size() * sizeof(float) <= cap);
      g.last = i;
      g.counts.assign(n_, 0);
      g.dest_offset.assign(n_, 0);
      for (int j = 0; j < n_; ++j) {
        g.dest_offset[j] = g.total;
        for (size_t k = g.first; k < g.last; ++k) g.counts[j] += bytes_[k][j];
        g.total += g.counts[j];
      }
      groups_.push_back(std::move(g));
    }
    groups_.back().tail = sizeof(uint64_t);
    if (fused_) {
      // No layout of group 0's layers can encode more than MaxEncodedBytes of each (a two_phase
      // chunk is at most the whole layer), whatever format, scaling or block a rank uses.
      Group& g = groups_[0];
      g.prefix = ao.check_record.size();
      g.slot = g.prefix + g.tail;
      for (size_t k = g.first; k < g.last; ++k) g.slot += MaxEncodedBytes(layers[k].in.size());
    }
    // Every size follows from the layers' shapes and formats, so the whole wire is laid out now.
    // Group s always uses the same buffers, so sizes repeat from step to step.
    if (!device_wire_ && ws.bytes.size() < 4 * groups_.size()) ws.bytes.resize(4 * groups_.size());
    auto wire = [&](size_t slot, size_t bytes) -> std::span<uint8_t> {
      if (device_wire_) return plane_.WireBuffer(slot, bytes);
      ws.bytes[slot].resize(bytes);
      return ws.bytes[slot];
    };
    for (size_t s = 0; s < groups_.size(); ++s) {
      Group& g = groups_[s];
      if (two_phase_) {
        g.send = wire(4 * s, g.total + n_ * (g.tail + g.prefix));
        g.recv = wire(4 * s + 1, g.slot ? g.slot * n_ : g.WireCount(r_) * n_);
        if (!rs_) {
          g.mine = wire(4 * s + 2, g.counts[r_]);
          g.all = wire(4 * s + 3, g.total);  // its flags went with the all-to-all
        }
      } else {
        g.mine = wire(4 * s + 2, g.prefix + g.WireCount(r_));
        g.all = wire(4 * s + 3, g.slot ? g.slot * n_ : g.total + n_ * g.tail);
      }
    }
    state_.assign(groups_.size(), 0);
  }

  // Every stage on the calling thread (AlgorithmOptions::inline_bytes): the fingerprints, every
  // group's encode (so the flags are complete for the last group's first collective), then per
  // group its collectives, sum and decode. The same wire layout and bytes as Run().
  uint64_t RunInline() {
    if (!fused_) RunBeforeData(ao_);
    const size_t G = groups_.size();
    for (size_t s = 0; s < G; ++s) {
      TraceScope span(ao_.trace, "encode", ExchangeTrace::kCodecLane, ao_.step,
                      static_cast<int>(s));
      Encode1(groups_[s]);
    }
    for (size_t s = 0; s < G; ++s) {
      Group& g = groups_[s];
      if (two_phase_) {
        {
          TraceScope span(ao_.trace, "all_to_all", ExchangeTrace::kMainLane, ao_.step,
                          static_cast<int>(s));
          First(comm_, s);
        }
        if (s + 1 == G) ReadFlags(g.recv, g);
        if (rs_) {
          TraceScope span(ao_.trace, "sum", ExchangeTrace::kCodecLane, ao_.step,
                          static_cast<int>(s));
          SumOwn(g);
          continue;
        }
        {
          TraceScope span(ao_.trace, "sum_requantize", ExchangeTrace::kCodecLane, ao_.step,
                          static_cast<int>(s));
          SumRequantize(g);
        }
      }
      {
        TraceScope span(ao_.trace, "all_gather", ExchangeTrace::kMainLane, ao_.step,
                        static_cast<int>(s));
        if (two_phase_) {
          AllGather(comm_, s);
        } else {
          First(comm_, s);
        }
      }
      if (!two_phase_ && s + 1 == G) ReadFlags(g.all, g);
      TraceScope span(ao_.trace, "decode", ExchangeTrace::kCodecLane, ao_.step,
                      static_cast<int>(s));
      DecodeAll(g);
    }
    return Agreed();
  }

  // Returns the OR over ranks of the flag bits (BucketLayer::flag_bit) of layers whose input held
  // a NaN or inf: the same answer on every rank. On a device wire, reading them is the run's one
  // wait for the device, once everything is issued.
  uint64_t Run() {
    // reduce-scatter: one collective per group, nothing for a second lane.
    Communicator* side = rs_ ? nullptr : comm_.side_channel();
    const int lanes = side ? 2 : 1;
    std::thread helper([this] {
      LowerThreadPriority(ao_.helper_nice);
      HelperLoop();
    });
    std::thread lane;
    if (side) {
      lane = std::thread([this, side] {
        try {
          RunLane(*side, 1, 2);
        } catch (...) {
          lane_error_ = std::current_exception();
          Abort();
        }
      });
    }
    try {
      // The caller's check (fingerprints) runs while the helper encodes the first groups; no
      // lane moves data before it has passed. Fused, lane 0's first collective is the check.
      if (!fused_) {
        RunBeforeData(ao_);
        MarkChecked();
      }
      RunLane(comm_, 0, lanes);
      WaitAllDecoded();
    } catch (...) {
      const std::exception_ptr mine = std::current_exception();
      Abort();
      helper.join();
      if (lane.joinable()) lane.join();
      std::rethrow_exception(Cause(mine));
    }
    helper.join();
    if (lane.joinable()) lane.join();
    if (helper_error_) std::rethrow_exception(helper_error_);
    if (lane_error_) std::rethrow_exception(lane_error_);
    return Agreed();
  }

 private:
  // One lane's collectives, in the same order on every rank. One lane (no side channel):
  //   two_phase A(0), A(1), G(0), A(2), G(1), ..., G(last): group s's all-to-all goes out while
  //   the helper still sums group s-1, whose all-gather follows;
  //   allgather G(0), G(1), ...
  // Two lanes, lane 1 on the side channel's own connections, so one phase's transfers fill the
  // other's synchronisation gaps:
  //   two_phase: lane 0 A(0), A(1), ...; lane 1 G(0), G(1), ...
  //   allgather: lane 0 the even groups' G, lane 1 the odd ones'.
  // The last group's first collective carries every rank's non-finite flags (agreed_).
  void RunLane(Communicator& comm, int lane, int lanes) {
    const size_t G = groups_.size();
    const auto trace_lane = lane == 0 ? ExchangeTrace::kMainLane : ExchangeTrace::kSideLane;
    if (lane > 0) WaitChecked();
    if (!two_phase_) {
      for (size_t s = lane; s < G; s += lanes) {
        WaitFor(s, kEncoded);
        {
          TraceScope span(ao_.trace, "all_gather", trace_lane, ao_.step, static_cast<int>(s));
          First(comm, s);
        }
        if (s + 1 == G) ReadFlags(groups_[s].all, groups_[s]);
        Mark(s, kGathered);
      }
      return;
    }
    const bool exchanges = lane == 0, gathers = !rs_ && (lanes == 1 || lane == 1);
    for (size_t s = 0; s <= G; ++s) {
      if (s < G && exchanges) {
        WaitFor(s, kEncoded);
        {
          TraceScope span(ao_.trace, "all_to_all", trace_lane, ao_.step, static_cast<int>(s));
          First(comm, s);
        }
        if (s + 1 == G) ReadFlags(groups_[s].recv, groups_[s]);
        Mark(s, kExchanged);
      }
      if (s >= 1 && gathers) {
        WaitFor(s - 1, kRequantized);
        {
          TraceScope span(ao_.trace, "all_gather", trace_lane, ao_.step, static_cast<int>(s - 1));
          AllGather(comm, s - 1);
        }
        Mark(s - 1, kGathered);
      }
    }
  }

  // Group s's first collective (two_phase's all-to-all, allgather's all-gather). In a fused run,
  // group 0's goes through ExchangeBounded with every rank's record in front, and returns only
  // once every record equals ours; the other lane may then move data.
  void First(Communicator& comm, size_t s) {
    if (!fused_ || s != 0) {
      if (two_phase_) {
        AllToAll(comm, s);
      } else {
        AllGather(comm, s);
      }
      return;
    }
    Group& g = groups_[s];
    const std::span<uint8_t> staging = two_phase_ ? g.recv : g.all;
    std::vector<std::span<const uint8_t>> send(n_);
    std::vector<std::span<uint8_t>> recv(n_);
    for (int j = 0; j < n_; ++j) {
      // two_phase: record and block j; allgather: record and this rank's block, to everyone.
      send[j] = two_phase_ ? std::span<const uint8_t>(g.send).subspan(g.SendOffset(j) - g.prefix,
                                                                      g.prefix + g.WireCount(j))
                           : std::span<const uint8_t>(g.mine);
      recv[j] = staging.subspan(j * g.slot, g.slot);
    }
    comm.ExchangeBounded(send, recv);
    std::copy(send[r_].begin(), send[r_].end(), recv[r_].begin());  // our own block
    CompareRecords(ao_, recv);
    MarkChecked();
  }

  // Where rank j's block of group g starts in the first collective's receive buffer: two_phase's
  // all-to-all (j's chunks for this rank) or allgather's all-gather (j's layers).
  size_t RecvAt(const Group& g, int j) const {
    if (g.slot) return j * g.slot + g.prefix;
    return two_phase_ ? j * g.WireCount(r_) : g.WireOffset(j);
  }

  // two_phase's first phase for group s: chunk j of every layer to rank j.
  void AllToAll(Communicator& comm, size_t s) {
    auto& g = groups_[s];
    std::vector<size_t> send_counts(n_);
    for (int j = 0; j < n_; ++j) send_counts[j] = g.WireCount(j);
    comm.AllToAllV(g.send, send_counts, g.recv, std::vector<size_t>(n_, g.WireCount(r_)));
  }

  // Group s's block of this rank to every rank: the requantized chunks (two_phase's second
  // phase) or the whole encoded layers (allgather).
  void AllGather(Communicator& comm, size_t s) {
    auto& g = groups_[s];
    const size_t tail = two_phase_ ? 0 : g.tail;  // two_phase's flags went with its all-to-all
    std::vector<size_t> counts(n_);
    for (int j = 0; j < n_; ++j) counts[j] = g.counts[j] + tail;
    comm.AllGatherV(g.mine, g.all, counts);
  }

  uint64_t Agreed() { return device_wire_ ? plane_.AgreedFlags() : agreed_; }

  // The 8 bytes of rank j's flags in the last group's first collective: block j of `wire` came
  // from rank j (the all-to-all's receive buffer, or the all-gather's).
  std::vector<std::span<const uint8_t>> FlagTails(std::span<const uint8_t> wire,
                                                  const Group& g) const {
    std::vector<std::span<const uint8_t>> tails(n_);
    for (int j = 0; j < n_; ++j) {
      const size_t end = RecvAt(g, j) + (two_phase_ ? g.WireCount(r_) : g.WireCount(j));
      tails[j] = wire.subspan(end - sizeof(uint64_t), sizeof(uint64_t));
    }
    return tails;
  }

  // The OR of every rank's flags, into agreed_ as soon as the collective that carries them is
  // done. A device wire's are not read here: the codec thread keeps them on the device (KeepFlags)
  // for the plane's AgreedFlags at the run's end.
  void ReadFlags(std::span<const uint8_t> wire, const Group& g) {
    if (device_wire_) return;
    uint64_t any = 0;
    for (const auto& tail : FlagTails(wire, g)) {
      uint64_t flags;
      std::memcpy(&flags, tail.data(), sizeof flags);
      any |= flags;
    }
    agreed_ = any;
  }
  void KeepFlags(std::span<const uint8_t> wire, const Group& g) {
    if (device_wire_ && g.tail) plane_.KeepFlags(FlagTails(wire, g));
  }

  // Appends this rank's flags after each block of the last group's first collective: every
  // group is encoded by now (the helper encodes in order), so the flags are complete. A device
  // wire's are copied there on the device, unread.
  void WriteFlags(Group& g, std::span<uint8_t> wire, int blocks) {
    if (!device_wire_) nonfinite_ |= plane_.TakeFlags();
    for (int j = 0; j < blocks; ++j) {
      const size_t end = blocks == 1 ? wire.size() : g.SendOffset(j) + g.WireCount(j);
      const std::span<uint8_t> tail = wire.subspan(end - sizeof nonfinite_, sizeof nonfinite_);
      if (device_wire_) {
        plane_.WriteFlags(tail);
      } else {
        std::memcpy(tail.data(), &nonfinite_, sizeof nonfinite_);
      }
    }
  }

  enum Stage : int { kEncoded = 1, kExchanged = 2, kRequantized = 3, kGathered = 4, kDecoded = 5 };

  CodecOptions Options(size_t i, int rank, uint32_t phase, int chunk) const {
    return LayerCodecOptions(layers_[i].policy, ao_.seed, ao_.step, layers_[i].layer,
                             static_cast<uint32_t>(rank), phase, static_cast<uint32_t>(chunk));
  }

  // Encodes elements c of layer i's input, divided by N, into `out` (data_plane.h).
  void EncodeChunk(size_t i, ChunkRange c, const CodecOptions& o, std::span<uint8_t> out) {
    plane_.EncodeChunk(layers_[i], c, ao_.divisor, o, out);
  }

  void Encode1(Group& g) {
    for (size_t i = g.first; i < g.last; ++i) {
      if (Transformed(layers_[i])) plane_.DivideTransform(layers_[i], ao_.divisor);
    }
    if (!two_phase_) {  // allgather: this rank's whole layers, once
      std::copy_n(ao_.check_record.begin(), g.prefix, g.mine.begin());
      size_t off = g.prefix;
      for (size_t i = g.first; i < g.last; ++i) {
        EncodeChunk(i, {0, layers_[i].in.size()}, Options(i, r_, 1, 0),
                    g.mine.subspan(off, bytes_[i][r_]));
        off += bytes_[i][r_];
      }
      if (g.tail) WriteFlags(g, g.mine, 1);
      return;
    }
    for (int j = 0; j < n_; ++j) {
      std::copy_n(ao_.check_record.begin(), g.prefix, g.send.begin() + g.SendOffset(j) - g.prefix);
      size_t off = g.SendOffset(j);
      for (size_t i = g.first; i < g.last; ++i) {
        const ChunkRange c = chunk_[i][j];
        EncodeChunk(i, c, Options(i, r_, 1, j), g.send.subspan(off, bytes_[i][j]));
        off += bytes_[i][j];
      }
    }
    if (g.tail) WriteFlags(g, g.send, n_);
  }

  // Sum this rank's chunk of each layer over sources in rank order, then requantize.
  void SumRequantize(Group& g) {
    KeepFlags(g.recv, g);
    size_t off = 0;
    std::vector<std::span<const uint8_t>> parts(n_);
    for (size_t i = g.first; i < g.last; ++i) {
      for (int src = 0; src < n_; ++src) {
        parts[src] = std::span<const uint8_t>(g.recv).subspan(RecvAt(g, src) + off, bytes_[i][r_]);
      }
      plane_.SumRequantize(layers_[i], chunk_[i][r_], parts, Options(i, r_, 2, r_),
                           g.mine.subspan(off, bytes_[i][r_]));
      off += bytes_[i][r_];
    }
  }

  // Reduce-scatter: this rank's rows of each layer, the sum over sources in rank order, with the
  // geometry's inverse where it is row-local (a lowrank one's waits for FinishRows).
  void SumOwn(Group& g) {
    KeepFlags(g.recv, g);
    size_t off = 0;
    std::vector<std::span<const uint8_t>> parts(n_);
    for (size_t i = g.first; i < g.last; ++i) {
      const BucketLayer& l = layers_[i];
      for (int src = 0; src < n_; ++src) {
        parts[src] = std::span<const uint8_t>(g.recv).subspan(RecvAt(g, src) + off, bytes_[i][r_]);
      }
      plane_.DecodeSum(l, {0, chunk_[i][r_].size()}, parts);
      off += bytes_[i][r_];
      if (l.geometry && ShardProductRows(*l.geometry) == 0) {
        plane_.InvertRows(l, FirstRow(i), {});
      }
    }
  }

 public:
  // This rank's first row of layer i (reduce-scatter).
  int64_t FirstRow(size_t i) const {
    return static_cast<int64_t>(chunk_[i][r_].begin) / std::max<int64_t>(layers_[i].cols, 1);
  }

 private:
  void DecodeAll(Group& g) {
    if (!two_phase_) {
      KeepFlags(g.all, g);
      // allgather: every rank sums the same bytes in the same (rank) order.
      size_t layer_off = 0;
      std::vector<std::span<const uint8_t>> parts(n_);
      for (size_t i = g.first; i < g.last; ++i) {
        for (int src = 0; src < n_; ++src) {
          parts[src] =
              std::span<const uint8_t>(g.all).subspan(RecvAt(g, src) + layer_off, bytes_[i][src]);
        }
        plane_.DecodeSum(layers_[i], {0, layers_[i].out.size()}, parts);
        layer_off += bytes_[i][r_];
        plane_.InvertTransform(layers_[i]);
      }
      return;
    }
    for (int j = 0; j < n_; ++j) {
      size_t off = g.dest_offset[j];
      for (size_t i = g.first; i < g.last; ++i) {
        plane_.Decode(layers_[i], chunk_[i][j],
                      std::span<const uint8_t>(g.all).subspan(off, bytes_[i][j]));
        off += bytes_[i][j];
      }
    }
    for (size_t i = g.first; i < g.last; ++i) plane_.InvertTransform(layers_[i]);
  }

  // Codec work, most advanced stage first so the wire never waits on a backlog of encodes.
  void HelperLoop() {
    try {
      const size_t G = groups_.size();
      size_t next_encode = 0;
      for (;;) {
        size_t pick = G;
        int stage = 0;
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] {
            if (abort_) return true;
            for (size_t s = 0; s < G; ++s) {
              if (state_[s] == kGathered || state_[s] == kExchanged) {
                pick = s;
                stage = state_[s];
                return true;
              }
            }
            if (next_encode < G) {
              pick = next_encode;
              stage = 0;
              return true;
            }
            return std::all_of(state_.begin(), state_.end(), [](int v) { return v == kDecoded; });
          });
          if (abort_ || pick == G) return;
        }
        Group& g = groups_[pick];
        const int done = stage == 0            ? kEncoded
                         : stage == kExchanged ? (rs_ ? kDecoded : kRequantized)
                                               : kDecoded;
        {
          const char* what = stage == 0            ? "encode"
                             : stage == kExchanged ? (rs_ ? "sum" : "sum_requantize")
                                                   : "decode";
          TraceScope span(ao_.trace, what, ExchangeTrace::kCodecLane, ao_.step,
                          static_cast<int>(pick));
          if (stage == 0) {
            Encode1(g);
          } else if (stage == kExchanged && rs_) {
            SumOwn(g);
          } else if (stage == kExchanged) {
            SumRequantize(g);
          } else {
            DecodeAll(g);
          }
        }
        if (stage == 0) ++next_encode;
        Mark(pick, done);
      }
    } catch (...) {
      helper_error_ = std::current_exception();
      Abort();
    }
  }

  void Mark(size_t s, int stage) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      state_[s] = stage;
    }
    cv_.notify_all();
  }

  void MarkChecked() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      checked_ = true;
    }
    cv_.notify_all();
  }

  void WaitChecked() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return abort_ || checked_; });
    if (abort_) throw Aborted();
  }

  // What to report when `mine` ended the run: the helper's or the other lane's error rather
  // than the Aborted it caused here.
  std::exception_ptr Cause(std::exception_ptr mine) const {
    if (helper_error_) return helper_error_;
    try {
      std::rethrow_exception(mine);
    } catch (const Aborted&) {
      if (lane_error_) return lane_error_;
    } catch (...) {
    }
    return mine;
  }

  void Abort() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      abort_ = true;
    }
    cv_.notify_all();
  }

  // Throws if the helper failed (its error is rethrown by Run).
  void WaitFor(size_t s, int stage) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return abort_ || state_[s] >= stage; });
    if (abort_) throw Aborted();
  }

  void WaitAllDecoded() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      return abort_ ||
             std::all_of(state_.begin(), state_.end(), [](int v) { return v == kDecoded; });
    });
    if (abort_) throw Aborted();
  }

  struct Aborted : std::exception {
    const char* what() const noexcept override { return "exchange pipeline: helper thread failed"; }
  };

  Communicator& comm_;
  const AlgorithmOptions& ao_;
  std::span<const BucketLayer> layers_;
  const bool two_phase_;
  const bool rs_;  // reduce-scatter: two_phase's first half over row chunks
  const int n_, r_;
  const bool fused_;  // group 0's first collective carries the records (check_record)
  std::vector<std::vector<ChunkRange>> chunk_;  // [layer][rank]
  std::vector<std::vector<size_t>> bytes_;      // [layer][rank] encoded bytes of that chunk
  std::vector<Group> groups_;
  DataPlane& plane_;        // helper thread only (the calling thread when inline)
  const bool device_wire_;  // the wire is in plane_'s device memory (DataPlane::device_wire)
  // Flag bits of layers whose input held a NaN or inf: written by the helper while encoding, read
  // once every group is encoded.
  uint64_t nonfinite_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> state_;  // per group: last completed Stage
  bool abort_ = false;
  bool checked_ = false;  // before_data passed: data may move
  std::exception_ptr helper_error_;
  std::exception_ptr lane_error_;  // lane 1's failure (Aborted when another thread failed first)
  uint64_t agreed_ = 0;            // the OR of every rank's flags; read after the lanes finish
};

}  // namespace

namespace {

// Reduce-scatter's lowrank layers after the pipeline: each owner's share of U^T D, one
// all-reduce of them all (in layer order, the same on every rank), then each owner's rows.
// An 8- or 4-bit layer's share travels as bf16: its rounding (2^-9 of W) is far below the codec's
// own error (2^-4 and up per element), and it halves the bytes the sharded inverse adds (k/m of
// the layer in fp32: 8k/m of an fp8 layer's wire, 4k/m in bf16). An fp32 or bf16 layer's stays
// fp32, so the baselines keep their precision. The shares are host memory on every plane (a device
// plane computes them on the device and reads them back, k x n floats a layer). Returns whether
// there were any.
bool FinishLowRankRows(Communicator& comm, const AlgorithmOptions& ao,
                       std::span<const BucketLayer> layers, DataPlane& plane) {
  const int n = comm.size(), r = comm.rank();
  auto rows_of = [](const BucketLayer& l) {
    return l.geometry ? static_cast<size_t>(ShardProductRows(*l.geometry)) : size_t{0};
  };
  auto in_bf16 = [](const BucketLayer& l) { return FormatBits(l.policy.format) <= 8; };
  // Each layer's share at[i] within its wire's buffer: w32 (fp32) or w16 (bf16 on the wire).
  std::vector<size_t> at(layers.size(), 0);
  size_t total32 = 0, total16 = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    size_t& total = in_bf16(layers[i]) ? total16 : total32;
    at[i] = total;
    total += rows_of(layers[i]) * static_cast<size_t>(layers[i].cols);
  }
  if (total32 + total16 == 0) return false;
  TraceScope span(ao.trace, "shard_products", ExchangeTrace::kMainLane, ao.step);
  std::vector<float> w32(total32, 0.f), w16(total16, 0.f);
  auto first_row = [&](const BucketLayer& l) {
    return static_cast<int64_t>(RowChunkOf(l.in.size(), l.cols, n, r).begin) / l.cols;
  };
  auto share = [&](size_t i) {
    const BucketLayer& l = layers[i];
    return std::span(in_bf16(l) ? w16 : w32)
        .subspan(at[i], rows_of(l) * static_cast<size_t>(l.cols));
  };
  for (size_t i = 0; i < layers.size(); ++i) {
    if (rows_of(layers[i]) > 0) plane.ShardProducts(layers[i], first_row(layers[i]), share(i));
  }
  if (total32) comm.AllReduceSum(w32);
  if (total16) {
    std::vector<uint16_t> bits;
    AllReduceSumAsBf16(comm, w16, bits);
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    if (rows_of(layers[i]) > 0) plane.InvertRows(layers[i], first_row(layers[i]), share(i));
  }
  return true;
}

uint64_t RunReduceScatter(Communicator& comm, Algorithm algorithm, const AlgorithmOptions& options,
                          std::span<const BucketLayer> in_layers, ExchangeWorkspace& ws,
                          DataPlane& plane) {
  GEOFP8_CHECK(algorithm != Algorithm::kNative,
               "reduce-scatter: algorithm native is an all-reduce (accepted: two_phase, "
               "allgather, auto, fp32, bf16)");
  std::vector<BucketLayer> layers(in_layers.begin(), in_layers.end());
  const bool baseline = algorithm == Algorithm::kFp32 || algorithm == Algorithm::kBf16;
  for (BucketLayer& l : layers) {
    if (!baseline) continue;
    // The baselines: every chunk in that format, summed in rank order (fp32: exactly).
    l.policy.format = algorithm == Algorithm::kFp32 ? Format::kFp32 : Format::kBf16;
    l.policy.scaling = Scaling::kTensor;
    l.policy.rounding = Rounding::kNearest;
  }
  if (layers.empty()) {
    CheckBeforeData(comm, options, layers, ws);
    return 0;
  }
  size_t fp32 = 0;
  for (const auto& l : layers) fp32 += l.in.size() * sizeof(float);
  uint64_t flags = 0;
  if (fp32 > options.inline_bytes) {
    flags = Pipeline(comm, options, layers, true, ws).Run();
  } else {
    AlgorithmOptions one = options;
    one.segment_bytes = std::max(options.segment_bytes, fp32);
    flags = Pipeline(comm, one, layers, true, ws).RunInline();
  }
  // A device wire's run ended with its one wait (the agreed flags); the inverses issued after it
  // are waited for here.
  if (FinishLowRankRows(comm, options, layers, plane) && plane.device_wire()) plane.Flush();
  return flags;
}

uint64_t RunAlgorithm(Communicator& comm, Algorithm algorithm, const AlgorithmOptions& options,
                      std::span<const BucketLayer> layers, ExchangeWorkspace& ws,
                      DataPlane& plane) {
  if (options.reduce_scatter) return RunReduceScatter(comm, algorithm, options, layers, ws, plane);
  if (algorithm == Algorithm::kTwoPhase || algorithm == Algorithm::kAllGather) {
    // Geometry transforms run inside the pipeline, per group.
    if (layers.empty()) {  // every rank has the same (fingerprinted) layers: nothing to agree on
      CheckBeforeData(comm, options, layers, ws);
      return 0;
    }
    size_t fp32 = 0;
    for (const auto& l : layers) fp32 += l.in.size() * sizeof(float);
    if (fp32 > options.inline_bytes) {
      return Pipeline(comm, options, layers, algorithm == Algorithm::kTwoPhase, ws).Run();
    }
    // Inline, groups only add collective rounds: the whole run is one group.
    AlgorithmOptions one = options;
    one.segment_bytes = std::max(options.segment_bytes, fp32);
    return Pipeline(comm, one, layers, algorithm == Algorithm::kTwoPhase, ws).RunInline();
  }
  CheckBeforeData(comm, options, layers, ws);
  TraceScope span(options.trace, "all_reduce", ExchangeTrace::kMainLane, options.step);
  for (const auto& l : layers) {
    if (Transformed(l)) plane.DivideTransform(l, options.divisor);
  }
  uint64_t bad = plane.TakeFlags();
  switch (algorithm) {
    case Algorithm::kFp32:
      bad |= RunFp32(comm, plane, layers, options.divisor, ws);
      break;
    case Algorithm::kBf16:
      bad |= RunBf16(comm, plane, layers, options.divisor, ws);
      break;
    case Algorithm::kNative:
      bad |= RunNative(comm, plane, layers, options.divisor, ws);
      break;
    default:
      GEOFP8_FAIL("algorithm: unknown value ", static_cast<int>(algorithm),
                  " (accepted: ", AcceptedAlgorithms(), ")");
  }
  for (const auto& l : layers) plane.InvertTransform(l);
  return AgreeFlags(comm, bad);
}

}  // namespace

void CheckWire(const Communicator& comm, const DataPlane& plane) {
  GEOFP8_CHECK(!plane.device_wire() || comm.TakesDeviceSpans(), "plane ", plane.name(),
               ": its wire is device memory, but communicator ", comm.backend(),
               " takes host spans only (a device plane stages its wire through host memory for "
               "it: WireMemory::kHost)");
}

uint64_t ExchangeBucketData(Communicator& comm, Algorithm algorithm,
                            const AlgorithmOptions& options, std::span<const BucketLayer> layers) {
  algorithm = ResolveAlgorithm(algorithm, comm.size());
  for (const auto& l : layers) {
    if (options.reduce_scatter) {
      GEOFP8_CHECK(l.cols >= 1 && l.in.size() % static_cast<size_t>(l.cols) == 0, "layer ", l.layer,
                   ": ", l.in.size(), " elements are not rows of ", l.cols);
      const ChunkRange mine = RowChunkOf(l.in.size(), l.cols, comm.size(), comm.rank());
      GEOFP8_CHECK(l.out.size() == mine.size(), "layer ", l.layer, ": reduce-scatter output has ",
                   l.out.size(), " elements, this rank's rows ", mine.size());
      GEOFP8_CHECK(l.hadamard_block == 0, "layer ", l.layer,
                   ": the block Hadamard rotation mixes rows across the reduce-scatter's shards "
                   "(use geometry none, diag or lowrank without hadamard)");
      continue;
    }
    GEOFP8_CHECK(l.in.size() == l.out.size(), "layer ", l.layer, ": input has ", l.in.size(),
                 " elements, output ", l.out.size());
    GEOFP8_CHECK(l.flag_bit < 64, "layer ", l.layer, ": flag_bit must be < 64 (", l.flag_bit, ")");
  }
  ExchangeWorkspace local;
  ExchangeWorkspace& ws = options.workspace ? *options.workspace : local;
  DataPlane& plane = options.plane ? *options.plane : ws.host;
  CheckWire(comm, plane);
  if (!plane.host_memory()) {
    for (const auto& l : layers) {
      const std::string why = plane.Unsupported(l);
      GEOFP8_CHECK(why.empty(), "layer ", l.layer, ": ", why);
    }
  }
  plane.ClearFlags();  // nothing left over from a run that failed midway
  uint64_t flags = 0;
  try {
    flags = RunAlgorithm(comm, algorithm, options, layers, ws, plane);
  } catch (...) {
    // Device work in flight must not outlive the caller's buffers.
    try {
      plane.Flush();
    } catch (...) {
    }
    throw;
  }
  // A device wire's pipeline ended with its flags' read, which waited for everything (a
  // reduce-scatter's, whatever the algorithm, runs the pipeline; RunReduceScatter waits for what
  // it issues after).
  const bool pipelined = (algorithm == Algorithm::kTwoPhase || algorithm == Algorithm::kAllGather ||
                          options.reduce_scatter) &&
                         !layers.empty();
  if (!(plane.device_wire() && pipelined)) plane.Flush();
  return flags;
}

}  // namespace geofp8
