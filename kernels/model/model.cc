// The Llama-style decoder of kernels/model/model.h: parameter layout, presets, init, and one
// forward+backward pass that reports each parameter's gradient as soon as it is final.

#include "kernels/model/model.h"

#include <cmath>
#include <sstream>

#include "kernels/common/check.h"
#include "kernels/model/ops.h"

namespace geofp8::model {

std::string ValidateModelConfig(const ModelConfig& c) {
  std::ostringstream os;
  auto positive = [&](const char* field, int v) {
    if (os.tellp() == 0 && v < 1) os << "model." << field << ": must be >= 1 (" << v << ")";
  };
  positive("vocab", c.vocab);
  positive("dim", c.dim);
  positive("layers", c.layers);
  positive("heads", c.heads);
  positive("ffn", c.ffn);
  positive("seq", c.seq);
  if (os.tellp() != 0) return os.str();
  if (c.dim % c.heads != 0) {
    os << "model.heads: must divide model.dim (" << c.dim << " % " << c.heads << " != 0)";
  } else if ((c.dim / c.heads) % 2 != 0) {
    os << "model.heads: head_dim = dim / heads must be even for rotary pairs (" << c.dim / c.heads
       << ")";
  } else if (!(c.rope_theta > 1.f) || !std::isfinite(c.rope_theta)) {
    os << "model.rope_theta: must be a finite value > 1 (" << c.rope_theta << ")";
  } else if (!(c.norm_eps > 0.f) || !std::isfinite(c.norm_eps)) {
    os << "model.norm_eps: must be a finite value > 0 (" << c.norm_eps << ")";
  } else if (!(c.init_std > 0.f) || !std::isfinite(c.init_std)) {
    os << "model.init_std: must be a finite value > 0 (" << c.init_std << ")";
  } else if (c.vocab > (1 << 24)) {
    os << "model.vocab: too large (" << c.vocab << ")";
  }
  return os.str();
}

std::optional<ModelConfig> PresetConfig(std::string_view name) {
  ModelConfig c;
  c.name = std::string(name);
  if (name == "llama-tiny") {
    c.dim = 64, c.layers = 2, c.heads = 4, c.ffn = 128, c.seq = 32;
  } else if (name == "llama-small") {
    // 3,344,640 parameters: the largest round shape whose 1000-step, 4-rank run fits about ten
    // minutes on the 2-core CI machine (worker/train/README.md). SwiGLU 704 = 8/3 x 256 rounded
    // to a multiple of 64.
    c.dim = 256, c.layers = 4, c.heads = 4, c.ffn = 704, c.seq = 64;
  } else if (name == "llama-300m") {
    c.dim = 1024, c.layers = 24, c.heads = 16, c.ffn = 2816, c.seq = 1024;
  } else if (name == "llama-600m") {
    c.dim = 1536, c.layers = 21, c.heads = 16, c.ffn = 4096, c.seq = 1024;
  } else {
    return std::nullopt;
  }
  return c;
}

std::string_view AcceptedPresets() { return "llama-tiny, llama-small, llama-300m, llama-600m"; }

int64_t ParameterCount(const ModelConfig& c) {
  const int64_t d = c.dim, f = c.ffn, v = c.vocab;
  return 2 * v * d + d + c.layers * (2 * d + 4 * d * d + 3 * d * f);
}

namespace {
// Parameters per transformer layer, in ParamLayout's order.
enum LayerParam { kAttnNorm, kWq, kWk, kWv, kWo, kMlpNorm, kW1, kW3, kW2, kPerLayer };
}  // namespace

std::vector<ParamInfo> ParamLayout(const ModelConfig& config) {
  const int64_t d = config.dim, f = config.ffn;
  std::vector<ParamInfo> out;
  auto add = [&](std::string name, int64_t rows, int64_t cols) {
    ParamInfo p;
    p.name = std::move(name);
    p.rows = rows;
    p.cols = cols;
    p.offset = out.empty() ? 0 : out.back().offset + out.back().size();
    out.push_back(std::move(p));
  };
  // Forward order; the backward finishes gradients in exactly the reverse of this order.
  add("tok_emb", config.vocab, d);
  for (int l = 0; l < config.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "attn_norm", 1, d);  // the order of LayerParam
    add(p + "attn.wq", d, d);
    add(p + "attn.wk", d, d);
    add(p + "attn.wv", d, d);
    add(p + "attn.wo", d, d);
    add(p + "mlp_norm", 1, d);
    add(p + "mlp.w1", f, d);
    add(p + "mlp.w3", f, d);
    add(p + "mlp.w2", d, f);
  }
  add("final_norm", 1, d);
  add("lm_head", config.vocab, d);
  return out;
}

