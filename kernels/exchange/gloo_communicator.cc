// Gloo backend of the Communicator (see gloo_communicator.h). Gloo reports failures by throwing
// gloo::Exception or gloo::EnforceNotMet; every call here converts them to geofp8::Error.
#include "kernels/exchange/gloo_communicator.h"

#include <algorithm>
#include <exception>
#include <numeric>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "kernels/common/check.h"
#include "kernels/exchange/bf16.h"

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

// Slot prefix of our point-to-point transfers (gloo's own collectives use small ones).
constexpr uint8_t kTransferSlotPrefix = 0xA6;

// Runs one gloo call, converting whatever gloo throws into a one-line geofp8::Error.
template <typename Fn>
void GlooCall(const char* op, int rank, bool* broken, Fn&& fn) {
  GEOFP8_CHECK(!*broken, "gloo ", op, " on rank ", rank,
               ": communicator is broken by an earlier failure");
  try {
    fn();
  } catch (const geofp8::Error&) {
    *broken = true;
    throw;
  } catch (const gloo::Exception& e) {
    *broken = true;
    GEOFP8_FAIL("gloo ", op, " failed on rank ", rank, ": ", e.what());
  } catch (const gloo::EnforceNotMet& e) {
    *broken = true;
    GEOFP8_FAIL("gloo ", op, " failed on rank ", rank, ": ", e.what());
  } catch (const std::exception& e) {
    *broken = true;
    GEOFP8_FAIL("gloo ", op, " failed on rank ", rank, ": ", e.what());
  }
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> context,
                   std::shared_ptr<gloo::transport::Device> device, std::chrono::milliseconds timeout)
      : context_(std::move(context)), device_(std::move(device)) {
    timeout_ = timeout;
  }

  ~GlooCommunicator() override {
    try {
      context_->closeConnections();
    } catch (...) {
      // A broken peer may already be gone; nothing to report from a destructor.
    }
  }

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  std::string_view backend() const override { return "gloo"; }

  void AllToAllV(std::span<const uint8_t> send, std::span<const size_t> send_counts,
                 std::span<uint8_t> recv, std::span<const size_t> recv_counts) override {
    const int n = size();
    GEOFP8_CHECK(static_cast<int>(send_counts.size()) == n && static_cast<int>(recv_counts.size()) == n,
                 "alltoallv: counts must have one entry per rank (", n, ")");
    const size_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
    const size_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
    GEOFP8_CHECK(send.size() >= send_total, "alltoallv: send buffer holds ", send.size(),
                 " bytes, counts need ", send_total);
    GEOFP8_CHECK(recv.size() >= recv_total, "alltoallv: recv buffer holds ", recv.size(),
                 " bytes, counts need ", recv_total);
    GEOFP8_CHECK(send_counts[rank()] == recv_counts[rank()], "alltoallv: rank ", rank(),
                 " keeps ", send_counts[rank()], " bytes of its own but expects ",
                 recv_counts[rank()]);
    ++stats_.collectives;
    stats_.bytes_sent += send_total - send_counts[rank()];
    if (n == 1) {
      std::copy_n(send.data(), send_total, recv.data());
      return;
    }
    std::vector<size_t> send_off(n, 0), recv_off(n, 0);
    for (int r = 1; r < n; ++r) {
      send_off[r] = send_off[r - 1] + send_counts[r - 1];
      recv_off[r] = recv_off[r - 1] + recv_counts[r - 1];
    }
    std::copy_n(send.data() + send_off[rank()], send_counts[rank()], recv.data() + recv_off[rank()]);
    // Every send and receive is posted at once, then waited for: no step waits on another.
    std::vector<PeerSend> sends;
    std::vector<PeerRecv> recvs;
    for (int k = 1; k < n; ++k) {  // staggered: rank r starts with r+1
      const int to = (rank() + k) % n, from = (rank() - k + n) % n;
      sends.push_back({to, 0, send.subspan(send_off[to], send_counts[to])});
      recvs.push_back({from, 0, recv.subspan(recv_off[from], recv_counts[from])});
    }
    Transfer("alltoallv", sends, recvs);
  }

  // Every rank sends its block straight to each other rank and receives theirs, all at once.
  // Each rank's link carries the same (N-1) blocks as gloo's ring allgatherv, but in one step
  // instead of N-1 dependent ones, so a small gather costs one link latency instead of N-1: the
  // two_phase pipeline issues one per group of layers.
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
    ++stats_.collectives;
    stats_.bytes_sent += send.size() * static_cast<size_t>(n - 1);
    std::vector<size_t> offset(n, 0);
    for (int r = 1; r < n; ++r) offset[r] = offset[r - 1] + recv_counts[r - 1];
    std::copy_n(send.data(), send.size(), recv.data() + offset[rank()]);
    if (n == 1 || total == 0) return;  // every rank computes the same counts, so every rank skips
    std::vector<PeerSend> sends;
    std::vector<PeerRecv> recvs;
    for (int k = 1; k < n; ++k) {
      const int to = (rank() + k) % n, from = (rank() - k + n) % n;
      sends.push_back({to, 0, send});
      recvs.push_back({from, 0, recv.subspan(offset[from], recv_counts[from])});
    }
    Transfer("allgatherv", sends, recvs);
  }

  void SendRecv(std::span<const PeerSend> sends, std::span<const PeerRecv> recvs) override {
    for (const auto& t : sends) {
      GEOFP8_CHECK(t.peer >= 0 && t.peer < size() && t.peer != rank(), "sendrecv: rank ", rank(),
                   " cannot send to peer ", t.peer);
    }
    for (const auto& t : recvs) {
      GEOFP8_CHECK(t.peer >= 0 && t.peer < size() && t.peer != rank(), "sendrecv: rank ", rank(),
                   " cannot receive from peer ", t.peer);
    }
    ++stats_.collectives;
    for (const auto& t : sends) stats_.bytes_sent += t.data.size();
    Transfer("sendrecv", sends, recvs);
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
    GEOFP8_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank of ", size());
    ++stats_.collectives;
    if (rank() == root) stats_.bytes_sent += data.size() * (size() - 1);
    if (size() == 1 || data.empty()) return;
    const uint32_t tag = next_tag_++;
    GlooCall("broadcast", rank(), &broken_, [&] {
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
    RunAllReduce<uint32_t>("max-reduce", &v, 1, [](void* c, const void* a, const void* b, size_t k) {
      auto* out = static_cast<uint32_t*>(c);
      auto* x = static_cast<const uint32_t*>(a);
      auto* y = static_cast<const uint32_t*>(b);
      for (size_t i = 0; i < k; ++i) out[i] = std::max(x[i], y[i]);
    });
    return v;
  }

  void Barrier() override {
    ++stats_.collectives;
    if (size() == 1) return;
    const uint32_t tag = next_tag_++;
    GlooCall("barrier", rank(), &broken_, [&] {
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 private:
  // Posts every transfer at once (one gloo unbound buffer each), then waits for all of them.
  // Empty transfers are skipped: both sides know the sizes. Channel c uses slot base + c.
  void Transfer(const char* op, std::span<const PeerSend> sends, std::span<const PeerRecv> recvs) {
    const gloo::Slot base = gloo::Slot::build(kTransferSlotPrefix, next_tag_++);
    GlooCall(op, rank(), &broken_, [&] {
      std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> out, in;
      for (const auto& t : recvs) {
        if (t.data.empty()) continue;
        in.push_back(context_->createUnboundBuffer(t.data.data(), t.data.size()));
        in.back()->recv(t.peer, base + t.channel);
      }
      for (const auto& t : sends) {
        if (t.data.empty()) continue;
        out.push_back(context_->createUnboundBuffer(const_cast<uint8_t*>(t.data.data()), t.data.size()));
        out.back()->send(t.peer, base + t.channel);
      }
      for (auto& b : in) GEOFP8_CHECK(b->waitRecv(timeout_), "receive aborted");
      for (auto& b : out) GEOFP8_CHECK(b->waitSend(timeout_), "send aborted");
    });
  }

  template <typename T>
  void RunAllReduce(const char* op, T* data, size_t count, gloo::AllreduceOptions::Func fn) {
    ++stats_.collectives;
    const int n = size();
    // Ring reduce-scatter plus all-gather: 2(N-1)/N of the buffer leaves each rank.
    stats_.bytes_sent += 2 * (n - 1) * count * sizeof(T) / n;
    if (n == 1 || count == 0) return;
    const uint32_t tag = next_tag_++;
    GlooCall(op, rank(), &broken_, [&] {
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
  uint32_t next_tag_ = 1;
  bool broken_ = false;
};

}  // namespace

std::unique_ptr<Communicator> CreateGlooCommunicator(geofp8::Store& store, int rank, int size,
                                                     const GlooOptions& options) {
  GEOFP8_CHECK(size >= 1, "gloo: size must be >= 1 (", size, ")");
  GEOFP8_CHECK(rank >= 0 && rank < size, "gloo: rank must be in [0, ", size, ") (", rank, ")");
  GEOFP8_CHECK(options.timeout.count() > 0, "gloo: timeout must be positive (",
               options.timeout.count(), " ms)");
  std::shared_ptr<gloo::rendezvous::Context> context;
  std::shared_ptr<gloo::transport::Device> device;
  bool broken = false;
  GlooCall("rendezvous", rank, &broken, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    device = gloo::transport::tcp::CreateDevice(attr);
    context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(options.timeout);
    GlooStoreAdapter adapter(store, options.timeout);
    gloo::rendezvous::PrefixStore prefixed(options.prefix, adapter);
    context->connectFullMesh(prefixed, device);
  });
  return std::make_unique<GlooCommunicator>(std::move(context), std::move(device), options.timeout);
}

}  // namespace geofp8
