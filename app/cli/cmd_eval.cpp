// hydrahead eval --model DIR --task niah-grid --lengths 1K,2K --depths 0,0.5,1 [--n N] [--niah-task T]
//                [--seed S] [--device] [--dtype] --out eval.h5
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <functional>
#include <filesystem>
#include <optional>

#include "app/cli/commands.h"
#include "core/attention/hybrid_model.h"
#include "core/eval/niah.h"
#include "core/eval/perplexity.h"
#include "core/io/h5.h"
#include "core/interp/task_registry.h"
#include "core/io/fingerprint.h"
#include "core/model/tokenizer.h"
#include "core/util/error.h"
#include "hydrahead/version.h"

namespace hh::cli {
namespace {

namespace fs = std::filesystem;

struct EvalArgs {
  std::string model, task = "niah-grid", lengths, depths = "0,0.25,0.5,0.75,1", niah_task = "niah-single", out;
  std::string device = "cpu", dtype = "auto", data, progress = "bar";
  int64_t n = 10, seq = 2048;
  uint64_t seed = 0;
};

// --progress: a bar on a terminal (ProgressBar), one JSON line an update on stdout for tools
// ({"event": "progress", "done", "total", "elapsed_s", "eta_s"}), or nothing.
class EvalProgress {
 public:
  EvalProgress(const std::string& mode, const std::string& label) : json_(mode == "json"), start_s_(now_s()) {
    if (mode == "bar") bar_.emplace(label);
  }
  void operator()(int64_t done, int64_t total) {
    if (bar_) bar_->update(static_cast<double>(done) / static_cast<double>(total), std::to_string(done) + "/" + std::to_string(total));
    if (!json_) return;
    const double elapsed = now_s() - start_s_;
    const nlohmann::json e = {{"event", "progress"},
                              {"done", done},
                              {"total", total},
                              {"elapsed_s", elapsed},
                              {"eta_s", elapsed / static_cast<double>(done) * static_cast<double>(total - done)}};
    std::printf("%s\n", e.dump().c_str());
    std::fflush(stdout);
  }
  void finish() {
    if (bar_) bar_->finish();
  }

