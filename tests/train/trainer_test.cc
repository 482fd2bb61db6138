// Data-parallel trainer: N ranks (threads over Gloo TCP) with the fp32 exchange match one rank on
// the combined batch; checkpoint/resume is bitwise identical, geometry included; a policy change
// at a step carries geometry over; a rank that drifts is caught by the parameter checksum;
// gradient dumps; each layer's compressed error matches its format's rounding; bad options and
// checkpoints are rejected naming the field.

#include "worker/train/trainer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "kernels/common/check.h"
#include "kernels/model/data.h"
#include "kernels/model/model.h"
#include "kernels/model/ops.h"
#include "kernels/model/optimizer.h"
#include "tests/exchange/rank_threads.h"
#include "tests/geometry/reference_geometry.h"
#include "worker/train/checkpoint.h"

namespace geofp8::train {
namespace {

namespace fs = std::filesystem;

TrainOptions Tiny(int ranks, int batch, int64_t steps, const std::string& policy = "fp32") {
  TrainOptions o;
  o.model = *model::PresetConfig("llama-tiny");
  o.model.seq = 16;
  o.ranks = ranks;
  o.batch = batch;
  o.steps = steps;
  o.policy = policy;
  o.data = "markov:4";
  o.eval_every = 0;
  o.eval_batches = 2;
  o.checksum_every = 2;
  o.optimizer.lr = 1e-2f;
  o.optimizer.warmup_steps = 2;
  o.optimizer.total_steps = 0;
  o.timeout = std::chrono::milliseconds(60000);
  return o;
}

fs::path TempPath(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return fs::temp_directory_path() /
         ("geofp8_trainer_" + std::to_string(getpid()) + "_" + info->name() + "_" + name);
}

TEST(Trainer, FourRanksFp32MatchOneRankOnTheCombinedBatch) {
  // Reference: one rank, batch 8, no exchange at all, plain loop over the model.
  const TrainOptions o4 = Tiny(4, 2, 3);
  // Bitwise equality below holds because both paths make the same GEMM calls with the same
  // shapes in the same order on the same OpenBLAS kernel and thread count. The thread count is
  // what differs unless pinned: the trainer runs with TrainOptions::blas_threads (1), the process
  // default is one thread per core, and the AVX2 (Haswell, Zen) kernels split a GEMM's work by
  // thread count in a way that changes its last bits. Prescott and SkylakeX kernels happen not
  // to, which is why this only failed on AVX2 machines.
  model::SetBlasThreads(o4.blas_threads);
  model::Model<float> ref(o4.model);
  ref.Init(o4.seed);
  model::OptimizerOptions opt = o4.optimizer;
  opt.total_steps = 3;
  model::AdamW adam(opt, ref.params());
  auto data = model::MakeDataSource(o4.data, o4.seed);
  std::vector<int32_t> tokens;
  for (int step = 0; step < 3; ++step) {
    data->TrainBatch(step, 0, 1, 8, 16, &tokens);
    ref.ForwardBackward(tokens, 8, 16);
    model::ClipGradNorm(ref.grads(), opt.clip_norm);
    adam.Step(ref.weights(), ref.grads(), step);
  }
  const TrainResult one = Train(Tiny(1, 8, 3));
  const TrainResult four = Train(o4);
  ASSERT_EQ(one.weights.size(), ref.weights().size());
  // One rank through the trainer is the plain loop, bit for bit.
  EXPECT_EQ(one.weights, ref.weights());
  double max_diff = 0, max_w = 0, moved = 0;
  model::Model<float> init(o4.model);
  init.Init(o4.seed);
  for (size_t i = 0; i < ref.weights().size(); ++i) {
    max_diff = std::max(max_diff, double(std::abs(four.weights[i] - ref.weights()[i])));
    max_w = std::max(max_w, double(std::abs(ref.weights()[i])));
    moved = std::max(moved, double(std::abs(ref.weights()[i] - init.weights()[i])));
  }
  // Round-off only: Adam's first steps move each weight by about lr = 1e-2; the 4-rank average
  // differs from the 8-row mean in the last bits, which after 3 steps stays far below that.
  std::printf("max |w4 - w1| = %.3g, max weight move = %.3g\n", max_diff, moved);
  EXPECT_GT(moved, 5e-3);
  EXPECT_LT(max_diff, 1e-4) << "max |w4 - w1| = " << max_diff;
}

// The gradient an accumulating step hands to the exchange, bit for bit: the sum of the first
// accum - 1 micro-batches' gradients (in order, from zero), plus the last one's, divided by
// accum; micro-batch m is rows [m * batch, (m + 1) * batch) of the step's accum * batch draw.
TEST(Trainer, AccumulationExchangesTheMeanOfItsMicroBatches) {
  TrainOptions o = Tiny(1, 2, 1);
  o.accum = 3;
  model::SetBlasThreads(o.blas_threads);
  model::Model<float> ref(o.model);
  ref.Init(o.seed);
  auto data = model::MakeDataSource(o.data, o.seed);
  std::vector<int32_t> tokens;
  data->TrainBatch(0, 0, 1, o.accum * o.batch, 16, &tokens);
  const size_t micro = size_t(o.batch) * 17;
  std::vector<float> sum(ref.grads().size(), 0.f);
  double loss = 0;
  for (int m = 0; m < o.accum; ++m) {
    loss += ref.ForwardBackward(std::span<const int32_t>(tokens).subspan(m * micro, micro), o.batch,
                                16);
    if (m + 1 < o.accum) {
      for (size_t j = 0; j < sum.size(); ++j) sum[j] += ref.grads()[j];
    }
  }
  std::vector<float> expected(sum.size());
  for (size_t j = 0; j < sum.size(); ++j) expected[j] = (sum[j] + ref.grads()[j]) / 3.f;

  const auto errors = geofp8::testing::RunRanks(1, [&](Communicator& comm) {
    Trainer t(o, comm);
    const StepRecord rec = t.Step(0, {.keep_local = true});
    EXPECT_EQ(t.local_gradient(), expected);
    EXPECT_EQ(rec.loss, double(float(loss / 3)));
    EXPECT_EQ(rec.tokens, 3 * 2 * 16);
  });
  EXPECT_EQ(geofp8::testing::JoinErrors(errors), "");
}

// accum N at batch b sees the data of batch N*b, and this model has no cross-sequence coupling
// (no batch statistics), so both compute the same gradient; only rounding differs.
TEST(Trainer, AccumulationMatchesTheLargerBatchToSummationRoundoff) {
  const int n = 4, b = 2, seq = 16;
  TrainOptions accum = Tiny(1, b, 1);
  accum.accum = n;
  TrainOptions big = Tiny(1, n * b, 1);
  model::SetBlasThreads(accum.blas_threads);
  std::vector<float> g_accum, g_big;
  const auto errors = geofp8::testing::RunRanks(1, [&](Communicator& comm) {
    Trainer ta(accum, comm);
    ta.Step(0, {.keep_local = true});
    g_accum = ta.local_gradient();
    Trainer tb(big, comm);
    tb.Step(0, {.keep_local = true});
    g_big = tb.local_gradient();
  });
  ASSERT_EQ(geofp8::testing::JoinErrors(errors), "");
  ASSERT_EQ(g_accum.size(), g_big.size());
  // Each parameter's gradient is a sum of R = n*b*seq per-row contributions c_r, each computed
  // alike in both runs (per-row forward, the same reductions over dim and ffn); what differs is
  // the order of the sum over rows (and the accumulating run's n - 1 extra additions and one
  // division, within the same bound). Recursive summation errs by at most gamma_R * sum_r |c_r|
  // per element (Higham, Accuracy and Stability, 4.2), so the two differ by at most
  // 2 * gamma_R * sum_r |c_r|. The rows of a sequence interact through attention, so sum_r |c_r|
  // is not observable; the sum of the absolute per-sequence gradients stands in for it, with a
  // factor seq for cancellation among a sequence's rows.
  model::Model<float> m(big.model);
  m.Init(big.seed);
  auto data = model::MakeDataSource(big.data, big.seed);
  std::vector<int32_t> tokens;
  data->TrainBatch(0, 0, 1, n * b, seq, &tokens);
  std::vector<double> abs_sum(g_big.size(), 0.0);
  for (int s = 0; s < n * b; ++s) {
    // A one-sequence mean gradient, scaled back to its share of the n*b-sequence mean.
    m.ForwardBackward(std::span<const int32_t>(tokens).subspan(size_t(s) * (seq + 1), seq + 1), 1,
                      seq);
    for (size_t j = 0; j < abs_sum.size(); ++j) abs_sum[j] += std::abs(m.grads()[j]) / (n * b);
  }
  const double R = n * b * seq, u = std::ldexp(1.0, -24), gamma = R * u / (1 - R * u);
  double worst = 0;
  for (size_t j = 0; j < g_big.size(); ++j) {
    const double bound = 2 * gamma * seq * abs_sum[j];
    const double diff = std::abs(double(g_accum[j]) - g_big[j]);
    if (diff > bound) ADD_FAILURE() << "element " << j << ": |diff| " << diff << " > " << bound;
    worst = std::max(worst, bound > 0 ? diff / bound : diff);
    if (::testing::Test::HasFailure()) break;
  }
  std::printf("worst |g_accum - g_big| / bound = %.3g\n", worst);
  // Not the same bits: the test would otherwise not see the division order at all.
  EXPECT_NE(g_accum, g_big);
}

TEST(Trainer, AccumulationResumesBitwiseAndIsPartOfTheCheckpointFingerprint) {
  const fs::path ckpt = TempPath("accum.ckpt");
  fs::remove(ckpt);
  TrainOptions straight = Tiny(2, 2, 6, "geofp8");
  straight.accum = 2;
  straight.optimizer.total_steps = 6;
  // The noise scale's averages travel in the checkpoint too: the resumed steps report the same.
  std::map<int64_t, double> gns_full, gns_resumed;
  const TrainResult full =
      Train(straight, [&](const StepRecord& r) { gns_full[r.step] = r.gradient_noise_scale; });
  TrainOptions first = straight;
  first.checkpoint = ckpt.string();
  first.steps = 3;
  Train(first);
  TrainOptions second = straight;
  second.checkpoint = ckpt.string();
  second.resume = true;
  const TrainResult resumed =
      Train(second, [&](const StepRecord& r) { gns_resumed[r.step] = r.gradient_noise_scale; });
  EXPECT_EQ(resumed.start_step, 3);
  EXPECT_EQ(resumed.weights, full.weights);
  EXPECT_EQ(resumed.checksum, full.checksum);
  ASSERT_EQ(gns_resumed.size(), 3u);
  for (const auto& [step, b] : gns_resumed) {
    EXPECT_TRUE(std::isfinite(b)) << step;
    EXPECT_EQ(b, gns_full.at(step)) << step;
  }
  // The same checkpoint under another accumulation is another run's.
  TrainOptions other = second;
  other.accum = 3;
  try {
    Train(other);
    ADD_FAILURE() << "a checkpoint of accum 2 resumed under accum 3";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("written by a different run"), std::string::npos)
        << e.what();
  }
  fs::remove(ckpt);
}

// The trainer's two-batch noise scale against a direct estimate on the same (fixed) model: the
// per-sequence gradients of many independent sequences give tr(Sigma) and |g|^2 without the
// two-batch trick. The learning rate is so small that the weights stay where they started
// (Adam moves each by about lr = 1e-8 a step), so both estimate one quantity.
TEST(Trainer, NoiseScaleAgreesWithADirectEstimateFromIndependentSequences) {
  const int seq = 16;
  TrainOptions o = Tiny(4, 2, 200);
  o.optimizer.lr = 1e-8f;
  o.optimizer.min_lr = 0;
  o.checksum_every = 0;
  o.gns_beta = 0.99;
  double trained = NAN;
  int defined = 0;
  Train(o, [&](const StepRecord& r) {
    trained = r.gradient_noise_scale;
    defined += std::isfinite(r.gradient_noise_scale) ? 1 : 0;
  });
  // Direct: S independent sequences (indices the run never drew), one gradient each (the mean
  // over its seq tokens). A batch of B tokens is B / seq sequences, so in tokens
  // tr(Sigma) = seq * tr(Cov over sequences), and B_simple = seq * tr / |g|^2, with the unbiased
  // |g|^2 = |mean|^2 - tr(Cov) / S.
  model::SetBlasThreads(o.blas_threads);
  model::Model<float> m(o.model);
  m.Init(o.seed);
  auto data = model::MakeDataSource(o.data, o.seed);
  const int S = 1024, per_draw = 64;
  std::vector<double> mean(m.grads().size(), 0.0), sq(m.grads().size(), 0.0);
  std::vector<int32_t> tokens;
  for (int draw = 0; draw < S / per_draw; ++draw) {
    data->TrainBatch(100000 + draw, 0, 1, per_draw, seq, &tokens);
    for (int s = 0; s < per_draw; ++s) {
      m.ForwardBackward(std::span<const int32_t>(tokens).subspan(size_t(s) * (seq + 1), seq + 1), 1,
                        seq);
      for (size_t j = 0; j < mean.size(); ++j) {
        mean[j] += m.grads()[j];
        sq[j] += double(m.grads()[j]) * m.grads()[j];
      }
    }
  }
  double trace = 0, mean_sq = 0;
  for (size_t j = 0; j < mean.size(); ++j) {
    const double mu = mean[j] / S;
    trace += (sq[j] - S * mu * mu) / (S - 1);
    mean_sq += mu * mu;
  }
  const double direct = seq * trace / (mean_sq - trace / S);
  std::printf("B_simple: trainer %.4g tokens, direct %.4g tokens (%d of %lld steps defined)\n",
              trained, direct, defined, (long long)o.steps);
  ASSERT_TRUE(std::isfinite(trained));
  EXPECT_GT(trained, direct / 2);
  EXPECT_LT(trained, direct * 2);
}

TEST(Trainer, NoiseScaleIsUndefinedOnOneRank) {
  TrainOptions o = Tiny(1, 2, 3);
  Train(o, [&](const StepRecord& r) { EXPECT_TRUE(std::isnan(r.gradient_noise_scale)); });
  o.gns_beta = 1;
  EXPECT_EQ(ValidateTrainOptions(o), "gns_beta: must be in [0, 1) (1)");
}

TEST(Trainer, ResumeFromCheckpointIsBitwiseIdentical) {
  // geofp8 uses the ema estimator: its sketch travels in the checkpoint (format 3).
  for (const std::string policy : {"fp32", "fp8", "geofp8"}) {
    const fs::path ckpt = TempPath(policy + ".ckpt");
    fs::remove(ckpt);
    TrainOptions straight = Tiny(2, 2, 8, policy);
    const TrainResult full = Train(straight);

    TrainOptions first = straight;
    first.checkpoint = ckpt.string();
    first.steps = 8;
    first.debug_perturb_step = -1;
    // Stop after 4 steps: same schedule (total_steps pinned to 8), checkpoint at the end.
    first.optimizer.total_steps = 8;
    first.steps = 4;
    const TrainResult part = Train(first);
    EXPECT_EQ(part.steps, 4);
    ASSERT_TRUE(fs::exists(ckpt));
    EXPECT_FALSE(fs::exists(ckpt.string() + ".tmp"));

    TrainOptions second = straight;
    second.checkpoint = ckpt.string();
    second.resume = true;
    second.optimizer.total_steps = 8;
    straight.optimizer.total_steps = 8;
    const TrainResult resumed = Train(second);
    EXPECT_EQ(resumed.start_step, 4);
    EXPECT_EQ(resumed.weights, full.weights) << policy;
    EXPECT_EQ(resumed.checksum, full.checksum) << policy;
    fs::remove(ckpt);
  }
}

// Error feedback's residuals differ between ranks, so Run's checkpoint gathers every rank's and a
// resume gives each its own: bitwise the uninterrupted run. Without them the resume differs,
// which is what makes the test see them.
TEST(Trainer, ErrorFeedbackResumesBitwiseWithEveryRanksResiduals) {
  const fs::path policy = TempPath("ef.yaml");
  std::ofstream(policy) << "exchange: {algorithm: two_phase}\n"
                           "policy:\n  default: {format: nvfp4, error_feedback: true}\n";
  const fs::path plain_policy = TempPath("plain.yaml");
  std::ofstream(plain_policy) << "exchange: {algorithm: two_phase}\n"
                                 "policy:\n  default: {format: nvfp4}\n";
  const fs::path ckpt = TempPath("ef.ckpt");
  fs::remove(ckpt);
  TrainOptions straight = Tiny(2, 2, 8, policy.string());
  straight.optimizer.total_steps = 8;
  const TrainResult full = Train(straight);
  TrainOptions plain = straight;
  plain.policy = plain_policy.string();
  EXPECT_NE(Train(plain).weights, full.weights) << "error feedback changed nothing";

  TrainOptions first = straight;
  first.checkpoint = ckpt.string();
  first.steps = 4;
  Train(first);
  Checkpoint saved = LoadCheckpoint(ckpt.string());
  ASSERT_EQ(saved.residuals.size(), 2u);
  bool differ = false;
  for (size_t l = 0; l < saved.residuals[0].size(); ++l) {
    ASSERT_FALSE(saved.residuals[0][l].local.empty()) << l;
    differ = differ || saved.residuals[0][l].local != saved.residuals[1][l].local;
  }
  EXPECT_TRUE(differ) << "both ranks saved the same residuals";

  TrainOptions second = straight;
  second.checkpoint = ckpt.string();
  second.resume = true;
  const TrainResult resumed = Train(second);
  EXPECT_EQ(resumed.start_step, 4);
  EXPECT_EQ(resumed.weights, full.weights);
  EXPECT_EQ(resumed.checksum, full.checksum);

  // A driver's per-rank checkpoints (MakeCheckpoint, as the worker daemon writes them) resume
  // each rank exactly from its own.
  std::vector<std::vector<float>> driven(2);
  const auto errors = geofp8::testing::RunRanks(2, [&](Communicator& comm) {
    Checkpoint mine;
    {
      Trainer t(straight, comm);
      for (int64_t s = 0; s < 4; ++s) t.Step(s);
      mine = t.MakeCheckpoint(4);
      ASSERT_EQ(mine.residuals.size(), 2u);
      EXPECT_TRUE(mine.residuals[1 - comm.rank()].empty());
      EXPECT_FALSE(mine.residuals[comm.rank()].empty());
    }
    Trainer t(straight, comm);
    t.Restore(mine);
    for (int64_t s = 4; s < 8; ++s) t.Step(s);
    driven[comm.rank()] = t.model().weights();
  });
  ASSERT_EQ(geofp8::testing::JoinErrors(errors), "");
  EXPECT_EQ(driven[0], full.weights);
  EXPECT_EQ(driven[1], full.weights);

  saved.residuals.clear();
  SaveCheckpoint(ckpt.string(), saved);
  EXPECT_NE(Train(second).weights, full.weights) << "the residuals did not matter";
  // One rank's set for a two-rank run is another run's checkpoint.
  saved.residuals.assign(1, {});
  SaveCheckpoint(ckpt.string(), saved);
  try {
    Train(second);
    ADD_FAILURE() << "residuals of 1 rank accepted for 2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("error-feedback residuals of 1 ranks, this run has 2"),
              std::string::npos)
        << e.what();
  }
  fs::remove(ckpt);
  fs::remove(policy);
  fs::remove(plain_policy);
}

