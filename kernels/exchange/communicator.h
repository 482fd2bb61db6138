// The collective operations the exchange algorithms need, behind one interface with a Gloo (CPU,
// TCP) and an NCCL (GPU) backend. Every call honours timeout(). Spans are host memory, except
// that a backend which TakesDeviceSpans() also moves the byte collectives' device memory where
// it lies: NCCL reads and writes a device plane's wire with no host copy; Gloo takes host memory
// only, and a device plane stages its wire through host memory for it (data_plane.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/common/check.h"

namespace geofp8 {

// Default collective timeout (DESIGN.md section 4: every collective has one).
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{300000};

// What this rank put on the wire, as the backend's algorithm sends it. Counted from two threads
// when a side channel is in use.
struct CommStats {
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> collectives{0};
};

// All spans are host memory, but see TakesDeviceSpans. Every rank must issue the same collectives
// in the same order. A failure or timeout throws geofp8::Error naming the operation; the
// communicator is then broken and every later call throws as well.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;  // "gloo", "nccl"

  // Rank r sends send[sum(send_counts[0..j)) ..+ send_counts[j]) to rank j and receives rank i's
  // part into recv at offset sum(recv_counts[0..i)). Counts are bytes; recv_counts[i] must equal
  // rank i's send_counts[r].
  virtual void AllToAllV(std::span<const uint8_t> send, std::span<const size_t> send_counts,
                         std::span<uint8_t> recv, std::span<const size_t> recv_counts) = 0;

  // recv is the concatenation of every rank's send, rank order; recv_counts[i] is rank i's size.
  virtual void AllGatherV(std::span<const uint8_t> send, std::span<uint8_t> recv,
                          std::span<const size_t> recv_counts) = 0;

  // In-place sums. The result is identical on every rank.
  virtual void AllReduceSum(std::span<float> data) = 0;
  // bf16 values as raw bits; each partial sum is rounded to bf16 (nearest even), as on the wire.
  virtual void AllReduceSumBf16(std::span<uint16_t> data) = 0;

  // root's data is copied into every rank's data (same size everywhere).
  virtual void Broadcast(std::span<uint8_t> data, int root) = 0;

  // Maximum of value over ranks (the non-finite flag: every rank makes the same skip decision).
  virtual uint32_t MaxReduce(uint32_t value) = 0;

  // Element-wise maximum over ranks of up to kMaxReduceWords words, in place, as one small
  // collective. The fingerprint check compares records with it where the backend has no bounded
  // receive (below): every rank holds the same x iff max(x) == ~max(~x). This default gathers every
  // rank's words; backends override it with their fastest small reduction.
  static constexpr size_t kMaxReduceWords = 16;
  virtual void MaxReduceWords(std::span<uint64_t> words);

  virtual void Barrier() = 0;

  // Whether ExchangeBounded is available. Where it is, the exchange sends its fingerprint record
  // in the first data round instead of a separate MaxReduceWords (algorithms.h,
  // AlgorithmOptions::check_record). Gloo: yes; NCCL: no.
  virtual bool SupportsBoundedReceive() const { return false; }
  // One round of point-to-point messages: this rank sends send_to[j] to every rank j != rank()
  // and receives rank j's message into the front of recv_from[j], whose size is a capacity: a
  // shorter message is accepted (its length is not reported, so messages must describe
  // themselves), a longer one is a failure. Entries for rank() are ignored. Every rank calls it
  // in the same position of its collective sequence. Counts one collective and the bytes sent.
  virtual void ExchangeBounded(std::span<const std::span<const uint8_t>> send_to,
                               std::span<const std::span<uint8_t>> recv_from);

  // The `native` algorithm: in-place sum of data over ranks through the backend's own FP8 E4M3
  // all-reduce (NCCL >= 2.24 on sm90+), one scale shared by all ranks. Backends without one
  // report false and throw.
  virtual bool HasNativeFp8() const { return false; }
  virtual void AllReduceSumNativeFp8(std::span<float> data);

