// Gloo backend of the Communicator (see gloo_communicator.h). Gloo reports failures by throwing
// gloo::Exception or gloo::EnforceNotMet; every call here converts them to geofp8::Error.
#include "kernels/exchange/gloo_communicator.h"

#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/pair.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "kernels/common/check.h"
#include "kernels/exchange/bf16.h"
#include "kernels/exchange/priority.h"

namespace geofp8 {

// ---- GlooStoreAdapter ----

void GlooStoreAdapter::set(const std::string& key, const std::vector<char>& data) {
  store_.Set(key, std::vector<uint8_t>(data.begin(), data.end()));
}

std::vector<char> GlooStoreAdapter::get(const std::string& key) {
  const auto v = store_.Get(key, timeout_);
  return std::vector<char>(v.begin(), v.end());
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys) { store_.Wait(keys, timeout_); }

void GlooStoreAdapter::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  // gloo passes kNoTimeout (0) to mean "no limit"; we never wait forever, so use ours.
  store_.Wait(keys, timeout.count() > 0 ? timeout : timeout_);
}

namespace {

// ExchangeBounded's slots: a prefix none of gloo's collectives use (gloo/types.h: 0x01..0x08).
constexpr uint8_t kBoundedSlotPrefix = 0x47;

// Gloo wakes the operations waiting on a pair with an error only through
// tcp::Pair::signalExceptionExternal: its own collective timeout calls it on every pair of the
// context (tcp::Context::signalException) and the pair then closes. Both are protected in this
// gloo (0.0~git20220518). The using-declaration names the member publicly; the pointer is to the
// base's member, and no PairAbort object is ever made.
struct PairAbort : gloo::transport::tcp::Pair {
  using gloo::transport::tcp::Pair::signalExceptionExternal;
};

// Fails every operation pending on `context`'s pairs, and every later one, with `message`.
void SignalEveryPair(gloo::Context& context, const std::string& message) {
  constexpr auto signal = &PairAbort::signalExceptionExternal;
  for (int i = 0; i < context.size; ++i) {
    if (i == context.rank) continue;
    std::unique_ptr<gloo::transport::Pair>& pair = context.getPair(i);
    if (pair) (static_cast<gloo::transport::tcp::Pair*>(pair.get())->*signal)(message);
  }
}

// Runs one gloo call, converting whatever it throws (gloo's exceptions, the rendezvous store's
// errors) into a one-line geofp8::TransportError.
template <typename Fn>
void GlooCall(const char* op, int rank, bool* broken, Fn&& fn) {
  if (*broken) {
    GEOFP8_FAIL_TRANSPORT("gloo ", op, " on rank ", rank,
                          ": communicator is broken by an earlier failure");
  }
  try {
    fn();
  } catch (const geofp8::TransportError&) {
    *broken = true;
    throw;
  } catch (const gloo::Exception& e) {
    *broken = true;
    GEOFP8_FAIL_TRANSPORT("gloo ", op, " failed on rank ", rank, ": ", e.what());
  } catch (const gloo::EnforceNotMet& e) {
    *broken = true;
    GEOFP8_FAIL_TRANSPORT("gloo ", op, " failed on rank ", rank, ": ", e.what());
  } catch (const std::exception& e) {
    *broken = true;
    GEOFP8_FAIL_TRANSPORT("gloo ", op, " failed on rank ", rank, ": ", e.what());
  }
}

class GlooCommunicator final : public Communicator {
 public:
  // `side`, when set, is a second context over the same device: it becomes side_channel(),
  // counting into this communicator's stats.
  GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> context,
                   std::shared_ptr<gloo::transport::Device> device,
                   std::chrono::milliseconds timeout,
                   std::shared_ptr<gloo::rendezvous::Context> side = nullptr)
      : context_(std::move(context)), device_(std::move(device)) {
    timeout_ = timeout;
    if (side) {
      side_ = std::make_unique<GlooCommunicator>(std::move(side), device_, timeout);
      side_->stats_ = stats_;
    }
  }

  ~GlooCommunicator() override {
    side_.reset();
    try {
      context_->closeConnections();
    } catch (...) {
      // A broken peer may already be gone; nothing to report from a destructor.
    }
  }

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  std::string_view backend() const override { return "gloo"; }
  Communicator* side_channel() override { return side_.get(); }

