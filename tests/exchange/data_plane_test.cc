// The device path of the exchange engine (StagedPlane, data_plane.h) without a device: a
// DeviceBackend whose "device memory" is host memory kept scrambled (every byte XORed with a
// key), so any read or write of it that bypasses the backend yields garbage and a wrong result.
// Its kernels unscramble, run the host codec and transforms, and scramble back. Through it the
// whole device dispatch and staging logic (what is copied when, flags, scratch) runs on the CPU,
// and each algorithm must give bit for bit what the host plane gives on the same inputs, with its
// wire staged through host memory or kept in the scrambled memory (WireMemory::kDevice) for a
// communicator that unscrambles at its boundary, as NCCL reads device memory: the algorithms run
// exactly their device-wire code. The CUDA backend runs the same tests on a GPU (tests/gpu).
#include "kernels/exchange/data_plane.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "kernels/exchange/algorithms.h"
#include "kernels/exchange/exchanger.h"
#include "kernels/geometry/hadamard.h"
#include "tests/exchange/plane_harness.h"

namespace geofp8 {
namespace {

using namespace geofp8::testing;

constexpr uint8_t kKey = 0xA5;

class ScrambledBackend final : public DeviceBackend {
 public:
  ~ScrambledBackend() override = default;
  std::string name() const override { return "scrambled"; }

  void* Allocate(size_t bytes) override {
    auto* p = new uint8_t[bytes];
    std::memset(p, kKey, bytes);  // scrambled zeros
    std::lock_guard<std::mutex> lock(mu_);
    live_[p] = bytes;
    ++allocations_;
    return p;
  }
  void Free(void* p) override {
    std::lock_guard<std::mutex> lock(mu_);
    ASSERT_EQ(live_.erase(p), 1u) << "free of memory this backend did not allocate";
    delete[] static_cast<uint8_t*>(p);
  }
  void ToHost(void* host, const void* device, size_t bytes) override {
    Read(host, device, bytes);
    ++host_syncs_;  // a GPU's copy to the host waits for the stream
  }
  void ToDevice(void* device, const void* host, size_t bytes) override {
    Check(device, bytes);
    Scramble(device, host, bytes);
  }
  void Copy(void* dst, const void* src, size_t bytes) override {
    Check(dst, bytes);
    Check(src, bytes);
    std::memmove(dst, src, bytes);  // scrambled stays scrambled
  }
  void Zero(void* device, size_t bytes) override {
    Check(device, bytes);
    std::memset(device, kKey, bytes);
  }
  void Divide(const float* x, float* y, size_t n, float divisor, uint64_t bit,
              uint64_t* flags) override {
    std::vector<float> t = Load(x, n);
    if (geofp8::Divide(t, divisor, t)) {
      uint64_t w;
      Read(&w, flags, 8);
      w |= bit;
      ToDevice(flags, &w, 8);
    }
    Store(y, t);
  }
  // Element by element through the per-element conversions a GPU kernel runs (grad_span.h,
  // GEOFP8_HD), against the host plane's vectorized LoadDivided and StoreRounded.
  void DivideLowp(const uint16_t* x, GradDtype dtype, float* y, size_t n, float divisor,
                  uint64_t bit, uint64_t* flags) override {
    std::vector<uint16_t> h(n);
    Read(h.data(), x, n * 2);
    std::vector<float> t(n);
    bool bad = false;
    for (size_t i = 0; i < n; ++i) {
      const float v = LowpToFloat(h[i], dtype);
      bad = bad || !std::isfinite(v);
      t[i] = v / divisor;
    }
    if (bad) {
      uint64_t w;
      Read(&w, flags, 8);
      w |= bit;
      ToDevice(flags, &w, 8);
    }
    Store(y, t);
  }
  void RoundLowp(const float* x, uint16_t* y, GradDtype dtype, size_t n) override {
    std::vector<float> t = Load(x, n);
    std::vector<uint16_t> h(n);
    for (size_t i = 0; i < n; ++i) h[i] = FloatToLowp(t[i], dtype);
    ToDevice(y, h.data(), n * 2);
  }
  // The host's row functions over unscrambled copies.
  void ShardProducts(const BucketLayer& l, int64_t first_row, const float* x, size_t n,
                     float* w) override {
    ++shard_products_;
    const size_t wn = size_t(ShardProductRows(*l.geometry)) * size_t(l.cols);
    std::vector<float> rows = Load(x, n), t(wn);
    ShardColumnProducts(*l.geometry, first_row, rows, t);
    Store(w, t);
  }
  void InvertRows(const BucketLayer& l, int64_t first_row, float* x, size_t n,
                  const float* w) override {
    ++invert_rows_;
    std::vector<float> rows = Load(x, n), shares;
    if (w) shares = Load(w, size_t(ShardProductRows(*l.geometry)) * size_t(l.cols));
    InvertGeometryRows(*l.geometry, first_row, rows, shares);
    Store(x, rows);
  }
  int shard_products() const { return shard_products_; }
  int invert_rows() const { return invert_rows_; }
  void Encode(const float* x, size_t n, const CodecOptions& o, uint8_t* out,
              size_t bytes) override {
    std::vector<float> t = Load(x, n);
    std::vector<uint8_t> e(bytes);
    geofp8::Encode(t, o, e);
    ToDevice(out, e.data(), bytes);
  }
  void Decode(const uint8_t* in, size_t bytes, const CodecOptions& o, float* out, size_t n,
              bool accumulate) override {
    std::vector<uint8_t> e(bytes);
    Read(e.data(), in, bytes);
    // The layout the plane names must be the header's: a GPU decodes by it alone.
    EncodedHeader h;
    std::memcpy(&h, e.data(), sizeof h);
    EXPECT_EQ(EncodedBytes(o, n), bytes);
    EXPECT_EQ(static_cast<Format>(h.format), o.format);
    EXPECT_EQ(h.count, n);
    std::vector<float> t = accumulate ? Load(out, n) : std::vector<float>(n);
    if (accumulate) {
      DecodeAccumulate(e, t);
    } else {
      geofp8::Decode(e, t);
    }
    Store(out, t);
  }
  void Fill(float* x, size_t n, uint32_t bits) override {
    float v;
    std::memcpy(&v, &bits, 4);
    Store(x, std::vector<float>(n, v));
  }
  void Transform(const BucketLayer& l, float* x, bool inverse) override {
    std::vector<float> t = Load(x, l.in.size());
    if (!inverse) {
      if (l.geometry) ApplyGeometry(*l.geometry, t);
      if (l.hadamard_block) HadamardForward(t, int(l.hadamard_block), l.hadamard_seed);
    } else {
      if (l.hadamard_block) HadamardInverse(t, int(l.hadamard_block), l.hadamard_seed);
      if (l.geometry) InvertGeometry(*l.geometry, t);
    }
    Store(x, t);
  }
  void Synchronize() override {
    ++syncs_;
    ++host_syncs_;
  }
  // The sketch's products over an unscrambled copy, through the host's code: the bits of a
  // refresh that reads a host copy. A snapshot is the same copy, taken when asked.
  std::unique_ptr<GradientProducts> Products(const float* g, int64_t m, int64_t n) override {
    ++products_;
    return std::make_unique<HostSnapshot>(Load(g, size_t(m * n)), m, n);
  }
  int products() const { return products_; }
  std::unique_ptr<GradientProducts> Snapshot(const float* g, int64_t m, int64_t n) override {
    ++snapshots_;
    return std::make_unique<HostSnapshot>(Load(g, size_t(m * n)), m, n);
  }
  int snapshots() const { return snapshots_; }

