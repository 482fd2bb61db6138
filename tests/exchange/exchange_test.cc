// Exchange engine over real Gloo TCP with ranks as threads: every CPU algorithm, world sizes
// {1,2,3,4,8} x counts {0,1,7,1000}, mixed per-layer policies, bucketing, fingerprint mismatches
// naming rank and layer, the non-finite skip and collective timeouts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <thread>
#include <tuple>

#include "kernels/exchange/algorithms.h"
#include "tests/exchange/exchange_harness.h"

namespace geofp8 {
namespace {

using namespace geofp8::testing;
using std::chrono::milliseconds;

std::vector<LayerSpec> OneLayer(size_t count, LayerPolicy p = {}) {
  return {LayerSpec{"grad", static_cast<int64_t>(count), 1, p}};
}

class Sweep : public ::testing::TestWithParam<std::tuple<int, size_t, Algorithm>> {};

TEST_P(Sweep, MatchesReferenceOnEveryRank) {
  const auto [n, count, algorithm] = GetParam();
  ExchangeOptions options;
  options.algorithm = algorithm;
  options.timeout = milliseconds(60000);
  const auto layers = OneLayer(count);
  const auto run = RunStep(n, layers, options);
  CheckRun(run, layers, options);
  EXPECT_FALSE(run.results[0].skipped);
}

std::string SweepName(const ::testing::TestParamInfo<Sweep::ParamType>& info) {
  return "n" + std::to_string(std::get<0>(info.param)) + "_count" +
         std::to_string(std::get<1>(info.param)) + "_" +
         std::string(AlgorithmName(std::get<2>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(
    Exchange, Sweep,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                       ::testing::Values(size_t{0}, size_t{1}, size_t{7}, size_t{1000}),
                       ::testing::Values(Algorithm::kTwoPhase, Algorithm::kAllGather,
                                         Algorithm::kFp32, Algorithm::kBf16)),
    SweepName);

// Several layers with different policies share buckets; a small cap splits them.
std::vector<LayerSpec> MixedLayers() {
  return {
      {"embed", 40, 25, Policy(Format::kFp8E4M3, Scaling::kTensor, 128, Rounding::kNearest)},
      {"fc1", 33, 31, Policy(Format::kFp8E5M2, Scaling::kBlock, 64, Rounding::kNearest)},
      {"fc2", 999, 1, Policy(Format::kMxfp8, Scaling::kBlock, 32, Rounding::kNearest)},
      {"fc3", 517, 1, Policy(Format::kNvfp4, Scaling::kBlock, 16, Rounding::kNearest)},
      {"norm", 7, 1, Policy(Format::kBf16, Scaling::kNone, 1, Rounding::kNearest)},
      {"head", 300, 3, Policy(Format::kFp8E4M3, Scaling::kBlock, 100, Rounding::kStochastic)},
      {"bias", 1, 1, Policy(Format::kFp32, Scaling::kNone, 1, Rounding::kNearest)},
  };
}

class Mixed : public ::testing::TestWithParam<std::tuple<int, Algorithm, size_t, int>> {};

// channels 1 and 2: the pipeline with one lane, and with the side channel's second lane.
TEST_P(Mixed, PerLayerPoliciesInBuckets) {
  const auto [n, algorithm, segment_bytes, channels] = GetParam();
  ExchangeOptions options;
  options.algorithm = algorithm;
  options.segment_bytes = segment_bytes;  // 1: every layer its own pipelined two_phase group
  options.seed = 1234;
  options.bucket_cap_bytes = 4096;  // several buckets
  const auto layers = MixedLayers();
  const auto run = RunStep(n, layers, options, /*step=*/5, {}, channels);
  CheckRun(run, layers, options, 5);
  EXPECT_GT(run.results[0].buckets.size(), 2u);
}

INSTANTIATE_TEST_SUITE_P(
    Exchange, Mixed,
    ::testing::Combine(::testing::Values(2, 3, 4),
                       ::testing::Values(Algorithm::kTwoPhase, Algorithm::kAllGather),
                       ::testing::Values(size_t{1}, size_t{4} << 20), ::testing::Values(1, 2)));

TEST(Buckets, ReverseOrderWithCap) {
  std::vector<LayerSpec> layers = {
      {"a", 10, 1, {}}, {"b", 100, 1, {}}, {"c", 5, 1, {}}, {"d", 1000, 1, {}}, {"e", 20, 1, {}}};
  const auto buckets = MakeBuckets(layers, 500);  // bytes: 40, 400, 20, 4000, 80
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0].layers, (std::vector<uint32_t>{4}));        // e; d would exceed the cap
  EXPECT_EQ(buckets[1].layers, (std::vector<uint32_t>{3}));        // d alone, over the cap
  EXPECT_EQ(buckets[2].layers, (std::vector<uint32_t>{2, 1, 0}));  // c + b + a = 460
  EXPECT_EQ(buckets[2].bytes, 460u);
  EXPECT_TRUE(MakeBuckets({}, 500).empty());
  EXPECT_EQ(MakeBuckets(layers, size_t{25} << 20).size(), 1u);
}

TEST(Exchanger, FuturesPerBucketAndBytesOnTheWire) {
  const int n = 4;
  const size_t count = 4096;
  std::vector<LayerSpec> layers = {{"l0", 1024, 1, {}}, {"l1", 2048, 1, {}}, {"l2", 1024, 1, {}}};
  ExchangeOptions options;
  options.bucket_cap_bytes = 4096 * 2;  // {l2}, {l1}, {l0}: no two neighbours fit together
  std::vector<uint64_t> bytes(n);
  const auto errors = RunRanks(n, [&](Communicator& comm) {
    Exchanger ex(comm, layers, options);
    ASSERT_EQ(ex.buckets().size(), 3u);
    Tensors data = MakeInputs(comm.rank(), layers);
    std::vector<std::span<float>> grads;
    for (auto& t : data) grads.emplace_back(t);
    std::vector<std::shared_future<BucketResult>> futures;
    for (size_t b = 0; b < ex.buckets().size(); ++b) futures.push_back(ex.Submit(3, b, grads));
    EXPECT_THROW(ex.Submit(3, 0, grads), Error);  // bucket 0 twice
    for (auto& f : futures) f.wait();
    const StepResult result = ex.Finish(3);
    bytes[comm.rank()] = result.bytes_sent;
  });
  ASSERT_EQ(JoinErrors(errors), "");
  // two_phase e4m3 block 128: 2(N-1)/N * n * (1 + 4/128) bytes plus headers and fingerprints.
  const double ideal = 2.0 * (n - 1) / n * count * (1 + 4.0 / 128);
  for (int r = 0; r < n; ++r) {
    EXPECT_GT(bytes[r], ideal * 0.9) << r;
    EXPECT_LT(bytes[r], ideal * 1.5) << r;
  }
}

// The trainer's path: BeginStep, then LayerReady as backward finishes each layer (last layer
// first). Every bucket must reach the exchange exactly as Submit would send it: the averaged
// gradients are bitwise those of the Submit path, and the bytes per layer add up to the step's.
TEST(Exchanger, LayerReadySubmitsBucketsAsBackwardCompletesThem) {
  const int n = 3;
  const auto layers = MixedLayers();
  ExchangeOptions options;
  options.bucket_cap_bytes = 4096;  // several buckets
  options.seed = 77;
  std::vector<Tensors> by_submit(n), by_ready(n);
  std::vector<StepResult> results(n);
  std::vector<std::vector<double>> layer_bytes(n);
  const auto errors = RunRanks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    for (int pass = 0; pass < 2; ++pass) {
      Exchanger ex(comm, layers, options);
      ASSERT_GT(ex.buckets().size(), 2u);
      Tensors data = MakeInputs(r, layers, 4);
      std::vector<std::span<float>> grads;
      for (auto& t : data) grads.emplace_back(t);
      StepResult result;
      if (pass == 0) {
        for (size_t b = 0; b < ex.buckets().size(); ++b) ex.Submit(4, b, grads);
        result = ex.Finish(4);
        by_submit[r] = data;
      } else {
        ex.BeginStep(4, grads);
        for (uint32_t l = uint32_t(layers.size()); l-- > 0;) ex.LayerReady(4, l);
        result = ex.Finish(4);
        by_ready[r] = data;
        results[r] = result;
        layer_bytes[r] = ex.LayerBytesSent(result);
        for (uint32_t l = 0; l < layers.size(); ++l) {
          EXPECT_EQ(std::count(ex.buckets()[ex.bucket_of(l)].layers.begin(),
                               ex.buckets()[ex.bucket_of(l)].layers.end(), l),
                    1);
        }
      }
    }
  });
  ASSERT_EQ(JoinErrors(errors), "");
  for (int r = 0; r < n; ++r) {
    for (size_t l = 0; l < layers.size(); ++l) {
      ASSERT_EQ(by_ready[r][l].size(), by_submit[r][l].size());
      EXPECT_EQ(0, std::memcmp(by_ready[r][l].data(), by_submit[r][l].data(),
                               by_ready[r][l].size() * sizeof(float)))
          << "rank " << r << " layer " << layers[l].name;
    }
    double sum = 0;
    for (double b : layer_bytes[r]) {
      EXPECT_GT(b, 0.0);
      sum += b;
    }
    // Shares of integers: exact up to the rounding of a few divisions.
    EXPECT_NEAR(sum, double(results[r].bytes_sent), 1e-9 * double(results[r].bytes_sent));
  }
}

