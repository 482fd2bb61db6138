// A Llama-style decoder (token embedding, RMSNorm, rotary attention, SwiGLU MLP, untied output
// head, cross-entropy) with a full backward pass on the CPU, for float (training) and double
// (tests).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace geofp8::model {

// Shape of the model. Plain struct with defaults (llama-tiny); validated by ValidateModelConfig.
struct ModelConfig {
  std::string name = "llama-tiny";
  int vocab = 256;  // byte-level tokenizer
  int dim = 64;     // model width d
  int layers = 2;   // decoder blocks
  int heads = 4;    // attention heads; head_dim = dim / heads, must be even (rotary pairs)
  int ffn = 128;    // SwiGLU hidden width
  int seq = 32;     // context length in tokens
  float rope_theta = 10000.f;
  float norm_eps = 1e-5f;
  float init_std = 0.02f;  // std of the normal init of matrices; output projections get
                           // init_std / sqrt(2 * layers)
};

// "" when usable, else one line naming the field: "model.heads: must divide model.dim (64 % 5)".
std::string ValidateModelConfig(const ModelConfig& config);

// Presets: llama-tiny (~0.1M params, tests), llama-small (3.3M, demos and the convergence
// study on 2 CPU cores), llama-300m and llama-600m (the paper's scale, for GPU clusters).
std::optional<ModelConfig> PresetConfig(std::string_view name);
std::string_view AcceptedPresets();  // "llama-tiny, llama-small, llama-300m, llama-600m"
int64_t ParameterCount(const ModelConfig& config);

// One parameter tensor inside the flat parameter buffer.
struct ParamInfo {
  std::string name;    // e.g. "layers.1.attn.wq"
  int64_t offset = 0;  // into the flat buffer, in elements
  int64_t rows = 0;    // 2-D weights are rows x cols = out x in (the gradient's m x n)
  int64_t cols = 0;    // 1-D parameters have rows = 1
  bool is_matrix() const { return rows > 1; }
  int64_t size() const { return rows * cols; }
  // The gradient's shape as the exchange takes it (LayerSpec, EngineLayer): a matrix as it is,
  // a 1-D parameter of n elements as (n, 1).
  int64_t exchange_rows() const { return is_matrix() ? rows : size(); }
  int64_t exchange_cols() const { return is_matrix() ? cols : 1; }
};

// The parameters of a model of this shape, names and offsets, in forward order, without
// allocating it (what policy globs are resolved against). Model::params() is exactly this.
std::vector<ParamInfo> ParamLayout(const ModelConfig& config);

// Called during the backward pass as soon as a parameter's gradient is final, in reverse layer
// order (the order buckets are filled). Argument: index into params().
using GradReadyFn = std::function<void(int param_index)>;

template <typename T>
class Model {
 public:
  explicit Model(const ModelConfig& config);  // throws geofp8::Error on an invalid config

  const ModelConfig& config() const { return config_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  std::vector<T>& weights() { return weights_; }
  const std::vector<T>& weights() const { return weights_; }
  std::vector<T>& grads() { return grads_; }
  const std::vector<T>& grads() const { return grads_; }
  std::span<T> weight(int i) {
    return {weights_.data() + params_[i].offset, size_t(params_[i].size())};
  }
  std::span<T> grad(int i) {
    return {grads_.data() + params_[i].offset, size_t(params_[i].size())};
  }

  // Deterministic init from a seed (own Box-Muller over splitmix64, platform independent).
  void Init(uint64_t seed);

  // Mean next-token cross-entropy of `tokens` laid out as batch rows of seq+1 tokens (row i
  // predicts tokens[i][1..seq] from tokens[i][0..seq)). seq <= config.seq.
  double Loss(std::span<const int32_t> tokens, int batch, int seq);

  // Same loss, and overwrites grads() with its gradient; calls on_ready(i) for each parameter in
  // reverse layer order as soon as its gradient is final.
  double ForwardBackward(std::span<const int32_t> tokens, int batch, int seq,
                         const GradReadyFn& on_ready = nullptr);

 private:
  struct LayerIndex {
    int attn_norm, wq, wk, wv, wo, mlp_norm, w1, w3, w2;
  };
  struct LayerActs {
    std::vector<T> x, xn1, rms1, q, k, v, probs, attn, xmid, xn2, rms2, a, b, h;
  };
  double Run(std::span<const int32_t> tokens, int batch, int seq, bool backward,
             const GradReadyFn& on_ready);
  T* W(int i) { return weights_.data() + params_[i].offset; }
  T* G(int i) { return grads_.data() + params_[i].offset; }

  ModelConfig config_;
  std::vector<ParamInfo> params_;
  std::vector<T> weights_, grads_;
  int tok_emb_ = 0, final_norm_ = 0, lm_head_ = 0;
  std::vector<LayerIndex> layer_index_;
  // Activation buffers, reused across calls.
  std::vector<LayerActs> acts_;
  std::vector<T> xf_, xnf_, rmsf_, logits_, dlogits_, dx_, dtmp_, dq_, dk_, dv_, da_, db_, dh_, dn_,
      scratch_, rope_cos_, rope_sin_;
  std::vector<int32_t> inputs_, targets_;
};

extern template class Model<float>;
extern template class Model<double>;

}  // namespace geofp8::model