  size_t live() const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.size();
  }
  int syncs() const { return syncs_; }

  // Whether [p, p + bytes) is this backend's memory (the communicator below tells device spans
  // from host ones by it, as NCCL does by address).
  bool Owns(const void* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(const_cast<void*>(p));
    if (it == live_.begin()) return false;
    --it;
    return static_cast<const uint8_t*>(p) < static_cast<const uint8_t*>(it->first) + it->second;
  }
  // The backend's copies without a host wait: the kernels' own reads, and the communicator's.
  void Read(void* host, const void* device, size_t bytes) const {
    Check(device, bytes);
    Unscramble(host, device, bytes);
  }
  void Write(void* device, const void* host, size_t bytes) {
    Check(device, bytes);
    Scramble(device, host, bytes);
  }

 private:
  // Every access must fall inside one allocation.
  void Check(const void* device, size_t bytes) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(const_cast<void*>(device));
    ASSERT_NE(it, live_.begin()) << "access to memory outside the backend's";
    --it;
    const auto* base = static_cast<const uint8_t*>(it->first);
    const auto* p = static_cast<const uint8_t*>(device);
    ASSERT_LE(p + bytes, base + it->second) << "access past the end of a device buffer";
  }
  static void Scramble(void* dst, const void* src, size_t bytes) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    for (size_t i = 0; i < bytes; ++i) d[i] = s[i] ^ kKey;
  }
  static void Unscramble(void* dst, const void* src, size_t bytes) { Scramble(dst, src, bytes); }
  std::vector<float> Load(const float* x, size_t n) {
    std::vector<float> t(n);
    Read(t.data(), x, n * 4);
    return t;
  }
  void Store(float* x, const std::vector<float>& t) { ToDevice(x, t.data(), t.size() * 4); }

  mutable std::mutex mu_;
  std::map<void*, size_t, std::less<>> live_;
  int allocations_ = 0;
  int syncs_ = 0;
  int products_ = 0;
  int snapshots_ = 0;
  int shard_products_ = 0;
  int invert_rows_ = 0;
};

// A communicator over a ScrambledBackend's memory, as NCCL is over a GPU's: the byte collectives
// take its spans (TakesDeviceSpans), unscramble them at the boundary, run the wrapped (Gloo)
// communicator's collective on host copies and scramble the results into place. Everything
// else is passed through, and like NCCL it has no bounded receive and no side channel.
class ScrambledComm final : public Communicator {
 public:
  ScrambledComm(Communicator& inner, ScrambledBackend& backend) : inner_(inner), backend_(backend) {
    stats_ = const_cast<CommStats*>(&inner.stats());  // the wrapped collectives count there
  }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view backend() const override { return "scrambled"; }
  bool TakesDeviceSpans() const override { return true; }

  void AllToAllV(std::span<const uint8_t> send, std::span<const size_t> send_counts,
                 std::span<uint8_t> recv, std::span<const size_t> recv_counts) override {
    std::vector<uint8_t> in = In(send), out(recv.size());
    inner_.AllToAllV(in, send_counts, out, recv_counts);
    Out(out, recv);
  }
  void AllGatherV(std::span<const uint8_t> send, std::span<uint8_t> recv,
                  std::span<const size_t> recv_counts) override {
    std::vector<uint8_t> in = In(send), out(recv.size());
    inner_.AllGatherV(in, out, recv_counts);
    Out(out, recv);
  }
  void AllReduceSum(std::span<float> data) override { inner_.AllReduceSum(data); }
  void AllReduceSumBf16(std::span<uint16_t> data) override { inner_.AllReduceSumBf16(data); }
  void Broadcast(std::span<uint8_t> data, int root) override { inner_.Broadcast(data, root); }
  uint32_t MaxReduce(uint32_t value) override { return inner_.MaxReduce(value); }
  void MaxReduceWords(std::span<uint64_t> words) override { inner_.MaxReduceWords(words); }
  void Barrier() override { inner_.Barrier(); }
  bool Abort(const std::string& reason) override { return inner_.Abort(reason); }

  // How many spans of the byte collectives were the backend's memory.
  int device_spans() const { return device_spans_; }