template <typename T>
Model<T>::Model(const ModelConfig& config) : config_(config) {
  const std::string err = ValidateModelConfig(config);
  GEOFP8_CHECK(err.empty(), err);
  params_ = ParamLayout(config);
  tok_emb_ = 0;
  for (int l = 0; l < config.layers; ++l) {
    const int base = 1 + l * kPerLayer;
    LayerIndex li;
    li.attn_norm = base + kAttnNorm;
    li.wq = base + kWq;
    li.wk = base + kWk;
    li.wv = base + kWv;
    li.wo = base + kWo;
    li.mlp_norm = base + kMlpNorm;
    li.w1 = base + kW1;
    li.w3 = base + kW3;
    li.w2 = base + kW2;
    layer_index_.push_back(li);
  }
  final_norm_ = 1 + config.layers * kPerLayer;
  lm_head_ = final_norm_ + 1;
  const int64_t total = params_.back().offset + params_.back().size();
  GEOFP8_CHECK(total == ParameterCount(config), "parameter layout mismatch");
  weights_.assign(total, T(0));
  grads_.assign(total, T(0));
  acts_.resize(config.layers);
}

namespace {
uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
double Uniform01(uint64_t& state) { return ((SplitMix64(state) >> 11) + 0.5) * 0x1.0p-53; }
}  // namespace

template <typename T>
void Model<T>::Init(uint64_t seed) {
  uint64_t state = seed ^ 0x67656f667038ULL;
  const double out_std = config_.init_std / std::sqrt(2.0 * config_.layers);
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamInfo& p = params_[i];
    T* w = W(static_cast<int>(i));
    if (!p.is_matrix()) {
      for (int64_t j = 0; j < p.size(); ++j) w[j] = T(1);  // norm gains
      continue;
    }
    const bool out_proj = p.name.ends_with(".wo") || p.name.ends_with(".w2");
    const double std = out_proj ? out_std : config_.init_std;
    for (int64_t j = 0; j < p.size(); j += 2) {
      const double r = std::sqrt(-2.0 * std::log(Uniform01(state)));
      const double th = 2.0 * M_PI * Uniform01(state);
      w[j] = static_cast<T>(std * r * std::cos(th));
      if (j + 1 < p.size()) w[j + 1] = static_cast<T>(std * r * std::sin(th));
    }
  }
}

template <typename T>
double Model<T>::Loss(std::span<const int32_t> tokens, int batch, int seq) {
  return Run(tokens, batch, seq, false, nullptr);
}

template <typename T>
double Model<T>::ForwardBackward(std::span<const int32_t> tokens, int batch, int seq,
                                 const GradReadyFn& on_ready) {
  return Run(tokens, batch, seq, true, on_ready);
}

