// hydrahead inspect --model DIR [--json]
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <set>

#include <cstdio>
#include <filesystem>

#include "app/cli/commands.h"
#include "core/model/summary.h"
#include "core/util/error.h"

namespace hh::cli {
namespace {

struct InspectArgs {
  std::string model;
  bool json = false;
};

int run_inspect(const InspectArgs& a) {
  namespace fs = std::filesystem;
  const fs::path dir = a.model;
  if (!fs::is_directory(dir)) throw Error(a.model + ": not a checkpoint directory");
  const model::ModelSummary sum = model::summarize_checkpoint(dir);
  const auto& cfg = sum.config;
  const int64_t L = cfg.num_hidden_layers, Hq = cfg.num_attention_heads, Hkv = cfg.num_key_value_heads;
  const int64_t G = cfg.kv_group_size();

  nlohmann::json kv_groups = nlohmann::json::array();
  for (int64_t g = 0; g < Hkv; ++g) {
    nlohmann::json heads = nlohmann::json::array();
    for (int64_t h = g * G; h < (g + 1) * G; ++h) heads.push_back(h);
    kv_groups.push_back(heads);
  }

  if (a.json) {
    nlohmann::json j = {
        {"path", fs::absolute(dir).string()},
        {"architecture", cfg.architecture},
        {"model_type", cfg.model_type},
        {"num_layers", L},
        {"num_heads", Hq},
        {"num_kv_heads", Hkv},
        {"head_dim", cfg.head_dim},
        {"hidden_size", cfg.hidden_size},
        {"intermediate_size", cfg.intermediate_size},
        {"vocab_size", cfg.vocab_size},
        {"rope_theta", cfg.rope_theta},
        {"rms_norm_eps", cfg.rms_norm_eps},
        {"tie_word_embeddings", cfg.tie_word_embeddings},
        {"parameters", sum.params_from_config},
        {"stored_parameters", sum.params_from_tensors},
        {"dtype", sum.weights_dtype},
        {"kv_groups", kv_groups},
        {"fingerprint", sum.fingerprint},
    };
    if (sum.is_hybrid()) j["hydrahead"] = sum.hydrahead;
    std::printf("%s\n", j.dump(2).c_str());
    return kExitOk;
  }

  std::printf("model         %s\n", fs::absolute(dir).string().c_str());
  std::printf("architecture  %s (%s)\n", cfg.architecture.c_str(), cfg.model_type.c_str());
  std::printf("layers        %lld\n", static_cast<long long>(L));
  std::printf("heads         %lld query, %lld key/value (GQA groups of %lld), head_dim %lld\n",
              static_cast<long long>(Hq), static_cast<long long>(Hkv), static_cast<long long>(G),
              static_cast<long long>(cfg.head_dim));
  std::printf("hidden        %lld, MLP %lld, vocab %lld\n", static_cast<long long>(cfg.hidden_size),
              static_cast<long long>(cfg.intermediate_size), static_cast<long long>(cfg.vocab_size));
  std::printf("rope theta    %g, rms eps %g, tied embeddings %s\n", cfg.rope_theta, cfg.rms_norm_eps,
              cfg.tie_word_embeddings ? "yes" : "no");
  std::printf("parameters    %s (%s)%s\n", model::format_parameter_count(sum.params_from_config).c_str(),
              model::group_digits(sum.params_from_config).c_str(),
              sum.params_match() ? "" : "  [stored tensors differ: see below]");
  if (!sum.params_match())
    std::printf("stored        %s parameters in the safetensors files\n",
                model::group_digits(sum.params_from_tensors).c_str());
  std::printf("dtype         %s\n", sum.weights_dtype.c_str());
  std::printf("fingerprint   %s\n", sum.fingerprint.c_str());
  std::set<std::pair<int64_t, int64_t>> fa;
  if (sum.is_hybrid()) {
    if (auto it = sum.hydrahead.find("fa_heads"); it != sum.hydrahead.end() && it->is_array())
      for (const auto& p : *it)
        if (p.is_array() && p.size() == 2 && p[0].is_number_integer() && p[1].is_number_integer())
          fa.insert({p[0].get<int64_t>(), p[1].get<int64_t>()});
    const int64_t nf = static_cast<int64_t>(fa.size());
    std::printf("hybrid        HydraHead: %lld full-attention heads, %lld Gated DeltaNet heads (marked * below: FA)\n",
                static_cast<long long>(nf), static_cast<long long>(L * Hq - nf));
  }
  std::printf("\nlayers x heads (cell = KV group of the query head)\n");
  std::printf("%8s", "");
  for (int64_t h = 0; h < Hq; ++h) std::printf(" %3lld", static_cast<long long>(h));
  std::printf("\n");
  for (int64_t l = 0; l < L; ++l) {
    std::printf("layer %2lld", static_cast<long long>(l));
    for (int64_t h = 0; h < Hq; ++h)
      std::printf(" %3s", (std::to_string(h / G) + (fa.count({l, h}) ? "*" : "")).c_str());
    std::printf("\n");
  }
  return kExitOk;
}

}  // namespace

Runner add_inspect(CLI::App& app) {
  auto args = std::make_shared<InspectArgs>();
  app.add_option("--model", args->model, "HF checkpoint directory (config.json + *.safetensors)")->required();
  app.add_flag("--json", args->json, "Print one JSON object instead of text");
  return [args] { return run_inspect(*args); };
}

}  // namespace hh::cli
