// Finite-difference checks of every model op's backward in float64, plus float-vs-double
// agreement of the forward passes the trainer actually runs.

#include "kernels/model/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/common/check.h"
#include "tests/model/fd_check.h"

namespace geofp8::model {
namespace {

using testing::Dot;
using testing::MaxRelativeError;
using testing::RandomVector;

constexpr double kTol = 1e-6;

TEST(ModelOps, EmbeddingGradientMatchesFiniteDifferences) {
  const int vocab = 7, d = 5;
  const std::vector<int32_t> tokens = {3, 0, 3, 6, 1};
  std::vector<double> table = RandomVector(vocab * d, 1);
  const std::vector<double> R = RandomVector(tokens.size() * d, 2);
  std::vector<double> x(tokens.size() * d), dtable(table.size(), 0.0);
  auto loss = [&] {
    EmbeddingForward<double>(tokens, table.data(), d, x.data());
    return Dot(x, R);
  };
  EmbeddingBackward<double>(tokens, R.data(), d, dtable.data());
  EXPECT_LT(MaxRelativeError(table, loss, dtable), kTol);
  // Rows of tokens never seen get no gradient.
  for (int j = 0; j < d; ++j) EXPECT_EQ(dtable[2 * d + j], 0.0);
}

TEST(ModelOps, RmsNormGradientMatchesFiniteDifferences) {
  const int rows = 4, d = 9;
  std::vector<double> x = RandomVector(rows * d, 3), gain = RandomVector(d, 4);
  const std::vector<double> R = RandomVector(rows * d, 5);
  std::vector<double> y(rows * d), inv(rows);
  auto loss = [&] {
    RmsNormForward<double>(x.data(), gain.data(), rows, d, 1e-5, y.data(), inv.data());
    return Dot(y, R);
  };
  loss();
  std::vector<double> dx(x.size()), dgain(d, 0.0);
  RmsNormBackward<double>(x.data(), gain.data(), inv.data(), R.data(), rows, d, dx.data(),
                          dgain.data());
  EXPECT_LT(MaxRelativeError(x, loss, dx), kTol);
  EXPECT_LT(MaxRelativeError(gain, loss, dgain), kTol);
}

TEST(ModelOps, LinearGradientMatchesFiniteDifferences) {
  const int rows = 5, in = 7, out = 3;
  std::vector<double> x = RandomVector(rows * in, 6), W = RandomVector(out * in, 7);
  const std::vector<double> R = RandomVector(rows * out, 8);
  std::vector<double> y(rows * out);
  auto loss = [&] {
    LinearForward<double>(x.data(), W.data(), rows, in, out, y.data());
    return Dot(y, R);
  };
  std::vector<double> dx(x.size()), dW(W.size(), 0.0);
  LinearBackward<double>(x.data(), W.data(), R.data(), rows, in, out, dx.data(), dW.data());
  EXPECT_LT(MaxRelativeError(x, loss, dx), kTol);
  EXPECT_LT(MaxRelativeError(W, loss, dW), kTol);
}

TEST(ModelOps, RopeGradientMatchesFiniteDifferencesAndPreservesNorm) {
  const int batch = 2, seq = 5, heads = 2, hd = 6, rows = batch * seq;
  std::vector<double> x = RandomVector(rows * heads * hd, 9);
  const std::vector<double> R = RandomVector(x.size(), 10);
  auto loss = [&] {
    std::vector<double> y = x;
    RopeForward<double>(y.data(), rows, seq, heads, hd, 10000.0);
    return Dot(y, R);
  };
  std::vector<double> dx = R;
  RopeBackward<double>(dx.data(), rows, seq, heads, hd, 10000.0);
  EXPECT_LT(MaxRelativeError(x, loss, dx), kTol);
  std::vector<double> y = x;
  RopeForward<double>(y.data(), rows, seq, heads, hd, 10000.0);
  EXPECT_NEAR(Dot(y, y), Dot(x, x), 1e-9 * Dot(x, x));
  // Position 0 is not rotated; position 1 is.
  for (int j = 0; j < heads * hd; ++j) EXPECT_EQ(y[j], x[j]);
  EXPECT_NE(y[heads * hd], x[heads * hd]);
}

TEST(ModelOps, AttentionGradientMatchesFiniteDifferences) {
  const int batch = 2, seq = 4, heads = 2, hd = 3, width = heads * hd;
  std::vector<double> q = RandomVector(batch * seq * width, 11),
                      k = RandomVector(batch * seq * width, 12),
                      v = RandomVector(batch * seq * width, 13);
  const std::vector<double> R = RandomVector(q.size(), 14);
  std::vector<double> probs(batch * heads * seq * seq), out(q.size());
  auto loss = [&] {
    AttentionForward<double>(q.data(), k.data(), v.data(), batch, seq, heads, hd, probs.data(),
                             out.data());
    return Dot(out, R);
  };
  loss();
  std::vector<double> dq(q.size()), dk(q.size()), dv(q.size()), scratch(seq * seq);
  AttentionBackward<double>(q.data(), k.data(), v.data(), probs.data(), R.data(), batch, seq, heads,
                            hd, dq.data(), dk.data(), dv.data(), scratch.data());
  EXPECT_LT(MaxRelativeError(q, loss, dq), kTol);
  EXPECT_LT(MaxRelativeError(k, loss, dk), kTol);
  EXPECT_LT(MaxRelativeError(v, loss, dv), kTol);
}

TEST(ModelOps, AttentionIsCausal) {
  // Changing a later token's key/value must not change an earlier position's output.
  const int batch = 1, seq = 6, heads = 1, hd = 4;
  std::vector<double> q = RandomVector(seq * hd, 15), k = RandomVector(seq * hd, 16),
                      v = RandomVector(seq * hd, 17);
  std::vector<double> probs(seq * seq), out1(q.size()), out2(q.size());
  AttentionForward<double>(q.data(), k.data(), v.data(), batch, seq, heads, hd, probs.data(),
                           out1.data());
  for (int j = 0; j < hd; ++j) k[5 * hd + j] += 1.0, v[5 * hd + j] -= 2.0;
  AttentionForward<double>(q.data(), k.data(), v.data(), batch, seq, heads, hd, probs.data(),
                           out2.data());
  for (int i = 0; i < 5 * hd; ++i) EXPECT_EQ(out1[i], out2[i]) << i;
  bool changed = false;
  for (int j = 0; j < hd; ++j) changed |= out1[5 * hd + j] != out2[5 * hd + j];
  EXPECT_TRUE(changed);
  for (int i = 0; i < seq; ++i) {
    double sum = 0;
    for (int j = 0; j < seq; ++j) sum += probs[i * seq + j];
    EXPECT_NEAR(sum, 1.0, 1e-12);
    for (int j = i + 1; j < seq; ++j) EXPECT_EQ(probs[i * seq + j], 0.0);
  }
}

TEST(ModelOps, SwiGluGradientMatchesFiniteDifferences) {
  const int n = 23;
  std::vector<double> a = RandomVector(n, 18, 2.0), b = RandomVector(n, 19);
  const std::vector<double> R = RandomVector(n, 20);
  std::vector<double> h(n);
  auto loss = [&] {
    SwiGluForward<double>(a.data(), b.data(), n, h.data());
    return Dot(h, R);
  };
  std::vector<double> da(n), db(n);
  SwiGluBackward<double>(a.data(), b.data(), R.data(), n, da.data(), db.data());
  EXPECT_LT(MaxRelativeError(a, loss, da), kTol);
  EXPECT_LT(MaxRelativeError(b, loss, db), kTol);
}

TEST(ModelOps, CrossEntropyGradientMatchesFiniteDifferences) {
  const int rows = 5, vocab = 11;
  std::vector<double> logits = RandomVector(rows * vocab, 21, 3.0);
  const std::vector<int32_t> targets = {0, 10, 3, 3, 7};
  auto loss = [&] { return CrossEntropy<double>(logits.data(), targets, vocab, nullptr); };
  std::vector<double> d(logits.size());
  CrossEntropy<double>(logits.data(), targets, vocab, d.data());
  EXPECT_LT(MaxRelativeError(logits, loss, d), 1e-5);  // log-sum-exp round-off at h = 1e-5
  // Uniform logits give log(vocab).
  std::vector<double> zeros(rows * vocab, 0.0);
  EXPECT_NEAR(CrossEntropy<double>(zeros.data(), targets, vocab, nullptr), std::log(11.0), 1e-12);
}

TEST(ModelOps, FloatForwardAgreesWithDouble) {
  const int batch = 2, seq = 8, heads = 2, hd = 8, width = heads * hd;
  std::vector<double> qd = RandomVector(batch * seq * width, 22), kd = RandomVector(qd.size(), 23),
                      vd = RandomVector(qd.size(), 24);
  std::vector<float> qf(qd.begin(), qd.end()), kf(kd.begin(), kd.end()), vf(vd.begin(), vd.end());
  std::vector<double> pd(batch * heads * seq * seq), od(qd.size());
  std::vector<float> pf(pd.size()), of(qd.size());
  AttentionForward<double>(qd.data(), kd.data(), vd.data(), batch, seq, heads, hd, pd.data(),
                           od.data());
  AttentionForward<float>(qf.data(), kf.data(), vf.data(), batch, seq, heads, hd, pf.data(),
                          of.data());
  for (size_t i = 0; i < od.size(); ++i) EXPECT_NEAR(of[i], od[i], 1e-5 * (1 + std::abs(od[i])));
}

TEST(ModelOps, FastExpMatchesLibm) {
  // ExpF32 against std::exp in double: a few ulp over the range the model uses, 0 below it, NaN
  // for NaN.
  double worst = 0;
  for (float x = -87.f; x <= 88.f; x += 0.001953125f * 7.f) {
    const double ref = std::exp(double(x));
    worst = std::max(worst, std::abs(double(ExpF32(x)) - ref) / ref);
  }
  EXPECT_LT(worst, 3 * 0x1p-24) << "worst relative error " << worst;
  EXPECT_EQ(ExpF32(0.f), 1.f);
  EXPECT_EQ(ExpF32(-100.f), 0.f);
  EXPECT_TRUE(std::isnan(ExpF32(std::nanf(""))));
  EXPECT_NEAR(ExpF32(1.f), 2.718281828f, 2e-7f);
}

TEST(ModelOps, FloatElementwiseOpsAgreeWithDouble) {
  // Rows of 8..200 elements run both the eight-lane main loops and the tails.
  for (int d : {8, 13, 64, 200}) {
    const int rows = 3;
    const std::vector<double> xd = RandomVector(rows * d, 30 + d, 2.0),
                              gd = RandomVector(d, 31 + d), dyd = RandomVector(rows * d, 32 + d);
    const std::vector<float> xf(xd.begin(), xd.end()), gf(gd.begin(), gd.end()),
        dyf(dyd.begin(), dyd.end());
    auto close = [&](const std::vector<float>& f, const std::vector<double>& ref, double tol,
                     const char* what) {
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_NEAR(f[i], ref[i], tol * (1 + std::abs(ref[i]))) << what << " d=" << d << " i=" << i;
      }
    };
    // RMSNorm forward and backward.
    std::vector<double> yd(xd.size()), invd(rows), dxd(xd.size()), dgd(d, 0.0);
    std::vector<float> yf(xd.size()), invf(rows), dxf(xd.size()), dgf(d, 0.f);
    RmsNormForward<double>(xd.data(), gd.data(), rows, d, 1e-5, yd.data(), invd.data());
    RmsNormForward<float>(xf.data(), gf.data(), rows, d, 1e-5f, yf.data(), invf.data());
    close(yf, yd, 1e-5, "rmsnorm y");
    RmsNormBackward<double>(xd.data(), gd.data(), invd.data(), dyd.data(), rows, d, dxd.data(),
                            dgd.data());
    RmsNormBackward<float>(xf.data(), gf.data(), invf.data(), dyf.data(), rows, d, dxf.data(),
                           dgf.data());
    close(dxf, dxd, 1e-5, "rmsnorm dx");
    close(dgf, dgd, 1e-5, "rmsnorm dgain");
    // SwiGLU forward and backward on the same values.
    std::vector<double> hd(xd.size()), dad(xd.size()), dbd(xd.size());
    std::vector<float> hf(xd.size()), daf(xd.size()), dbf(xd.size());
    SwiGluForward<double>(xd.data(), dyd.data(), int64_t(xd.size()), hd.data());
    SwiGluForward<float>(xf.data(), dyf.data(), int64_t(xd.size()), hf.data());
    close(hf, hd, 1e-6, "swiglu h");
    SwiGluBackward<double>(xd.data(), dyd.data(), yd.data(), int64_t(xd.size()), dad.data(),
                           dbd.data());
    SwiGluBackward<float>(xf.data(), dyf.data(), yf.data(), int64_t(xd.size()), daf.data(),
                          dbf.data());
    close(daf, dad, 1e-5, "swiglu da");
    close(dbf, dbd, 1e-5, "swiglu db");
    // Cross-entropy with its gradient, logits scaled up so the softmax is peaked.
    std::vector<double> ld(xd.size());
    for (size_t i = 0; i < ld.size(); ++i) ld[i] = 4 * xd[i];
    const std::vector<float> lf(ld.begin(), ld.end());
    const std::vector<int32_t> targets = {0, d - 1, d / 2};
    std::vector<double> dld(ld.size());
    std::vector<float> dlf(ld.size());
    const double cd = CrossEntropy<double>(ld.data(), targets, d, dld.data());
    const double cf = CrossEntropy<float>(lf.data(), targets, d, dlf.data());
    EXPECT_NEAR(cf, cd, 1e-6 * (1 + cd)) << "d=" << d;
    EXPECT_NEAR(CrossEntropy<float>(lf.data(), targets, d, nullptr), cf, 1e-6 * (1 + cd));
    close(dlf, dld, 1e-6, "cross-entropy dlogits");
  }
}

TEST(ModelOps, RopeTableMatchesTheDirectRotation) {
  const int rows = 12, seq = 6, heads = 2, hd = 8;
  std::vector<double> x = RandomVector(rows * heads * hd, 40), y = x;
  RopeForward<double>(x.data(), rows, seq, heads, hd, 10000.0);
  for (int t = 0; t < rows; ++t) {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < hd / 2; ++i) {
        const double angle = (t % seq) * std::pow(10000.0, -2.0 * i / hd);
        double* p = y.data() + (t * heads + h) * hd + 2 * i;
        const double a = p[0], b = p[1];
        p[0] = a * std::cos(angle) - b * std::sin(angle);
        p[1] = a * std::sin(angle) + b * std::cos(angle);
      }
    }
  }
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], y[i], 1e-12) << i;
}

