// The fingerprint record in the first data round (AlgorithmOptions::check_record) over real Gloo
// TCP with ranks as threads: the same bits as the separate max-reduce round, one collective round
// fewer per run, and ranks whose layouts differ (encoded sizes bigger and smaller than their
// peers', other chunkings, steps, policy versions, geometry digests) get the diagnosis's error
// naming rank and layer on every rank instead of a transport failure or a process abort.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>

#include "kernels/exchange/algorithms.h"
#include "kernels/exchange/fingerprint.h"
#include "tests/exchange/exchange_harness.h"

namespace geofp8 {
namespace {

using namespace geofp8::testing;

// Several formats and block sizes in a few buckets (cap 4096 bytes), each several groups when
// segment_bytes is small.
std::vector<LayerSpec> Layers() {
  return {
      {"embed", 40, 25, Policy(Format::kFp8E4M3, Scaling::kTensor, 128)},
      {"fc1", 33, 31, Policy(Format::kFp8E5M2, Scaling::kBlock, 64)},
      {"fc2", 999, 1, Policy(Format::kMxfp8, Scaling::kBlock, 32)},
      {"fc3", 517, 1, Policy(Format::kNvfp4, Scaling::kBlock, 16)},
      {"norm", 7, 1, Policy(Format::kBf16, Scaling::kNone, 1)},
      {"head", 300, 3, Policy(Format::kFp8E4M3, Scaling::kBlock, 100, Rounding::kStochastic)},
      {"bias", 1, 1, Policy(Format::kFp32, Scaling::kNone, 1)},
  };
}

// ranks, algorithm, inline (one group on the calling thread) or pipelined, Gloo channels (2: the
// pipeline's second lane on the side channel).
using Config = std::tuple<int, Algorithm, bool, int>;

std::string ConfigName(const ::testing::TestParamInfo<Config>& info) {
  const auto [n, a, in_line, channels] = info.param;
  return "n" + std::to_string(n) + "_" + std::string(AlgorithmName(a)) +
         (in_line ? "_inline" : "_threaded") + "_channels" + std::to_string(channels);
}

class FusedCheck : public ::testing::TestWithParam<Config> {};

// On a communicator where a step with this layout has passed the separate check, the next steps
// fuse it, also in an Exchanger built afterwards (as geofp8.torch rebuilds them); on a fresh
// communicator the first step does not. Same step, same inputs: the same bits on every rank, the
// same skip decisions, and one collective round fewer.
TEST_P(FusedCheck, SameBitsAsTheSeparateRoundAndOneRoundFewer) {
  const auto [n, algorithm, in_line, channels] = GetParam();
  const auto layers = Layers();
  ExchangeOptions options;
  options.algorithm = algorithm;
  options.seed = 99;
  options.bucket_cap_bytes = 4096;
  options.segment_bytes = 1024;  // pipelined: several groups per run
  options.inline_bytes = in_line ? size_t{1} << 30 : 0;
  for (const bool with_nan : {false, true}) {
    std::vector<Tensors> fused(n), rebuilt(n), separate(n);
    std::vector<StepResult> fused_result(n), rebuilt_result(n), separate_result(n);
    std::vector<uint64_t> fused_rounds(n), rebuilt_rounds(n), separate_rounds(n);
    auto step1 = [&](Communicator& comm, Exchanger& ex, Tensors& out, StepResult& result,
                     uint64_t& rounds) {
      const int r = comm.rank();
      out = MakeInputs(r, layers, 1);
      if (with_nan && r == n - 1) out[2][17] = std::nanf("");  // fc2's bucket is skipped
      const uint64_t before = comm.stats().collectives;
      result = ex.Exchange(1, std::vector<std::span<float>>(out.begin(), out.end()));
      rounds = comm.stats().collectives - before;
    };
    auto errors = RunRanks(
        n,
        [&](Communicator& comm) {
          const int r = comm.rank();
          {
            Exchanger warm(comm, layers, options);
            Tensors step0 = MakeInputs(r, layers, 0);
            warm.Exchange(0, std::vector<std::span<float>>(step0.begin(), step0.end()));
            step1(comm, warm, fused[r], fused_result[r], fused_rounds[r]);
          }
          Exchanger again(comm, layers, options);
          step1(comm, again, rebuilt[r], rebuilt_result[r], rebuilt_rounds[r]);
        },
        std::chrono::milliseconds(60000), channels);
    ASSERT_EQ(JoinErrors(errors), "") << "nan " << with_nan;
    errors = RunRanks(
        n,
        [&](Communicator& comm) {
          Exchanger fresh(comm, layers, options);
          const int r = comm.rank();
          step1(comm, fresh, separate[r], separate_result[r], separate_rounds[r]);
        },
        std::chrono::milliseconds(60000), channels);
    ASSERT_EQ(JoinErrors(errors), "") << "nan " << with_nan;
    const auto buckets = MakeBuckets(layers, options.bucket_cap_bytes);
    for (int r = 0; r < n; ++r) {
      const std::string where = "nan " + std::to_string(with_nan) + " rank " + std::to_string(r);
      // One RunBuckets (Exchange runs every bucket at once): exactly one round fewer.
      EXPECT_EQ(fused_rounds[r] + 1, separate_rounds[r]) << where;
      EXPECT_EQ(rebuilt_rounds[r], fused_rounds[r]) << where;
      EXPECT_EQ(fused_result[r].skipped, with_nan) << where;
      ASSERT_EQ(fused_result[r].buckets.size(), separate_result[r].buckets.size()) << where;
      for (size_t b = 0; b < fused_result[r].buckets.size(); ++b) {
        EXPECT_EQ(fused_result[r].buckets[b].skipped, separate_result[r].buckets[b].skipped)
            << where << " bucket " << b;
        if (fused_result[r].buckets[b].skipped) continue;  // outputs hold no meaningful values
        for (uint32_t l : buckets.at(fused_result[r].buckets[b].bucket).layers) {
          EXPECT_TRUE(SameBytes(fused[r][l], separate[r][l]))
              << where << " layer " << l << " first difference at "
              << FirstBitDifference(fused[r][l], separate[r][l]);
          EXPECT_TRUE(SameBytes(rebuilt[r][l], separate[r][l])) << where << " layer " << l;
          EXPECT_TRUE(SameBytes(fused[r][l], fused[0][l])) << where << " layer " << l;
        }
      }
    }
  }
}

// What one rank of a mismatch test changes: its policy for one layer (a different encoded size
// or chunking) or its record (step, policy version, geometry digest), and what every rank's error
// must then say.
struct Difference {
  const char* name;
  std::function<void(std::vector<LayerSpec>&, BucketRecord&, std::vector<LayerRecord>&)> apply;
  std::string want;
};

std::vector<Difference> Differences() {
  auto policy_of = [](uint32_t layer, LayerPolicy p) {
    return [layer, p](std::vector<LayerSpec>& l, BucketRecord&, std::vector<LayerRecord>&) {
      l[layer].policy = p;
    };
  };
  return {
      // fc2 (mxfp8, ~1 byte per element) as fp32: 4 bytes per element, bigger than the peers'.
      {"bigger_fp32", policy_of(2, Policy(Format::kFp32, Scaling::kNone, 1)),
       "rank 1 layer 2 'fc2' has format fp32 (others: mxfp8)"},
      // fp8 with block 1: the largest encoding of any option set (MaxEncodedBytes).
      {"largest_block1", policy_of(2, Policy(Format::kFp8E4M3, Scaling::kBlock, 1)),
       "rank 1 layer 2 'fc2' has format fp8_e4m3 (others: mxfp8)"},
      // fc1 (e5m2 block 64) as nvfp4: half a byte per element, smaller than the peers'.
      {"smaller_nvfp4", policy_of(1, Policy(Format::kNvfp4, Scaling::kBlock, 16)),
       "rank 1 layer 1 'fc1' has format nvfp4 (others: fp8_e5m2)"},
      // head's block 100 as 7: more scales and, for two_phase, other chunk boundaries.
      {"block7", policy_of(5, Policy(Format::kFp8E4M3, Scaling::kBlock, 7, Rounding::kStochastic)),
       "rank 1 layer 5 'head' has block 7 (others: 100)"},
      {"step",
       [](std::vector<LayerSpec>&, BucketRecord& h, std::vector<LayerRecord>&) { h.step = 6; },
       "rank 1 is at step 6"},
      {"policy_version",
       [](std::vector<LayerSpec>&, BucketRecord& h, std::vector<LayerRecord>&) {
         h.policy_version = 3;
       },
       "rank 1 has policy version 3"},
      {"geometry_digest",
       [](std::vector<LayerSpec>&, BucketRecord&, std::vector<LayerRecord>& l) {
         l[3].geometry_digest = 0x1234;
       },
       "rank 1 layer 3 'fc3' has geometry digest 1234"},
  };
}

// The pipeline on its own, every layer in one bucket, with the real records and diagnosis of
// fingerprint.h: rank 1 differs; every rank must end with the diagnosis's error, and the separate
// round (before_data) must never run.
TEST_P(FusedCheck, MismatchIsDiagnosedOnEveryRank) {
  const auto [n, algorithm, in_line, channels] = GetParam();
  for (const Difference& d : Differences()) {
    const auto errors = RunRanks(
        n,
        [&](Communicator& comm) {
          const int r = comm.rank();
          std::vector<LayerSpec> layers = Layers();
          BucketFingerprint print;
          print.header.step = 5;
          print.header.algorithm = static_cast<uint32_t>(algorithm);
          std::vector<LayerRecord> records(layers.size());
          if (r == 1) d.apply(layers, print.header, records);
          std::vector<std::string> names;
          Tensors data = MakeInputs(r, layers, 5);
          std::vector<BucketLayer> work;
          for (uint32_t l = 0; l < layers.size(); ++l) {
            const LayerPolicy& p = layers[l].policy;
            LayerRecord& rec = records[l];
            rec.layer = l;
            rec.format = static_cast<uint8_t>(p.format);
            rec.scaling = static_cast<uint8_t>(p.scaling);
            rec.rounding = static_cast<uint8_t>(p.rounding);
            rec.block = p.block;
            rec.rows = layers[l].rows;
            rec.cols = layers[l].cols;
            print.layers.push_back(rec);
            names.push_back(layers[l].name);
            work.push_back(BucketLayer{l, p, nullptr, data[l], data[l]});
          }
          const std::vector<BucketFingerprint> prints = {print};
          AlgorithmOptions ao;
          ao.step = 5;
          ao.divisor = static_cast<float>(n);
          ao.segment_bytes = 1024;
          ao.inline_bytes = in_line ? size_t{1} << 30 : 0;
          ao.before_data = [] { GEOFP8_FAIL("the separate fingerprint round ran"); };
          const RunRecord run = MakeRunRecord(prints);
          const auto* bytes = reinterpret_cast<const uint8_t*>(&run);
          ao.check_record.assign(bytes, bytes + sizeof run);
          ao.diagnose = [&] { DiagnoseFingerprints(comm, prints, names); };
          ExchangeBucketData(comm, algorithm, ao, work);
        },
        std::chrono::milliseconds(60000), channels);
    for (int r = 0; r < n; ++r) {
      EXPECT_NE(errors[r].find(d.want), std::string::npos)
          << d.name << " rank " << r << ": " << errors[r];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Exchange, FusedCheck,
                         ::testing::Combine(::testing::Values(2, 3),
                                            ::testing::Values(Algorithm::kTwoPhase,
                                                              Algorithm::kAllGather),
                                            ::testing::Bool(), ::testing::Values(1, 2)),
                         ConfigName);

// Through the Exchanger: after a passed step the check is fused, and a rank one step ahead is
// still named on every rank.
TEST(FusedCheckExchanger, StepMismatchAfterAPassedStepNamesTheRank) {
  const auto layers = Layers();
  ExchangeOptions options;
  options.bucket_cap_bytes = 4096;
  std::vector<std::string> second(3);
  const auto errors = RunRanks(3, [&](Communicator& comm) {
    Exchanger ex(comm, layers, options);
    Tensors data = MakeInputs(comm.rank(), layers, 0);
    ex.Exchange(0, std::vector<std::span<float>>(data.begin(), data.end()));
    try {
      ex.Exchange(comm.rank() == 2 ? 2 : 1,
                  std::vector<std::span<float>>(data.begin(), data.end()));
    } catch (const Error& e) {
      second[comm.rank()] = e.what();
    }
  });
  ASSERT_EQ(JoinErrors(errors), "");
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(second[r].find("rank 2 is at step 2"), std::string::npos) << r << ": " << second[r];
  }
}

// After a passed step, one rank's policy switches algorithm (as a diverged policy version
// would): every algorithm sends the record through the same bounded round, so the ranks still
// meet and every rank gets the error naming the rank and its algorithm.
TEST(FusedCheckExchanger, AlgorithmSwitchOnOneRankIsNamed) {
  const auto layers = Layers();
  for (auto [base, other] : {std::pair{Algorithm::kTwoPhase, Algorithm::kFp32},
                             std::pair{Algorithm::kTwoPhase, Algorithm::kAllGather},
                             std::pair{Algorithm::kFp32, Algorithm::kTwoPhase},
                             std::pair{Algorithm::kBf16, Algorithm::kAllGather}}) {
    ExchangeOptions options;
    options.algorithm = base;
    options.bucket_cap_bytes = 4096;
    std::vector<std::string> second(3);
    const auto errors = RunRanks(3, [&](Communicator& comm) {
      Tensors data = MakeInputs(comm.rank(), layers, 0);
      {
        Exchanger ex(comm, layers, options);
        ex.Exchange(0, std::vector<std::span<float>>(data.begin(), data.end()));
      }
      ExchangeOptions mine = options;
      if (comm.rank() == 1) mine.algorithm = other;
      Exchanger ex(comm, layers, mine);
      try {
        ex.Exchange(1, std::vector<std::span<float>>(data.begin(), data.end()));
      } catch (const Error& e) {
        second[comm.rank()] = e.what();
      }
    });
    const std::string what =
        std::string(AlgorithmName(base)) + " -> " + std::string(AlgorithmName(other));
    ASSERT_EQ(JoinErrors(errors), "") << what;
    const std::string want = "algorithm " + std::string(AlgorithmName(other));
    for (int r = 0; r < 3; ++r) {
      EXPECT_NE(second[r].find("rank 1 is at step 1"), std::string::npos)
          << what << " rank " << r << ": " << second[r];
      EXPECT_NE(second[r].find(want), std::string::npos)
          << what << " rank " << r << ": " << second[r];
    }
  }
}

// The baselines keep their check round, now through the bounded exchange once the layout has
// passed: the same rounds and bits as the max-reduce, and the record's bytes on the wire instead
// of the max-reduce's (40 to each peer against a ring all-reduce of 16 words: 2(N-1)/N x 128).
TEST(FusedCheckExchanger, BaselinesKeepTheirRoundAndBits) {
  const auto layers = Layers();
  for (int n : {2, 3}) {
    for (Algorithm a : {Algorithm::kFp32, Algorithm::kBf16}) {
      ExchangeOptions options;
      options.algorithm = a;
      options.bucket_cap_bytes = 4096;
      std::vector<Tensors> out(2 * n);
      std::vector<uint64_t> rounds(2 * n), bytes(2 * n);
      for (int fresh = 0; fresh < 2; ++fresh) {
        const auto errors = RunRanks(n, [&](Communicator& comm) {
          const int r = comm.rank(), k = fresh * n + r;
          Exchanger ex(comm, layers, options);
          if (!fresh) {
            Tensors step0 = MakeInputs(r, layers, 0);
            ex.Exchange(0, std::vector<std::span<float>>(step0.begin(), step0.end()));
          }
          out[k] = MakeInputs(r, layers, 1);
          const uint64_t c0 = comm.stats().collectives, b0 = comm.stats().bytes_sent;
          ex.Exchange(1, std::vector<std::span<float>>(out[k].begin(), out[k].end()));
          rounds[k] = comm.stats().collectives - c0;
          bytes[k] = comm.stats().bytes_sent - b0;
        });
        ASSERT_EQ(JoinErrors(errors), "") << AlgorithmName(a) << " n " << n;
      }
      for (int r = 0; r < n; ++r) {
        const std::string where = std::string(AlgorithmName(a)) + " n " + std::to_string(n) +
                                  " rank " + std::to_string(r);
        EXPECT_EQ(rounds[r], rounds[n + r]) << where;
        EXPECT_EQ(bytes[n + r] - bytes[r], 2 * (n - 1) * 128 / n - 40 * (n - 1)) << where;
        for (size_t l = 0; l < layers.size(); ++l) {
          EXPECT_TRUE(SameBytes(out[r][l], out[n + r][l])) << where << " layer " << l;
        }
      }
    }
  }
}

}  // namespace
}  // namespace geofp8