// The shares follow the encoded sizes: one bucket holding an fp32 layer and an e4m3 layer of
// the same length sends about 4x more for the fp32 one.
TEST(Exchanger, LayerBytesSentSharesABucketByEncodedSize) {
  std::vector<LayerSpec> layers = {
      {"a", 1000, 1, Policy(Format::kFp32, Scaling::kNone, 1, Rounding::kNearest)},
      {"b", 1000, 1, Policy(Format::kFp8E4M3, Scaling::kTensor, 128, Rounding::kNearest)}};
  const auto errors = RunRanks(1, [&](Communicator& comm) {
    Exchanger ex(comm, layers, ExchangeOptions{});
    ASSERT_EQ(ex.buckets().size(), 1u);
    StepResult fake;
    fake.buckets.push_back(BucketResult{0, false, 5000, 0.0});
    const std::vector<double> bytes = ex.LayerBytesSent(fake);
    ASSERT_EQ(bytes.size(), 2u);
    EXPECT_NEAR(bytes[0] + bytes[1], 5000.0, 1e-9);
    CodecOptions o;
    o.format = Format::kFp8E4M3;
    o.scaling = Scaling::kTensor;
    o.block = 128;
    const double e4m3 = double(EncodedBytes(o, 1000));
    EXPECT_NEAR(bytes[0] / bytes[1], 4000.0 / e4m3, 1e-12);
    EXPECT_GT(bytes[0] / bytes[1], 3.5);
  });
  ASSERT_EQ(JoinErrors(errors), "");
}

