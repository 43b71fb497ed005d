#pragma once
// Causal analysis of one calibration example (DESIGN.md section 6): activation patching (head and
// layer level, noising and denoising), path patching, attribution patching, retrieval score.
//
// Two implementations of exact patching live here:
//  - the fast sweeps batch many patched variants into one forward (the batch axis holds variants),
//    start at the patched layer from the cached residual, recompute only the positions from the
//    first token where clean and corrupt differ (the earlier keys and values are the clean run's),
//    and project to the vocabulary only at the answer positions;
//  - the reference runs one plain forward per patched head with hooks, nothing reused. Tests hold
//    the fast sweeps to it; it is also what `--reference` runs.
// Every result is a metric value per variant; normalise_effect() turns it into DESIGN's effect.
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/interp/calibration.h"
#include "core/util/compat.h"

namespace hh::model {
class Transformer;
}

namespace hh::interp {

enum class Metric { LogProb, LogitDiff };
enum class Mode { Noising, Denoising };
enum class LayerSite { AttnOut, MlpOut, Resid };  // hook_attn_out, hook_mlp_out, hook_resid_post

Metric parse_metric(const std::string& s);  // logprob | logit-diff
Mode parse_mode(const std::string& s);      // noising | denoising
const char* metric_name(Metric m);
const char* mode_name(Mode m);
const char* site_name(LayerSite s);         // attn_out | mlp_out | resid
inline constexpr LayerSite kLayerSites[] = {LayerSite::AttnOut, LayerSite::MlpOut, LayerSite::Resid};

// One example laid out for the model: teacher forcing on prompt ++ answer[:-1].
struct PreparedExample {
  at::Tensor clean, corrupt;  // [1, T] int64 on the model's device
  at::Tensor answer_pos;      // [A] int64: answer token i is predicted at position len(prompt) - 1 + i
  at::Tensor answer_ids;      // [A] int64
  int64_t wrong_id = -1;      // first wrong-answer token, -1 when the example has none
  int64_t diff = 0;           // first position where clean and corrupt differ; T when they do not
  int64_t T = 0;
  int64_t prompt_len = 0;
};

// Checks ids against the model's vocabulary; `where` names the example in errors. logit-diff needs
// wrong_ids.
PreparedExample prepare_example(const CalibExample& ex, const model::Transformer& model, Metric metric,
                                const std::string& where);

// logits [B, A, V] at the answer positions -> metric per batch row [B] float64.
at::Tensor metric_from_logits(const at::Tensor& logits, const PreparedExample& ex, Metric metric);

// The clean and corrupt runs of one example, with what the sweeps reuse. Per layer l:
struct RunCache {
  double metric_clean = 0, metric_corrupt = 0;
  // Residual entering layer l, rows diff.. only ([1, T - diff, d]).
  std::vector<at::Tensor> resid_pre_clean, resid_pre_corrupt;
  // Per-head outputs (hook_z), rows diff.. only ([1, T - diff, Hq, Dh]).
  std::vector<at::Tensor> z_clean, z_corrupt;
  // Keys and values of rows 0..diff, the same in both runs ([1, diff, Hkv, Dh]); empty when diff == 0.
  std::vector<at::Tensor> prefix_k, prefix_v;
};
RunCache run_clean_corrupt(const model::Transformer& model, const PreparedExample& ex, Metric metric);

struct HeadRef {
  int64_t layer = 0, head = 0;
  bool operator==(const HeadRef& o) const { return layer == o.layer && head == o.head; }
};
// "L:H,L:H,..." -> heads, each checked against the model's shape; an empty string is every head.
std::vector<HeadRef> parse_heads(const std::string& s, int64_t num_layers, int64_t num_heads);
std::vector<HeadRef> all_heads(int64_t num_layers, int64_t num_heads);

// Progress of a sweep: units done so far of `total` (patched variants for sweeps).
using ProgressFn = std::function<void(int64_t done, int64_t total)>;

struct SweepOptions {
  Metric metric = Metric::LogProb;
  Mode mode = Mode::Noising;
  std::vector<HeadRef> heads;    // empty: every head
  int64_t max_batch = 0;         // variants per forward; 0: sized from free memory
  ProgressFn progress;           // may be empty
  const std::atomic<bool>* cancel = nullptr;  // checked between forwards; throws hh::Cancelled
};

// Activation patching of hook_z heads. Returns metric_patched [L, Hq] float64; NaN where a head was
// not asked for. Noising: clean input, the head's z from the corrupt run; denoising: the reverse.
at::Tensor head_sweep(const model::Transformer& model, const PreparedExample& ex, const RunCache& cache,
                      const SweepOptions& opts);
// The same numbers from one full forward per head, no reuse of any kind.
at::Tensor head_sweep_reference(const model::Transformer& model, const PreparedExample& ex, const SweepOptions& opts);

// Layer-level activation patching at attn_out, mlp_out and resid (hook_resid_post) of every layer:
// metric_patched [3, L] float64 in kLayerSites order.
at::Tensor layer_sweep(const model::Transformer& model, const PreparedExample& ex, const RunCache& cache,
                       const SweepOptions& opts);
at::Tensor layer_sweep_reference(const model::Transformer& model, const PreparedExample& ex, const SweepOptions& opts);

// Path patching, sender -> receivers, on the clean run (noising direction). With no receivers the
// receiver is the logits (the sender's direct effect through the residual stream and the MLPs, with
// every other head frozen at its clean value); with receivers, the sender's change reaches only the
// receivers' q/k/v inputs (first pass), then only the receivers' outputs are patched into a normal
// clean run (second pass). Receivers must sit in later layers than a sender to be reached.
// Returns metric_patched [L, Hq] float64 (NaN where not asked).
at::Tensor path_sweep(const model::Transformer& model, const PreparedExample& ex, const RunCache& cache,
                      const std::vector<HeadRef>& receivers, const SweepOptions& opts);
at::Tensor path_sweep_reference(const model::Transformer& model, const PreparedExample& ex,
                                const std::vector<HeadRef>& receivers, const SweepOptions& opts);

// Attribution patching: one forward and one backward on the base run (clean for noising, corrupt
// for denoising); estimate for head (l, h) = M_base + sum over positions of
// (z_source - z_base) . dM/dz_base. Returns metric_estimate [L, Hq] float64.
at::Tensor attribution(const model::Transformer& model, const PreparedExample& ex, const RunCache& cache,
                       const SweepOptions& opts);

// Retrieval score on a copy-style example: for each answer token, each head's most attended key at
// the predicting position is a hit when it lies inside the needle and holds that token. Needle
// spans come from meta.needles[*].span of the asked needles, else meta.needle. Returns [L, Hq]
// float64 hits / answer length, or an undefined tensor when the example has no needle span.
at::Tensor retrieval_score(const model::Transformer& model, const CalibExample& raw, const PreparedExample& ex);
// Head (layer, head)'s attention from each answer-predicting position of the clean run (prompt ++
// answer[:-1]) over its T tokens: [A, T] float64, each row a softmax row (zero after its query).
// `cancel`, when given, is read at each layer's start: once it is true, the forward throws Cancelled.
at::Tensor answer_attention(const model::Transformer& model, const PreparedExample& ex, int64_t layer, int64_t head,
                            const std::atomic<bool>* cancel = nullptr);
// The needle spans ([begin, end) token positions) retrieval_score uses; empty when none.
std::vector<std::pair<int64_t, int64_t>> needle_spans(const CalibExample& raw);

// Normalised effect of one example (DESIGN section 6): noising (M_clean - M_patched) / (M_clean -
// M_corrupt), denoising (M_patched - M_corrupt) / (M_clean - M_corrupt), elementwise on `patched`.
at::Tensor normalise_effect(const at::Tensor& patched, double m_clean, double m_corrupt, Mode mode);
// Examples with |M_clean - M_corrupt| below this are skipped from means and counted.
inline constexpr double kMinMetricGap = 1e-3;

}  // namespace hh::interp
