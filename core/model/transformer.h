#pragma once
// Qwen3 dense decoder, the exact math of HF Qwen3ForCausalLM (DESIGN §4), batched, CPU or CUDA.
#include <filesystem>
#include <string>
#include <vector>

#include "core/model/config.h"
#include "core/model/hooks.h"
#include "core/util/compat.h"

namespace hh::io { class Checkpoint; }

namespace hh::model {

// Weights of one decoder layer, HF names in comments (prefix model.layers.{l}.).
struct LayerWeights {
  at::Tensor input_layernorm;           // input_layernorm.weight            [d]
  at::Tensor q_proj, k_proj, v_proj;    // self_attn.{q,k,v}_proj.weight     [Hq*Dh, d], [Hkv*Dh, d]
  at::Tensor q_bias, k_bias, v_bias;    // self_attn.{q,k,v}_proj.bias       only when attention_bias
  at::Tensor o_proj;                    // self_attn.o_proj.weight           [d, Hq*Dh]
  at::Tensor q_norm, k_norm;            // self_attn.{q,k}_norm.weight       [Dh]
  at::Tensor post_attention_layernorm;  // post_attention_layernorm.weight   [d]
  at::Tensor gate_proj, up_proj;        // mlp.{gate,up}_proj.weight         [I, d]
  at::Tensor down_proj;                 // mlp.down_proj.weight              [d, I]
};

struct Weights {
  at::Tensor embed_tokens;              // model.embed_tokens.weight [V, d]
  std::vector<LayerWeights> layers;
  at::Tensor norm;                      // model.norm.weight [d]
  at::Tensor lm_head;                   // lm_head.weight [V, d] (== embed_tokens when tied)
};

// The (name, tensor-slot, expected shape) table that loading, saving and checks share.
struct WeightEntry {
  std::string name;
  at::Tensor* slot;
  std::vector<int64_t> shape;
};
std::vector<WeightEntry> weight_table(const ModelConfig& cfg, Weights& w);

struct ForwardOptions {
  const Hooks* hooks = nullptr;
  // > 0: the input is the residual stream entering this layer ([B, T, d], e.g. a cached
  // blocks.{l}.hook_resid_pre) instead of token ids.
  int64_t start_layer = 0;
  // Run layers [start_layer, stop_layer). -1: all layers, then final norm and lm_head.
  // Stopping early returns the residual and no logits.
  int64_t stop_layer = -1;
  // [P] int64 positions: project to the vocabulary only there (logits [B, P, V]). Undefined: all.
  at::Tensor logit_positions;
  // [R] int64 query positions whose attention rows hook_pattern receives ([B, Hq, R, T]).
  // Undefined: all T rows (only sensible for short inputs).
  at::Tensor pattern_rows;
  // Position of the first token of `input` (RoPE offset), for inputs that are a suffix.
  int64_t position_offset = 0;
};

struct ForwardOutput {
  at::Tensor logits;  // [B, T or P, V] float32; undefined when stopped early
  at::Tensor resid;   // [B, T, d] residual after the last layer run (before the final norm)
};

class Transformer {
 public:
  Transformer(ModelConfig cfg, Weights w);
  // Loads config.json + safetensors. dtype: "" keeps the checkpoint's dtype, else f32|bf16|f16.
  // Every tensor's presence and shape is checked; errors name the file and tensor.
  static Transformer load(const std::filesystem::path& dir, const std::string& device = "cpu",
                          const std::string& dtype = "");

  // input: token ids [B, T] int64 (start_layer == 0) or residual [B, T, d].
  ForwardOutput forward(const at::Tensor& input, const ForwardOptions& opts = {}) const;

  const ModelConfig& config() const { return cfg_; }
  const Weights& weights() const { return w_; }
  Weights& mutable_weights() { return w_; }
  at::Device device() const;
  at::ScalarType dtype() const;

 private:
  ModelConfig cfg_;
  Weights w_;
  at::Tensor inv_freq_;  // [Dh/2] float32
};

at::ScalarType parse_dtype(const std::string& name);  // f32|bf16|f16 (and float32, bfloat16, ...)

}  // namespace hh::model