TEST(Exchanger, LayerReadyErrorsNameTheLayer) {
  const auto layers = MixedLayers();
  ExchangeOptions options;
  options.bucket_cap_bytes = 4096;
  const auto errors = RunRanks(1, [&](Communicator& comm) {
    Exchanger ex(comm, layers, options);
    Tensors data = MakeInputs(0, layers);
    std::vector<std::span<float>> grads;
    for (auto& t : data) grads.emplace_back(t);
    EXPECT_THROW(ex.LayerReady(1, 0), Error);  // step not begun
    ex.BeginStep(1, grads);
    ex.LayerReady(1, 6);
    try {
      ex.LayerReady(1, 6);
      ADD_FAILURE() << "a layer ready twice was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("bias was reported ready twice in step 1"),
                std::string::npos)
          << e.what();
    }
    for (uint32_t l = 5; l >= 2; --l) ex.LayerReady(1, l);  // fc1 and embed never come
    try {
      ex.Finish(1);
      ADD_FAILURE() << "a step with layers never ready finished";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("never ready: embed, fc1"), std::string::npos)
          << e.what();
    }
  });
  ASSERT_EQ(JoinErrors(errors), "");
}

TEST(Exchanger, PolicyMismatchNamesRankAndLayer) {
  const auto layers = MixedLayers();
  ExchangeOptions options;
  const auto run = RunStep(3, layers, options, 0,
                           [](int r, std::vector<LayerSpec>& l, ExchangeOptions&, Tensors&) {
                             if (r == 2) l[1].policy.format = Format::kFp8E4M3;  // fc1 was e5m2
                           });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(run.errors[r].find("rank 2 layer 1 'fc1' has format fp8_e4m3"), std::string::npos)
        << "rank " << r << ": " << run.errors[r];
  }
}