 private:
  std::vector<uint8_t> In(std::span<const uint8_t> s) {
    std::vector<uint8_t> host(s.size());
    if (!s.empty() && backend_.Owns(s.data())) {
      backend_.Read(host.data(), s.data(), s.size());
      ++device_spans_;
    } else if (!s.empty()) {
      std::memcpy(host.data(), s.data(), s.size());
    }
    return host;
  }
  void Out(const std::vector<uint8_t>& host, std::span<uint8_t> s) {
    if (s.empty()) return;
    if (backend_.Owns(s.data())) {
      backend_.Write(s.data(), host.data(), s.size());
      ++device_spans_;
    } else {
      std::memcpy(s.data(), host.data(), s.size());
    }
  }

  Communicator& inner_;
  ScrambledBackend& backend_;
  int device_spans_ = 0;
};

std::unique_ptr<Communicator> Scrambled(Communicator& gloo, DeviceBackend& b) {
  return std::make_unique<ScrambledComm>(gloo, static_cast<ScrambledBackend&>(b));
}

// The staged run keeps its wire in the scrambled memory when `device_wire`.
Runs RunBothPlanes(int n, const std::vector<LayerSpec>& layers, const ExchangeOptions& options,
                   int steps, const std::vector<RefreshSchedule>& schedule = {},
                   const Mutate& mutate = {}, bool device_wire = false) {
  return testing::RunBothPlanes([](int) { return std::make_unique<ScrambledBackend>(); },
                                [](int r, DeviceBackend& b) {
                                  EXPECT_EQ(static_cast<ScrambledBackend&>(b).live(), 0u)
                                      << "rank " << r << ": device buffers leaked";
                                },
                                n, layers, options, steps, schedule, mutate,
                                device_wire ? Scrambled : DeviceComm());
}

struct Case {
  Algorithm algorithm;
  int ranks;
  size_t inline_bytes;
  bool device_wire = false;
};

class StagedPlaneAlgorithms : public ::testing::TestWithParam<Case> {};

TEST_P(StagedPlaneAlgorithms, BitIdenticalToTheHostPlane) {
  const Case c = GetParam();
  const auto layers = MixedLayers();
  ExchangeOptions options;
  options.algorithm = c.algorithm;
  options.seed = 7;
  options.inline_bytes = c.inline_bytes;
  options.segment_bytes = 16 << 10;  // several pipeline groups
  options.bucket_cap_bytes = 24 << 10;
  const Runs runs = RunBothPlanes(c.ranks, layers, options, 2, {}, {}, c.device_wire);
  ExpectSame(runs, layers, std::string(AlgorithmName(c.algorithm)));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, StagedPlaneAlgorithms,
    ::testing::Values(Case{Algorithm::kTwoPhase, 2, 0}, Case{Algorithm::kTwoPhase, 3, 0},
                      Case{Algorithm::kTwoPhase, 3, size_t{1} << 30},
                      Case{Algorithm::kAllGather, 2, 0}, Case{Algorithm::kAllGather, 3, 0},
                      Case{Algorithm::kAllGather, 2, size_t{1} << 30}, Case{Algorithm::kAuto, 4, 0},
                      Case{Algorithm::kFp32, 3, 0}, Case{Algorithm::kBf16, 2, 0},
                      Case{Algorithm::kTwoPhase, 2, 0, true},
                      Case{Algorithm::kTwoPhase, 3, 0, true},
                      Case{Algorithm::kTwoPhase, 3, size_t{1} << 30, true},
                      Case{Algorithm::kAllGather, 3, 0, true},
                      Case{Algorithm::kAllGather, 2, size_t{1} << 30, true},
                      Case{Algorithm::kAuto, 4, 0, true}, Case{Algorithm::kFp32, 3, 0, true}),
    [](const auto& info) {
      return std::string(AlgorithmName(info.param.algorithm)) + "_" +
             std::to_string(info.param.ranks) + "ranks" +
             (info.param.inline_bytes ? "_inline" : "") +
             (info.param.device_wire ? "_device_wire" : "");
    });

TEST(StagedPlane, NonFiniteOnOneRankSkipsTheSameBucketsEverywhere) {
  const auto layers = MixedLayers();
  for (const auto& [a, device_wire] : {std::pair{Algorithm::kTwoPhase, false},
                                       {Algorithm::kAllGather, false},
                                       {Algorithm::kFp32, false},
                                       {Algorithm::kTwoPhase, true},
                                       {Algorithm::kAllGather, true}}) {
    ExchangeOptions options;
    options.algorithm = a;
    options.bucket_cap_bytes = 24 << 10;
    const Runs runs = RunBothPlanes(
        3, layers, options, 2, {},
        [](int r, uint64_t s, Tensors& t) {
          if (r == 1 && s == 0) t[2][5] = std::numeric_limits<float>::infinity();
        },
        device_wire);
    ExpectSame(runs, layers, std::string(AlgorithmName(a)) + " with an inf");
    for (int r = 0; r < 3; ++r) {
      EXPECT_TRUE(runs.results[1][r][0].skipped) << AlgorithmName(a) << " rank " << r;
      EXPECT_FALSE(runs.results[1][r][1].skipped) << AlgorithmName(a) << " rank " << r;
      // Only the bucket holding mlp.w.
      int skipped = 0;
      for (const auto& b : runs.results[1][r][0].buckets) skipped += b.skipped;
      EXPECT_EQ(skipped, 1) << AlgorithmName(a) << " rank " << r;
    }
  }
}