  // A second communicator over the same ranks, with connections of its own, for collectives
  // issued from another thread while one is in flight here: two_phase runs its all-gathers on it,
  // overlapping the next all-to-alls, much as NCCL spreads work over channels. Its traffic counts
  // in this communicator's stats(), and set_timeout() applies to both. Each channel still needs
  // the same collectives in the same order on every rank. Null: the backend has none.
  virtual Communicator* side_channel() { return nullptr; }

  // Makes the collectives in flight on this communicator and its side channel, and every later
  // one, throw at once with an error that contains `reason`. It is how another thread gets a rank
  // out of a collective whose peer hangs (stopped, partitioned) without waiting out timeout(); the
  // peers see the connections close. The one member that may be called from any thread while a
  // collective runs. The communicator is broken afterwards. False: the backend cannot interrupt
  // a collective, which then ends at its timeout.
  virtual bool Abort(const std::string& reason) {
    (void)reason;
    return false;
  }

  // Whether AllToAllV and AllGatherV also take spans of device memory (a device plane's wire,
  // DataPlane::device_wire), read and written in place, ordered after the device work issued on
  // that memory before the call and before the work issued after it, with no host copy. Host
  // spans work as always: the backend tells them apart by address (send and recv must be of the
  // same kind). False (Gloo): host spans only; a device plane whose wire is in device memory is
  // refused with such a communicator before anything is read.
  virtual bool TakesDeviceSpans() const { return false; }

  void set_timeout(std::chrono::milliseconds timeout) {
    timeout_ = timeout;
    if (Communicator* side = side_channel()) side->set_timeout(timeout);
  }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const CommStats& stats() const { return *stats_; }
  void ResetStats() {
    stats_->bytes_sent = 0;
    stats_->collectives = 0;
  }

  // Layouts (Exchanger: a digest of a run's layer sizes and grouping options) with which every
  // rank of this communicator has passed a fingerprint check, so every rank is known to have the
  // same layer sizes for them: the exchange sizes the receives of its fused check from those
  // (AlgorithmOptions::check_record). Kept here, not per Exchanger, so that an Exchanger rebuilt
  // on some ranks only (geofp8.torch does on start_trace) makes the same choice as its peers.
  // Every rank passes the same checks, so every rank holds the same set. Thread-safe.
  bool IsAgreedLayout(uint64_t digest) const {
    std::lock_guard<std::mutex> lock(layouts_mu_);
    return agreed_layouts_.count(digest) != 0;
  }
  void AddAgreedLayout(uint64_t digest) {
    std::lock_guard<std::mutex> lock(layouts_mu_);
    agreed_layouts_.insert(digest);
  }

 protected:
  std::chrono::milliseconds timeout_ = kDefaultCollectiveTimeout;
  CommStats own_stats_;
  CommStats* stats_ = &own_stats_;  // a side channel counts into its parent's

 private:
  mutable std::mutex layouts_mu_;
  std::set<uint64_t> agreed_layouts_;  // under layouts_mu_
};

inline void Communicator::MaxReduceWords(std::span<uint64_t> words) {
  GEOFP8_CHECK(words.size() <= kMaxReduceWords, "max-reduce: ", words.size(), " words, at most ",
               kMaxReduceWords);
  const size_t n = static_cast<size_t>(size()), bytes = words.size_bytes();
  std::vector<uint64_t> all(words.size() * n);
  AllGatherV({reinterpret_cast<const uint8_t*>(words.data()), bytes},
             {reinterpret_cast<uint8_t*>(all.data()), bytes * n}, std::vector<size_t>(n, bytes));
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < words.size(); ++i)
      words[i] = std::max(words[i], all[r * words.size() + i]);
  }
}

inline void Communicator::ExchangeBounded(std::span<const std::span<const uint8_t>>,
                                          std::span<const std::span<uint8_t>>) {
  GEOFP8_FAIL("exchange-bounded: backend ", backend(), " has no bounded receive");
}

inline void Communicator::AllReduceSumNativeFp8(std::span<float>) {
  GEOFP8_FAIL(
      "algorithm: native needs a backend with FP8 all-reduce (NCCL >= 2.24 on sm90+); "
      "backend ",
      backend(), " has none");
}

}  // namespace geofp8