TEST(Exchanger, ShapeMismatchNamesRankAndLayer) {
  const auto layers = MixedLayers();
  ExchangeOptions options;
  const auto run = RunStep(4, layers, options, 0,
                           [](int r, std::vector<LayerSpec>& l, ExchangeOptions&, Tensors& d) {
                             if (r == 1) {
                               l[5].rows = 299;  // head: 300x3 elsewhere
                               d[5].resize(299 * 3);
                             }
                           });
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(run.errors[r].find("rank 1 layer 5 'head'"), std::string::npos)
        << "rank " << r << ": " << run.errors[r];
  }
}

// Exchange() checks every bucket of the step with one gather; when the digests differ, the
// per-bucket records still find the layer, here in the last of several buckets.
TEST(Exchanger, MismatchInALaterBucketOfOneRunNamesRankAndLayer) {
  const auto layers = MixedLayers();
  for (Algorithm a : {Algorithm::kTwoPhase, Algorithm::kFp32}) {
    ExchangeOptions options;
    options.algorithm = a;
    options.bucket_cap_bytes = 4096;
    const auto buckets = MakeBuckets(layers, options.bucket_cap_bytes);
    ASSERT_GT(buckets.size(), 2u);
    const uint32_t target = buckets.back().layers.front();  // exchanged last
    const auto run = RunStep(3, layers, options, 0,
                             [&](int r, std::vector<LayerSpec>& l, ExchangeOptions&, Tensors&) {
                               if (r == 1) l[target].policy.block = 48;
                             });
    const std::string want =
        "rank 1 layer " + std::to_string(target) + " '" + layers[target].name + "' has block 48";
    for (int r = 0; r < 3; ++r) {
      EXPECT_NE(run.errors[r].find(want), std::string::npos)
          << AlgorithmName(a) << " rank " << r << ": " << run.errors[r];
    }
  }
}

// One fingerprint gather per step, whatever the bucket count, and the non-finite flags ride in
// the data: a pipelined step of one group costs three collectives (fingerprints, all-to-all,
// all-gather) and allgather two.
TEST(Exchanger, CollectivesPerStep) {
  const auto layers = MixedLayers();
  for (auto [a, want] : {std::pair{Algorithm::kTwoPhase, 3u}, std::pair{Algorithm::kAllGather, 2u},
                         std::pair{Algorithm::kFp32, 3u}}) {
    ExchangeOptions options;
    options.algorithm = a;
    options.bucket_cap_bytes = 4096;          // several buckets...
    options.segment_bytes = size_t{1} << 30;  // ...in one pipeline group
    std::vector<uint64_t> collectives(3);
    const auto errors = RunRanks(3, [&](Communicator& comm) {
      Exchanger ex(comm, layers, options);
      ASSERT_GT(ex.buckets().size(), 2u);
      Tensors data = MakeInputs(comm.rank(), layers);
      std::vector<std::span<float>> grads(data.begin(), data.end());
      const uint64_t before = comm.stats().collectives;
      ex.Exchange(0, grads);
      collectives[comm.rank()] = comm.stats().collectives - before;
    });
    ASSERT_EQ(JoinErrors(errors), "") << AlgorithmName(a);
    for (int r = 0; r < 3; ++r)
      EXPECT_EQ(collectives[r], want) << AlgorithmName(a) << " rank " << r;
  }
}