template <typename T>
double Model<T>::Run(std::span<const int32_t> tokens, int batch, int seq, bool backward,
                     const GradReadyFn& on_ready) {
  const ModelConfig& c = config_;
  GEOFP8_CHECK(batch >= 1, "batch must be >= 1, got ", batch);
  GEOFP8_CHECK(seq >= 1 && seq <= c.seq, "seq must be in [1, ", c.seq, "], got ", seq);
  GEOFP8_CHECK(tokens.size() == static_cast<size_t>(batch) * (seq + 1), "expected ",
               batch * (seq + 1), " tokens (batch x (seq+1)), got ", tokens.size());
  const int rows = batch * seq, d = c.dim, f = c.ffn, H = c.heads, hd = c.dim / c.heads;
  const T eps = static_cast<T>(c.norm_eps), theta = static_cast<T>(c.rope_theta);
  inputs_.resize(rows);
  targets_.resize(rows);
  for (int b = 0; b < batch; ++b) {
    for (int s = 0; s < seq; ++s) {
      const int32_t in = tokens[b * (seq + 1) + s], out = tokens[b * (seq + 1) + s + 1];
      GEOFP8_CHECK(in >= 0 && in < c.vocab, "token ", in, " outside vocab ", c.vocab);
      inputs_[b * seq + s] = in;
      targets_[b * seq + s] = out;
    }
  }
  const size_t rd = size_t(rows) * d, rf = size_t(rows) * f;
  rope_cos_.resize(size_t(seq) * (hd / 2)), rope_sin_.resize(rope_cos_.size());
  RopeTable<T>(seq, hd, theta, rope_cos_.data(), rope_sin_.data());
  auto rope = [&](std::vector<T>& x, bool inverse) {
    RopeApply<T>(x.data(), rows, seq, H, hd, rope_cos_.data(), rope_sin_.data(), inverse);
  };

  // Forward. acts_[l].x is the residual stream entering layer l, xf_ the one leaving the last.
  acts_[0].x.resize(rd);
  EmbeddingForward<T>(inputs_, W(tok_emb_), d, acts_[0].x.data());
  for (int l = 0; l < c.layers; ++l) {
    const LayerIndex& li = layer_index_[l];
    LayerActs& A = acts_[l];
    A.xn1.resize(rd), A.rms1.resize(rows), A.q.resize(rd), A.k.resize(rd), A.v.resize(rd);
    A.probs.resize(size_t(batch) * H * seq * seq), A.attn.resize(rd), A.xmid.resize(rd);
    A.xn2.resize(rd), A.rms2.resize(rows), A.a.resize(rf), A.b.resize(rf), A.h.resize(rf);
    RmsNormForward<T>(A.x.data(), W(li.attn_norm), rows, d, eps, A.xn1.data(), A.rms1.data());
    LinearForward<T>(A.xn1.data(), W(li.wq), rows, d, d, A.q.data());
    LinearForward<T>(A.xn1.data(), W(li.wk), rows, d, d, A.k.data());
    LinearForward<T>(A.xn1.data(), W(li.wv), rows, d, d, A.v.data());
    rope(A.q, false);
    rope(A.k, false);
    AttentionForward<T>(A.q.data(), A.k.data(), A.v.data(), batch, seq, H, hd, A.probs.data(),
                        A.attn.data());
    // xmid = x + attn Wo^T
    A.xmid = A.x;
    Gemm<T>(false, true, rows, d, d, T(1), A.attn.data(), d, W(li.wo), d, T(1), A.xmid.data(), d);
    RmsNormForward<T>(A.xmid.data(), W(li.mlp_norm), rows, d, eps, A.xn2.data(), A.rms2.data());
    LinearForward<T>(A.xn2.data(), W(li.w1), rows, d, f, A.a.data());
    LinearForward<T>(A.xn2.data(), W(li.w3), rows, d, f, A.b.data());
    SwiGluForward<T>(A.a.data(), A.b.data(), int64_t(rf), A.h.data());
    std::vector<T>& out = l + 1 < c.layers ? acts_[l + 1].x : xf_;
    out = A.xmid;
    Gemm<T>(false, true, rows, d, f, T(1), A.h.data(), f, W(li.w2), f, T(1), out.data(), d);
  }
  xnf_.resize(rd), rmsf_.resize(rows), logits_.resize(size_t(rows) * c.vocab);
  RmsNormForward<T>(xf_.data(), W(final_norm_), rows, d, eps, xnf_.data(), rmsf_.data());
  LinearForward<T>(xnf_.data(), W(lm_head_), rows, d, c.vocab, logits_.data());
  if (!backward) return CrossEntropy<T>(logits_.data(), targets_, c.vocab, nullptr);

  dlogits_.resize(logits_.size());
  const double loss = CrossEntropy<T>(logits_.data(), targets_, c.vocab, dlogits_.data());
  // Every weight matrix's gradient is written once (the GEMM's beta = 0, below); only the
  // embedding (scatter-added) and the norm gains (summed over rows) accumulate from zero.
  auto zero = [&](int i) { std::fill_n(G(i), params_[i].size(), T(0)); };
  zero(tok_emb_);
  zero(final_norm_);
  for (const LayerIndex& li : layer_index_) zero(li.attn_norm), zero(li.mlp_norm);
  auto ready = [&](int i) {
    if (on_ready) on_ready(i);
  };
  // dx = dy W (+= when accumulate_dx), dW = dy^T x.
  auto linear_backward = [&](const T* x, int w, const T* dy, int in, int out, T* dx,
                             bool accumulate_dx = false) {
    LinearBackward<T>(x, W(w), dy, rows, in, out, dx, G(w), accumulate_dx, false);
  };

  // Backward. dx_ carries d(loss)/d(residual stream).
  dn_.resize(rd), dx_.resize(rd), dtmp_.resize(rd), dq_.resize(rd), dk_.resize(rd), dv_.resize(rd);
  da_.resize(rf), db_.resize(rf), dh_.resize(rf), scratch_.resize(size_t(seq) * seq);
  linear_backward(xnf_.data(), lm_head_, dlogits_.data(), d, c.vocab, dn_.data());
  ready(lm_head_);
  RmsNormBackward<T>(xf_.data(), W(final_norm_), rmsf_.data(), dn_.data(), rows, d, dx_.data(),
                     G(final_norm_));
  ready(final_norm_);
  for (int l = c.layers - 1; l >= 0; --l) {
    const LayerIndex& li = layer_index_[l];
    LayerActs& A = acts_[l];
    // MLP: x = xmid + h W2^T.
    linear_backward(A.h.data(), li.w2, dx_.data(), f, d, dh_.data());
    ready(li.w2);
    SwiGluBackward<T>(A.a.data(), A.b.data(), dh_.data(), int64_t(rf), da_.data(), db_.data());
    linear_backward(A.xn2.data(), li.w3, db_.data(), d, f, dn_.data());
    ready(li.w3);
    linear_backward(A.xn2.data(), li.w1, da_.data(), d, f, dn_.data(), true);
    ready(li.w1);
    RmsNormBackward<T>(A.xmid.data(), W(li.mlp_norm), A.rms2.data(), dn_.data(), rows, d,
                       dtmp_.data(), G(li.mlp_norm));
    ready(li.mlp_norm);
    for (size_t i = 0; i < rd; ++i) dx_[i] += dtmp_[i];  // d xmid = residual + MLP branch
    // Attention: xmid = x + attn Wo^T.
    linear_backward(A.attn.data(), li.wo, dx_.data(), d, d, dtmp_.data());
    ready(li.wo);
    AttentionBackward<T>(A.q.data(), A.k.data(), A.v.data(), A.probs.data(), dtmp_.data(), batch,
                         seq, H, hd, dq_.data(), dk_.data(), dv_.data(), scratch_.data());
    rope(dq_, true);
    rope(dk_, true);
    linear_backward(A.xn1.data(), li.wv, dv_.data(), d, d, dn_.data());
    ready(li.wv);
    linear_backward(A.xn1.data(), li.wk, dk_.data(), d, d, dn_.data(), true);
    ready(li.wk);
    linear_backward(A.xn1.data(), li.wq, dq_.data(), d, d, dn_.data(), true);
    ready(li.wq);
    RmsNormBackward<T>(A.x.data(), W(li.attn_norm), A.rms1.data(), dn_.data(), rows, d,
                       dtmp_.data(), G(li.attn_norm));
    ready(li.attn_norm);
    for (size_t i = 0; i < rd; ++i) dx_[i] += dtmp_[i];
  }
  EmbeddingBackward<T>(inputs_, dx_.data(), d, G(tok_emb_));
  ready(tok_emb_);
  return loss;
}

template class Model<float>;
template class Model<double>;

}  // namespace geofp8::model