TEST(Trainer, ErrorFeedbackWithFp32IsRefusedNamingTheLayer) {
  const fs::path policy = TempPath("ef32.yaml");
  std::ofstream(policy) << "policy:\n  default: {format: fp32, error_feedback: true}\n";
  try {
    Train(Tiny(2, 2, 1, policy.string()));
    ADD_FAILURE() << "fp32 with error feedback accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "layer 'tok_emb': error_feedback: fp32 loses nothing to feed back (format fp32)"),
              std::string::npos)
        << e.what();
  }
  fs::remove(policy);
}

// A geofp8 policy whose matrices refresh every 3 steps (offsets staggered over 0, 1, 2) with sigma
// smoothing: the geometry state a resume has to carry.
fs::path GeoPolicyFile(const std::string& tag) {
  const fs::path path = TempPath(tag + ".yaml");
  std::ofstream f(path);
  f << "geometry_refresh: {estimator: instant, interval: 3, sigma_ema: 0.5}\n"
       "policy:\n"
       "  default: {format: fp8_e4m3, scaling: block, block: 32, geometry: lowrank, rank: 4}\n";
  return path;
}

TEST(Trainer, GeometryResumeIsBitwiseIdentical) {
  const fs::path policy = GeoPolicyFile("geo");
  const fs::path ckpt = TempPath("geo.ckpt");
  fs::remove(ckpt);
  // Step 3 refreshes the offset-0 layers, active from step 4: pending across the checkpoint.
  const int64_t N = 9, K = 4;
  TrainOptions straight = Tiny(3, 2, N, policy.string());
  straight.optimizer.total_steps = N;
  straight.eval_every = 2;  // K is a multiple: both runs validate at the same steps
  std::vector<StepRecord> full_log, part_log, resumed_log;
  const TrainResult full = Train(straight, [&](const StepRecord& s) { full_log.push_back(s); });

  TrainOptions first = straight;
  first.steps = K;
  first.checkpoint = ckpt.string();
  Train(first, [&](const StepRecord& s) { part_log.push_back(s); });
  const Checkpoint c = LoadCheckpoint(ckpt.string());
  EXPECT_EQ(c.next_step, K);
  ASSERT_EQ(c.geometry.size(), full.params.size());
  int active = 0, pending = 0;
  for (const auto& g : c.geometry) {
    active += !g.active.empty();
    if (!g.pending.empty()) {
      ++pending;
      EXPECT_EQ(g.pending_from, uint64_t(K));
    }
  }
  EXPECT_GT(active, 0);
  EXPECT_GT(pending, 0) << "the test needs a refresh pending across the checkpoint";

  TrainOptions second = straight;
  second.checkpoint = ckpt.string();
  second.resume = true;
  const TrainResult resumed = Train(second, [&](const StepRecord& s) { resumed_log.push_back(s); });
  EXPECT_EQ(resumed.start_step, K);
  EXPECT_EQ(resumed.weights, full.weights);
  EXPECT_EQ(resumed.checksum, full.checksum);
  // The resumed process's first step runs on a fresh communicator, so its fingerprint check is
  // a round of its own once more (a 16-word ring all-reduce: 2(N-1)/N x 128 bytes leave rank 0)
  // instead of the 40-byte record sent to each peer in the data round (kernels/exchange/
  // algorithms.h, AlgorithmOptions::check_record); every other byte is the same.
  const uint64_t n = static_cast<uint64_t>(straight.ranks);
  EXPECT_EQ(resumed.bytes_sent, full.bytes_sent + 2 * (n - 1) * 128 / n - 40 * (n - 1));
  EXPECT_EQ(resumed.best_val_loss, full.best_val_loss);
  EXPECT_EQ(resumed.final_val_loss, full.final_val_loss);
  part_log.insert(part_log.end(), resumed_log.begin(), resumed_log.end());
  ASSERT_EQ(part_log.size(), full_log.size());
  int refreshes = 0;
  for (size_t i = 0; i < full_log.size(); ++i) {
    EXPECT_EQ(part_log[i].loss, full_log[i].loss) << "step " << i;  // bitwise
    EXPECT_EQ(part_log[i].refreshes, full_log[i].refreshes) << "step " << i;
    refreshes += full_log[i].refreshes;
  }
  EXPECT_GT(refreshes, 0);
  fs::remove(ckpt);
  fs::remove(policy);
}