// algorithm auto (the job spec's default): allgather at 2 ranks, where it sends no more bytes
// than two_phase and needs one collective round fewer, two_phase from 3 ranks, where allgather
// would send N / 2 times more. Resolved on every rank from the world size alone.
TEST(Exchanger, AutoIsAllgatherAtTwoRanksAndTwoPhaseFromThree) {
  EXPECT_EQ(ParseAlgorithm("auto"), Algorithm::kAuto);
  EXPECT_EQ(AlgorithmName(Algorithm::kAuto), "auto");
  EXPECT_EQ(ResolveAlgorithm(Algorithm::kAuto, 1), Algorithm::kAllGather);
  EXPECT_EQ(ResolveAlgorithm(Algorithm::kAuto, 2), Algorithm::kAllGather);
  EXPECT_EQ(ResolveAlgorithm(Algorithm::kAuto, 3), Algorithm::kTwoPhase);
  EXPECT_EQ(ResolveAlgorithm(Algorithm::kAuto, 64), Algorithm::kTwoPhase);
  for (Algorithm a : {Algorithm::kTwoPhase, Algorithm::kAllGather, Algorithm::kFp32}) {
    EXPECT_EQ(ResolveAlgorithm(a, 2), a);
  }
  const auto layers = MixedLayers();
  for (int ranks : {2, 3}) {
    const Algorithm expect = ranks == 2 ? Algorithm::kAllGather : Algorithm::kTwoPhase;
    ExchangeOptions automatic;
    automatic.algorithm = Algorithm::kAuto;
    ExchangeOptions fixed = automatic;
    fixed.algorithm = expect;
    ExchangeOptions other = automatic;
    other.algorithm = ranks == 2 ? Algorithm::kTwoPhase : Algorithm::kAllGather;
    const auto a = RunStep(ranks, layers, automatic, 3);
    const auto f = RunStep(ranks, layers, fixed, 3);
    const auto o = RunStep(ranks, layers, other, 3);
    ASSERT_EQ(JoinErrors(a.errors), "") << ranks;
    ASSERT_EQ(JoinErrors(f.errors), "") << ranks;
    ASSERT_EQ(JoinErrors(o.errors), "") << ranks;
    for (int r = 0; r < ranks; ++r) {
      const std::string where = std::to_string(ranks) + " ranks, rank " + std::to_string(r);
      EXPECT_EQ(a.results[r].bytes_sent, f.results[r].bytes_sent) << where;
      // The choice is the one that sends fewer bytes (at 2 ranks: no more, and here fewer by
      // two_phase's second set of block scales for the requantized shard).
      EXPECT_LE(a.results[r].bytes_sent, o.results[r].bytes_sent) << where;
      for (size_t l = 0; l < layers.size(); ++l) {
        EXPECT_TRUE(SameBytes(a.outputs[r][l], f.outputs[r][l])) << where << " layer " << l;
      }
    }
  }
}

TEST(Exchanger, PolicyVersionMismatchFailsEverywhere) {
  const auto layers = OneLayer(100);
  ExchangeOptions options;
  const auto run = RunStep(3, layers, options, 0,
                           [](int r, std::vector<LayerSpec>&, ExchangeOptions& o, Tensors&) {
                             if (r == 0) o.policy_version = 7;
                           });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(run.errors[r].find("rank 0 has policy version 7"), std::string::npos)
        << "rank " << r << ": " << run.errors[r];
  }
}