TEST(StagedPlane, GeometryRefreshedFromAHostCopyMatchesTheHostPlane) {
  // The owner estimates the geometry from a host copy of the averaged gradient (instant
  // estimator), so both planes derive the same geometries and the same bits.
  LayerPolicy lowrank = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 4;
  LayerPolicy diag = lowrank;
  diag.geometry = GeometryMode::kDiag;
  LayerPolicy both = lowrank;
  both.hadamard = true;
  const std::vector<LayerSpec> layers = {
      {"w1", 64, 48, lowrank}, {"w2", 32, 64, diag}, {"w3", 48, 64, both}, {"b", 48, 1, lowrank}};
  const std::vector<RefreshSchedule> schedule = {{1, 1, 0}, {0, 2, 0}, {2, 1, 0}, {0, 1, 0}};
  for (const auto& [a, device_wire] : {std::pair{Algorithm::kTwoPhase, false},
                                       {Algorithm::kAllGather, false},
                                       {Algorithm::kTwoPhase, true}}) {
    ExchangeOptions options;
    options.algorithm = a;
    options.seed = 3;
    const Runs runs = RunBothPlanes(3, layers, options, 4, schedule, {}, device_wire);
    ExpectSame(runs, layers, std::string(AlgorithmName(a)) + " with geometry");
    EXPECT_FALSE(runs.results[1][0][3].refreshes.empty());
  }
}

TEST(StagedPlane, FactorSketchWithoutTheInversesProductsAgreesAcrossRanks) {
  // The sketch takes its products from the inverse transform on the host plane only; on a
  // device plane it runs its own over the result through the backend, so at width = k the
  // geometries may differ from the host plane's in round-off but must agree across ranks (the
  // digest check would fail otherwise).
  LayerPolicy lowrank = Policy(Format::kNvfp4, Scaling::kBlock, 16);
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 4;
  const std::vector<LayerSpec> layers = {{"w", 64, 48, lowrank}};
  ExchangeOptions options;
  options.algorithm = Algorithm::kTwoPhase;
  options.estimator = GeometryEstimator::kFactorEma;
  const Runs runs = RunBothPlanes(2, layers, options, 5, {{0, 1, 0}});
  for (int r = 0; r < 2; ++r) {
    for (int s = 0; s < 5; ++s) {
      ASSERT_EQ(runs.results[1][r][s].refreshes.size(), 1u) << "rank " << r << " step " << s;
      EXPECT_FALSE(runs.results[1][r][s].refreshes[0].from_inverse);
      EXPECT_TRUE(SameBytes(runs.outputs[1][r][s][0], runs.outputs[1][0][s][0]))
          << "rank " << r << " step " << s;
    }
  }
}

TEST(StagedPlane, SketchProductsRunThroughTheBackendWithTheHostsBits) {
  // Sketch wider than k: the host plane's refreshes never take the inverse's products either, so
  // a refresh through the backend's GradientProducts must give the host plane's bits.
  LayerPolicy lowrank = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 4;
  const std::vector<LayerSpec> layers = {{"w1", 64, 48, lowrank}, {"w2", 40, 72, lowrank}};
  ExchangeOptions options;
  options.algorithm = Algorithm::kTwoPhase;
  options.estimator = GeometryEstimator::kFactorEma;
  options.sketch.width = 6;
  std::vector<int> products(3, 0);
  const Runs runs = testing::RunBothPlanes(
      [](int) { return std::make_unique<ScrambledBackend>(); },
      [&](int r, DeviceBackend& b) { products[r] = static_cast<ScrambledBackend&>(b).products(); },
      3, layers, options, 4, {{0, 1, 0}, {0, 1, 0}});
  ExpectSame(runs, layers, "factor_ema through the backend's products");
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(products[r], 2 * 4) << "rank " << r;  // two layers, four steps
    for (int s = 0; s < 4; ++s) {
      ASSERT_EQ(runs.results[1][r][s].refreshes.size(), 2u);
      EXPECT_FALSE(runs.results[0][r][s].refreshes[0].from_inverse);
    }
  }
}

TEST(StagedPlane, DeferredRefreshesRunOnADeviceSnapshotWithTheHostsBits) {
  // Refreshes::kDeferred on a device plane keeps a copy of each refreshed layer through the backend
  // (DeviceBackend::Snapshot) and runs the sketch's products over it later: the geometry and
  // outputs of every step are those of the host plane refreshing at once.
  LayerPolicy lowrank = Policy(Format::kNvfp4, Scaling::kBlock, 16);
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 4;
  const std::vector<LayerSpec> layers = {{"w", 64, 48, lowrank}, {"b", 48, 1, lowrank}};
  ExchangeOptions options;
  options.estimator = GeometryEstimator::kFactorEma;
  options.sketch.width = 6;  // > k: the host plane reads the average too
  const int N = 2, steps = 5;
  const Runs host = RunBothPlanes(N, layers, options, steps, {{0, 1, 0}, {0, 1, 0}});
  std::vector<std::vector<Tensors>> out(N);
  std::vector<int> snapshots(N, 0);
  const auto errors = RunRanks(N, [&](Communicator& comm) {
    const int r = comm.rank();
    ScrambledBackend backend;
    {
      StagedPlane plane(backend);
      ExchangeOptions o = options;
      o.plane = &plane;
      Exchanger ex(comm, layers, o, {{0, 1, 0}, {0, 1, 0}});
      for (int s = 0; s < steps; ++s) {
        DeviceTensors dev(backend, MakeInputs(r, layers, s));
        ex.Exchange(s, dev.spans(), Refreshes::kDeferred);
        out[r].push_back(dev.Download());
        if (s == 2) ex.RunPendingRefreshes();
      }
      ex.RunPendingRefreshes();
    }
    snapshots[r] = backend.snapshots();
    EXPECT_EQ(backend.live(), 0u) << "rank " << r << ": device buffers leaked";
  });
  ASSERT_EQ(JoinErrors(errors), "");
  for (int r = 0; r < N; ++r) {
    EXPECT_EQ(snapshots[r], steps) << "rank " << r;  // one matrix layer refreshed every step
    for (int s = 0; s < steps; ++s) {
      EXPECT_TRUE(SameBytes(out[r][s][0], host.outputs[0][r][s][0]))
          << "rank " << r << " step " << s << " differs from the host plane at element "
          << FirstBitDifference(out[r][s][0], host.outputs[0][r][s][0]);
    }
  }
}

