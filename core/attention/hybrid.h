#pragma once
// The HydraHead attention block (DESIGN.md section 9): in every layer, the full-attention (FA) query
// heads keep softmax attention over the teacher's keys and values, and the linear-attention (LA)
// heads run the gated delta rule on their own key/value projections; every head's output is
// scale-normalised (gate * gamma * RMSNorm(o)) before the teacher's o_proj.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/model/config.h"
#include "core/model/kv_cache.h"
#include "core/util/compat.h"

namespace hh::model {
struct LayerWeights;
}

namespace hh::attention {

// The "hydrahead" block of a hybrid checkpoint's config.json.
struct HybridOptions {
  bool fa_rope = false;             // true: FA heads keep the teacher's RoPE (ablation)
  bool fa_log_scale = true;         // q_t *= ln(t + alpha) / ln(alpha)
  double fa_log_scale_alpha = 512;
  bool gdn_short_conv = true;       // depthwise causal conv (kernel 4) + SiLU on LA q, k, v
  bool gdn_allow_neg_eigval = false;  // beta = 2 * sigmoid(.)
  int64_t gdn_chunk = 64;
  bool fusion_concat = false;       // true: y_h = o_h, no gate, gamma or RMSNorm (the plain-concatenation ablation)
  std::vector<std::pair<int64_t, int64_t>> fa_heads;  // (layer, head), sorted

  nlohmann::json to_json() const;
  // Checks every field and every head against the model; `where` names the file in errors.
  static HybridOptions from_json(const nlohmann::json& j, const model::ModelConfig& cfg, const std::string& where);
};

// Heads of one layer by kind, ascending: the order of the new tensors' rows.
struct HeadSplit {
  std::vector<int64_t> fa, la;
};
std::vector<HeadSplit> split_heads(const HybridOptions& o, const model::ModelConfig& cfg);

inline constexpr int64_t kShortConvKernel = 4;

// New tensors of one layer (HF names under model.layers.{l}.self_attn.; shapes for nF FA and nL LA heads).
struct HybridLayerWeights {
  at::Tensor fa_gate;                         // fa_gate.weight   [nF*Dh, d]
  at::Tensor la_k_proj, la_v_proj, la_gate;   // la_*.weight      [nL*Dh, d]
  at::Tensor la_a_proj, la_b_proj;            // la_{a,b}_proj.weight [nL, d]
  at::Tensor la_A_log, la_dt_bias;            // [nL]
  at::Tensor la_conv;                         // la_conv.weight   [3*nL*Dh, 1, 4] (q, k, v blocks, head-major)
  at::Tensor fusion_gamma;                    // [Hq, Dh]
  // fa_gate, la_gate and fusion_gamma are absent under fusion_concat.
};

struct HybridWeightEntry {
  std::string name;
  at::Tensor* slot;
  std::vector<int64_t> shape;
};
// The (name, slot, shape) table of one layer's new tensors, in the checkpoint's naming.
std::vector<HybridWeightEntry> hybrid_weight_table(const model::ModelConfig& cfg, const HybridOptions& o,
                                                   const HeadSplit& split, int64_t layer, HybridLayerWeights& w);

// What decoding keeps per layer between calls: FA heads' keys and values (per head, after k_norm and,
// with fa_rope, RoPE), LA heads' recurrent state and the last 3 inputs of their short convolution.
struct HybridLayerCache {
  model::GrowingRows fa_k, fa_v;  // [B, P, nF, Dh]
  at::Tensor la_state;            // [B, nL, Dh, Dh] float32 (float64 for float64 models)
  at::Tensor la_conv;             // [B, 3*nL*Dh, kShortConvKernel - 1] (with gdn_short_conv)
  int64_t pos = 0;                // tokens seen
};

// The block's per-head outputs y [B, T, Hq, Dh] (the input of o_proj, heads in their original order)
// for the normed hidden states xn [B, T, d]. cache null: a whole sequence at positions 0..T-1; else the
// T tokens continue the cached ones (positions cache->pos..) and the cache is advanced.
// chunked: the chunked gated delta rule (else the per-token recurrence, the oracle).
// side_by_side: on CUDA, without a graph, and without a cache or with an empty one (a prompt), the LA
// heads run on a second stream while the FA heads run on the current one, so each fills the SMs the
// other leaves idle; false: one after the other. The result and what the cache keeps are the same, bit
// for bit.
at::Tensor hybrid_attention(const model::ModelConfig& cfg, const HybridOptions& o, const HeadSplit& split,
                            const model::LayerWeights& teacher, const HybridLayerWeights& w, const at::Tensor& xn,
                            const at::Tensor& inv_freq, bool chunked = true, HybridLayerCache* cache = nullptr,
                            bool side_by_side = true);

// With side_by_side on CUDA, when the FA heads' attention may start: once its own inputs are formed
// (kInputs), once the LA heads' chunk_factors is done too (kFactors, the default), or their scan
// (kScan). The result is the same; for timing one against another.
enum class FlashGate { kInputs, kFactors, kScan };
void set_flash_gate(FlashGate gate);
FlashGate flash_gate();

// Whether a decoding step (one token, with a cache, on CUDA without a graph) runs the LA heads after
// their projections as one kernel (kernels::gdn_decode_step, the default) or as the op sequence (the
// short convolution with its past, rope_l2, the gates, gdn_recurrent, the fusion). Process-wide; for
// comparisons.
void set_decode_kernel(bool on);
// Whether a forward that records a graph (training) runs the LA heads' short convolution, RoPE and L2
// norm on their kernels with CUDA backwards (the default) or as LibTorch ops. Process-wide; for
// comparisons.
void set_graph_kernels(bool on);
// How many layers' decoding steps have run on that kernel in this process (tests and benchmarks check
// which path ran by it).
int64_t decode_kernel_steps();

}  // namespace hh::attention