// The worker's use of the trainer: a policy version switched in at a known step keeps the
// geometry of layers whose mode, rank and alpha stay and drops the others; a checkpoint written
// under the old version, resumed under the new one, continues exactly like the run that never
// stopped.
TEST(Trainer, SetPoliciesCarriesGeometryAndResumesExactlyAcrossTheChange) {
  const fs::path policy = GeoPolicyFile("change");
  TrainOptions o = Tiny(2, 2, 8, policy.string());
  o.optimizer.total_steps = 8;
  const int64_t change = 4;
  const auto params = model::Model<float>(o.model).params();
  auto is_mlp = [&](size_t i) { return params[i].name.find(".mlp.w") != std::string::npos; };
  std::vector<LayerPolicy> changed = MakeExchangePlan(o.policy, params).layers;
  for (size_t i = 0; i < changed.size(); ++i) {
    if (is_mlp(i)) changed[i].rank = 2;
  }
  std::vector<std::vector<float>> straight(2), resumed(2);
  std::vector<std::vector<double>> straight_loss(2), resumed_loss(2);
  const auto errors = geofp8::testing::RunRanks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::vector<RefreshSchedule> schedule =
        MakeRefreshSchedule(MakeExchangePlan(o.policy, params), 2);
    Checkpoint saved;
    {
      Trainer t(o, comm);
      for (int64_t s = 0; s < change; ++s) straight_loss[r].push_back(t.Step(s).loss);
      saved = t.MakeCheckpoint(change);
      std::vector<uint64_t> before;
      for (uint32_t l = 0; l < params.size(); ++l) {
        before.push_back(t.exchanger().active_geometry(l).version);
      }
      try {
        t.SetPolicies(change - 1, changed, schedule, 1);
        ADD_FAILURE() << "a step that already ran must be refused";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("policy v1: effective from step 3, but step 3 has "
                                             "already run"),
                  std::string::npos)
            << e.what();
      }
      std::vector<LayerPolicy> bad = changed;
      bad[2].rank = 0;  // layers.0.attn.wq
      try {
        t.SetPolicies(change, bad, schedule, 1);
        ADD_FAILURE() << "rank 0 must be refused";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("policy v1: layer '" + params[2].name + "': rank"),
                  std::string::npos)
            << e.what();
      }
      t.SetPolicies(change, changed, schedule, 1);
      EXPECT_EQ(t.policy_version(), 0u);  // not before its step
      straight_loss[r].push_back(t.Step(change).loss);
      EXPECT_EQ(t.policy_version(), 1u);
      for (uint32_t l = 0; l < params.size(); ++l) {
        if (!params[l].is_matrix()) continue;
        const uint64_t v = t.exchanger().active_geometry(l).version;
        if (is_mlp(l)) {
          EXPECT_EQ(v, 0u) << params[l].name << ": rank changed, must re-warm";
        } else {
          EXPECT_GT(before[l], 0u) << params[l].name;
          EXPECT_GE(v, before[l]) << params[l].name << ": unchanged, must keep its geometry";
        }
      }
      for (int64_t s = change + 1; s < o.steps; ++s) straight_loss[r].push_back(t.Step(s).loss);
      straight[r] = t.model().weights();
    }
    {
      ExchangePlan plan = MakeExchangePlan(o.policy, params);
      plan.layers = changed;
      Trainer t(o, comm, plan, schedule, 1);
      EXPECT_EQ(t.Restore(saved), change);
      for (int64_t s = change; s < o.steps; ++s) resumed_loss[r].push_back(t.Step(s).loss);
      resumed[r] = t.model().weights();
    }
  });
  ASSERT_EQ(geofp8::testing::JoinErrors(errors), "");
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(resumed[r], straight[r]) << "rank " << r;
    ASSERT_EQ(resumed_loss[r].size(), size_t(o.steps - change));
    for (size_t i = 0; i < resumed_loss[r].size(); ++i) {
      EXPECT_EQ(resumed_loss[r][i], straight_loss[r][change + i]) << "step " << change + i;
    }
  }
  EXPECT_EQ(straight[0], straight[1]);
  fs::remove(policy);
}

