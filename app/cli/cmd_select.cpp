// hydrahead select --analysis A.h5 --ratio R [--strategy S] [--weights name=w,...] [--min-per-layer n]
//                  [--seed N] [--exclude L:H,...] [--force L:H,...] [--heads L:H,...] [--model DIR]
//                  [--compare] --out manifest.json
// hydrahead select --validate manifest.json [--model DIR]
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "app/cli/commands.h"
#include "core/interp/patching.h"
#include "core/io/fingerprint.h"
#include "core/model/config.h"
#include "core/select/manifest.h"
#include "core/select/selection.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "hydrahead/version.h"

namespace hh::cli {
namespace {

namespace fs = std::filesystem;
using select::Head;
using select::ModelShape;

struct SelectArgs {
  std::string analysis, model, out, ratio = "7", strategy = "global", weights, exclude, force, heads, validate;
  std::string retrieval_tasks;
  int64_t min_per_layer = 0, kv_bytes = 2;
  uint64_t seed = 0;
  bool compare = false, json = false;
};

// "7" or "7:1" -> 7
int64_t parse_ratio(const std::string& s) {
  std::string la = s, fa = "1";
  if (auto c = s.find(':'); c != std::string::npos) {
    la = s.substr(0, c);
    fa = s.substr(c + 1);
  }
  if (fa != "1") throw Error("--ratio '" + s + "': the FA side must be 1 (LA:FA = r:1)");
  if (la.empty() || la.find_first_not_of("0123456789") != std::string::npos || la.size() > 6)
    throw Error("--ratio '" + s + "': expected a non-negative integer r or r:1");
  return std::stoll(la);
}

// LAYER:HEAD lists through the analysis parser (range and duplicate checks), as select's pairs.
std::vector<Head> parse_head_list(const std::string& s, const char* flag, const ModelShape& shape) {
  std::vector<Head> out;
  try {
    for (const auto& h : interp::parse_heads(s, shape.num_layers, shape.num_heads)) out.push_back({h.layer, h.head});
  } catch (const Error& e) {
    throw Error(std::string(flag) + ": " + e.what());
  }
  return out;
}

std::map<std::string, double> parse_weights(const std::string& s) {
  try {
    return select::parse_weights(s);
  } catch (const Error& e) {
    throw Error(std::string("--weights: ") + e.what());
  }
}

std::string context_name(int64_t n) { return std::to_string(n / 1024) + "K"; }

void print_heads(const ModelShape& s, const std::vector<Head>& heads) {
  std::printf("FA heads per layer (%zu of %lld):\n", heads.size(), static_cast<long long>(s.num_layers * s.num_heads));
  for (int64_t l = 0; l < s.num_layers; ++l) {
    std::string list;
    int n = 0;
    for (const Head& h : heads)
      if (h.first == l) {
        list += (n++ ? "," : "") + std::to_string(h.second);
      }
    std::printf("  layer %2lld: %2d  %s\n", static_cast<long long>(l), n, list.c_str());
  }
}

int run_validate(const SelectArgs& a) {
  const auto m = select::read_manifest(a.validate);
  if (!a.model.empty()) {
    const auto cfg = model::ModelConfig::load(fs::path(a.model) / "config.json");
    select::check_fits(m, select::shape_of(cfg, io::model_fingerprint(a.model)), a.validate);
  }
  std::printf("%s: valid, %zu FA heads%s\n", a.validate.c_str(), m.fa_heads.size(),
              a.model.empty() ? " (no --model given: fit to a model not checked)" : (" and it fits " + a.model).c_str());
  return kExitOk;
}

int run_select(const SelectArgs& a) {
  if (!a.validate.empty()) return run_validate(a);
  if (a.out.empty()) throw Error("--out is required (or --validate MANIFEST)");
  const int64_t ratio = parse_ratio(a.ratio);
  if (a.kv_bytes <= 0) throw Error("--kv-bytes must be positive");
  const bool needs_analysis = a.strategy == "global" || a.strategy == "per-layer" || a.strategy == "kv-group";
  if (needs_analysis && a.analysis.empty()) throw Error("strategy " + a.strategy + " ranks heads: give --analysis A.h5");
  if (a.analysis.empty() && a.model.empty())
    throw Error("give --analysis A.h5 or --model DIR so the model's shape is known");

  // The model's shape (and fingerprint) from the model dir when given, else from the analysis file.
  ModelShape shape;
  select::Signals signals;
  std::map<std::string, double> weights;
  if (!a.analysis.empty()) {
    auto tasks = select::default_retrieval_tasks();
    if (!a.retrieval_tasks.empty()) {
      tasks.clear();
      for (const auto& t : split_list(a.retrieval_tasks)) tasks.insert(t);
    }
    signals = select::load_signals(a.analysis, tasks);
    shape = signals.shape;
  }
  if (!a.model.empty()) {
    const auto cfg = model::ModelConfig::load(fs::path(a.model) / "config.json");
    const ModelShape from_model = select::shape_of(cfg, io::model_fingerprint(a.model));
    if (!a.analysis.empty()) {
      select::Manifest probe;
      probe.model = shape;
      select::check_fits(probe, from_model, a.analysis + " (the model it was made from)");
    }
    shape = from_model;
  }
  if (needs_analysis) {
    weights = parse_weights(a.weights);
  } else if (!a.weights.empty()) {
    throw Error("--weights applies to the global, per-layer and kv-group strategies");
  }

  select::SelectOptions o;
  o.strategy = a.strategy;
  o.ratio = ratio;
  o.min_per_layer = a.min_per_layer;
  o.seed = a.seed;
  o.exclude = parse_head_list(a.exclude, "--exclude", shape);
  o.force = parse_head_list(a.force, "--force", shape);
  o.manual = parse_head_list(a.heads, "--heads", shape);
  if (!o.manual.empty() && a.strategy != "manual") throw Error("--heads is the head list of --strategy manual");
  const select::SelectionReport r = select::make_selection(shape, a.analysis.empty() ? nullptr : &signals, weights, o,
                                                           a.compare, a.kv_bytes,
                                                           std::string("hydrahead ") + HYDRAHEAD_VERSION);
  for (const auto& n : r.composite.notes) log::warn(n);
  for (const auto& n : r.notes) log::warn(n);

  print_heads(shape, r.heads);
  std::printf("\nbudget (KV cache in %lld-byte elements, GDN state fp32, prefill attention FLOPs):\n",
              static_cast<long long>(a.kv_bytes));
  std::printf("  %-8s %-22s %12s %12s %12s %14s\n", "context", "configuration", "FA heads", "KV cache", "GDN state", "attn TFLOP");
  for (const auto& row : r.budget) {
    const auto& b = row.budget;
    std::printf("  %-8s %-22s %12lld %12s %12s %14.1f\n", context_name(b.context).c_str(), row.configuration.c_str(),
                static_cast<long long>(b.fa_heads), util::human_bytes(b.kv_bytes).c_str(), util::human_bytes(b.state_bytes).c_str(),
                b.attn_flops / 1e12);
  }
  if (a.compare) {
    std::printf("\noverlap with baselines (Jaccard of FA head sets):\n");
    std::printf("  %-22s %8.3f  (%zu heads)\n", ("layer-wise " + std::to_string(ratio) + ":1").c_str(),
                r.layerwise_jaccard, r.layerwise.size());
    std::printf("  %-22s %8.3f  (%zu heads, seed %llu)\n", "random", r.random_jaccard, r.random.size(),
                static_cast<unsigned long long>(a.seed));
  }
  select::write_manifest(a.out, r.manifest);
  std::printf("\nwrote %s: %zu FA heads, %s, LA:FA = %lld:1\n", a.out.c_str(), r.heads.size(), a.strategy.c_str(),
              static_cast<long long>(ratio));
  return kExitOk;
}

}  // namespace

Runner add_select(CLI::App& app) {
  auto a = std::make_shared<SelectArgs>();
  app.footer(
      "Strategies (DESIGN section 8): global = top-k heads by composite score; per-layer = equal quota per\n"
      "layer; kv-group = whole GQA groups by mean score (saves KV cache); manual = --heads; layerwise =\n"
      "every (r+1)-th layer in full (Qwen3-Next style baseline); random = seeded baseline.\n"
      "k = round(L * Hq / (r + 1)) FA heads. Composite = weighted sum of rank-normalised signals:\n"
      "retrieval_noising, reasoning_noising, noising, denoising, path, attribution, retrieval_score\n"
      "(default retrieval_noising=1,reasoning_noising=1,path=1); a signal the file lacks is reported and dropped.");
  app.add_option("--analysis", a->analysis, "analysis.h5 from `hydrahead analyze`");
  app.add_option("--model", a->model, "Checkpoint dir: checks the analysis and manifest fit it, records its fingerprint");
  app.add_option("--ratio", a->ratio, "LA:FA ratio r (or r:1)")->capture_default_str();
  app.add_option("--strategy", a->strategy, "global, per-layer, kv-group, manual, layerwise or random")->capture_default_str();
  app.add_option("--weights", a->weights, "Signal weights NAME=W,... (see below)");
  app.add_option("--min-per-layer", a->min_per_layer, "At least this many FA heads in every layer (global, random)")
      ->capture_default_str();
  app.add_option("--seed", a->seed, "Seed of the random strategy and baseline")->capture_default_str();
  app.add_option("--exclude", a->exclude, "Never full attention: L:H,...");
  app.add_option("--force", a->force, "Always full attention: L:H,...");
  app.add_option("--heads", a->heads, "The FA heads of --strategy manual: L:H,...");
  app.add_option("--retrieval-tasks", a->retrieval_tasks,
                 "Task ids whose examples make retrieval_noising (default: niah-*, passkey)");
  app.add_option("--kv-bytes", a->kv_bytes, "Bytes per KV-cache element in the budget")->capture_default_str();
  app.add_flag("--compare", a->compare, "Also report overlap (Jaccard) with the layer-wise and random baselines");
  app.add_option("--validate", a->validate, "Only check this manifest (against --model when given)");
  app.add_option("--out", a->out, "manifest.json to write");
  return [a] { return run_select(*a); };
}

}  // namespace hh::cli