TEST(Exchanger, NonFiniteOnOneRankSkipsEverywhere) {
  const auto layers = MixedLayers();
  for (Algorithm a :
       {Algorithm::kTwoPhase, Algorithm::kAllGather, Algorithm::kFp32, Algorithm::kBf16}) {
    for (float bad : {std::nanf(""), -std::numeric_limits<float>::infinity()}) {
      ExchangeOptions options;
      options.algorithm = a;
      options.bucket_cap_bytes = 4096;  // several buckets: only fc2's may be skipped
      const auto run = RunStep(3, layers, options, 0,
                               [&](int r, std::vector<LayerSpec>&, ExchangeOptions&, Tensors& d) {
                                 if (r == 1) d[2][17] = bad;  // fc2
                               });
      ASSERT_EQ(JoinErrors(run.errors), "") << AlgorithmName(a);
      const auto buckets = MakeBuckets(layers, options.bucket_cap_bytes);
      for (int r = 0; r < 3; ++r) {
        const std::string where = std::string(AlgorithmName(a)) + " rank " + std::to_string(r);
        EXPECT_TRUE(run.results[r].skipped) << where;
        ASSERT_EQ(run.results[r].buckets.size(), run.results[0].buckets.size()) << where;
        size_t skipped = 0;
        for (const auto& b : run.results[r].buckets) {
          const auto& members = buckets.at(b.bucket).layers;
          const bool has_fc2 = std::find(members.begin(), members.end(), 2u) != members.end();
          EXPECT_EQ(b.skipped, has_fc2) << where << " bucket " << b.bucket;
          skipped += b.skipped;
          if (b.skipped) continue;
          // The other buckets are averaged as usual: byte-identical on every rank.
          for (uint32_t l : members) {
            EXPECT_TRUE(SameBytes(run.outputs[r][l], run.outputs[0][l])) << where << " layer " << l;
          }
        }
        EXPECT_EQ(skipped, 1u) << where;
      }
    }
  }
}

// ExchangeOptions::inline_bytes: a run on the calling thread as one group gives the pipelined
// run's bits and bytes (same stream keys, same chunks), and skips a non-finite bucket everywhere.
TEST(Exchanger, InlineRunMatchesThePipelineBitForBit) {
  const auto layers = MixedLayers();
  for (Algorithm a : {Algorithm::kTwoPhase, Algorithm::kAllGather}) {
    ExchangeOptions piped;
    piped.algorithm = a;
    piped.segment_bytes = 2048;  // many groups in the pipelined run
    ExchangeOptions inl = piped;
    inl.inline_bytes = size_t{1} << 30;
    const auto p = RunStep(3, layers, piped, 5);
    const auto q = RunStep(3, layers, inl, 5);
    ASSERT_EQ(JoinErrors(p.errors), "") << AlgorithmName(a);
    ASSERT_EQ(JoinErrors(q.errors), "") << AlgorithmName(a);
    CheckRun(q, layers, inl, 5);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(q.results[r].bytes_sent, p.results[r].bytes_sent) << AlgorithmName(a);
      for (size_t l = 0; l < layers.size(); ++l) {
        EXPECT_TRUE(SameBytes(q.outputs[r][l], p.outputs[r][l]))
            << AlgorithmName(a) << " rank " << r << " layer " << l;
      }
    }
    const auto bad = RunStep(3, layers, inl, 5,
                             [](int r, std::vector<LayerSpec>&, ExchangeOptions&, Tensors& d) {
                               if (r == 2) d[1][3] = std::nanf("");
                             });
    ASSERT_EQ(JoinErrors(bad.errors), "") << AlgorithmName(a);
    for (int r = 0; r < 3; ++r) EXPECT_TRUE(bad.results[r].skipped) << AlgorithmName(a) << r;
  }
}

