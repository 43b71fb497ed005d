#pragma once
// A HydraHead hybrid checkpoint (DESIGN.md section 9): the teacher's tensors under their HF names plus
// each layer's new tensors, and a config.json that keeps the teacher's fields with
// "architectures": ["HydraHeadForCausalLM"], "model_type": "hydrahead_qwen3" and a "hydrahead" block.
// Also the conversion teacher + manifest -> hybrid.
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/attention/hybrid.h"
#include "core/interp/calibration.h"
#include "core/model/transformer.h"
#include "core/select/manifest.h"

namespace hh::attention {

inline constexpr const char* kHybridArchitecture = "HydraHeadForCausalLM";
inline constexpr const char* kHybridModelType = "hydrahead_qwen3";

// config.json of `dir` has a "hydrahead" block.
bool is_hybrid_checkpoint(const std::filesystem::path& dir);

class HybridModel {
 public:
  // Checks every new tensor against hybrid_weight_table (presence, shape, dtype and device = the teacher's).
  HybridModel(model::Transformer teacher, HybridOptions options, std::vector<HybridLayerWeights> layers);
  // `cancel`, when given, is read before each tensor is copied (Transformer::load's): once it is true,
  // load throws hh::Cancelled.
  static HybridModel load(const std::filesystem::path& dir, const std::string& device = "cpu", const std::string& dtype = "",
                          const std::atomic<bool>* cancel = nullptr);
  // Writes the checkpoint into a temporary sibling directory and renames it to `dir`, which must not exist.
  // `dtype`: the tensors' dtype in the files (and config.json's torch_dtype); default the model's.
  void save(const std::filesystem::path& dir, uint64_t max_shard_bytes = 0,
            std::optional<at::ScalarType> dtype = std::nullopt) const;

  // Logits [B, T, V] (float32; float64 for a float64 model) of whole sequences. chunked: the chunked
  // gated delta rule (else the recurrence, the oracle). checkpoint_layers (activation checkpointing,
  // for training on long sequences): with autograd on, each layer keeps only its input and is run
  // again during the backward pass, so the graph holds one layer's activations at a time; the values
  // and gradients are those of the plain forward.
  at::Tensor forward(const at::Tensor& ids, bool chunked = true, bool checkpoint_layers = false) const;
  // The residual stream after the last layer [B, T, d] (forward() without the final norm and lm_head).
  at::Tensor hidden(const at::Tensor& ids, bool chunked = true, bool checkpoint_layers = false) const;
  // One decoder layer on the residual stream x [B, T, d] (attention block + MLP, residuals added).
  at::Tensor layer_forward(int64_t layer, const at::Tensor& x, bool chunked = true) const;

  // Incremental inference: the first call is the prefill, each later one continues the same
  // sequences (e.g. one token at a time). Returns the logits of the new tokens [B, T, V], or with
  // last_only those of the last one [B, 1, V] (all a decoder reads: a long prompt's logits at every
  // position would be T x V floats, gigabytes at a 150K vocabulary).
  struct Cache {
    std::vector<HybridLayerCache> layers;
    int64_t pos = 0;
  };
  at::Tensor step(const at::Tensor& ids, Cache& cache, bool chunked = true, bool last_only = false) const;
  // Greedy decoding of `n` tokens after `prompt` (one sequence); returns the new ids.
  std::vector<int64_t> generate(const std::vector<int64_t>& prompt, int64_t n) const;
  // One step of it: `ids` (the prompt, or the last new token) enter the cache; returns the most likely
  // next token.
  int64_t greedy_next(const std::vector<int64_t>& ids, Cache& cache) const;

  const model::Transformer& teacher() const { return teacher_; }
  const model::ModelConfig& config() const { return teacher_.config(); }
  const HybridOptions& options() const { return options_; }
  const std::vector<HeadSplit>& splits() const { return splits_; }
  const std::vector<HybridLayerWeights>& layers() const { return layers_; }

 private:
  model::Transformer teacher_;
  HybridOptions options_;
  std::vector<HeadSplit> splits_;
  std::vector<HybridLayerWeights> layers_;
};

struct ConvertOptions {
  HybridOptions hybrid;                                        // fa_heads are taken from the manifest
  const std::vector<interp::CalibExample>* calib = nullptr;    // for fusion_gamma; none: gamma = 1
  int64_t max_calib_tokens = 65536;                            // tokens of `calib` the RMS is taken over
  uint64_t seed = 0;                                           // for the randomly initialised tensors
  // Hears the calibration tokens run so far and the number it will run, after each prompt (may be empty).
  std::function<void(int64_t done, int64_t total)> progress;
};

// Teacher + manifest -> hybrid (in memory). The manifest must fit the teacher (check_fits). New
// tensors, documented in docs/CONVERSION.md: la_k/v_proj copy the teacher's rows of each head's KV
// group; fa_gate = 0 (gate 1/2); la_gate, la_a_proj, la_b_proj ~ N(0, 0.02^2); la_A_log = log U(1, 16);
// la_dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]; la_conv = identity (last tap 1);
// fusion_gamma = per-channel RMS of the teacher's z of that head over the calibration tokens, else 1.
HybridModel convert(const model::Transformer& teacher, const select::Manifest& manifest, const ConvertOptions& o);

}  // namespace hh::attention