  bool Abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(abort_mu_);
      if (aborted_) return true;
      abort_reason_ = reason.empty() ? "no reason given" : reason;
      aborted_ = true;
    }
    SignalEveryPair(*context_, "aborted on rank " + std::to_string(rank()) + ": " + reason);
    if (side_) side_->Abort(reason);
    return true;
  }

  void AllToAllV(std::span<const uint8_t> send, std::span<const size_t> send_counts,
                 std::span<uint8_t> recv, std::span<const size_t> recv_counts) override {
    const int n = size();
    GEOFP8_CHECK(
        static_cast<int>(send_counts.size()) == n && static_cast<int>(recv_counts.size()) == n,
        "alltoallv: counts must have one entry per rank (", n, ")");
    const size_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
    const size_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
    GEOFP8_CHECK(send.size() >= send_total, "alltoallv: send buffer holds ", send.size(),
                 " bytes, counts need ", send_total);
    GEOFP8_CHECK(recv.size() >= recv_total, "alltoallv: recv buffer holds ", recv.size(),
                 " bytes, counts need ", recv_total);
    ++stats_->collectives;
    stats_->bytes_sent += send_total - send_counts[rank()];
    if (n == 1) {
      std::copy_n(send.data(), send_total, recv.data());
      return;
    }
    std::vector<int64_t> in(send_counts.begin(), send_counts.end());
    std::vector<int64_t> out(recv_counts.begin(), recv_counts.end());
    // gloo needs real pointers even for empty buffers.
    uint8_t dummy_in = 0, dummy_out = 0;
    uint8_t* in_ptr = send_total ? const_cast<uint8_t*>(send.data()) : &dummy_in;
    uint8_t* out_ptr = recv_total ? recv.data() : &dummy_out;
    const uint32_t tag = next_tag_++;
    Call("alltoallv", [&] {
      gloo::AlltoallvOptions opts(context_);
      opts.setInput(in_ptr, in);
      opts.setOutput(out_ptr, out);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::alltoallv(opts);
    });
  }

  void AllGatherV(std::span<const uint8_t> send, std::span<uint8_t> recv,
                  std::span<const size_t> recv_counts) override {
    const int n = size();
    GEOFP8_CHECK(static_cast<int>(recv_counts.size()) == n,
                 "allgatherv: recv_counts must have one entry per rank (", n, ")");
    GEOFP8_CHECK(send.size() == recv_counts[rank()], "allgatherv: rank ", rank(), " sends ",
                 send.size(), " bytes but recv_counts says ", recv_counts[rank()]);
    const size_t total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
    GEOFP8_CHECK(recv.size() >= total, "allgatherv: recv buffer holds ", recv.size(),
                 " bytes, counts need ", total);
    ++stats_->collectives;
    // Ring: a rank forwards every block except its successor's.
    stats_->bytes_sent += total - recv_counts[(rank() + 1) % n];
    if (n == 1) {
      std::copy_n(send.data(), send.size(), recv.data());
      return;
    }
    if (total == 0) return;  // every rank computes the same counts, so every rank skips
    std::vector<size_t> elements(recv_counts.begin(), recv_counts.end());
    uint8_t dummy_in = 0;
    uint8_t* in_ptr = send.empty() ? &dummy_in : const_cast<uint8_t*>(send.data());
    const uint32_t tag = next_tag_++;
    Call("allgatherv", [&] {
      gloo::AllgathervOptions opts(context_);
      opts.setInput(in_ptr, send.size());
      opts.setOutput(recv.data(), elements);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::allgatherv(opts);
    });
  }

  void AllReduceSum(std::span<float> data) override {
    RunAllReduce<float>("allreduce fp32", data.data(), data.size(),
                        [](void* c, const void* a, const void* b, size_t k) {
                          auto* out = static_cast<float*>(c);
                          auto* x = static_cast<const float*>(a);
                          auto* y = static_cast<const float*>(b);
                          for (size_t i = 0; i < k; ++i) out[i] = x[i] + y[i];
                        });
  }

  void AllReduceSumBf16(std::span<uint16_t> data) override {
    RunAllReduce<uint16_t>("allreduce bf16", data.data(), data.size(),
                           [](void* c, const void* a, const void* b, size_t k) {
                             auto* out = static_cast<uint16_t*>(c);
                             auto* x = static_cast<const uint16_t*>(a);
                             auto* y = static_cast<const uint16_t*>(b);
                             for (size_t i = 0; i < k; ++i) {
                               out[i] = FloatToBf16(Bf16ToFloat(x[i]) + Bf16ToFloat(y[i]));
                             }
                           });
  }

  void Broadcast(std::span<uint8_t> data, int root) override {
    GEOFP8_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank of ",
                 size());
    ++stats_->collectives;
    if (rank() == root) stats_->bytes_sent += data.size() * (size() - 1);
    if (size() == 1 || data.empty()) return;
    const uint32_t tag = next_tag_++;
    Call("broadcast", [&] {
      gloo::BroadcastOptions opts(context_);
      if (rank() == root) opts.setInput(data.data(), data.size());
      opts.setOutput(data.data(), data.size());
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    });
  }

  uint32_t MaxReduce(uint32_t value) override {
    uint32_t v = value;
    RunAllReduce<uint32_t>("max-reduce", &v, 1,
                           [](void* c, const void* a, const void* b, size_t k) {
                             auto* out = static_cast<uint32_t*>(c);
                             auto* x = static_cast<const uint32_t*>(a);
                             auto* y = static_cast<const uint32_t*>(b);
                             for (size_t i = 0; i < k; ++i) out[i] = std::max(x[i], y[i]);
                           });
    return v;
  }

  // One element of kMaxReduceWords words: gloo's ring sends a single non-empty segment, which
  // here takes a fraction of the time of a multi-element reduction or any all-gather.
  void MaxReduceWords(std::span<uint64_t> words) override {
    GEOFP8_CHECK(words.size() <= kMaxReduceWords, "max-reduce: ", words.size(), " words, at most ",
                 kMaxReduceWords);
    struct Words {
      uint64_t w[kMaxReduceWords];
    };
    Words v{};
    std::copy(words.begin(), words.end(), v.w);
    RunAllReduce<Words>("max-reduce", &v, 1, [](void* c, const void* a, const void* b, size_t k) {
      auto* out = static_cast<Words*>(c);
      auto* x = static_cast<const Words*>(a);
      auto* y = static_cast<const Words*>(b);
      for (size_t e = 0; e < k; ++e) {
        for (size_t i = 0; i < kMaxReduceWords; ++i) out[e].w[i] = std::max(x[e].w[i], y[e].w[i]);
      }
    });
    std::copy_n(v.w, words.size(), words.begin());
  }

  bool SupportsBoundedReceive() const override { return true; }

  // Pairwise unbound-buffer messages on one slot of their own. Gloo's TCP pair accepts a message
  // no longer than the posted receive (and fails the process on a longer one), so each receive is
  // posted at its full capacity. Receives go out first, so every peer's send finds one posted.
  void ExchangeBounded(std::span<const std::span<const uint8_t>> send_to,
                       std::span<const std::span<uint8_t>> recv_from) override {
    const int n = size(), me = rank();
    GEOFP8_CHECK(static_cast<int>(send_to.size()) == n && static_cast<int>(recv_from.size()) == n,
                 "exchange-bounded: send_to and recv_from must have one entry per rank (", n, ")");
    ++stats_->collectives;
    for (int j = 0; j < n; ++j) {
      if (j != me) stats_->bytes_sent += send_to[j].size();
    }
    if (n == 1) return;
    const uint32_t tag = next_tag_++;
    Call("exchange-bounded", [&] {
      const uint64_t slot = gloo::Slot::build(kBoundedSlotPrefix, tag);
      uint8_t dummy_in = 0, dummy_out = 0;
      std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> recvs, sends;
      for (int k = 1; k < n; ++k) {
        const int j = (me + n - k) % n;
        const std::span<uint8_t> in = recv_from[j];
        recvs.push_back(
            context_->createUnboundBuffer(in.empty() ? &dummy_in : in.data(), in.size()));
        recvs.back()->recv(j, slot, 0, in.size());
      }
      for (int k = 1; k < n; ++k) {
        const int j = (me + k) % n;
        const std::span<const uint8_t> out = send_to[j];
        sends.push_back(context_->createUnboundBuffer(
            out.empty() ? &dummy_out : const_cast<uint8_t*>(out.data()), out.size()));
        sends.back()->send(j, slot, 0, out.size());
      }
      for (auto& b : recvs) {
        if (!b->waitRecv(timeout_))
          GEOFP8_FAIL_TRANSPORT("gloo exchange-bounded on rank ", me, ": receive aborted");
      }
      for (auto& b : sends) {
        if (!b->waitSend(timeout_))
          GEOFP8_FAIL_TRANSPORT("gloo exchange-bounded on rank ", me, ": send aborted");
      }
    });
  }

  void Barrier() override {
    ++stats_->collectives;
    if (size() == 1) return;
    const uint32_t tag = next_tag_++;
    Call("barrier", [&] {
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 private:
  // GlooCall, refusing to start once Abort() was called (its pairs are closed by then anyway;
  // this names the reason).
  template <typename Fn>
  void Call(const char* op, Fn&& fn) {
    if (aborted_.load()) {
      std::lock_guard<std::mutex> lock(abort_mu_);
      broken_ = true;
      GEOFP8_FAIL_TRANSPORT("gloo ", op, " on rank ", rank(), ": aborted (", abort_reason_, ")");
    }
    GlooCall(op, rank(), &broken_, std::forward<Fn>(fn));
  }

  template <typename T>
  void RunAllReduce(const char* op, T* data, size_t count, gloo::AllreduceOptions::Func fn) {
    ++stats_->collectives;
    const int n = size();
    // Ring reduce-scatter plus all-gather: 2(N-1)/N of the buffer leaves each rank.
    stats_->bytes_sent += 2 * (n - 1) * count * sizeof(T) / n;
    if (n == 1 || count == 0) return;
    const uint32_t tag = next_tag_++;
    Call(op, [&] {
      gloo::AllreduceOptions opts(context_);
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts.setOutput(data, count);
      opts.setReduceFunction(fn);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::allreduce(opts);
    });
  }

  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::unique_ptr<GlooCommunicator> side_;
  uint32_t next_tag_ = 1;
  bool broken_ = false;  // touched only by the thread running this channel's collectives
  std::atomic<bool> aborted_{false};
  std::mutex abort_mu_;
  std::string abort_reason_;  // under abort_mu_
};

}  // namespace

std::unique_ptr<Communicator> CreateGlooCommunicator(geofp8::Store& store, int rank, int size,
                                                     const GlooOptions& options) {
  GEOFP8_CHECK(size >= 1, "gloo: size must be >= 1 (", size, ")");
  GEOFP8_CHECK(rank >= 0 && rank < size, "gloo: rank must be in [0, ", size, ") (", rank, ")");
  GEOFP8_CHECK(options.timeout.count() > 0, "gloo: timeout must be positive (",
               options.timeout.count(), " ms)");
  GEOFP8_CHECK(options.channels == 1 || options.channels == 2, "gloo: channels must be 1 or 2 (",
               options.channels, ")");
  GEOFP8_CHECK(options.loop_nice >= 0 && options.loop_nice <= 19,
               "gloo: loop_nice must be in [0, 19] (", options.loop_nice, ")");
  std::shared_ptr<gloo::rendezvous::Context> context, side;
  std::shared_ptr<gloo::transport::Device> device;
  bool broken = false;
  GlooCall("rendezvous", rank, &broken, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    if (options.loop_nice > 0) {
      // The device starts its event-loop thread; created from a thread with lowered priority,
      // the loop inherits it (a thread cannot raise its priority back without privilege).
      std::exception_ptr error;
      std::thread maker([&] {
        try {
          LowerThreadPriority(options.loop_nice);
          device = gloo::transport::tcp::CreateDevice(attr);
        } catch (...) {
          error = std::current_exception();
        }
      });
      maker.join();
      if (error) std::rethrow_exception(error);
    } else {
      device = gloo::transport::tcp::CreateDevice(attr);
    }
    GlooStoreAdapter adapter(store, options.timeout);
    // One full mesh per channel, each under its own key prefix, both over one device (one
    // listening socket and one event loop thread).
    for (int c = 0; c < options.channels; ++c) {
      auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
      ctx->setTimeout(options.timeout);
      gloo::rendezvous::PrefixStore prefixed(c == 0 ? options.prefix : options.prefix + "/side",
                                             adapter);
      ctx->connectFullMesh(prefixed, device);
      (c == 0 ? context : side) = std::move(ctx);
    }
    // No rank returns before every rank has connected both meshes: one that closed its
    // communicator at once (an error right after the rendezvous) reset a peer still connecting,
    // whose error then read "connection reset by peer" instead of the real reason.
    for (const auto& ctx : {context, side}) {
      if (!ctx) continue;
      gloo::BarrierOptions opts(ctx);
      opts.setTimeout(options.timeout);
      gloo::barrier(opts);
    }
  });
  return std::make_unique<GlooCommunicator>(std::move(context), std::move(device), options.timeout,
                                            std::move(side));
}

}  // namespace geofp8