TEST(ModelOps, LinearBackwardCanOverwriteTheWeightGradient) {
  const int rows = 4, in = 5, out = 3;
  const std::vector<double> x = RandomVector(rows * in, 50), W = RandomVector(out * in, 51),
                            dy = RandomVector(rows * out, 52);
  std::vector<double> dx(rows * in), dw_acc(out * in, 0.0), dw_new(out * in, 123.0);
  LinearBackward<double>(x.data(), W.data(), dy.data(), rows, in, out, dx.data(), dw_acc.data());
  LinearBackward<double>(x.data(), W.data(), dy.data(), rows, in, out, dx.data(), dw_new.data(),
                         false, false);
  for (size_t i = 0; i < dw_acc.size(); ++i) EXPECT_NEAR(dw_new[i], dw_acc[i], 1e-14) << i;
}

TEST(ModelOps, PreferredBlasCoreIsEmptyWhenTheUserChose) {
  // With OPENBLAS_CORETYPE set the user's choice stands, whatever the CPU.
  const char* saved = std::getenv("OPENBLAS_CORETYPE");
  const std::string keep = saved ? saved : "";
  setenv("OPENBLAS_CORETYPE", "Haswell", 1);
  EXPECT_EQ(PreferredBlasCore(), "");
  if (saved)
    setenv("OPENBLAS_CORETYPE", keep.c_str(), 1);
  else
    unsetenv("OPENBLAS_CORETYPE");
  EXPECT_FALSE(BlasCoreName().empty());
}

TEST(ModelOps, RejectsBadArguments) {
  std::vector<float> logits(4, 0.f), d(4);
  const std::vector<int32_t> bad = {4};
  EXPECT_THROW(CrossEntropy<float>(logits.data(), bad, 4, d.data()), geofp8::Error);
  std::vector<float> x(6);
  EXPECT_THROW(RopeForward<float>(x.data(), 1, 1, 2, 3, 10000.f), geofp8::Error);
  EXPECT_THROW(SetBlasThreads(0), geofp8::Error);
}

}  // namespace
}  // namespace geofp8::model