TEST(StagedPlane, FingerprintMismatchIsReportedAsOnTheHost) {
  const auto layers = MixedLayers();
  std::vector<std::string> messages;
  const auto errors = RunRanks(2, [&](Communicator& comm) {
    ScrambledBackend backend;
    StagedPlane plane(backend);
    ExchangeOptions o;
    o.plane = &plane;
    o.policy_version = comm.rank() == 1 ? 2 : 1;
    Exchanger ex(comm, layers, o);
    DeviceTensors dev(backend, MakeInputs(comm.rank(), layers));
    ex.Exchange(0, dev.spans());
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("exchange fingerprint mismatch"), std::string::npos) << e;
    EXPECT_NE(e.find("policy version"), std::string::npos) << e;
  }
}

TEST(StagedPlane, ErrorFeedbackIsRefusedNamingTheLayer) {
  LayerPolicy ef = Policy(Format::kNvfp4, Scaling::kBlock, 16);
  ef.error_feedback = true;
  const std::vector<LayerSpec> layers = {{"blocks.0.mlp.w", 16, 16, ef}};
  const auto errors = RunRanks(1, [&](Communicator& comm) {
    ScrambledBackend backend;
    StagedPlane plane(backend);
    ExchangeOptions o;
    o.plane = &plane;
    Exchanger ex(comm, layers, o);
  });
  EXPECT_NE(errors[0].find("layer 'blocks.0.mlp.w': error_feedback: not available on device "
                           "memory (scrambled)"),
            std::string::npos)
      << errors[0];
}

// One bucket straight through ExchangeBucketData on each wire, counting the backend's host waits:
// the staged wire waits for every encode it copies out; the device wire never inside the run,
// and once at its end, to read the agreed flags. The outputs are the same bits.
TEST(StagedPlane, DeviceWireWaitsForTheDeviceOnlyAtTheRunsEnd) {
  const auto specs = MixedLayers();
  const int N = 3;
  for (Algorithm a : {Algorithm::kTwoPhase, Algorithm::kAllGather}) {
    for (size_t inline_bytes : {size_t{0}, size_t{1} << 30}) {
      const std::string what = std::string(AlgorithmName(a)) + (inline_bytes ? " inline" : "");
      std::vector<Tensors> out[2];
      out[0].resize(N);
      out[1].resize(N);
      for (int wire = 0; wire < 2; ++wire) {
        const auto errors = RunRanks(N, [&](Communicator& gloo) {
          const int r = gloo.rank();
          ScrambledBackend backend;
          ScrambledComm scrambled(gloo, backend);
          Communicator& comm = wire ? static_cast<Communicator&>(scrambled) : gloo;
          {
            StagedPlane plane(backend, wire ? WireMemory::kDevice : WireMemory::kHost);
            Tensors inputs = MakeInputs(r, specs, 0);
            inputs[1][3] = std::numeric_limits<float>::quiet_NaN();  // layer 1 of every rank
            DeviceTensors dev(backend, inputs);
            std::vector<BucketLayer> layers(specs.size());
            for (size_t l = 0; l < specs.size(); ++l) {
              layers[l].layer = static_cast<uint32_t>(l);
              layers[l].policy = specs[l].policy;
              layers[l].in = layers[l].out = GradSpan(dev.spans()[l]);
              layers[l].flag_bit = static_cast<uint32_t>(l);
            }
            AlgorithmOptions ao;
            ao.seed = 5;
            ao.divisor = float(N);
            ao.segment_bytes = 16 << 10;  // several groups
            ao.inline_bytes = inline_bytes;
            ao.plane = &plane;
            const uint64_t before = backend.host_syncs();
            const uint64_t flags = ExchangeBucketData(comm, a, ao, layers);
            const uint64_t syncs = backend.host_syncs() - before;
            EXPECT_EQ(flags, uint64_t{1} << 1) << what << " rank " << r;
            if (wire) {
              EXPECT_EQ(syncs, 1u) << what << " rank " << r;
              EXPECT_GT(scrambled.device_spans(), 0) << what << " rank " << r;
            } else {
              EXPECT_GT(syncs, specs.size()) << what << " rank " << r;  // per encode at least
            }
            out[wire][r] = dev.Download();
          }
          EXPECT_EQ(backend.live(), 0u) << what << " rank " << r;
        });
        ASSERT_EQ(JoinErrors(errors), "") << what << (wire ? " device wire" : " staged");
      }
      for (int r = 0; r < N; ++r) {
        for (size_t l = 0; l < specs.size(); ++l) {
          if (l == 1) continue;  // skipped: its values have no meaning
          EXPECT_TRUE(SameBytes(out[1][r][l], out[0][r][l]))
              << what << " rank " << r << " layer " << specs[l].name << " element "
              << FirstBitDifference(out[1][r][l], out[0][r][l]);
        }
      }
    }
  }
}

// ---- bf16 and fp16 gradients, and reduce-scatter, on the device plane ----

// The dtype harness (plane_harness.h RunDtypes) over a ScrambledBackend, counting its calls of
// the reduce-scatter row inverse and shares per rank.
struct ScrambledDtypeRuns : ByteRuns {
  std::vector<int> invert_rows, shard_products;
};

ScrambledDtypeRuns RunDtypes(int n, const std::vector<LayerSpec>& layers,
                             const ExchangeOptions& options, int steps, const DtypeRun& run) {
  ScrambledDtypeRuns runs;
  runs.invert_rows.assign(n, 0);
  runs.shard_products.assign(n, 0);
  static_cast<ByteRuns&>(runs) = testing::RunDtypes(
      [](int) { return std::make_unique<ScrambledBackend>(); },
      [&](int r, DeviceBackend& b) {
        auto& s = static_cast<ScrambledBackend&>(b);
        EXPECT_EQ(s.live(), 0u) << "rank " << r << ": device buffers leaked";
        runs.invert_rows[r] = s.invert_rows();
        runs.shard_products[r] = s.shard_products();
      },
      n, layers, options, steps, run, run.device_wire ? Scrambled : DeviceComm());
  return runs;
}

