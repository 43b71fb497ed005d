// hydrahead run --model DIR (--tokens 1,2,3 | --text "...") --out F.h5 [--device] [--dtype] [--hooks ...]
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>

#include "app/cli/commands.h"
#include "core/attention/hybrid_model.h"
#include "core/io/fingerprint.h"
#include "core/io/h5.h"
#include "core/model/config.h"
#include "core/model/hooks.h"
#include "core/model/tokenizer.h"
#include "core/model/transformer.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "hydrahead/version.h"

namespace hh::cli {
namespace {

struct RunArgs {
  std::string model, tokens, text, out, device = "cpu", dtype = "auto", hooks;
  int64_t generate = 0;
};

int run_forward(const RunArgs& a) {
  namespace fs = std::filesystem;
  const fs::path dir = a.model;
  // Everything that can be checked without the weights is checked first, so a bad request fails fast.
  nlohmann::json hybrid_block;
  const auto cfg = model::ModelConfig::load_teacher_view(dir / "config.json", &hybrid_block);
  const bool hybrid = !hybrid_block.is_null();
  if (a.generate < 0) throw Error("--generate must be >= 0");
  (void)model::parse_device(a.device);
  model::check_dtype(a.dtype);

  std::vector<int64_t> ids;
  if (!a.text.empty() || a.tokens.empty()) {
    const auto tok = model::Tokenizer::load(dir / "tokenizer.json");
    ids = tok.encode(a.text);
  } else {
    for (long long v : parse_id_list(a.tokens, "--tokens")) ids.push_back(v);
  }
  if (ids.empty()) throw Error("the input has no tokens");
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= cfg.vocab_size)
      throw Error("token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                  " is out of range [0, " + std::to_string(cfg.vocab_size) + ") of " +
                  (dir / "config.json").string());

  std::vector<std::string> hook_names = split_list(a.hooks);
  for (const auto& name : hook_names) {
    const auto [layer, kind] = model::parse_hook_name(name);
    if (layer >= cfg.num_hidden_layers)
      throw Error("--hooks: '" + name + "' names layer " + std::to_string(layer) + " but the model has " +
                  std::to_string(cfg.num_hidden_layers) + " layers");
  }

  if (hybrid && !hook_names.empty())
    throw Error("--hooks: hook points are not available on HydraHead hybrid checkpoints (" + dir.string() + ")");

  const auto t0 = std::chrono::steady_clock::now();
  std::optional<model::Transformer> dense;
  std::optional<attention::HybridModel> hyb;
  if (hybrid) hyb.emplace(attention::HybridModel::load(dir, a.device, a.dtype));
  else dense.emplace(model::Transformer::load(dir, a.device, a.dtype));
  const model::Transformer& model = hybrid ? hyb->teacher() : *dense;
  const auto t1 = std::chrono::steady_clock::now();

  std::map<std::string, at::Tensor> cache;
  model::Hooks hooks;
  for (const auto& name : hook_names) hooks.cache(name, &cache);
  const auto input = torch::tensor(ids, torch::kInt64).unsqueeze(0).to(model.device());  // [1, T]
  model::ForwardOptions opts;
  opts.hooks = hooks.empty() ? nullptr : &hooks;
  model::ForwardOutput out;
  std::vector<int64_t> generated;
  {
    torch::NoGradGuard no_grad;
    if (hybrid) {
      out.logits = hyb->forward(input);
      if (a.generate > 0) generated = hyb->generate(ids, a.generate);
    } else {
      out = model.forward(input, opts);
      if (a.generate > 0) generated = model::generate_greedy(model, ids, a.generate);
    }
  }
  const auto t2 = std::chrono::steady_clock::now();

  auto file = io::H5File::create(a.out);
  file.set_attr("/", "format", std::string("hydrahead-run"));
  file.set_attr("/", "format_version", int64_t{1});
  file.set_attr("/", "created_by", std::string("hydrahead ") + HYDRAHEAD_VERSION);
  file.set_attr("/", "model_fingerprint", io::model_fingerprint(dir));
  file.set_attr("/", "dtype", std::string(c10::toString(model.dtype())));
  file.set_attr("/", "device", a.device);
  file.write("/tokens", torch::tensor(ids, torch::kInt64), {"position"});
  if (a.generate > 0) file.write("/generated", torch::tensor(generated, torch::kInt64), {"position"});
  if (hybrid) file.set_attr("/", "hybrid", std::string("hydrahead"));
  file.write("/logits", out.logits.squeeze(0).to(torch::kCPU, torch::kFloat32).contiguous(),
             {"position", "vocab"});
  for (const auto& name : hook_names) {
    const auto& t = cache.at(name);
    std::vector<std::string> labels;
    const auto kind = model::parse_hook_name(name).second;
    switch (kind) {
      case model::HookKind::Q: case model::HookKind::K: case model::HookKind::V: case model::HookKind::Z:
        labels = {"position", "head", "head_dim"}; break;
      case model::HookKind::Pattern: labels = {"head", "query", "key"}; break;
      default: labels = {"position", "d_model"}; break;
    }
    file.write("/hooks/" + name, t.squeeze(0).to(torch::kCPU, torch::kFloat32).contiguous(), labels);
  }
  file.commit();

  using ms = std::chrono::duration<double, std::milli>;
  char line[256];
  std::snprintf(line, sizeof line, "%zu tokens, load %.0f ms, forward %.0f ms, wrote ", ids.size(),
                ms(t1 - t0).count(), ms(t2 - t1).count());
  log::info(line + a.out);
  if (a.generate > 0) {
    std::string list;
    for (int64_t g : generated) list += (list.empty() ? "" : ",") + std::to_string(g);
    std::printf("generated %s\n", list.c_str());
    if (fs::exists(dir / "tokenizer.json"))
      std::printf("text      %s\n", model::Tokenizer::load(dir / "tokenizer.json").decode(generated).c_str());
  }
  return kExitOk;
}

}  // namespace

Runner add_run(CLI::App& app) {
  auto args = std::make_shared<RunArgs>();
  app.add_option("--model", args->model, "HF checkpoint directory")->required();
  auto* tokens = app.add_option("--tokens", args->tokens, "Comma-separated token ids");
  auto* text = app.add_option("--text", args->text, "Text, tokenised with the model's tokenizer.json");
  tokens->excludes(text);
  text->excludes(tokens);
  app.add_option("--out", args->out, "Output HDF5 file: /logits [T, V] f32, /tokens [T] i64, /hooks/<name>")
      ->required();
  app.add_option("--device", args->device, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--dtype", args->dtype, kDtypeHelp)->capture_default_str();
  app.add_option("--generate", args->generate, "Also decode this many tokens greedily; stored as /generated and printed")
      ->capture_default_str();
  app.add_option("--hooks", args->hooks,
                 "Comma-separated hook points to store, e.g. blocks.0.attn.hook_z,blocks.3.hook_resid_post");
  app.callback([tokens, text] {
    if (tokens->count() + text->count() == 0) throw CLI::RequiredError("--tokens or --text");
  });
  return [args] { return run_forward(*args); };
}

}  // namespace hh::cli
