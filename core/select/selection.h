#pragma once
// From causal maps to a full-attention head set (DESIGN.md section 8): signals read from
// analysis.h5, their rank-normalised composite, the selection strategies and the budget calculator.
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/select/manifest.h"

namespace hh::select {

// ---- budget --------------------------------------------------------------------------------------

// Memory and compute of one attention configuration at a context of N tokens:
//  kv_bytes    = 2 * N * Dh * bytes_per_elem * (number of (layer, KV group) pairs holding >= 1 FA head)
//  state_bytes = (number of LA heads) * Dh * Dh * 4            (the fp32 Gated DeltaNet state)
//  attn_flops  = FA heads * 2 * N^2 * Dh                        (causal QK^T and PV, prefill)
//              + LA heads * 6 * N * Dh^2                        (state decay + rank-1 update, read-out)
struct Budget {
  int64_t context = 0;
  int64_t fa_heads = 0, la_heads = 0, kv_groups = 0;
  double kv_bytes = 0, state_bytes = 0, attn_flops = 0;
};
Budget budget(const ModelShape& shape, const std::vector<Head>& fa, int64_t context, int64_t bytes_per_elem = 2);
inline constexpr int64_t kBudgetContexts[] = {32768, 131072, 524288};

// ---- signals -------------------------------------------------------------------------------------

// Signal names: retrieval_noising and reasoning_noising (activation noising effect over the examples
// of retrieval tasks / of all other tasks), noising, denoising, path, attribution, retrieval_score.
inline const std::vector<std::string> kSignalNames = {"retrieval_noising", "reasoning_noising", "noising", "denoising",
                                                      "path", "attribution", "retrieval_score"};
// DESIGN's default: retrieval-task noising, reasoning-task noising and path effect, equally weighted.
std::map<std::string, double> default_weights();
// The built-in retrieval tasks (task plugin ids) that retrieval_noising averages over by default.
std::set<std::string> default_retrieval_tasks();

struct Signals {
  std::map<std::string, std::vector<double>> maps;  // name -> [L * Hq] row-major, NaN where not measured
  std::map<std::string, std::string> absent;        // name -> why it is not in the file
  int64_t num_layers = 0, num_heads = 0;
  std::string analysis_sha256, model_fingerprint;
  ModelShape shape;                                 // from the file's config_json
};
Signals load_signals(const std::filesystem::path& analysis, const std::set<std::string>& retrieval_tasks);

// Ranks in [0, 1]: the smallest value 0, the largest 1, ties share their average rank; NaN ranks 0.
std::vector<double> rank_normalise(const std::vector<double>& values);

struct Composite {
  std::vector<double> score;                 // [L * Hq]
  std::map<std::string, double> used;        // weights of the signals that were present (renormalised to sum 1)
  std::vector<std::string> notes;            // what was missing or partial, in words
};
// "name=w,name=w" -> weights; empty -> default_weights(). Throws naming the item that is not NAME=NUMBER.
std::map<std::string, double> parse_weights(const std::string& spec);
// Throws when no weighted signal is present; names unknown signal names.
Composite composite(const Signals& s, const std::map<std::string, double>& weights);

// ---- strategies ----------------------------------------------------------------------------------

struct SelectOptions {
  std::string strategy = "global";  // global | per-layer | kv-group | manual | layerwise | random
  int64_t ratio = 7;                // LA:FA = ratio:1
  int64_t min_per_layer = 0;
  uint64_t seed = 0;
  std::vector<Head> exclude, force, manual;
};
inline const std::vector<std::string> kStrategies = {"global", "per-layer", "kv-group", "manual", "layerwise", "random"};

// k = round(L * Hq / (ratio + 1)).
int64_t fa_count(const ModelShape& shape, int64_t ratio);
// `score` ([L * Hq]) is needed by global, per-layer and kv-group; empty otherwise. Result sorted.
std::vector<Head> select_heads(const ModelShape& shape, const std::vector<double>& score, const SelectOptions& o);
// |a n b| / |a u b| (1 when both are empty).
double jaccard(const std::vector<Head>& a, const std::vector<Head>& b);

// ---- a whole selection, as `hydrahead select` reports and writes it ---------------------------------

struct BudgetRow {
  std::string configuration;  // "dense", "layer-wise r:1", "random (seed s)", "this selection"
  Budget budget;
};

struct SelectionReport {
  std::vector<Head> heads;                // the selection, sorted
  std::vector<Head> layerwise, random;    // the baselines at the same ratio (random only with compare)
  Composite composite;                    // empty score for strategies that rank nothing
  std::vector<BudgetRow> budget;          // per kBudgetContexts: dense, layer-wise, [random], this selection
  double layerwise_jaccard = 0, random_jaccard = 0;
  std::vector<std::string> notes;         // what the user should know about the selection or its baselines
  Manifest manifest;                      // ready for write_manifest (created = now)
};

// Runs the strategy and builds the budget table, the baseline overlaps and the manifest. `signals` may
// be null when no analysis is open (then only manual, layerwise and random work); the composite uses
// `weights` for global, per-layer and kv-group. `created_by` goes into the manifest.
SelectionReport make_selection(const ModelShape& shape, const Signals* signals,
                               const std::map<std::string, double>& weights, const SelectOptions& o, bool compare,
                               int64_t kv_bytes, const std::string& created_by);

// The budget table entry as the manifest's notes store it.
nlohmann::json budget_json(const Budget& b);

}  // namespace hh::select