// Each layer bf16 or fp16 in turn (`shift` swaps them), with every third one fp32.
std::vector<GradDtype> MixedDtypes(size_t layers, int shift) {
  std::vector<GradDtype> d(layers);
  for (size_t l = 0; l < layers; ++l) {
    d[l] = l % 3 == 2 ? GradDtype::kFp32 : ((l + shift) % 2 ? GradDtype::kFp16 : GradDtype::kBf16);
  }
  return d;
}

// MixedLayers (a rotation, stochastic rounding, several formats) and a lowrank and a diag layer,
// refreshed from the average (the instant estimator's owner reads a bf16 or fp16 one in fp32).
std::vector<LayerSpec> LowpLayers() {
  std::vector<LayerSpec> layers = MixedLayers();
  LayerPolicy lowrank = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 4;
  LayerPolicy diag = Policy(Format::kNvfp4, Scaling::kBlock, 16);
  diag.geometry = GeometryMode::kDiag;
  layers.push_back({"lowrank.w", 64, 48, lowrank});
  layers.push_back({"diag.w", 32, 64, diag});
  return layers;
}

std::vector<RefreshSchedule> EveryOtherStep(size_t layers) {
  return std::vector<RefreshSchedule>(layers, RefreshSchedule{0, 2, 0});
}

struct DtypeCase {
  Algorithm algorithm;
  int ranks;
  bool device_wire = false;
  size_t inline_bytes = 0;
};

std::string DtypeCaseName(const DtypeCase& c) {
  return std::string(AlgorithmName(c.algorithm)) + "_" + std::to_string(c.ranks) + "ranks" +
         (c.inline_bytes ? "_inline" : "") + (c.device_wire ? "_device_wire" : "");
}

// gtest prints a case by its name, not its bytes (padding included).
void PrintTo(const DtypeCase& c, std::ostream* os) { *os << DtypeCaseName(c); }

class StagedPlaneLowp : public ::testing::TestWithParam<DtypeCase> {};

