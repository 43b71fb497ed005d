#pragma once
// Qwen3 dense decoder, the exact math of HF Qwen3ForCausalLM (DESIGN §4), batched, CPU or CUDA.
#include <atomic>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "core/model/config.h"
#include "core/model/hooks.h"
#include "core/model/kv_cache.h"
#include "core/util/compat.h"

namespace hh::io { class Checkpoint; }

namespace hh::model {

// Weights of one decoder layer, HF names in comments (prefix model.layers.{l}.).
struct LayerWeights {
  at::Tensor input_layernorm;           // input_layernorm.weight            [d]
  at::Tensor q_proj, k_proj, v_proj;    // self_attn.{q,k,v}_proj.weight     [Hq*Dh, d], [Hkv*Dh, d]
  at::Tensor q_bias, k_bias, v_bias;    // self_attn.{q,k,v}_proj.bias       only when attention_bias
  at::Tensor o_proj;                    // self_attn.o_proj.weight           [d, Hq*Dh]
  at::Tensor o_bias;                    // self_attn.o_proj.bias  [d]        only when attention_bias (as HF)
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
// Resizes w.layers to the config's layer count. Tied models have no lm_head.weight entry
// (HF files do not store it); Transformer aliases lm_head to embed_tokens instead.
struct WeightEntry {
  std::string name;
  at::Tensor* slot;
  std::vector<int64_t> shape;
};
std::vector<WeightEntry> weight_table(const ModelConfig& cfg, Weights& w);

// Random weights for tests and from-scratch runs: linear/embedding weights ~ N(0, std^2), biases
// ~ N(0, std^2), norm weights ~ 1 + N(0, 0.1^2). Drawn in float32 on the CPU from `seed` and then
// cast, so the same seed gives the same model (up to rounding) in every dtype. lm_head is aliased
// to embed_tokens when tied.
Weights random_weights(const ModelConfig& cfg, uint64_t seed, at::ScalarType dtype, double std = 0.02);

// Writes an HF checkpoint directory: config.json (cfg, torch_dtype from the weights) and the weights
// under their HF names, one model.safetensors or shards of at most max_shard_bytes (0: one file).
// Every file is written atomically; the directory is created when missing.
void save_model(const std::filesystem::path& dir, const ModelConfig& cfg, const Weights& w,
                uint64_t max_shard_bytes = 0);
// config.json's torch_dtype spelling of a weight dtype ("bfloat16", "float32", ...); throws for others.
std::string hf_dtype_name(at::ScalarType t);

struct ForwardOptions {
  const Hooks* hooks = nullptr;
  // > 0: the input is the residual stream entering this layer ([B, T, d], e.g. a cached
  // blocks.{l}.hook_resid_pre) instead of token ids.
  int64_t start_layer = 0;
  // Run layers [start_layer, stop_layer). -1: all layers, then final norm and lm_head.
  // Stopping early returns the residual and no logits (stop_layer = the layer count is not early: see
  // `logits`).
  int64_t stop_layer = -1;
  // [P] int64 positions: project to the vocabulary only there (logits [B, P, V]). Undefined: all.
  at::Tensor logit_positions;
  // [R] int64 query positions whose attention rows hook_pattern receives ([B, Hq, R, T]).
  // Undefined: all T rows (only sensible for short inputs).
  at::Tensor pattern_rows;
  // Position of the first token of `input` (RoPE offset), for inputs that are a suffix. With a
  // kv_prefix of P tokens the first input token sits at position P + position_offset.
  int64_t position_offset = 0;
  // Keys and values of P earlier tokens that every row of the batch shares (a clean run's prefix),
  // so only the tokens after it are recomputed. One entry per layer the forward runs (indexed by
  // layer; others may be undefined): k and v [1 or B, P, Hkv, Dh], k after k_norm and RoPE, exactly
  // what blocks.{l}.attn.hook_k / hook_v hold. hook_k / hook_v see the new tokens only; hook_pattern
  // rows index the new tokens and span all P + T keys.
  const std::vector<at::Tensor>* prefix_k = nullptr;
  const std::vector<at::Tensor>* prefix_v = nullptr;
  // Decoding: the keys and values of the tokens before the input (one entry a layer, all holding the
  // same number of tokens P). Each layer appends its new keys and values to it and attends over all of
  // them, read in place; the input's first token sits at position P + position_offset. Not with
  // prefix_k / prefix_v.
  KvCache* cache = nullptr;
  // Attention kernel. false: scaled_dot_product_attention where LibTorch has it (>= 2.0; HF's default
  // "sdpa"), else the blockwise eager math. true: always the blockwise eager math (HF "eager":
  // scores in the model dtype, softmax in float32), e.g. to reproduce HF eager logits.
  bool eager_attention = false;
  // Fused CUDA kernels for RMSNorm, q/k norm + RoPE and SiLU * up (kernels/fused_ops.h) where built,
  // on CUDA, and without autograd. Same math; results may differ from the default path by one unit
  // in the last place (the float32 sum of squares is ordered differently), so the default stays the
  // bit-for-bit HF path and the patching sweeps opt in.
  bool fused_kernels = false;
  // With logit_positions set and no hook on the last layer: run that layer's queries, attention
  // output, MLP and residual at those positions only (keys and values still cover every row), since
  // nothing else reaches the logits. ForwardOutput::resid is then [B, P, d] at those positions.
  bool trim_last_layer = false;
  // true: the input is the residual entering start_layer even at start_layer 0 (the layers without the
  // embedding), as the per-layer runs of hidden(..., checkpoint_layers) pass it.
  bool residual_input = false;
  // false: no final norm and lm_head even when the forward runs to the last layer (logits undefined).
  bool logits = true;
};

struct ForwardOutput {
  at::Tensor logits;  // [B, T or P, V] float32 (float64 for a float64 model); undefined when stopped early
  at::Tensor resid;   // [B, T, d] residual after the last layer run (before the final norm)
};

// Numerics follow HF Qwen3ForCausalLM in its dtype order: RMSNorm statistics and softmax in float32
// (float64 when the model is float64) then cast back to the model dtype; RoPE cos/sin computed in
// float32 from float32 inv_freq, then cast to the model dtype. Attention never materialises T x T:
// SDPA (LibTorch >= 2.0) or query blocks of a few hundred rows. hook_pattern is computed only when
// a hook is registered for it; replacing it (or making it require grad) recomputes hook_z of those
// rows from the new pattern.
// Hooks should assign a new tensor rather than modify in place: the tensor handed to
// blocks.{start_layer}.hook_resid_pre is the caller's input residual itself.
class Transformer {
 public:
  // Checks every tensor against weight_table (presence, shape) and that all share one dtype and
  // device. A tied model with lm_head undefined gets lm_head = embed_tokens.
  Transformer(ModelConfig cfg, Weights w);
  // Loads config.json + safetensors in the dtype resolve_dtype() names ("" keeps the checkpoint's).
  // Every tensor's presence and shape is checked; errors name the file and tensor.
  // The same with the configuration given (e.g. read from a hybrid checkpoint's config.json).
  // `cancel`, when given, is read before each tensor is copied: once it is true, load throws
  // hh::Cancelled and keeps nothing.
  static Transformer load(const std::filesystem::path& dir, ModelConfig cfg, const std::string& device,
                          const std::string& dtype, const std::atomic<bool>* cancel = nullptr);
  static Transformer load(const std::filesystem::path& dir, const std::string& device = "cpu",
                          const std::string& dtype = "", const std::atomic<bool>* cancel = nullptr);