TEST(Exchanger, CollectiveTimeoutFailsInsteadOfHanging) {
  const auto layers = OneLayer(1000);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = RunRanks(2, [&](Communicator& comm) {
    ExchangeOptions options;
    options.timeout = milliseconds(300);
    Exchanger ex(comm, layers, options);
    if (comm.rank() == 1) {
      std::this_thread::sleep_for(milliseconds(1500));  // never exchanges
      return;
    }
    Tensors data = MakeInputs(0, layers);
    ex.Exchange(0, {std::span<float>(data[0])});
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(errors[0].find("rank 0"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[1], "");
  EXPECT_LT(seconds, 20.0);
}

// geofp8.torch runs one Exchanger per DDP bucket: with layer_ids, a layer's stochastic-rounding
// stream is keyed by its model index, so splitting the model over exchangers changes no bit.
TEST(Exchanger, LayerIdsMakeResultsIndependentOfTheSplit) {
  const int n = 2;
  LayerPolicy sr;
  sr.rounding = Rounding::kStochastic;
  const std::vector<LayerSpec> all = {{"l0", 1000, 1, sr}, {"l1", 777, 1, sr}, {"l2", 500, 1, sr}};
  std::vector<Tensors> whole(n), split(n), unkeyed(n);
  const auto errors = RunRanks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    ExchangeOptions options;
    options.seed = 9;
    whole[r] = MakeInputs(r, all);
    split[r] = whole[r];
    unkeyed[r] = whole[r];
    std::vector<std::span<float>> g;
    for (auto& t : whole[r]) g.emplace_back(t);
    Exchanger(comm, all, options).Exchange(4, g);
    ExchangeOptions even = options;
    even.layer_ids = {0, 2};
    Exchanger(comm, {all[0], all[2]}, even)
        .Exchange(4, {std::span<float>(split[r][0]), std::span<float>(split[r][2])});
    ExchangeOptions odd = options;
    odd.layer_ids = {1};
    Exchanger(comm, {all[1]}, odd).Exchange(4, {std::span<float>(split[r][1])});
    // Without layer_ids l1 is layer 0 of its exchanger: another stream.
    Exchanger(comm, {all[1]}, options).Exchange(4, {std::span<float>(unkeyed[r][1])});
  });
  ASSERT_EQ(JoinErrors(errors), "");
  for (int r = 0; r < n; ++r) {
    for (size_t l = 0; l < all.size(); ++l) EXPECT_EQ(whole[r][l], split[r][l]) << r << " " << l;
    EXPECT_NE(whole[r][1], unkeyed[r][1]) << r;
  }
  MemoryStore store;
  auto comm = CreateGlooCommunicator(store, 0, 1);
  ExchangeOptions bad;
  bad.layer_ids = {0, 1};
  try {
    Exchanger ex(*comm, {all[0]}, bad);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer_ids: needs one entry per layer (2 entries for 1"),
              std::string::npos)
        << e.what();
  }
}

TEST(Exchanger, RejectsBadPolicyNamingLayerAndField) {
  MemoryStore store;
  auto comm = CreateGlooCommunicator(store, 0, 1);
  auto layers = OneLayer(10);
  layers[0].name = "w";
  layers[0].policy.error_feedback = true;
  const Format format = layers[0].policy.format;
  layers[0].policy.format = Format::kFp32;  // nothing to feed back
  try {
    Exchanger ex(*comm, layers, {});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 'w': error_feedback: fp32 loses nothing"),
              std::string::npos)
        << e.what();
  }
  layers[0].policy.format = format;
  layers[0].policy.error_feedback = false;
  EXPECT_THROW(Exchanger(*comm, layers, {}, {RefreshSchedule{3, 10, 0}}), Error);  // owner 3 of 1
  for (int nice : {-1, 20}) {
    ExchangeOptions o;
    o.helper_nice = nice;
    try {
      Exchanger ex(*comm, layers, o);
      ADD_FAILURE() << "helper_nice " << nice << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("helper_nice: must be in [0, 19] (" +
                                           std::to_string(nice) + ")"),
                std::string::npos)
          << e.what();
    }
  }
  ExchangeOptions native;
  native.algorithm = Algorithm::kNative;
  Exchanger ex(*comm, layers, native);
  std::vector<float> g(10, 1.f);
  try {
    ex.Exchange(0, {std::span<float>(g)});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("native needs a backend with FP8 all-reduce"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace geofp8

namespace geofp8 {
namespace {

// Forwards to a real communicator but fails the k-th call of one collective ("alltoallv" or
// "allgatherv"): a transport failure in the middle of the pipeline, while the helper thread and
// the other lane are busy. `side` is what side_channel() returns.
class FailingComm final : public Communicator {
 public:
  FailingComm(Communicator& inner, std::string op, int fail_at, Communicator* side = nullptr)
      : inner_(inner), op_(std::move(op)), fail_at_(fail_at), side_(side) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view backend() const override { return "failing"; }
  Communicator* side_channel() override { return side_; }
  void AllToAllV(std::span<const uint8_t> s, std::span<const size_t> sc, std::span<uint8_t> r,
                 std::span<const size_t> rc) override {
    MaybeFail("alltoallv");
    inner_.AllToAllV(s, sc, r, rc);
  }
  void AllGatherV(std::span<const uint8_t> s, std::span<uint8_t> r,
                  std::span<const size_t> c) override {
    MaybeFail("allgatherv");
    inner_.AllGatherV(s, r, c);
  }
  void AllReduceSum(std::span<float> d) override { inner_.AllReduceSum(d); }
  void AllReduceSumBf16(std::span<uint16_t> d) override { inner_.AllReduceSumBf16(d); }
  void Broadcast(std::span<uint8_t> d, int root) override { inner_.Broadcast(d, root); }
  uint32_t MaxReduce(uint32_t v) override { return inner_.MaxReduce(v); }
  void Barrier() override { inner_.Barrier(); }

 private:
  void MaybeFail(const char* op) {
    if (op_ == op && ++calls_ == fail_at_) GEOFP8_FAIL("injected ", op, " failure");
  }

  Communicator& inner_;
  std::string op_;
  int fail_at_;
  Communicator* side_;
  int calls_ = 0;
};

// A failure on either lane (the main channel's all-to-alls, the side channel's all-gathers) or
// with no side channel at all is reported as itself, and the engine stays usable.
TEST(Exchanger, TransportFailureInsidePipelineSurfacesAsError) {
  MemoryStore store;
  auto real = CreateGlooCommunicator(store, 0, 1);
  ASSERT_NE(real->side_channel(), nullptr);
  struct Case {
    const char* main_op;
    const char* side_op;
    bool with_side;
    const char* want;
  };
  for (const Case& c : {Case{"alltoallv", "", true, "injected alltoallv failure"},
                        Case{"", "allgatherv", true, "injected allgatherv failure"},
                        Case{"alltoallv", "", false, "injected alltoallv failure"},
                        Case{"allgatherv", "", false, "injected allgatherv failure"}}) {
    FailingComm side(*real->side_channel(), c.side_op, 3);
    FailingComm comm(*real, c.main_op, 3, c.with_side ? &side : nullptr);  // the third group
    std::vector<LayerSpec> layers;
    for (int i = 0; i < 6; ++i) layers.push_back({"l" + std::to_string(i), 512, 1, {}});
    ExchangeOptions options;
    options.segment_bytes = 1;  // one group per layer
    Exchanger ex(comm, layers, options);
    Tensors data = MakeInputs(0, layers);
    std::vector<std::span<float>> grads(data.begin(), data.end());
    try {
      ex.Exchange(0, grads);
      ADD_FAILURE() << "no error: " << c.want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.want), std::string::npos) << e.what();
    }
    // The next step goes through and averages (N = 1: identity through fp8 quantization).
    Tensors again = MakeInputs(0, layers);
    std::vector<std::span<float>> grads2(again.begin(), again.end());
    const StepResult r = ex.Exchange(1, grads2);
    EXPECT_FALSE(r.skipped) << c.want;
    EXPECT_EQ(r.buckets.size(), 1u) << c.want;
  }
}

}  // namespace
}  // namespace geofp8

namespace geofp8 {
namespace {

TEST(ExchangeBucketData, HelperThreadErrorIsReportedNotSwallowed) {
  MemoryStore store;
  auto comm = CreateGlooCommunicator(store, 0, 1);
  // A geometry whose shape does not match the layer: ApplyGeometry throws on the helper thread.
  Geometry g;
  g.mode = GeometryMode::kDiag;
  g.version = 1;
  g.m = 3;
  g.n = 3;
  g.row_scale.assign(3, 1.f);
  g.col_scale.assign(3, 1.f);
  for (Algorithm a : {Algorithm::kTwoPhase, Algorithm::kAllGather}) {
    std::vector<float> in(10, 1.f), out(10);
    std::vector<BucketLayer> layers = {{0, {}, &g, in, out}};
    AlgorithmOptions ao;
    try {
      ExchangeBucketData(*comm, a, ao, layers);
      FAIL() << "no error for " << AlgorithmName(a);
    } catch (const std::exception& e) {
      EXPECT_EQ(std::string(e.what()).find("helper thread failed"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace geofp8