// Format version 1 (no policy version, totals or pending geometry), written by hand from its
// documented layout: read when it holds no geometry, refused when it does; unknown versions and
// geometry that does not fit the model are refused naming the problem.
TEST(Trainer, CheckpointVersionsAndGeometryAreValidated) {
  auto fnv = [](const std::string& s) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ULL;
    return h;
  };
  auto v1 = [&](bool with_geometry) {
    std::string out = "GFP8CKPT";
    auto pod = [&](auto v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
    pod(uint32_t{1});
    pod(uint64_t{3});
    out += "abc";
    pod(int64_t{5});
    pod(uint64_t{7});
    for (int k = 0; k < 3; ++k) {
      pod(uint64_t{2});
      pod(1.5f);
      pod(-2.f);
    }
    pod(uint64_t{1});
    pod(uint64_t{with_geometry ? 1u : 0u});
    if (with_geometry) out += 'x';
    pod(uint64_t{0});
    pod(uint64_t{0});
    pod(fnv(out));
    return out;
  };
  const Checkpoint c = ParseCheckpoint(v1(false), "old");
  EXPECT_EQ(c.fingerprint, "abc");
  EXPECT_EQ(c.next_step, 5);
  EXPECT_EQ(c.rng_seed, 7u);
  EXPECT_EQ(c.policy_version, 0u);
  EXPECT_TRUE(std::isnan(c.best_val_loss));
  EXPECT_EQ(c.weights, (std::vector<float>{1.5f, -2.f}));
  EXPECT_TRUE(c.geometry.empty());
  try {
    ParseCheckpoint(v1(true), "old");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("checkpoint old: format version 1 holds geometry (layer 0)"),
        std::string::npos)
        << e.what();
  }
  std::string v5 = SerializeCheckpoint(c);
  v5[8] = 5;
  const uint64_t h = fnv(v5.substr(0, v5.size() - 8));
  std::memcpy(v5.data() + v5.size() - 8, &h, 8);
  try {
    ParseCheckpoint(v5, "new");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "checkpoint new: format version 5 is not supported (this build reads 1 to 4)"),
              std::string::npos)
        << e.what();
  }

  // A geofp8 checkpoint whose geometry was tampered with is refused on resume, naming the layer.
  const fs::path policy = GeoPolicyFile("tamper");
  const fs::path ckpt = TempPath("tamper.ckpt");
  TrainOptions o = Tiny(1, 2, 3, policy.string());
  o.checkpoint = ckpt.string();
  Train(o);
  Checkpoint saved = LoadCheckpoint(ckpt.string());
  ASSERT_FALSE(saved.geometry[2].active.empty());  // layers.0.attn.wq
  saved.geometry[2].active[40] ^= 1;
  SaveCheckpoint(ckpt.string(), saved);
  o.steps = 4;
  o.resume = true;
  try {
    Train(o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ImportGeometry: layer 2 'layers.0.attn.wq': active: "),
              std::string::npos)
        << e.what();
  }
  fs::remove(ckpt);
  fs::remove(policy);
}