TEST_P(StagedPlaneLowp, Bf16AndFp16BitIdenticalToTheHostPlane) {
  const DtypeCase c = GetParam();
  const auto layers = LowpLayers();
  ExchangeOptions options;
  options.algorithm = c.algorithm;
  options.seed = 11;
  options.inline_bytes = c.inline_bytes;
  options.segment_bytes = 16 << 10;  // several pipeline groups
  options.bucket_cap_bytes = 24 << 10;
  for (int shift : {0, 1}) {
    DtypeRun run;
    run.dtypes = MixedDtypes(layers.size(), shift);
    run.device_wire = c.device_wire;
    run.schedule = EveryOtherStep(layers.size());
    const ScrambledDtypeRuns runs = RunDtypes(c.ranks, layers, options, 4, run);
    ExpectSameBytes(runs, layers, DtypeCaseName(c) + " dtypes " + std::to_string(shift));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, StagedPlaneLowp,
    ::testing::Values(DtypeCase{Algorithm::kTwoPhase, 2}, DtypeCase{Algorithm::kTwoPhase, 3},
                      DtypeCase{Algorithm::kAllGather, 2}, DtypeCase{Algorithm::kAllGather, 3},
                      DtypeCase{Algorithm::kFp32, 3}, DtypeCase{Algorithm::kBf16, 2},
                      DtypeCase{Algorithm::kTwoPhase, 3, true},
                      DtypeCase{Algorithm::kAllGather, 2, true},
                      DtypeCase{Algorithm::kTwoPhase, 2, true, size_t{1} << 30},
                      DtypeCase{Algorithm::kFp32, 2, true}),
    [](const auto& info) { return DtypeCaseName(info.param); });

TEST(StagedPlaneLowp, NonFiniteInALowpGradientSkipsTheSameBucketsEverywhere) {
  const auto layers = MixedLayers();
  for (Algorithm a : {Algorithm::kTwoPhase, Algorithm::kAllGather, Algorithm::kBf16}) {
    for (GradDtype d : {GradDtype::kBf16, GradDtype::kFp16}) {
      ExchangeOptions options;
      options.algorithm = a;
      options.bucket_cap_bytes = 24 << 10;
      DtypeRun run;
      run.dtypes.assign(layers.size(), d);
      // 1e6 is finite in fp32 and bf16 but beyond fp16's range: an fp16 gradient holds inf.
      run.mutate = [d](int r, uint64_t s, Tensors& t) {
        if (r == 1 && s == 0) {
          t[2][5] = d == GradDtype::kFp16 ? 1e6f : std::numeric_limits<float>::infinity();
        }
      };
      const std::string what = std::string(AlgorithmName(a)) + " " + GradDtypeName(d);
      const ScrambledDtypeRuns runs = RunDtypes(3, layers, options, 2, run);
      ExpectSameBytes(runs, layers, what);
      for (int p = 0; p < 2; ++p) {
        for (int r = 0; r < 3; ++r) {
          EXPECT_TRUE(runs.results[p][r][0].skipped) << what << " rank " << r;
          EXPECT_FALSE(runs.results[p][r][1].skipped) << what << " rank " << r;
          int skipped = 0;  // only the bucket holding mlp.w
          for (const auto& b : runs.results[p][r][0].buckets) skipped += b.skipped;
          EXPECT_EQ(skipped, 1) << what << " rank " << r;
        }
      }
    }
  }
}

// Reduce-scatter layers whose rows do not divide by 2 or 3 ranks (one of them has fewer rows than
// 3 ranks), with a lowrank geometry (its inverse needs the k x n shares of U^T D) and a diag one
// (row-local), refreshed every other step by the instant estimator: a refresh step all-reduces
// those layers, the others scatter them.
std::vector<LayerSpec> ScatterLayers() {
  LayerPolicy lowrank = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 4;
  LayerPolicy diag = Policy(Format::kNvfp4, Scaling::kBlock, 16, Rounding::kStochastic);
  diag.geometry = GeometryMode::kDiag;
  return {
      {"lowrank.w", 40, 48, lowrank},
      {"diag.w", 22, 64, diag},
      {"plain.w", 33, 40, Policy(Format::kFp8E5M2, Scaling::kTensor, 0)},
      {"tiny.w", 2, 30, Policy(Format::kFp8E4M3, Scaling::kBlock, 128)},
      {"bias", 5, 1, Policy(Format::kFp8E4M3, Scaling::kBlock, 128)},
  };
}

class StagedPlaneReduceScatter : public ::testing::TestWithParam<DtypeCase> {};

TEST_P(StagedPlaneReduceScatter, BitIdenticalToTheHostPlane) {
  const DtypeCase c = GetParam();
  const auto layers = ScatterLayers();
  ExchangeOptions options;
  options.algorithm = c.algorithm;
  options.seed = 5;
  options.inline_bytes = c.inline_bytes;
  options.segment_bytes = 8 << 10;  // several pipeline groups
  options.reduce_scatter_segment_bytes = 8 << 10;
  options.bucket_cap_bytes = 16 << 10;
  for (int dtypes = 0; dtypes < 3; ++dtypes) {
    for (bool geometry : {false, true}) {
      DtypeRun run;
      run.dtypes = dtypes == 0 ? std::vector<GradDtype>(layers.size(), GradDtype::kFp32)
                               : MixedDtypes(layers.size(), dtypes - 1);
      run.reduce_scatter = true;
      run.device_wire = c.device_wire;
      if (geometry) run.schedule = EveryOtherStep(layers.size());
      const ScrambledDtypeRuns runs = RunDtypes(c.ranks, layers, options, 4, run);
      const std::string what = DtypeCaseName(c) + " dtypes " + std::to_string(dtypes) +
                               (geometry ? " with geometry" : "");
      ExpectSameBytes(runs, layers, what);
      // The baselines run no geometry; under two_phase, steps 1 and 3 scatter both geometry
      // layers through the device's row inverse (the lowrank one with its shares of U^T D).
      const bool inverse = geometry && c.algorithm == Algorithm::kTwoPhase;
      for (int r = 0; r < c.ranks; ++r) {
        EXPECT_EQ(runs.invert_rows[r] > 0, inverse) << what << " rank " << r;
        EXPECT_EQ(runs.shard_products[r] > 0, inverse) << what << " rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, StagedPlaneReduceScatter,
    ::testing::Values(DtypeCase{Algorithm::kTwoPhase, 2}, DtypeCase{Algorithm::kTwoPhase, 3},
                      DtypeCase{Algorithm::kFp32, 3}, DtypeCase{Algorithm::kBf16, 2},
                      DtypeCase{Algorithm::kTwoPhase, 3, false, size_t{1} << 30},
                      DtypeCase{Algorithm::kTwoPhase, 2, true},
                      DtypeCase{Algorithm::kTwoPhase, 3, true},
                      DtypeCase{Algorithm::kTwoPhase, 3, true, size_t{1} << 30},
                      DtypeCase{Algorithm::kFp32, 3, true}),
    [](const auto& info) { return DtypeCaseName(info.param); });

TEST(StagedPlaneReduceScatter, ShardedFactorSketchReadsTheDeviceRowsWithTheHostsBits) {
  // Under the ema estimator a layer this large refreshes from its owners' rows (ShardedRefresh):
  // the device plane reads its rows to the host for that, and its geometry (sketch wider than k,
  // so the host plane takes no products from its inverse either) and outputs are the host's.
  LayerPolicy lowrank = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 4;
  const std::vector<LayerSpec> layers = {{"big.w", 256, 193, lowrank}, {"b", 7, 1, lowrank}};
  ExchangeOptions options;
  options.algorithm = Algorithm::kTwoPhase;
  options.estimator = GeometryEstimator::kFactorEma;
  options.sketch.width = 6;
  for (GradDtype d : {GradDtype::kFp32, GradDtype::kBf16}) {
    DtypeRun run;
    run.dtypes.assign(layers.size(), d);
    run.reduce_scatter = true;
    run.schedule = {{0, 1, 0}, {0, 1, 0}};
    const ScrambledDtypeRuns runs = RunDtypes(3, layers, options, 4, run);
    ExpectSameBytes(runs, layers, "ema " + GradDtypeName(d));
    for (int s = 0; s < 4; ++s) EXPECT_EQ(runs.results[1][0][s].refreshes.size(), 1u) << s;
  }
}

// One bucket straight through ExchangeBucketData on the device wire: a reduce-scatter, and an
// all-reduce of bf16 and fp16 gradients, wait for the device once, at the run's end, as the
// fp32 all-reduce does; a reduce-scatter's lowrank layer adds one wait to read its share of
// U^T D and one for its inverse. Each gives the host plane's bits over the same inputs.
TEST(StagedPlane, DeviceWireReduceScatterAndLowpWaitOnlyAtTheRunsEnd) {
  auto specs = ScatterLayers();
  const int N = 3;
  Geometry lowrank;  // a lowrank geometry of layer 0, estimated from rank 0's input
  {
    GeometryOptions go;
    go.mode = GeometryMode::kLowRank;
    go.rank = 4;
    lowrank =
        EstimateGeometry(MakeInputs(0, specs, 9)[0], specs[0].rows, specs[0].cols, go, nullptr)
            .geometry;
    ASSERT_GT(ShardProductRows(lowrank), 0);
  }
  struct Mode {
    Algorithm algorithm;
    bool reduce_scatter;
    GradDtype dtype;
    bool geometry;
  };
  for (const Mode m : {Mode{Algorithm::kTwoPhase, true, GradDtype::kFp32, false},
                       Mode{Algorithm::kFp32, true, GradDtype::kBf16, false},
                       Mode{Algorithm::kTwoPhase, true, GradDtype::kFp16, true},
                       Mode{Algorithm::kTwoPhase, false, GradDtype::kBf16, false},
                       Mode{Algorithm::kAllGather, false, GradDtype::kFp16, false}}) {
    const std::string what = std::string(AlgorithmName(m.algorithm)) +
                             (m.reduce_scatter ? " reduce-scatter " : " all-reduce ") +
                             GradDtypeName(m.dtype) + (m.geometry ? " lowrank" : "");
    const auto errors = RunRanks(N, [&](Communicator& gloo) {
      const int r = gloo.rank();
      ScrambledBackend backend;
      ScrambledComm scrambled(gloo, backend);
      {
        StagedPlane plane(backend, WireMemory::kDevice);
        HostPlane host;
        Tensors inputs = MakeInputs(r, specs, 0);
        inputs[2][3] = std::numeric_limits<float>::quiet_NaN();  // layer 2 of every rank
        std::vector<Bytes> in[2], out[2];
        std::vector<void*> device;
        uint64_t flags[2] = {0, 0};
        for (int p = 0; p < 2; ++p) {
          std::vector<BucketLayer> layers(specs.size());
          for (size_t l = 0; l < specs.size(); ++l) {
            BucketLayer& b = layers[l];
            b.layer = static_cast<uint32_t>(l);
            b.policy = specs[l].policy;
            b.cols = specs[l].cols;
            b.flag_bit = static_cast<uint32_t>(l);
            if (l == 0 && m.geometry) b.geometry = &lowrank;
            // The geometry's layer stays fp32 (its inverse runs in place in fp32).
            const GradDtype d = b.geometry ? GradDtype::kFp32 : m.dtype;
            in[p].push_back(AsDtype(inputs[l], d));
            const size_t rows = m.reduce_scatter ? RowChunkOf(inputs[l].size(), b.cols, N, r).size()
                                                 : inputs[l].size();
            out[p].push_back(Bytes(rows * ElementBytes(d), 0xEE));
          }
          for (size_t l = 0; l < specs.size(); ++l) {
            BucketLayer& b = layers[l];
            const GradDtype d = b.geometry ? GradDtype::kFp32 : m.dtype;
            if (p == 0) {
              b.in = GradSpan(in[p][l].data(), inputs[l].size(), d);
              b.out = m.reduce_scatter
                          ? GradSpan(out[p][l].data(), out[p][l].size() / ElementBytes(d), d)
                          : b.in;
              continue;
            }
            for (Bytes* host_bytes : {&in[p][l], &out[p][l]}) {
              void* ptr = backend.Allocate(std::max<size_t>(host_bytes->size(), 1));
              backend.ToDevice(ptr, host_bytes->data(), host_bytes->size());
              device.push_back(ptr);
            }
            b.in = GradSpan(device[device.size() - 2], inputs[l].size(), d);
            b.out = m.reduce_scatter
                        ? GradSpan(device.back(), out[p][l].size() / ElementBytes(d), d)
                        : b.in;
          }
          AlgorithmOptions ao;
          ao.seed = 5;
          ao.divisor = float(N);
          ao.segment_bytes = 8 << 10;  // several groups
          ao.reduce_scatter = m.reduce_scatter;
          ao.plane = p ? static_cast<DataPlane*>(&plane) : &host;
          const uint64_t before = backend.host_syncs();
          flags[p] = ExchangeBucketData(p ? static_cast<Communicator&>(scrambled) : gloo,
                                        m.algorithm, ao, layers);
          const uint64_t syncs = backend.host_syncs() - before;
          if (p == 1) {
            EXPECT_EQ(syncs, m.geometry ? 3u : 1u) << what << " rank " << r;
            EXPECT_GT(scrambled.device_spans(), 0) << what << " rank " << r;
          }
        }
        EXPECT_EQ(flags[0], uint64_t{1} << 2) << what << " rank " << r;
        EXPECT_EQ(flags[1], flags[0]) << what << " rank " << r;
        for (size_t l = 0; l < specs.size(); ++l) {
          Bytes& result = m.reduce_scatter ? out[1][l] : in[1][l];
          backend.ToHost(result.data(), device[2 * l + (m.reduce_scatter ? 1 : 0)], result.size());
          if (l == 2) continue;  // skipped: its values have no meaning
          const Bytes& want = m.reduce_scatter ? out[0][l] : in[0][l];
          EXPECT_TRUE(result == want) << what << " rank " << r << " layer " << specs[l].name;
        }
        for (void* ptr : device) backend.Free(ptr);
      }
      EXPECT_EQ(backend.live(), 0u) << what << " rank " << r;
    });
    ASSERT_EQ(JoinErrors(errors), "") << what;
  }
}

TEST(StagedPlane, DeviceWireOverAHostOnlyCommunicatorIsRefusedBeforeAnyRead) {
  const auto layers = MixedLayers();
  const auto errors = RunRanks(1, [&](Communicator& gloo) {
    ScrambledBackend backend;
    StagedPlane plane(backend, WireMemory::kDevice);
    ExchangeOptions o;
    o.plane = &plane;
    try {
      Exchanger ex(gloo, layers, o);
    } catch (...) {
      EXPECT_EQ(backend.host_syncs(), 0u);
      throw;
    }
  });
  EXPECT_NE(errors[0].find("plane scrambled: its wire is device memory, but communicator gloo "
                           "takes host spans only"),
            std::string::npos)
      << errors[0];
}

}  // namespace
}  // namespace geofp8
