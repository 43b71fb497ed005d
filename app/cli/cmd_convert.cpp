// hydrahead convert --model DIR --manifest M.json [--calib F.jsonl] --out DIR2 [--seed N] [options]
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <optional>

#include "app/cli/commands.h"
#include "core/attention/hybrid_model.h"
#include "core/io/fingerprint.h"
#include "core/model/tokenizer.h"
#include "core/select/manifest.h"
#include "core/util/error.h"

namespace hh::cli {
namespace {

namespace fs = std::filesystem;

struct ConvertArgs {
  std::string model, manifest, calib, out, device = "cpu";
  uint64_t seed = 0;
  int64_t max_calib_tokens = 65536;
  bool fa_rope = false, no_fa_log_scale = false, no_short_conv = false, neg_eigval = false;
  std::string fusion = "scale-normalised";
  double log_scale_alpha = 512;
};

int run_convert(const ConvertArgs& a) {
  const fs::path dir = a.model, out = a.out;
  // Everything that can be refused is refused before the weights load and before anything is written.
  if (fs::exists(out)) throw Error("--out " + a.out + ": already exists; choose a new directory");
  if (out.has_parent_path() && !fs::is_directory(out.parent_path()))
    throw Error("--out " + a.out + ": directory " + out.parent_path().string() + " does not exist");
  const auto cfg = model::ModelConfig::load(dir / "config.json");
  const auto manifest = select::read_manifest(a.manifest);
  select::check_fits(manifest, select::shape_of(cfg, io::model_fingerprint(dir)), a.manifest);
  std::optional<model::Tokenizer> tok;
  if (fs::exists(dir / "tokenizer.json")) tok = model::Tokenizer::load(dir / "tokenizer.json");
  std::vector<interp::CalibExample> calib;
  if (!a.calib.empty()) calib = interp::read_calibration(a.calib, tok ? &*tok : nullptr, cfg.vocab_size);

  attention::ConvertOptions o;
  o.hybrid.fa_rope = a.fa_rope;
  o.hybrid.fa_log_scale = !a.no_fa_log_scale;
  o.hybrid.fa_log_scale_alpha = a.log_scale_alpha;
  o.hybrid.gdn_short_conv = !a.no_short_conv;
  o.hybrid.gdn_allow_neg_eigval = a.neg_eigval;
  o.hybrid.fusion_concat = a.fusion == "concat";
  o.calib = calib.empty() ? nullptr : &calib;
  o.max_calib_tokens = a.max_calib_tokens;
  o.seed = a.seed;
  // The calibration forward in float32 on the CPU (dtype auto), the hybrid saved in the teacher's dtype.
  const auto teacher = model::Transformer::load(dir, a.device, "auto");
  ProgressBar bar("fusion_gamma");
  o.progress = [&bar](int64_t done, int64_t total) {
    bar.update(static_cast<double>(done) / static_cast<double>(total), std::to_string(done) + "/" + std::to_string(total) + " tokens");
  };
  const auto hybrid = attention::convert(teacher, manifest, o);
  bar.finish();
  hybrid.save(out, 0, model::stored_dtype(dir));
  for (const char* extra : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"})
    if (fs::exists(dir / extra)) fs::copy_file(dir / extra, out / extra);
  int64_t nf = static_cast<int64_t>(manifest.fa_heads.size());
  const int64_t all = cfg.num_hidden_layers * cfg.num_attention_heads;
  char ratio[64];
  if (nf == 0) std::snprintf(ratio, sizeof ratio, "no FA head: every head is LA");
  else if (nf == all) std::snprintf(ratio, sizeof ratio, "no LA head");
  else std::snprintf(ratio, sizeof ratio, "LA:FA = %.2f:1", static_cast<double>(all - nf) / static_cast<double>(nf));
  std::printf("wrote %s: %lld FA and %lld LA heads (%s), gamma from %s\n", a.out.c_str(), static_cast<long long>(nf),
              static_cast<long long>(all - nf), ratio,
              calib.empty() ? "no calibration set (1)" : (std::to_string(calib.size()) + " calibration prompts").c_str());
  return kExitOk;
}

}  // namespace

Runner add_convert(CLI::App& app) {
  auto a = std::make_shared<ConvertArgs>();
  app.footer(
      "The new tensors are initialised as docs/CONVERSION.md says: LA heads copy their KV group's k/v rows,\n"
      "gates and decay parameters start small, the short conv starts as the identity, and fusion_gamma is the\n"
      "teacher's per-channel RMS of each head's output on --calib (else 1).");
  app.add_option("--model", a->model, "Teacher checkpoint directory")->required();
  app.add_option("--manifest", a->manifest, "manifest.json from `hydrahead select` (or written by hand)")->required();
  app.add_option("--calib", a->calib, "Calibration set whose clean prompts set fusion_gamma");
  app.add_option("--out", a->out, "New directory for the hybrid checkpoint")->required();
  app.add_option("--device", a->device, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--seed", a->seed, "Seed of the randomly initialised tensors")->capture_default_str();
  app.add_option("--max-calib-tokens", a->max_calib_tokens, "Tokens of --calib used for fusion_gamma")->capture_default_str();
  app.add_flag("--fa-rope", a->fa_rope, "FA heads keep the teacher's RoPE (ablation; default NoPE)");
  app.add_flag("--no-fa-log-scale", a->no_fa_log_scale, "No log-length scaling of FA queries");
  app.add_option("--fa-log-scale-alpha", a->log_scale_alpha, "alpha of q_t *= ln(t + alpha) / ln(alpha)")->capture_default_str();
  app.add_flag("--no-short-conv", a->no_short_conv, "No short convolution on LA q, k, v");
  app.add_option("--fusion", a->fusion,
                 "How head outputs join before o_proj: scale-normalised (gate * gamma * RMSNorm(o), default) or "
                 "concat (the raw outputs: the plain-concatenation ablation)")
      ->check(CLI::IsMember({"scale-normalised", "concat"}));
  app.add_flag("--allow-neg-eigval", a->neg_eigval, "beta = 2 sigmoid(.) (negative eigenvalues in the delta rule)");
  return [a] { return run_convert(*a); };
}

}  // namespace hh::cli