TEST(Trainer, CheckpointRejectsCorruptionAndOtherRuns) {
  const fs::path ckpt = TempPath("c.ckpt");
  TrainOptions o = Tiny(1, 2, 2);
  o.checkpoint = ckpt.string();
  Train(o);
  // A different run's options are refused, naming the checkpoint.
  TrainOptions other = o;
  other.resume = true;
  other.steps = 4;
  other.batch = 3;
  try {
    Train(other);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("written by a different run"), std::string::npos)
        << e.what();
  }
  // A flipped byte is caught by the hash.
  {
    std::fstream f(ckpt, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
  }
  EXPECT_THROW(LoadCheckpoint(ckpt.string()), Error);
  // A truncated file too.
  fs::resize_file(ckpt, 50);
  EXPECT_THROW(LoadCheckpoint(ckpt.string()), Error);
  fs::remove(ckpt);
}

TEST(Trainer, ChecksumStopsTrainingWhenARankDrifts) {
  TrainOptions o = Tiny(2, 2, 6);
  o.checksum_every = 1;
  o.debug_perturb_rank = 1;
  o.debug_perturb_step = 2;
  try {
    Train(o);
    FAIL() << "expected a checksum error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("parameter checksum mismatch after step 2: rank 1"), std::string::npos)
        << msg;
  }
}

