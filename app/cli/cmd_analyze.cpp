// hydrahead analyze --model DIR --calib F.jsonl --method M[,M...] --out analysis.h5
//                   [--mode noising|denoising] [--metric logprob|logit-diff] [--device] [--dtype]
//                   [--heads L:H,...] [--receivers L:H,...] [--max-batch N] [--reference] [--no-layers]
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "app/cli/commands.h"
#include "core/dist/process_group.h"
#include "core/interp/analysis.h"
#include "core/interp/calibration.h"
#include "core/io/fingerprint.h"
#include "core/model/config.h"
#include "core/model/tokenizer.h"
#include "core/model/transformer.h"
#include "core/util/error.h"
#include "hydrahead/version.h"

namespace hh::cli {
namespace {

namespace fs = std::filesystem;

struct AnalyzeArgs {
  std::string model, calib, out, method = "activation", mode = "noising", metric = "logprob";
  std::string device = "cpu", dtype = "auto", heads, receivers;
  int64_t max_batch = 0, cka_tokens = 1024, top = 10;
  bool reference = false, no_layers = false;
  DistArgs dist;
};

// The `top` heads of an effect map, largest first, as "L:H value" lines.
void print_top(const char* title, const at::Tensor& effect, int64_t top) {
  if (!effect.defined()) return;
  const at::Tensor flat = effect.flatten().to(at::kDouble).nan_to_num(-INFINITY);
  const int64_t k = std::min<int64_t>(top, flat.size(0));
  const auto sorted = flat.topk(k);
  const int64_t H = effect.size(1);
  std::printf("%s (top %lld):", title, static_cast<long long>(k));
  for (int64_t i = 0; i < k; ++i) {
    const double v = std::get<0>(sorted)[i].item<double>();
    if (!std::isfinite(v)) break;
    const int64_t idx = std::get<1>(sorted)[i].item<int64_t>();
    std::printf("%s %lld:%lld %.3f", i ? "," : "", static_cast<long long>(idx / H), static_cast<long long>(idx % H), v);
  }
  std::printf("\n");
}

int run_analyze(const AnalyzeArgs& a) {
  const fs::path dir = a.model;
  // Everything that can be checked before the weights load is checked first.
  const auto cfg = model::ModelConfig::load(dir / "config.json");
  interp::AnalyzeOptions o;
  interp::parse_methods(a.method, o);
  o.mode = interp::parse_mode(a.mode);
  o.metric = interp::parse_metric(a.metric);
  o.heads = interp::parse_heads(a.heads, cfg.num_hidden_layers, cfg.num_attention_heads);
  o.receivers = interp::parse_heads(a.receivers, cfg.num_hidden_layers, cfg.num_attention_heads);
  if (a.max_batch < 0) throw Error("--max-batch must be >= 0 (0: sized from free memory)");
  if (a.cka_tokens < 2) throw Error("--cka-tokens must be at least 2");
  o.max_batch = a.max_batch;
  o.reference = a.reference;
  o.layers = !a.no_layers;
  o.cka_tokens = a.cka_tokens;
  const fs::path out = a.out;
  if (const int status = maybe_launch(a.dist); status >= 0) return status;
  const auto group = join_group(a.dist, a.device);
  const bool lead = !group || group->rank() == 0;   // rank 0 shows progress, writes and summarises
  o.dist = group.get();

  interp::AnalyzeCheckpoint job;
  job.model_dir = dir;
  job.calib = a.calib;
  job.out = out;
  job.device = a.device;
  job.dtype = a.dtype;
  job.created_by = std::string("hydrahead ") + HYDRAHEAD_VERSION;
  job.options = o;
  job.options.cancel = install_interrupt_flag();
  interp::AnalysisResult r;
  {
    std::optional<ProgressBar> bar;  // shown once the weights are loaded
    job.options.progress = [&bar, lead](const std::string& step, int64_t done, int64_t total) {
      if (!lead) return;
      if (bar) bar->update(static_cast<double>(done) / static_cast<double>(std::max<int64_t>(total, 1)), step);
    };
    try {
      r = interp::analyze_checkpoint(job, [&bar, lead](const std::string& what) {
        if (!lead) return;
        std::fprintf(stderr, "%s\n", what.c_str());
        bar.emplace("analyze");
      });
    } catch (const Cancelled&) {
      if (bar) bar->finish();
      std::fprintf(stderr, "interrupted: nothing was written%s\n",
                   fs::exists(out) ? (" (" + out.string() + " is unchanged)").c_str() : "");
      return kExitInterrupted;
    }
  }
  const size_t examples_size = r.tasks.size();
  if (!lead) return kExitOk;

  const int64_t kept = r.kept.sum().item<int64_t>();
  std::printf("wrote %s: %zu examples (%lld kept, %lld with |M_clean - M_corrupt| < %g skipped), metric %s\n",
              out.string().c_str(), examples_size, static_cast<long long>(kept),
              static_cast<long long>(static_cast<int64_t>(examples_size) - kept), interp::kMinMetricGap,
              interp::metric_name(o.metric));
  for (const auto& [method, s] : r.seconds) std::printf("  %-12s %s\n", method.c_str(), format_seconds(s).c_str());
  const std::string mode = interp::mode_name(o.mode);
  print_top(("activation " + mode + " effect").c_str(), r.act_effect, a.top);
  print_top(("attribution " + mode + " effect").c_str(), r.attr_effect, a.top);
  print_top("path effect", r.path_effect, a.top);
  print_top("retrieval score", r.retrieval, a.top);
  return kExitOk;
}

}  // namespace

Runner add_analyze(CLI::App& app) {
  auto a = std::make_shared<AnalyzeArgs>();
  app.footer(
      "Methods (DESIGN section 6): activation = exact activation patching of every head's hook_z (and of\n"
      "attn_out / mlp_out / resid per layer), batched with the clean prefix reused; path = path patching\n"
      "sender -> logits (or -> --receivers' q/k/v inputs), noising; attribution = one forward and one\n"
      "backward, normalised like noising; retrieval = retrieval score on examples with a needle span;\n"
      "similarity = cosine of residual updates, linear CKA and angular distance between layers.\n"
      "Effects: noising (M_clean - M_patched) / (M_clean - M_corrupt); denoising (M_patched - M_corrupt) /\n"
      "(M_clean - M_corrupt); examples with |M_clean - M_corrupt| < 1e-3 are skipped from the means.\n"
      "An existing --out of the same model, calibration set and metric gets the new methods added.\n"
      "Ctrl-C stops between forwards and writes nothing.\n"
      "Several processes (--nproc-per-node N, or torchrun / srun): the (example, head batch) work is dealt\n"
      "over the ranks and rank 0 writes the gathered result, the same datasets as one process writes.");
  app.add_option("--model", a->model, "HF checkpoint directory (config.json, *.safetensors)")->required();
  app.add_option("--calib", a->calib, "Calibration set (JSONL, see `hydrahead tasks generate`)")->required();
  app.add_option("--method", a->method, "activation, path, attribution, retrieval, similarity, or all (comma list)")
      ->capture_default_str();
  app.add_option("--mode", a->mode, "noising (is the head necessary?) or denoising (is it sufficient?)")->capture_default_str();
  app.add_option("--metric", a->metric, "logprob (sum over answer tokens) or logit-diff (answer vs wrong, first token)")
      ->capture_default_str();
  app.add_option("--device", a->device, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--dtype", a->dtype, kDtypeHelp)->capture_default_str();
  app.add_option("--heads", a->heads, "Only these heads, as LAYER:HEAD,... (default: all)");
  app.add_option("--receivers", a->receivers, "Path patching receivers LAYER:HEAD,... (default: the logits)");
  app.add_option("--max-batch", a->max_batch, "Patched variants per forward (0: sized from free memory)")->capture_default_str();
  app.add_option("--cka-tokens", a->cka_tokens, "Tokens sampled for linear CKA")->capture_default_str();
  app.add_option("--top", a->top, "Heads listed in the summary per map")->capture_default_str();
  app.add_flag("--reference", a->reference, "Exact patching with one plain forward per head (slow ground truth)");
  app.add_flag("--no-layers", a->no_layers, "Skip layer-level patching (attn_out, mlp_out, resid)");
  app.add_option("--out", a->out, "analysis.h5 to write (or extend)")->required();
  add_dist_options(app, a->dist);
  return [a] { return run_analyze(*a); };
}

}  // namespace hh::cli
