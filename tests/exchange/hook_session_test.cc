// HookSession (kernels/exchange/hook_session.h): flat buckets averaged exactly on ranks as threads
// (exchange, submit, reduce-scatter), the checks that name the layer, offset or backend, the
// trace, abort, and a callback dropped unrun when the session goes.
#include "kernels/exchange/hook_session.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/check.h"
#include "tests/exchange/rank_threads.h"

namespace geofp8::testing {
namespace {

// "w" (4 x 6), "b" (1-D, 5) and "v" (5 x 3): a matrix, a 1-D layer, and one whose rows do not
// split evenly over two ranks.
const std::vector<std::string> kNames = {"w", "b", "v"};
const std::vector<std::pair<int64_t, int64_t>> kShapes = {{4, 6}, {1, 5}, {5, 3}};

// Runs `body` on `n` ranks as threads, each with its own session over one MemoryStore.
std::vector<std::string> RunSessions(int n, const std::function<void(HookSession&, int)>& body) {
  MemoryStore store;
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        HookSessionOptions o;
        o.rank = r;
        o.size = n;
        o.timeout = std::chrono::milliseconds(60000);
        HookSession s(store, o);
        s.SetLayers(kNames, kShapes);
        body(s, r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// fp32 over the plain all-reduce: the average of small integers is exact.
EnginePolicy Fp32Policy() {
  EnginePolicy p;
  LayerPolicy lp;
  lp.format = Format::kFp32;
  p.layers.assign(kNames.size(), lp);
  p.options.algorithm = Algorithm::kFp32;
  return p;
}

// A bucket buffer holding "b" at 0 and "w" at 7 (a gap between them, 2 floats after): the values
// i + 100 rank, whose average over two ranks is i + 50.
struct Buffer {
  std::vector<float> data = std::vector<float>(33, -1.0f);
  explicit Buffer(int rank) {
    for (int64_t i = 0; i < 5; ++i) data[i] = float(i + 100 * rank);
    for (int64_t i = 0; i < 24; ++i) data[7 + i] = float(i + 100 * rank);
  }
  FlatBucket Bucket() { return FlatBucket{{1, 0}, data, {0, 7}}; }
  void ExpectAveraged() const {
    for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(data[i], float(i + 50)) << "b[" << i << "]";
    for (int64_t i = 0; i < 24; ++i) EXPECT_EQ(data[7 + i], float(i + 50)) << "w[" << i << "]";
    EXPECT_EQ(data[5], -1.0f);  // the gap and the tail are not the bucket's
    EXPECT_EQ(data[32], -1.0f);
  }
};

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(HookSession, ExchangeAveragesTheBucketsLayersInPlace) {
  const auto errors = RunSessions(2, [](HookSession& s, int rank) {
    EXPECT_EQ(s.size(), 2);
    EXPECT_EQ(s.rank(), rank);
    EXPECT_STREQ(s.backend(), "gloo");
    EXPECT_FALSE(s.on_device());
    s.SetPolicy(Fp32Policy());
    Buffer buf(rank);
    std::chrono::steady_clock::time_point started{};
    const StepResult r = s.Exchange(1, buf.Bucket(), &started);
    EXPECT_FALSE(r.skipped);
    EXPECT_NE(started, std::chrono::steady_clock::time_point{});
    buf.ExpectAveraged();
  });
  EXPECT_EQ(JoinErrors(errors), "");
}

TEST(HookSession, SubmitRunsTheSameExchangeAndCallsDone) {
  const auto errors = RunSessions(2, [](HookSession& s, int rank) {
    s.SetPolicy(Fp32Policy());
    Buffer buf(rank);
    int calls = 0;
    bool ok = false;
    s.Submit(1, buf.Bucket(), [&](const ExchangeEngine::Completion& c) {
      ++calls;
      ok = c.result != nullptr && !c.error;
    });
    s.engine().Drain();
    EXPECT_EQ(calls, 1);
    EXPECT_TRUE(ok);
    EXPECT_EQ(s.engine().in_flight(), 0u);
    buf.ExpectAveraged();
  });
  EXPECT_EQ(JoinErrors(errors), "");
}

TEST(HookSession, ReduceScatterWritesThisRanksRows) {
  const auto errors = RunSessions(2, [](HookSession& s, int rank) {
    s.SetPolicy(Fp32Policy());
    // "v" (5 x 3) at 0: rank 0 gets rows 0-2 (9 floats), rank 1 rows 3-4 (6 floats).
    std::vector<float> data(15);
    for (int i = 0; i < 15; ++i) data[i] = float(i + 100 * rank);
    std::vector<float> out(12, -1.0f);
    s.ReduceScatter(1, FlatBucket{{2}, data, {0}}, out, {2});
    const int rows = rank == 0 ? 3 : 2;
    for (int i = 0; i < rows * 3; ++i) {
      EXPECT_EQ(out[2 + i], float(9 * rank + i + 50)) << "out[" << 2 + i << "]";
    }
    EXPECT_EQ(out[1], -1.0f);
    EXPECT_EQ(out[2 + rows * 3], -1.0f);
    // An output too small for this rank's rows is refused naming the layer.
    const std::string error = ErrorOf([&] { s.ReduceScatter(2, {{2}, data, {0}}, out, {10}); });
    EXPECT_EQ(error.rfind("reduce-scatter: layer 'v' at output offset 10", 0), 0u) << error;
  });
  EXPECT_EQ(JoinErrors(errors), "");
}

TEST(HookSession, BucketChecksNameTheLayerAndOffset) {
  const auto errors = RunSessions(1, [](HookSession& s, int) {
    Buffer buf(0);
    EXPECT_EQ(ErrorOf([&] { s.Exchange(1, buf.Bucket()); }), "exchange: set_policy first");
    s.SetPolicy(Fp32Policy());
    const std::span<float> all(buf.data);
    auto error = [&](const FlatBucket& b) { return ErrorOf([&] { s.Exchange(1, b); }); };
    EXPECT_EQ(error({{0}, all, {10}}),
              "exchange: layer 'w' at offset 10 + 24 is outside the bucket of 33 elements");
    EXPECT_EQ(error({{0, 1}, all, {0}}), "exchange: 2 layers but 1 offsets");
    EXPECT_EQ(error({{}, all, {}}), "exchange: 0 layers but 0 offsets");
    EXPECT_EQ(error({{3}, all, {0}}), "exchange: layer index 3 >= 3");
    EXPECT_EQ(
        error({{1}, all, {0}, /*on_device=*/true}).rfind("device: this engine runs on CPU", 0), 0u);
    // A refused Submit queues nothing and never calls its callback.
    bool called = false;
    auto done = [&](const ExchangeEngine::Completion&) { called = true; };
    EXPECT_NE(ErrorOf([&] { s.Submit(1, {{0}, all, {10}}, done); }), "");
    s.engine().Drain();
    EXPECT_FALSE(called);
    EXPECT_EQ(s.engine().in_flight(), 0u);
  });
  EXPECT_EQ(JoinErrors(errors), "");
}

TEST(HookSession, LayersAndPoliciesAreChecked) {
  const auto errors = RunSessions(1, [](HookSession& s, int) {
    EXPECT_EQ(s.params().size(), 3u);
    EXPECT_EQ(s.params()[2].offset, 29);  // 24 + 5: the model's flat layout
    using Shapes = std::vector<std::pair<int64_t, int64_t>>;
    auto error = [&](const std::vector<std::string>& names, const Shapes& shapes) {
      return ErrorOf([&] { s.SetLayers(names, shapes); });
    };
    EXPECT_EQ(error({"a", "b"}, {{2, 2}}), "layers: 2 names but 1 shapes");
    EXPECT_EQ(error({"a"}, {{0, 2}}), "layers: parameter 'a' has shape (0, 2)");
    EXPECT_EQ(error({}, {}), "layers: the model has no parameter that requires a gradient");
    // The host plane runs error feedback; a policy for another model is refused.
    EnginePolicy p = Fp32Policy();
    p.layers[0].error_feedback = true;
    EXPECT_EQ(ErrorOf([&] { s.CheckPolicy(p.layers); }), "");
    p.layers.pop_back();
    EXPECT_EQ(ErrorOf([&] { s.CheckPolicy(p.layers); }), "policy: 2 layer policies for 3 layers");
  });
  EXPECT_EQ(JoinErrors(errors), "");
}

TEST(HookSession, ParamsNeedTheLayers) {
  MemoryStore store;
  HookSession s(store, HookSessionOptions{});
  EXPECT_EQ(ErrorOf([&] { s.params(); }), "policy: set_layers first");
}

TEST(HookSession, OptionsAreChecked) {
  MemoryStore store;
  HookSessionOptions o;
  o.backend = "mpi";
  EXPECT_EQ(ErrorOf([&] { HookSession s(store, o); }),
            "backend: unknown value 'mpi' (accepted: gloo, nccl)");
  o.backend = "gloo";
  for (double bad : {0.0, -1.0, 0.0004, std::nan("")}) {
    o.timeout = std::chrono::duration<double>(bad);
    EXPECT_EQ(ErrorOf([&] { HookSession s(store, o); }).rfind("timeout: must be > 0 seconds", 0),
              0u)
        << bad;
  }
  // nccl: refused by name in a build without the device plane, or on a machine without a GPU.
  o.timeout = std::chrono::milliseconds(1000);
  o.backend = "nccl";
  if (!HookSession::kHasDevicePlane) {
    EXPECT_EQ(ErrorOf([&] { HookSession s(store, o); }).rfind("device: CUDA tensors need", 0), 0u);
  }
}

// A rank's own store over the ranks' shared one, which says when it goes.
class KeptStore final : public Store {
 public:
  KeptStore(Store& shared, std::atomic<int>& gone) : shared_(shared), gone_(gone) {}
  ~KeptStore() override { ++gone_; }
  void Set(const std::string& k, const std::vector<uint8_t>& v) override { shared_.Set(k, v); }
  std::vector<uint8_t> Get(const std::string& k, std::chrono::milliseconds t) override {
    return shared_.Get(k, t);
  }
  void Wait(const std::vector<std::string>& k, std::chrono::milliseconds t) override {
    shared_.Wait(k, t);
  }
  int64_t Add(const std::string& k, int64_t d) override { return shared_.Add(k, d); }

 private:
  Store& shared_;
  std::atomic<int>& gone_;
};

TEST(HookSession, AnOwnedStoreLivesAsLongAsTheSession) {
  MemoryStore shared;
  std::atomic<int> gone{0};
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        HookSessionOptions o;
        o.rank = r;
        o.size = 2;
        auto s = std::make_unique<HookSession>(std::make_unique<KeptStore>(shared, gone), o);
        s->SetLayers(kNames, kShapes);
        s->SetPolicy(Fp32Policy());
        Buffer buf(r);
        s->Exchange(1, buf.Bucket());
        buf.ExpectAveraged();
        EXPECT_EQ(gone.load(), 0);
        s->engine().AgreeMin(1);  // neither rank's session goes before both have exchanged
        s.reset();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(JoinErrors(errors), "");
  EXPECT_EQ(gone.load(), 2);
}

TEST(HookSession, GradientDtypesByTorchsNames) {
  for (GradDtype d : {GradDtype::kFp32, GradDtype::kBf16, GradDtype::kFp16}) {
    EXPECT_EQ(GradDtypeNamed(GradDtypeName(d)), d) << GradDtypeName(d);
  }
  for (std::string bad : {"float64", "", "Float32", "bf16"}) {
    EXPECT_EQ(ErrorOf([&] { GradDtypeNamed(bad); }),
              "gradient dtype: unknown value '" + bad + "' (accepted: float32, bfloat16, float16)");
  }
}

TEST(HookSession, WriteTraceNeedsATrace) {
  const auto errors = RunSessions(2, [](HookSession& s, int rank) {
    s.SetPolicy(Fp32Policy());
    EXPECT_EQ(ErrorOf([&] { s.WriteTrace("unused.json"); }),
              "write_trace: no trace recorded (call start_trace first)");
    s.engine().StartTrace();
    Buffer buf(rank);
    s.Exchange(1, buf.Bucket());
    const std::string path =
        ::testing::TempDir() + "hook_session_trace" + std::to_string(rank) + ".json";
    EXPECT_GT(s.WriteTrace(path), 0u);
    std::remove(path.c_str());
  });
  EXPECT_EQ(JoinErrors(errors), "");
}

TEST(HookSession, AbortMakesTheNextExchangeFailWithTheReason) {
  const auto errors = RunSessions(2, [](HookSession& s, int rank) {
    s.SetPolicy(Fp32Policy());
    EXPECT_TRUE(s.Abort("the bucket watch gave up"));
    Buffer buf(rank);
    EXPECT_NE(ErrorOf([&] { s.Exchange(1, buf.Bucket()); }).find("the bucket watch gave up"),
              std::string::npos);
  });
  EXPECT_EQ(JoinErrors(errors), "");
}

TEST(HookSession, AQueuedBucketIsDroppedUncalledWithTheSession) {
  // The session goes while its bucket waits on the peer that never exchanges: the wire is
  // stopped and the callback destroyed, never called.
  MemoryStore store;
  auto called = std::make_shared<std::atomic<bool>>(false);
  std::thread peer;
  {
    HookSessionOptions o0, o1;
    o0.size = o1.size = 2;
    o1.rank = 1;
    std::unique_ptr<HookSession> s1;
    peer = std::thread([&] { s1 = std::make_unique<HookSession>(store, o1); });
    HookSession s0(store, o0);
    peer.join();
    s0.SetLayers(kNames, kShapes);
    s0.SetPolicy(Fp32Policy());
    Buffer buf(0);
    s0.Submit(1, buf.Bucket(),
              [called](const ExchangeEngine::Completion&) { called->store(true); });
    s0.Submit(2, buf.Bucket(),
              [called](const ExchangeEngine::Completion&) { called->store(true); });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_GE(s0.engine().in_flight(), 1u);
  }
  EXPECT_FALSE(called->load());
}

}  // namespace
}  // namespace geofp8::testing