  // input: token ids [B, T] int64 (start_layer == 0) or residual [B, T, d] (cast to the model's
  // dtype/device). Ids outside [0, V) throw hh::Error naming the id and its position.
  ForwardOutput forward(const at::Tensor& input, const ForwardOptions& opts = {}) const;

  // The residual after the last layer ([B, T, d], before the final norm) for token ids [B, T], as
  // forward(ids).resid. checkpoint_layers (with autograd on): activation checkpointing, each layer run
  // without recording a graph and again in the backward pass, keeping only the layers' inputs; the same
  // values and gradients, less memory, about one more forward of time.
  at::Tensor hidden(const at::Tensor& ids, bool checkpoint_layers = false) const;

  // Pieces of one layer, the same code forward() runs, for sweeps that recompute only part of a
  // block (path patching freezes attention and recomputes MLPs).
  // attn_out: o_proj of per-head outputs z [..., Hq, Dh] -> [..., d].
  at::Tensor attn_out(int64_t layer, const at::Tensor& z) const;
  // mlp_out: the MLP branch of the block for the residual after attention [..., d] -> [..., d].
  at::Tensor mlp_out(int64_t layer, const at::Tensor& resid_mid, bool fused_kernels = false) const;
  // Final norm and lm_head: [..., d] -> [..., V] float32 (float64 for a float64 model).
  at::Tensor unembed(const at::Tensor& resid) const;

  const ModelConfig& config() const { return cfg_; }
  const Weights& weights() const { return w_; }
  Weights& mutable_weights() { return w_; }
  at::Device device() const;
  const at::Tensor& inv_freq() const { return inv_freq_; }
  at::ScalarType dtype() const;