// Half the quantization step at each value of one quantization of `v` (the values as sent, laid
// over the layer from its first element) under the policy's format, and the clipping an nvfp4
// block max may see. Scales follow DESIGN.md section 3: e4m3 multiplies a block by 448 / A_b
// (A_b: block amax), so its step is 2^(floor(log2 |v s|) - 3) / s, or the subnormal step 2^-9 / s
// below 2^-6; nvfp4 divides by den = E4M3(A_b / (6 g)) g ~ A_b / 6 within E4M3's rounding 2^-4
// (taken at its largest for the step, at its smallest for clipping), E2M1 steps 0.5, 1, 2 on
// [0, 2), [2, 4), [4, 6]; bf16 has 8 significant bits, step 2^(floor(log2 |v|) - 7).
struct StepModel {
  std::vector<double> half, clip;
};
StepModel HalfSteps(const std::vector<double>& v, Format f, uint32_t block) {
  StepModel out{std::vector<double>(v.size(), 0.0), std::vector<double>(v.size(), 0.0)};
  const size_t b = f == Format::kNvfp4 ? 16 : f == Format::kBf16 ? v.size() + 1 : block;
  for (size_t b0 = 0; b0 < v.size(); b0 += b) {
    const size_t b1 = std::min(v.size(), b0 + b);
    double a = 0;
    for (size_t i = b0; i < b1; ++i) a = std::max(a, std::abs(v[i]));
    for (size_t i = b0; i < b1; ++i) {
      const double x = std::abs(v[i]);
      if (x == 0 || a == 0) continue;
      if (f == Format::kBf16) {
        out.half[i] = std::ldexp(1.0, std::ilogb(x) - 8);
      } else if (f == Format::kFp8E4M3) {
        const double sc = 448 / a, w = x * sc;
        out.half[i] =
            (w >= std::ldexp(1.0, -6) ? std::ldexp(1.0, std::ilogb(w) - 4) : std::ldexp(1.0, -10)) /
            sc;
      } else {
        const double den = a / 6 * (1 + 1.0 / 16), w = x / den;
        out.half[i] = (w < 2 ? 0.25 : w < 4 ? 0.5 : 1.0) * den;
        out.clip[i] = std::max(0.0, x - a * (1 - 1.0 / 16));
      }
    }
  }
  return out;
}