 private:
  static double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  bool json_;
  double start_s_;
  std::optional<ProgressBar> bar_;
};

void check_progress_mode(const std::string& mode) {
  if (mode != "bar" && mode != "json" && mode != "none") throw Error("--progress " + mode + ": expected bar, json or none");
}

int run_ppl(const EvalArgs& a) {
  const fs::path dir = a.model, out = a.out;
  if (a.data.empty()) throw Error("--task ppl needs --data (a .bin of uint32 ids or a .jsonl of {\"text\": ...})");
  nlohmann::json block;
  const auto cfg = model::ModelConfig::load_teacher_view(dir / "config.json", &block);
  std::optional<model::Tokenizer> tok;
  if (fs::exists(dir / "tokenizer.json")) tok = model::Tokenizer::load(dir / "tokenizer.json");
  const auto stream = eval::read_token_stream(a.data, tok ? &*tok : nullptr, cfg.vocab_size);
  std::optional<model::Transformer> dense;
  std::optional<attention::HybridModel> hybrid;
  eval::LanguageModel lm;
  if (!block.is_null()) {
    hybrid.emplace(attention::HybridModel::load(dir, a.device, a.dtype));
    lm.hidden = [&](const at::Tensor& ids) { return hybrid->hidden(ids); };
    lm.logits = [&](const at::Tensor& rows) { return hybrid->teacher().unembed(rows); };
  } else {
    dense.emplace(model::Transformer::load(dir, a.device, a.dtype));
    lm.hidden = [&](const at::Tensor& ids) { return dense->hidden(ids); };
    lm.logits = [&](const at::Tensor& rows) { return dense->unembed(rows); };
  }
  eval::PerplexityResult r;
  {
    EvalProgress progress(a.progress, "eval ppl");
    try {
      r = eval::perplexity(lm, stream, a.seq, 1024, std::ref(progress), install_interrupt_flag());
    } catch (const Cancelled&) {
      progress.finish();
      std::fprintf(stderr, "interrupted: nothing was written\n");
      return kExitInterrupted;
    }
  }
  io::H5File f = io::H5File::create(out);
  f.set_attr("/", "format", "hydrahead-eval");
  f.set_attr("/", "format_version", int64_t{1});
  f.set_attr("/", "created_by", std::string("hydrahead ") + HYDRAHEAD_VERSION);
  f.set_attr("/", "model_fingerprint", io::model_fingerprint(dir));
  f.write("/ppl/ppl", at::full({1}, r.ppl, at::TensorOptions().dtype(at::kDouble)));
  f.write("/ppl/nll", at::full({1}, r.nll, at::TensorOptions().dtype(at::kDouble)));
  f.set_attr("/ppl", "tokens", r.tokens);
  f.set_attr("/ppl", "windows", r.windows);
  f.set_attr("/ppl", "seq", a.seq);
  f.set_attr("/ppl", "data", fs::absolute(a.data).string());
  f.commit();
  std::printf("perplexity %.4f (NLL %.4f nats over %lld tokens in %lld windows of <= %lld)\nwrote %s\n", r.ppl, r.nll,
              static_cast<long long>(r.tokens), static_cast<long long>(r.windows), static_cast<long long>(a.seq), a.out.c_str());
  return kExitOk;
}

int run_eval(const EvalArgs& a) {
  const fs::path dir = a.model;
  check_progress_mode(a.progress);
  if (a.task == "ppl") return run_ppl(a);
  if (a.task != "niah-grid") throw Error("--task " + a.task + ": expected niah-grid or ppl");
  if (a.lengths.empty()) throw Error("--lengths is required for niah-grid (e.g. 1K,2K,4K)");
  eval::NiahGridOptions o;
  o.task = a.niah_task;
  o.lengths = eval::parse_lengths(a.lengths);
  o.depths = eval::parse_depths(a.depths);
  o.n = a.n;
  o.seed = a.seed;
  if (o.n < 1) throw Error("--n must be at least 1");
  const fs::path out = a.out;
  if (out.has_parent_path() && !fs::is_directory(out.parent_path()))
    throw Error("--out " + a.out + ": directory " + out.parent_path().string() + " does not exist");
  if (!fs::exists(dir / "tokenizer.json")) throw Error(dir.string() + ": no tokenizer.json (NIAH prompts are text)");
  const auto tok = model::Tokenizer::load(dir / "tokenizer.json");
  interp::TaskRegistry tasks;
  tasks.load_default();
  (void)tasks.resolve_params(o.task, nullptr);  // an unknown task fails here, naming the known ones

  std::optional<model::Transformer> dense;
  std::optional<attention::HybridModel> hybrid;
  eval::GenerateFn gen;
  if (attention::is_hybrid_checkpoint(dir)) {
    hybrid.emplace(attention::HybridModel::load(dir, a.device, a.dtype));
    gen = [&](const std::vector<int64_t>& p, int64_t k) { return hybrid->generate(p, k); };
  } else {
    dense.emplace(model::Transformer::load(dir, a.device, a.dtype));
    gen = [&](const std::vector<int64_t>& p, int64_t k) { return model::generate_greedy(*dense, p, k); };
  }
  o.cancel = install_interrupt_flag();
  eval::NiahGridResult r;
  {
    EvalProgress progress(a.progress, "eval " + o.task);
    o.progress = std::ref(progress);
    try {
      r = eval::niah_grid(gen, tasks, tok, o);
    } catch (const Cancelled&) {
      progress.finish();
      std::fprintf(stderr, "interrupted: nothing was written\n");
      return kExitInterrupted;
    }
  }
  eval::write_niah(out, r, o, io::model_fingerprint(dir), std::string("hydrahead ") + HYDRAHEAD_VERSION);
  std::printf("NIAH exact-match accuracy (%s, %lld prompts a cell)\n%10s", o.task.c_str(), static_cast<long long>(o.n), "length");
  for (double d : o.depths) std::printf("  d=%-5.2f", d);
  std::printf("\n");
  for (size_t i = 0; i < o.lengths.size(); ++i) {
    std::printf("%10lld", static_cast<long long>(o.lengths[i]));
    for (size_t j = 0; j < o.depths.size(); ++j)
      std::printf("  %7.3f", r.accuracy[static_cast<int64_t>(i)][static_cast<int64_t>(j)].item<double>());
    std::printf("\n");
  }
  std::printf("wrote %s\n", a.out.c_str());
  return kExitOk;
}

}  // namespace

Runner add_eval(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  app.add_option("--model", a->model, "Dense or hybrid checkpoint directory (with tokenizer.json)")->required();
  app.add_option("--task", a->task, "niah-grid or ppl")->capture_default_str();
  app.add_option("--data", a->data, "ppl: a .bin of uint32 token ids or a .jsonl with a \"text\" field a line");
  app.add_option("--seq", a->seq, "ppl: window length in tokens")->capture_default_str();
  app.add_option("--lengths", a->lengths, "Prompt lengths in tokens: 512,1K,4K");
  app.add_option("--depths", a->depths, "Needle depths in [0, 1]")->capture_default_str();
  app.add_option("--n", a->n, "Prompts per (length, depth) cell")->capture_default_str();
  app.add_option("--niah-task", a->niah_task, "Task plugin that makes the prompts")->capture_default_str();
  app.add_option("--seed", a->seed, "Cell (i, j) uses seed + 1000 i + j")->capture_default_str();
  app.add_option("--device", a->device, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--dtype", a->dtype, kDtypeHelp)->capture_default_str();
  app.add_option("--out", a->out, "eval.h5 to write")->required();
  app.add_option("--progress", a->progress,
                 "bar (on a terminal), json (one {\"event\": \"progress\", \"done\", \"total\", \"elapsed_s\", \"eta_s\"} "
                 "line an update on stdout, for tools) or none")
      ->capture_default_str();
  return [a] { return run_eval(*a); };
}

}  // namespace hh::cli