 private:
  ModelConfig cfg_;
  Weights w_;
  at::Tensor inv_freq_;  // [Dh/2] float32
};

// Building blocks of the Qwen3 math shared with the hybrid layer (core/attention), HF's op order:
// RMSNorm with statistics in float32 then `weight * x` (an undefined weight: no scaling).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// Rotate-half RoPE of x [B, T, H, Dh] at positions offset.., angles from inv_freq [Dh/2] in float32.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& inv_freq, int64_t offset);
// The same on the cos and sin tables of x's positions (rope_cos_sin, [T, Dh] in x's dtype).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// rotary(rms_norm(x, weight, eps), inv_freq, offset): as one kernel on CUDA (16-bit or float32, weight
// needing no gradient; differentiable in x), else the op sequence.
at::Tensor norm_rotary(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& inv_freq,
                       int64_t offset);
// The same with the cos and sin tables of x's positions built once (rope_cos_sin, [T, Dh] in x's dtype):
// a layer's q and k, or the heads of a hybrid layer, share one build.
at::Tensor norm_rotary(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                       const at::Tensor& sin);
// rms_norm(x, weight, eps), as one kernel on CUDA (16-bit or float32, weight needing no gradient), else
// the op sequence.
at::Tensor norm_fused(const at::Tensor& x, const at::Tensor& weight, double eps);
// The cos and sin tables rotary() applies, [T, Dh] in dtype, for positions offset .. offset + T - 1.
std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& inv_freq, int64_t offset, int64_t T, at::ScalarType dtype);
// Causal attention, GQA (q [B, T, Hq, Dh], k/v [B, T, Hkv, Dh]) -> [B, T, Hq, Dh]; never T x T. With
// prefix_k/v [1 or B, P, Hkv, Dh], the T rows sit after P cached tokens and see all of them.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            const at::Tensor& prefix_k = {}, const at::Tensor& prefix_v = {});
// The same for the T rows of q after P earlier tokens, where k_all/v_all [B, P + T, Hkv, Dh] hold the
// P tokens' keys and values followed by the T rows' own (a cache after their append): read where they
// lie, never concatenated. eager: the blockwise eager math (ForwardOptions::eager_attention).
at::Tensor causal_attention_after(const at::Tensor& q, const at::Tensor& k_all, const at::Tensor& v_all, double scale,
                                  bool eager = false);
// at::linear (x [..., in], w [out, in], optional b [out]); one row of float32 or float64 on the CPU as a
// matrix-vector product, which reads w once where BLAS's matrix product first repacks all of it (a
// decoding step's products: 3-5x faster with OpenBLAS).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});
// inv_freq = theta^(-2i/Dh) in float32, as HF builds it.
at::Tensor rope_inv_freq(double theta, int64_t head_dim, const at::Device& device);

// "cpu", "cuda", "cuda:N"; throws hh::Error naming the value, for a CUDA device this build or machine
// does not have too.
at::Device parse_device(const std::string& name);

// Greedy decoding of `n` tokens after `prompt` (one sequence) with a key/value cache: one prefill, then
// one single-token forward per new token over the cached keys and values. Returns the new ids.
std::vector<int64_t> generate_greedy(const Transformer& model, const std::vector<int64_t>& prompt, int64_t n);
// One step of it: `ids` (the prompt, or the last new token) enter the cache; returns the most likely
// next token.
int64_t greedy_next(const Transformer& model, KvCache& cache, const std::vector<int64_t>& ids);

// f32|bf16|f16|f64 (and float32, bfloat16, float16, half, float64, fp32, ...). Throws naming the value.
at::ScalarType parse_dtype(const std::string& name);
// The dtype a model loads in: "" keeps the checkpoint's (`stored`); "auto" keeps it on a GPU but takes
// float32 on the CPU for a 16-bit checkpoint, since CPUs without 16-bit matrix units emulate those
// products (the demo model's forward took 35x as long in bfloat16 as in float32 on a 2-core x86 machine);
// anything else is parse_dtype's.
at::ScalarType resolve_dtype(const std::string& dtype, const at::Device& device, at::ScalarType stored);
// The dtype a checkpoint's weights are stored in (its embedding's), read from the safetensors header.
at::ScalarType stored_dtype(const std::filesystem::path& dir);
// Checks a dtype option as resolve_dtype() takes it ("", "auto" or parse_dtype's names), naming it.
void check_dtype(const std::string& dtype);

}  // namespace hh::model