// Each layer's reported rel_fro_error at one step against the error its format's rounding
// predicts for that step's local gradients, under the layer's policy and the geometry the step
// used (a float64 reference map P, as in the exchange tests). Every rank's y_r = P(g_r / N) is
// quantized, then their sum (two_phase; bf16 rounds the pairwise sum). Round to nearest of a
// value with many more bits than the format is modelled the standard way: independent errors
// uniform in +-h (mean square h^2 / 3, variance of the square 4 h^4 / 45). The sum of two
// quantized values has few bits, at most one more than the format when their exponents agree, so
// its rounding is exact or a tie: mean square at most h^2 / 2, variance h^4 / 4. nvfp4's clipping
// is added as its worst case. P^-1 weighs element (i, j)'s error by |P_L^-1 e_i|^2
// |e_j^T P_R^-1|^2. The bound is the predicted mean square plus six standard deviations. The old
// bound was 0.1 for every format (about 30x bf16's error) and 0.5 for nvfp4.
TEST(Trainer, LayerErrorsMatchEachFormatsRounding) {
  for (const std::string policy : {"bf16", "fp8", "geofp8", "nvfp4"}) {
    const int N = 2;
    const int64_t step_measured = 5;
    const TrainOptions o = Tiny(N, 4, 6, policy);
    std::vector<std::vector<float>> local(N);
    std::vector<double> reported;
    std::vector<Geometry> geos;
    std::vector<model::ParamInfo> params;
    std::vector<LayerPolicy> policies;
    const auto errors = geofp8::testing::RunRanks(N, [&](Communicator& comm) {
      Trainer t(o, comm);
      for (int64_t s = 0; s <= step_measured; ++s) {
        StepControl c;
        c.measure_error = c.keep_local = s == step_measured;
        const StepRecord rec = t.Step(s, c);
        if (s != step_measured) continue;
        local[comm.rank()] = t.local_gradient();
        if (comm.rank() != 0) continue;
        reported = rec.layer_error;
        params = t.model().params();
        policies = t.plan().layers;
        for (size_t l = 0; l < params.size(); ++l) geos.push_back(t.exchanger().active_geometry(l));
      }
    });
    ASSERT_EQ(geofp8::testing::JoinErrors(errors), "") << policy;
    ASSERT_EQ(reported.size(), params.size());
    int with_geometry = 0;
    double worst_ratio = 0;
    for (size_t l = 0; l < params.size(); ++l) {
      const model::ParamInfo& p = params[l];
      const int64_t m = p.exchange_rows(), n = p.exchange_cols();
      const Geometry& geo = geos[l];
      const bool lowrank = geo.mode == GeometryMode::kLowRank && !geo.is_identity();
      with_geometry += lowrank;
      const auto left = geofp8::testing::MakeReferenceSide(geo, true, m);
      const auto right = geofp8::testing::MakeReferenceSide(geo, false, n);
      // Weights of element (i, j)'s error after P^-1.
      std::vector<double> wl(m, 1.0), wr(n, 1.0);
      if (lowrank) {
        for (int64_t i = 0; i < m; ++i) {
          wl[i] = 0;
          for (int64_t r = 0; r < m; ++r) wl[i] += left.p_inv[r * m + i] * left.p_inv[r * m + i];
        }
        for (int64_t j = 0; j < n; ++j) {
          wr[j] = 0;
          for (int64_t c = 0; c < n; ++c) wr[j] += right.p_inv[j * n + c] * right.p_inv[j * n + c];
        }
      }
      std::vector<double> sum(p.size(), 0.0), exact(p.size(), 0.0);
      std::vector<double> mean_sq(p.size(), 0.0), var_sq(p.size(), 0.0);
      // Mean square and variance of the square of one rounding's error at each element.
      auto add = [&](const StepModel& sm, double ms, double vs) {
        for (int64_t i = 0; i < p.size(); ++i) {
          const double h2 = sm.half[i] * sm.half[i];
          mean_sq[i] += ms * h2 + sm.clip[i] * sm.clip[i];
          var_sq[i] += vs * h2 * h2;
        }
      };
      const double kUniform = 1.0 / 3, kUniformVar = 4.0 / 45, kTie = 0.5, kTieVar = 0.25;
      for (int r = 0; r < N; ++r) {
        std::vector<double> a(p.size());
        for (int64_t i = 0; i < p.size(); ++i) {
          a[i] = double(local[r][p.offset + i]) / N;
          exact[i] += a[i];
        }
        const std::vector<double> y =
            lowrank ? geofp8::testing::Sandwich(left.p, a, right.p, m, n) : a;
        for (int64_t i = 0; i < p.size(); ++i) sum[i] += y[i];
        if (policy != "bf16")
          add(HalfSteps(y, policies[l].format, policies[l].block), kUniform, kUniformVar);
      }
      if (policy == "bf16") {
        // Each rank rounds its share, then the one pairwise sum is rounded.
        for (int r = 0; r < N; ++r) {
          std::vector<double> a(p.size());
          for (int64_t i = 0; i < p.size(); ++i) a[i] = double(local[r][p.offset + i]) / N;
          add(HalfSteps(a, Format::kBf16, 0), kUniform, kUniformVar);
        }
      }
      add(HalfSteps(sum, policies[l].format, policies[l].block), kTie, kTieVar);
      double mean = 0, var = 0, x2 = 0;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          const int64_t k = i * n + j;
          const double w = wl[i] * wr[j];
          mean += w * mean_sq[k];
          var += w * w * var_sq[k];
          x2 += exact[k] * exact[k];
        }
      const double bound = std::sqrt((mean + 6 * std::sqrt(var)) / x2);
      EXPECT_LE(reported[l], bound) << policy << " " << p.name;
      worst_ratio = std::max(worst_ratio, reported[l] / bound);
    }
    std::printf("%s: worst layer error / bound = %.3g\n", policy.c_str(), worst_ratio);
    EXPECT_EQ(with_geometry > 0, policy == "geofp8");
  }
}

TEST(Trainer, CompressedPoliciesTrainAndReportErrors) {
  // The validation loss before training and after the same 30 steps with the fp32 exchange.
  TrainOptions base = Tiny(2, 4, 30);
  base.eval_every = 30;
  model::Model<float> init(base.model);
  init.Init(base.seed);
  auto data = model::MakeDataSource(base.data, base.seed);
  std::vector<int32_t> tokens;
  double initial = 0;
  for (int i = 0; i < base.eval_batches; ++i) {
    data->ValidationBatch(i, 16, base.model.seq, &tokens);
    initial += init.Loss(tokens, 16, base.model.seq) / base.eval_batches;
  }
  const double fp32 = Train(base).final_val_loss;
  ASSERT_LT(fp32, initial - 0.5) << "the fp32 run must learn for the comparison to mean anything";
  for (const std::string policy : {"bf16", "fp8", "geofp8", "nvfp4"}) {
    TrainOptions o = Tiny(2, 4, 30, policy);
    o.error_every = 5;
    o.eval_every = 30;
    std::vector<StepRecord> records;
    const TrainResult r = Train(o, [&](const StepRecord& s) { records.push_back(s); });
    ASSERT_EQ(records.size(), 30u);
    // Not a round-off bound (no error analysis follows 30 steps of training): the requirement
    // that compression cost at most 2% of the loss reduction fp32 achieves in the same steps.
    // The old bound, 0.6 log 256, let a run keep almost half of the loss fp32 removes.
    EXPECT_LE(r.final_val_loss - fp32, 0.02 * (initial - fp32))
        << policy << ": validation loss " << r.final_val_loss << ", fp32 " << fp32 << ", initial "
        << initial;
    EXPECT_GT(r.bytes_sent, 0u);
    ASSERT_EQ(records[5].layer_error.size(), r.params.size());
    EXPECT_TRUE(records[6].layer_error.empty());
    double worst = 0;
    for (double e : records[5].layer_error) worst = std::max(worst, e);
    EXPECT_GT(worst, 0.0) << policy << ": a lossy format must show some error";
    // Residual-subspace error: over the whole space (so equal to rel_fro_error) without a
    // low-rank basis; with one, the error left in the weak directions, finite and nonzero.
    ASSERT_EQ(records[10].residual_error.size(), r.params.size());
    int with_basis = 0;
    for (size_t i = 0; i < r.params.size(); ++i) {
      const double rel = records[10].layer_error[i], res = records[10].residual_error[i];
      if (policy == "geofp8" && r.params[i].is_matrix()) {
        ++with_basis;
        EXPECT_TRUE(std::isfinite(res) && res > 0) << r.params[i].name << ": " << res;
        EXPECT_NE(res, rel) << r.params[i].name;
      } else {
        EXPECT_NEAR(res, rel, 1e-5 * rel) << policy << " " << r.params[i].name;
      }
    }
    EXPECT_EQ(with_basis > 0, policy == "geofp8");
  }
}

TEST(Trainer, Fp32ExchangeHasZeroLayerError) {
  TrainOptions o = Tiny(2, 2, 2);
  o.error_every = 1;
  std::vector<StepRecord> records;
  Train(o, [&](const StepRecord& s) { records.push_back(s); });
  for (double e : records[0].layer_error) EXPECT_EQ(e, 0.0);
}

TEST(Trainer, DumpGradsWritesAveragesPerRankGradientsAndShapes) {
  const fs::path dir = TempPath("dump");
  fs::remove_all(dir);
  TrainOptions o = Tiny(2, 2, 3);
  o.dump_dir = dir.string();
  o.dump_layers = {"layers.0.attn.wq", "final_norm"};
  o.dump_steps = {1};
  Train(o);
  const fs::path step = dir / "step_1";
  ASSERT_TRUE(fs::exists(step / "shapes.json"));
  std::ifstream js(step / "shapes.json");
  const std::string json((std::istreambuf_iterator<char>(js)), {});
  EXPECT_NE(json.find("\"name\": \"layers.0.attn.wq\", \"rows\": 64, \"cols\": 64"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("final_norm.rank1.f32"), std::string::npos);
  EXPECT_EQ(json.find("layers.1."), std::string::npos);
  auto read = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::vector<float> v(fs::file_size(p) / 4);
    f.read(reinterpret_cast<char*>(v.data()), std::streamsize(v.size() * 4));
    return v;
  };
  const auto avg = read(step / "layers.0.attn.wq.avg.f32");
  const auto r0 = read(step / "layers.0.attn.wq.rank0.f32");
  const auto r1 = read(step / "layers.0.attn.wq.rank1.f32");
  ASSERT_EQ(avg.size(), 64u * 64u);
  ASSERT_EQ(r0.size(), avg.size());
  EXPECT_NE(r0, r1);
  for (size_t i = 0; i < avg.size(); ++i) {
    EXPECT_NEAR(avg[i], 0.5f * (r0[i] + r1[i]), 1e-6f * (1 + std::abs(avg[i])));
  }
  EXPECT_FALSE(fs::exists(dir / "step_0"));
  fs::remove_all(dir);
}

TEST(Trainer, BadOptionsAreRejectedNamingTheField) {
  TrainOptions o = Tiny(0, 2, 2);
  EXPECT_EQ(ValidateTrainOptions(o), "ranks: must be in [1, 64] (0)");
  o = Tiny(1, 0, 2);
  EXPECT_EQ(ValidateTrainOptions(o), "batch: must be >= 1 (0)");
  o = Tiny(1, 2, 2);
  o.seq = 99;
  EXPECT_EQ(ValidateTrainOptions(o), "seq: must be in [0, model.seq = 16] (99)");
  o = Tiny(1, 2, 2);
  o.model.heads = 3;
  EXPECT_NE(ValidateTrainOptions(o).find("model.heads"), std::string::npos);
  o = Tiny(1, 2, 2);
  o.optimizer.lr = 0;
  EXPECT_NE(ValidateTrainOptions(o).find("optimizer.lr"), std::string::npos);
  o = Tiny(1, 2, 2);
  o.accum = 0;
  EXPECT_EQ(ValidateTrainOptions(o), "accum: must be in [1, 65536] (0)");
  o = Tiny(1, 2, 2);
  o.resume = true;
  EXPECT_EQ(ValidateTrainOptions(o), "resume: needs a checkpoint path (empty)");
  o = Tiny(1, 2, 2, "fp9");
  try {
    Train(o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("policy: unknown preset 'fp9'"), std::string::npos)
        << e.what();
  }
  o = Tiny(1, 2, 2);
  o.data = "/nonexistent/corpus";
  EXPECT_THROW(Train(o), Error);
}

}  // namespace
}  // namespace geofp8::train
